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
  (:meth:`CompiledSteps.attend`) runs the capturable decode kernel over each row's own length
  (``torch.ops.vmkv.decode_store``), finding the steps through
  ``vmkv.hf.attention.COMPILED_STEP``.

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


def check_compile(compile: Any, mode: str, config: Any, max_seq_len: int | None) -> bool:
    """``compile`` as a bool, once ``VirtualCache(compile=True)`` has what it needs.

    Raises:
        InvalidConfig: ``compile=True`` in paged mode, without ``config`` or without ``max_seq_len``.
    """
    if not isinstance(compile, bool):
        raise InvalidConfig(f"compile must be True or False, got {compile!r}")
    if not compile:
        return False
    if mode != "vmm":
        raise InvalidConfig("compile=True writes and reads virtually contiguous tensors at device positions: "
                            "VMM mode only")
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
    """The device tensors and flags a compiled ``VirtualCache`` forward reads.

    Args:
        stores: per layer, the core's ``kv_cache(layer)`` K and V, ``[max_batch, max_len, kv_heads,
            head_dim]``, as :class:`~vmkv.kernels.capturable.Store` s made once (:meth:`for_core`):
            their addresses never move. The compiled region's inputs are the stores' bases (one
            per storage, marked static); the compiled write goes through them, only at positions
            the eager point mapped for the step.
        max_len: columns of every view a layer returns (the core's ``max_seq_len``).
        ragged: the ``"vmkv"`` attention's steps: rows hold only their real tokens (padding was
            dropped at the eager prefill), so each row writes at its own position and the
            attention reads each row's own length (:meth:`attend`); else dense steps of the
            model's attention over full-length views (:meth:`views`).

    Attributes:
        armed: a step was committed at the eager point and no forward has written it yet.
        live: the forward in progress writes the armed step (set at its first layer; a ragged
            forward clears it at its last layer's attention).
        starts: int64 ``[]``, columns before the armed step as transformers counts them (padding
            included); a dense step writes every row there.
        positions: ragged: int64 ``[B]``, the column each row's new token goes to.
        kv_lens: ragged: int32 ``[B]``, each row's tokens once the step is written.
        slots: int64 ``[B]`` (``slots32``: int32, the kernel's), each row's slot.
        rows: the rows of the views as a slice (rows in evenly spaced slots), or ``None``: gathered
            through ``slots``.

    Invariant: while ``armed``, every column the step writes (dense: ``starts .. starts + q_len -
    1`` of every row; ragged: ``positions[b]`` of row ``b``) is in a mapped page the row owns
    alone (``begin_step`` made it so).
    """

    def __init__(self, stores: list[tuple[Store, Store]], max_len: int, ragged: bool = False) -> None:
        self.max_len = max_len
        self.stores = stores
        self.ragged = ragged
        device = stores[0][0].base.device
        self.starts = torch.zeros((), dtype=torch.int64, device=device)
        self.slots = self.slots32 = self.positions = self.kv_lens = torch.zeros(0, dtype=torch.int64, device=device)
        self.rows: slice | None = slice(0, 0)
        self._slot_tuple: tuple[int, ...] = ()
        self.armed = False
        self.live = False
        for base in {id(store.base): store.base for pair in stores for store in pair}.values():
            torch._dynamo.mark_static_address(base)
        torch._dynamo.mark_static_address(self.starts)

    @classmethod
    def for_core(cls, core: KVCacheBase, max_len: int, ragged: bool = False) -> "CompiledSteps":
        """The compiled steps over ``core``'s layers."""
        views = [tuple(map(unguarded, core.kv_cache(layer))) for layer in range(core.config.num_layers)]
        return cls(stores_of(views), max_len, ragged)

    def copy(self) -> "CompiledSteps":
        """Steps of another ``VirtualCache`` over the same core (a deep copy: its own rows)."""
        return CompiledSteps(self.stores, self.max_len, self.ragged)

    def arm(self, plan: StepPlan, columns: int) -> None:
        """The eager point: ``plan`` (committed; :meth:`follow` saw it) is what the next forward
        writes, after ``columns`` columns (transformers' count)."""
        self.starts.fill_(columns)
        if self.ragged:
            self.kv_lens.copy_(plan.kv_lens_t)
            self.positions.copy_(self.kv_lens).sub_(1)  # ragged steps decode one token per row
        self.armed = True

    def follow(self, plan: StepPlan) -> None:
        """A step begins (eager): its rows' slots are the ones the forward reads."""
        if plan.slots != self._slot_tuple:
            self._set_rows(plan.slots)

    def _set_rows(self, slots: tuple[int, ...]) -> None:
        """New row slots: in place when the batch keeps its size (the tensors' addresses stay)."""
        if len(slots) == self.slots.shape[0]:
            self.slots.copy_(torch.tensor(slots, dtype=torch.int64))
            self.slots32.copy_(self.slots)
        else:
            device = self.slots.device
            self.slots = torch.tensor(slots, dtype=torch.int64, device=device)
            self.slots32 = self.slots.to(torch.int32)
            self.positions = torch.zeros(len(slots), dtype=torch.int64, device=device)
            self.kv_lens = torch.zeros(len(slots), dtype=torch.int32, device=device)
            for tensor in (self.slots, self.slots32, self.positions, self.kv_lens):
                torch._dynamo.mark_static_address(tensor)
        self.rows = slot_slice(slots)
        self._slot_tuple = slots

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
        head_dim]``) at the device positions. Returns the full-length views (dense), or ``k``, ``v``
        unchanged (ragged: :meth:`attend` reads the stores)."""
        k_store, v_store = self.stores[layer]
        write_columns(k_store, v_store, k, v, self.slots, self.positions if self.ragged else self.starts)
        return (k, v) if self.ragged else self.views(layer)

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V of the rows, ``[B, kv_heads, max_len, head_dim]``: views where the
        rows' slots are evenly spaced, else gathered (a copy)."""
        k_store, v_store = (store.view() for store in self.stores[layer])
        if self.rows is not None:
            return k_store[self.rows].transpose(1, 2), v_store[self.rows].transpose(1, 2)
        return k_store.index_select(0, self.slots).transpose(1, 2), v_store.index_select(0, self.slots).transpose(1, 2)

    def attend(self, layer: int, query: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Inside the compiled forward of a ragged step, after :meth:`update` of ``layer``: each
        row's new token attends over that row's own tokens (``kv_lens``), ``query: [B, Hq, 1, D]``
        -> ``[B, 1, Hq, D]``. The last layer ends the step (``live`` off)."""
        k_store, v_store = self.stores[layer]
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out = decode_store(query[:, :, 0], k_store, v_store, self.kv_lens, self.slots32, scale, self.max_len)
        if layer == len(self.stores) - 1:
            self.live = False
        return out.unsqueeze(1)


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
