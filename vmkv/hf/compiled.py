"""The compiled steps of a ``VirtualCache(compile=True)``: StaticCache's contract over pages.

A compiled forward cannot map, plan or read a Python length, so a step is split in two: the eager
point (``VirtualCache.prepare_step``, reached through ``get_mask_sizes``) begins it undoably and
loads the :class:`~vmkv.kernels.static_step.StaticStep`; the compiled forward writes through its
device positions and attends over fixed-address views or each row's own length. A step commits
once a forward wrote every layer, else is cancelled; without a prepared step the update runs
eagerly at a graph break. Details: docs/hf.md, "Compiled generation".
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..core.base import KVCacheBase
from ..core.mapping import background_safe
from ..core.step import StepPlan
from ..errors import InvalidConfig, InvalidShape, StalePlan
from ..kernels.static_step import StaticStep
from .compat import attention_kwargs

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
    """Raise ``InvalidConfig`` if pages would be mapped on a thread beside compiled steps that read the
    zero pages past each row.
    """
    if compile and map_ahead and not background_safe(device.type, reads_past_length=True):
        raise InvalidConfig("map_ahead maps pages on a thread while compile=True's attention reads the zero pages "
                            "past each row, which a remap on CUDA would fault: use one or the other")


class CompiledStep:
    """One ``VirtualCache(compile=True)``'s compiled steps: its static step and the step in flight.

    Args:
        core: the core cache (the static step reads and writes its storage).
        max_len: the most columns a row reaches (the core's ``max_seq_len``).
        ragged: the ``"vmkv"`` attention (rows of their own lengths), else full-length views.

    Attributes:
        static: the fixed-address step inputs.
        start: int64 ``[]`` on the device, the columns before the step (``get_seq_length``).
        plan, q_len, rows: the prepared step (``None``, 0, 0 without one).
        armed, live, done: the step's state, ``armed -> live -> done``; :meth:`settle` forgets it.
    """

    def __init__(self, core: KVCacheBase, max_len: int, ragged: bool) -> None:
        self.ragged = ragged
        self.static = StaticStep(core, core.config.max_batch_size, max_len)
        self.num_layers = core.config.num_layers
        self.start = torch.zeros((), dtype=torch.int64, device=self.static.device)
        torch._dynamo.mark_static_address(self.start, guard=False)
        self.plan: StepPlan | None = None
        self.q_len = self.rows = 0
        self.armed = self.live = False
        self.done: str | None = None

    def copy(self, core: KVCacheBase) -> "CompiledStep":
        """Steps of another ``VirtualCache`` over the same core (a deep copy: its own rows)."""
        return type(self)(core, self.static.max_len, self.ragged)

    # ---- eager -------------------------------------------------------------------------------
    def begin(self, core: KVCacheBase, seq_ids: list[Any], q_len: int, columns: int) -> None:
        """The eager point: begin ``q_len`` new columns of every row, undoably, after ``columns``.

        Raises:
            SequenceTooLong, OutOfPages, CacheClosed: from the core (nothing changed).
        """
        self.prepare(core.begin_step(dict.fromkeys(seq_ids, q_len), undoable=True), columns)

    def prepare(self, plan: StepPlan, columns: int) -> None:
        """``plan`` (an undoable step of the core) is what the next forward writes."""
        self.static.load(plan)
        self.start.fill_(columns)
        self.plan, self.q_len, self.rows = plan, plan.q_lens[0], plan.batch_size
        self.armed, self.live, self.done = True, False, None

    def waiting(self, q_len: int) -> bool:
        """Whether a step of ``q_len`` tokens is prepared and no forward took it yet."""
        return self.armed and self.q_len == q_len

    def settle(self, unwritten: bool = True) -> tuple[str, StepPlan, int] | None:
        """Forget the step in flight: ``(outcome, plan, q_len)``, outcome ``"compiled"``/``"eager"`` (commit)
        or ``"cancel"``; ``None`` without one.
        """
        if self.plan is None or (self.done is None and not unwritten):
            return None
        outcome = (self.done or "cancel", self.plan, self.q_len)
        self.plan, self.q_len, self.rows = None, 0, 0
        self.armed = self.live = False
        self.done = None
        return outcome

    def resolve(self, core: KVCacheBase, counters: Any, cancel_unwritten: bool = True) -> int:
        """Commit a written step or cancel an unwritten one (unless ``cancel_unwritten`` is False); returns
        the columns committed.
        """
        outcome = self.settle(cancel_unwritten)
        if outcome is None:
            return 0
        how, plan, q_len = outcome
        if how == "cancel":
            cancel(core, plan)
            return 0
        if how == "compiled":
            core.written(plan)  # every layer was written through device positions
        counters[f"{how}_steps"] += 1
        return q_len

    def take_eagerly(self, core: KVCacheBase, k: torch.Tensor) -> StepPlan:
        """An eager forward's first layer takes the prepared step: its plan.

        Raises:
            InvalidShape: the forward does not fit the step, which is cancelled first.
        """
        if k.shape[0] != self.rows or k.shape[2] != self.q_len:
            rows, q_len = self.rows, self.q_len
            cancel(core, self.settle()[1])
            raise InvalidShape(f"the prepared step is {rows} rows of {q_len} new tokens, the forward gives "
                               f"{k.shape[0]} rows of {k.shape[2]}; use reorder_cache, batch_select_indices or "
                               "batch_repeat_interleave to change rows, or cache.reset() for a new batch")
        self.take()
        return self.plan

    def take(self) -> None:
        """A forward's first layer takes the prepared step (eager, or traced in a compiled forward)."""
        self.live, self.armed = True, False

    def finish(self, layer: int, how: str) -> None:
        """After ``layer``: the last layer makes the step ``done`` (``how`` it was written)."""
        if layer == self.num_layers - 1:
            self.live, self.done = False, how

    # ---- inside the compiled forward ---------------------------------------------------------------
    def traced_update(self, cache: Any, k: torch.Tensor, v: torch.Tensor, layer: int, args: tuple,
                      kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache.update`` as dynamo traces it: the prepared step writes through its device positions;
        anything else runs eagerly at a graph break.
        """
        why = None
        if layer == 0 and not self.armed or layer > 0 and not self.live:
            why = FALLBACK_NO_STEP
        elif layer == 0 and (k.shape[0] != self.rows or k.shape[2] != self.q_len):
            why = FALLBACK_MISFIT  # the eager update refuses it (and cancels the step)
        elif self.ragged:
            carrier = attention_kwargs(kwargs)
            if carrier is None:
                why = FALLBACK_NO_KWARGS
            else:
                carrier["vmkv_step"] = self  # this layer's attention gets this cache's step, from this call
        if why is not None:
            return eager_update(cache, k, v, layer, args, kwargs, why)
        if layer == 0:
            self.take()
        return self.update(layer, k, v)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` at the step's positions; return full-length views, or ``k``, ``v`` (``"vmkv"``)."""
        self.static.write(layer, k, v)
        if self.ragged:
            return k, v
        self.finish(layer, "compiled")
        return self.static.views(layer, k.shape[0])

    def attend(self, layer: int, query: torch.Tensor, scale: float | None, variant: Any) -> torch.Tensor:
        """The ``"vmkv"`` attention after :meth:`update`: each row's new token over its own tokens,
        ``query: [B, Hq, 1, D]`` -> ``[B, 1, Hq, D]``.
        """
        out = self.static.attend(layer, query[:, :, 0], scale, softcap=variant.softcap, sinks=variant.sinks)
        self.finish(layer, "compiled")
        return out.unsqueeze(1)


@torch.compiler.disable
def eager_update(cache: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                 args: tuple, kwargs: dict, why: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update`` run eagerly inside a compiled forward (a graph break), counted in ``compile_fallbacks``."""
    cache.counters["compile_fallbacks"] += 1
    if cache.counters["compile_fallbacks"] == 1:
        log.warning("vmkv.hf: %s", why)
    return cache._eager_update(key_states, value_states, layer_idx, *args, **kwargs)


def cancel(core: KVCacheBase, plan: StepPlan) -> None:
    """Undo a prepared step no forward wrote; where that cannot be undone, forget its tokens."""
    try:
        core.cancel_step(plan)
    except StalePlan:
        for seq_id, q_len in zip(plan.seq_ids, plan.q_lens):
            core.truncate(seq_id, core.seq_len(seq_id) - q_len)


FALLBACK_NO_STEP = ("a compiled forward ran with no step prepared at an eager point, so the cache runs eagerly "
                    "at a graph break (slower, correct); transformers' generate() prepares each step itself, a "
                    "hand-written loop calls cache.prepare_step(q_len) before each compiled forward")
FALLBACK_NOT_COMPILEABLE = ("this VirtualCache was made without compile=True, so under torch.compile it runs eagerly "
                            "at graph breaks (slower, correct); VirtualCache(compile=True, config=..., max_seq_len=...) "
                            "compiles (docs/hf.md)")
FALLBACK_MISFIT = ("a compiled forward does not fit the prepared step (another batch or number of new tokens): it "
                   "runs eagerly, which refuses it")
FALLBACK_NO_KWARGS = ("this model does not pass the attention's kwargs to Cache.update (transformers < 5.24, or a "
                      "model such as GPT-NeoX), so the compiled 'vmkv' attention cannot receive its step: each layer "
                      "runs eagerly at a graph break (slower, correct)")
