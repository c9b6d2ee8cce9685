"""The compiled steps of a ``VirtualCache(compile=True)``: StaticCache's contract over pages.

transformers compiles a forward for a cache whose ``is_compileable`` is True (on CUDA by itself,
elsewhere with a ``compile_config``; mode ``reduce-overhead`` captures CUDA graphs). A compiled
forward cannot map a page, build a plan or read a Python length without baking it into the
graph, so a step is split in two:

* **the eager point** (:meth:`CompiledSteps.arm`), outside the compiled region, before each
  forward: the cache commits the step in the core (``begin_step``: pages mapped and shared pages
  copied, so every position the step writes is in a mapped, private page) and copies the step's
  write positions into device tensors whose addresses never change. transformers reaches it
  through ``cache.get_mask_sizes`` when ``prepare_inputs_for_generation`` builds the step's mask
  (eagerly, before every compiled forward); a hand-written loop calls ``cache.prepare_step(q_len)``.
* **the compiled forward** (:meth:`CompiledSteps.update`): per layer, one custom op
  (:func:`vmkv.kernels.capturable.write_columns`) writes the new K/V at the device positions.
  With the model's attention the layer returns ``[B, kv_heads, max_len, head_dim]`` views of the
  virtual tensors, whose addresses never move (marked static for dynamo and CUDA graphs).
  Positions past a row's length read the zero page (zeros, no memory) and the model's mask hides
  them, as StaticCache's does. With the ``"vmkv"`` attention the rows are ragged (the eager
  prefill dropped their padding): each row writes at its own position and the attention
  (:meth:`RaggedSteps.attend`) runs the capturable decode kernel over each row's own length
  (``torch.ops.vmkv.decode_store``), finding the steps through
  ``vmkv.hf.attention.COMPILED_STEP``; in paged mode (:class:`PagedSteps`) the positions are
  rows of the block pools and the kernel reads a block table.

Nothing in the compiled region reads a Python value that changes from step to step (the flags it
reads are the same at every armed step), so dynamo compiles a decode step once.

A compiled forward that finds no armed step (a hand-written loop that did not call
``prepare_step``, or a compiled prefill) runs the cache's eager update at a graph break, with one
warning: slower, never a crash.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..core.base import KVCacheBase
from ..core.mapping import background_safe
from ..core.step import StepPlan, slot_slice
from ..errors import InvalidConfig
from ..kernels.capturable import Store, decode_store, stores_of, write_columns
from ..vmm.views import unguarded

log = logging.getLogger("vmkv")


def check_compile(compile: Any, config: Any, max_seq_len: int | None) -> bool:
    """``compile`` as a bool, once ``VirtualCache(compile=True)`` has what it needs.

    Raises:
        InvalidConfig: ``compile=True`` without ``config`` or without ``max_seq_len``.
    """
    if not isinstance(compile, bool):
        raise InvalidConfig(f"compile must be True or False, got {compile!r}")
    if not compile:
        return False
    if config is None:
        raise InvalidConfig("compile=True needs config=model.config: the compiled forward must know the layers "
                            "and the attention up front")
    if max_seq_len is None:
        raise InvalidConfig("compile=True needs max_seq_len: every compiled step attends over that many columns "
                            "(as StaticCache over max_cache_len), so give the longest row you will generate")
    return True


def check_map_ahead(compile: bool, map_ahead: bool, device: torch.device) -> None:
    """Raise ``InvalidConfig`` if pages would be mapped on a thread beside compiled steps whose
    attention reads the zero pages past each row (CUDA: ``vmkv.core.mapping.background_safe``)."""
    if compile and map_ahead and not background_safe(device.type, reads_past_length=True):
        raise InvalidConfig("map_ahead maps pages on a thread while compile=True's attention reads the zero pages "
                            "past each row, which a remap on CUDA would fault: use one or the other")


class CompiledSteps:
    """The device tensors and flags a compiled ``VirtualCache`` forward reads: the model's own
    attention over full-length views (dense steps). :class:`RaggedSteps` and :class:`PagedSteps`
    are the ``"vmkv"`` attention's; :func:`compiled_steps` makes the one a cache needs.

    Args:
        stores: per layer, the core's K and V (VMM: ``kv_cache(layer)``, ``[max_batch, max_len,
            kv_heads, head_dim]``; paged: ``block_pool(layer)``) as
            :class:`~vmkv.kernels.capturable.Store` s made once: their addresses never move. The
            compiled region's inputs are the stores' bases (one per storage, marked static); the
            compiled write goes through them, only at positions the eager point mapped for the step.
        max_len: the most columns a row reaches (the core's ``max_seq_len``): what dense views
            span, and the bound the decode kernel's launch is fixed by.

    Attributes:
        armed: a step was committed at the eager point and no forward has written it yet.
        live: the forward in progress writes the armed step (set at its first layer).
        starts: int64 ``[]``, columns before the armed step as transformers counts them (padding
            included); a dense step writes every row there.
        slots: int64 ``[B]``, each row's slot.
        rows: the rows of the views as a slice (rows in evenly spaced slots), or ``None``: gathered
            through ``slots``.

    Invariant: while ``armed``, every position the step writes (dense: columns ``starts ..
    starts + q_len - 1`` of every row) is in a mapped page the row owns alone (``begin_step``
    made it so).
    """

    ragged = False  # rows of their own lengths ("vmkv" attention), or every row as long as the step's columns

    def __init__(self, stores: list[tuple[Store, Store]], max_len: int) -> None:
        self.max_len = max_len
        self.stores = stores
        self.device = stores[0][0].base.device
        self.starts = self._static(torch.zeros((), dtype=torch.int64))
        self.slots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.rows: slice | None = slice(0, 0)
        self._slot_tuple: tuple[int, ...] = ()
        self.armed = False
        self.live = False
        for base in {id(store.base): store.base for pair in stores for store in pair}.values():
            torch._dynamo.mark_static_address(base)

    def copy(self) -> "CompiledSteps":
        """Steps of another ``VirtualCache`` over the same core (a deep copy: its own rows)."""
        return type(self)(self.stores, self.max_len)

    def _static(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the device, its address marked static: the eager point writes it in place."""
        tensor = tensor.to(self.device)
        torch._dynamo.mark_static_address(tensor)
        return tensor

    def arm(self, plan: StepPlan, columns: int) -> None:
        """The eager point: ``plan`` (committed; :meth:`follow` saw it) is what the next forward
        writes, after ``columns`` columns (transformers' count)."""
        self.starts.fill_(columns)
        self._load(plan)
        self.armed = True

    def _load(self, plan: StepPlan) -> None:
        """The armed step's per-row device inputs beyond ``starts`` (dense steps have none)."""

    def follow(self, plan: StepPlan) -> None:
        """A step begins (eager): its rows' slots are the ones the forward reads."""
        if plan.slots != self._slot_tuple:
            self._set_rows(plan.slots)

    def _set_rows(self, slots: tuple[int, ...]) -> None:
        """New row slots: in place when the batch keeps its size (the tensors' addresses stay)."""
        if len(slots) == self.slots.shape[0]:
            self.slots.copy_(torch.tensor(slots, dtype=torch.int64))
        else:
            self.slots = self._static(torch.tensor(slots, dtype=torch.int64))
            self._resize(len(slots))
        self.rows = slot_slice(slots)
        self._slot_tuple = slots

    def _resize(self, batch: int) -> None:
        """New per-row device inputs for a batch of ``batch`` rows (dense steps have none)."""

    def disarm(self) -> bool:
        """Forget the armed step, not live either; whether one was armed. An eager forward takes
        the step this way (it writes it eagerly); elsewhere the caller rolls its tokens back."""
        armed, self.armed, self.live = self.armed, False, False
        return armed

    def begin_forward(self) -> bool:
        """At a forward's first layer: whether it writes the armed step (which it then consumes)."""
        self.live, self.armed = self.armed, False
        return self.live

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside the compiled forward, an armed step: write ``k``, ``v`` (``[B, kv_heads, S,
        head_dim]``) at the device positions and return the full-length views."""
        k_store, v_store = self.stores[layer]
        write_columns(k_store, v_store, k, v, self.slots, self.starts)
        return self.views(layer)

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V of the rows, ``[B, kv_heads, max_len, head_dim]``: views where the
        rows' slots are evenly spaced, else gathered (a copy)."""
        k_store, v_store = (store.view() for store in self.stores[layer])
        if self.rows is not None:
            return k_store[self.rows].transpose(1, 2), v_store[self.rows].transpose(1, 2)
        return k_store.index_select(0, self.slots).transpose(1, 2), v_store.index_select(0, self.slots).transpose(1, 2)


class RaggedSteps(CompiledSteps):
    """Compiled decode steps of the ``"vmkv"`` attention over slots (VMM mode). The rows hold only
    their real tokens (the eager prefill dropped the padding), so each row writes its one new
    token at its own position and :meth:`attend` reads each row's own length.

    Attributes (beyond :class:`CompiledSteps`'):
        positions: int64 ``[B]``, where each row's new token goes (here: its column).
        kv_lens: int32 ``[B]``, each row's tokens once the step is written.
        slots32: int32 ``[B]``, ``slots`` as the kernel reads them.

    Invariant: while ``armed``, ``positions[b]`` is in a mapped page row ``b`` owns alone.
    """

    ragged = True

    def __init__(self, stores: list[tuple[Store, Store]], max_len: int) -> None:
        super().__init__(stores, max_len)
        self.positions = self.kv_lens = self.slots32 = torch.zeros(0, dtype=torch.int64, device=self.device)

    def _resize(self, batch: int) -> None:
        self.positions = self._static(torch.zeros(batch, dtype=torch.int64))
        self.kv_lens = self._static(torch.zeros(batch, dtype=torch.int32))
        self.slots32 = self._static(torch.zeros(batch, dtype=torch.int32))

    def _set_rows(self, slots: tuple[int, ...]) -> None:
        super()._set_rows(slots)
        self.slots32.copy_(self.slots)

    def _load(self, plan: StepPlan) -> None:
        self.kv_lens.copy_(plan.kv_lens_t)
        self.positions.copy_(self.kv_lens).sub_(1)  # a ragged step decodes one token per row

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` (``[B, kv_heads, 1, head_dim]``) at each row's position; returns them
        unchanged (:meth:`attend` reads the stores)."""
        k_store, v_store = self.stores[layer]
        write_columns(k_store, v_store, k, v, self.slots, self.positions)
        return k, v

    def attend(self, layer: int, query: torch.Tensor, scale: float | None) -> torch.Tensor:
        """After :meth:`update` of ``layer``: each row's new token attends over that row's own
        tokens, ``query: [B, Hq, 1, D]`` -> ``[B, 1, Hq, D]``. The last layer ends the step
        (``live`` off)."""
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out = self._decode(layer, query[:, :, 0], scale)
        if layer == len(self.stores) - 1:
            self.live = False
        return out.unsqueeze(1)

    def _decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        k_store, v_store = self.stores[layer]
        return decode_store(q, k_store, v_store, self.kv_lens, scale, self.max_len, slots=self.slots32)


class PagedSteps(RaggedSteps):
    """:class:`RaggedSteps` over block pools (paged mode): ``positions`` are each new token's row
    of the flattened pool (the plan's ``write_rows``), and the kernel finds each row's blocks in
    ``block_table``, int32 ``[B, blocks a row of max_len tokens spans]``, copied from the plan's
    at the eager point (entries past a row's length are never read)."""

    def __init__(self, stores: list[tuple[Store, Store]], max_len: int) -> None:
        super().__init__(stores, max_len)
        self.token_rows = [(k.token_rows(), v.token_rows()) for k, v in stores]  # [1, blocks * size, H, D]
        block_size = stores[0][0].size[1]
        self.table_width = -(-max_len // block_size)
        self.block_table = torch.zeros(0, self.table_width, dtype=torch.int32, device=self.device)
        self.zero_slots = self.slots

    def _resize(self, batch: int) -> None:
        super()._resize(batch)
        self.block_table = self._static(torch.zeros(batch, self.table_width, dtype=torch.int32))
        self.zero_slots = self._static(torch.zeros(batch, dtype=torch.int64))  # the one "slot" of token_rows

    def _load(self, plan: StepPlan) -> None:
        self.kv_lens.copy_(plan.kv_lens_t)
        self.positions.copy_(plan.write_rows)
        self.block_table[:, : plan.block_table.shape[1]].copy_(plan.block_table)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_rows, v_rows = self.token_rows[layer]
        write_columns(k_rows, v_rows, k, v, self.zero_slots, self.positions)
        return k, v

    def _decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        k_store, v_store = self.stores[layer]
        return decode_store(q, k_store, v_store, self.kv_lens, scale, self.max_len, block_table=self.block_table)


def compiled_steps(core: KVCacheBase, max_len: int, ragged: bool, paged: bool) -> CompiledSteps:
    """The compiled steps over ``core``'s layers: :class:`PagedSteps` (``paged``),
    :class:`RaggedSteps` (``ragged``: the ``"vmkv"`` attention) or dense :class:`CompiledSteps`."""
    layers = range(core.config.num_layers)
    if paged:
        return PagedSteps(stores_of([core.block_pool(layer) for layer in layers]), max_len)
    views = [tuple(map(unguarded, core.kv_cache(layer))) for layer in layers]
    return (RaggedSteps if ragged else CompiledSteps)(stores_of(views), max_len)


@torch._dynamo.disable
def eager_update(cache: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                 args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update`` run eagerly from inside a compiled forward (dynamo breaks the graph here),
    counted in ``stats()["compile_fallbacks"]`` and said once per cache."""
    cache.counters["compile_fallbacks"] += 1
    if cache.counters["compile_fallbacks"] == 1:
        why = (FALLBACK_NO_STEP if cache.is_compileable else
               "this VirtualCache was made without compile=True, so under torch.compile it runs eagerly at "
               "graph breaks (slower, correct); VirtualCache(compile=True, config=..., max_seq_len=...) "
               "compiles (docs/hf.md)")
        log.warning("vmkv.hf: %s", why)
    return cache._eager_update(key_states, value_states, layer_idx, *args, **kwargs)


FALLBACK_NO_STEP = ("a compiled forward ran with no step prepared at an eager point, so the cache runs eagerly "
                    "at a graph break (slower, correct); transformers' generate() prepares each step itself, a "
                    "hand-written loop calls cache.prepare_step(q_len) before each compiled forward")
