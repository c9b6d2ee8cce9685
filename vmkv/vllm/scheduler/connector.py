"""The KV connector's scheduler half: each step's page and slot changes, built in the engine core.

At the end of every ``Scheduler.schedule`` (``build_connector_meta``) it sends the pages the
page-affine pool mapped and unmapped since the last step (and contiguous mode's slot changes) as
:class:`~vmkv.vllm.metadata.VmkvMetadata`. It holds the engine's ledger seat in a shared budget,
asks for one more (empty) step while changes wait and no request runs, and numbers the step
that carries a trim (``trim_step``) so :func:`vmkv.vllm.trim` can wait for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ...errors import InvalidConfig
from ...ledger import SharedBudget
from .. import settings as plugin
from ..contiguous.assign import SlotAssigner, SlotDelta, WriteGuard
from ..contiguous.support import check_model, slot_geometry
from ..layout import KVLayout, check_supported, meta_layout
from ..metadata import VmkvMetadata
from ..metrics import VmkvConnectorStats
from .block_pool import PageAffineBlockPool
from .share import EngineShare

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput

logger = init_logger(__name__)


class VmkvConnectorScheduler:
    """The scheduler half of vmkv's KV connector (``vllm_config``, ``kv_cache_config``: the engine's)."""

    def __init__(self, config: plugin.PluginConfig, vllm_config: "VllmConfig", kv_cache_config: Any) -> None:
        self.config = config
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.pool: PageAffineBlockPool | None = None  # bound by VmkvScheduler (bind)
        self.share: EngineShare | None = None  # in a shared budget: the ledger seat
        self._manager: Any = None  # vLLM's KVCacheManager
        self._step = 0
        self._flush = False
        self._trim_step = 0  # the step carrying the latest trim
        self._slots: SlotAssigner | None = None  # contiguous mode
        self._guard: WriteGuard | None = None

    def pool_settings(self, vllm_config: "VllmConfig") -> tuple[KVLayout, int, int]:
        """``(layout, budget_pages, max_idle_units)`` for the scheduler's block pool.

        Raises:
            InvalidConfig: the model's KV cache is not supported, or the budget is too small.
        """
        check_supported(self._kv_cache_config)
        if self.config.kv_mode == "contiguous":
            self._start_slots(vllm_config)
        kv_layout = meta_layout(self._kv_cache_config, vllm_config.cache_config.get_resolved_kv_cache_layout(),
                                self.config.page_size)
        budget_pages, max_idle_units = plugin.budget_settings(self.config, kv_layout)
        logger.info("vmkv: %s; %s", plugin.describe(self.config), kv_layout)
        return kv_layout, budget_pages, max_idle_units

    def _start_slots(self, vllm_config: "VllmConfig") -> None:
        check_model(vllm_config, self._kv_cache_config)
        max_slots, max_blocks = slot_geometry(vllm_config, self._kv_cache_config)
        self._slots = SlotAssigner(max_slots, max_blocks)
        self._guard = WriteGuard(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)

    def bind(self, kv_cache_manager: "KVCacheManager") -> None:
        """Follow ``kv_cache_manager`` and its block pool (vmkv's, once ``VmkvScheduler`` installed it)."""
        self._manager = kv_cache_manager
        pool = kv_cache_manager.block_pool
        self.pool = pool if isinstance(pool, PageAffineBlockPool) else None
        if self.pool is not None and self._slots is not None:
            self.pool.track_handed_out = True

    def join_ledger(self, ranks: int, wake: Any) -> EngineShare | None:
        """Join the ``shared_budget`` ledger, if the settings name one (``ranks``: workers mapping every
        page; ``wake``: wakes the engine-core loop).

        Raises:
            OutOfPages: the ledger cannot grant what the pool maps from the start.
        """
        if self.config.shared_budget is None or self.pool is None:
            return None
        queue = self.pool.free_block_queue
        self.share = EngineShare(SharedBudget.parse(self.config.shared_budget), queue.layout.page_size * ranks,
                                 queue.budget_pages, wake)
        try:
            self.share.attach(queue)
        except BaseException:
            self.share.close()
            self.share = None
            raise
        return self.share

    def step_boundary(self) -> None:
        """Start of ``schedule()``: serve other ledger members' requests (shared budget only)."""
        if self.share is not None:
            self.share.boundary(self._step + 1)

    def step_finished(self, meta: Any) -> None:
        """Every worker executed the step ``meta`` (its connector metadata) carried."""
        if self.share is not None and isinstance(meta, VmkvMetadata):
            self.share.finished(meta.step)

    def build_meta(self, scheduler_output: "SchedulerOutput") -> VmkvMetadata:
        """The pages mapped and unmapped since the previous step (and the step's slot changes).

        Raises:
            InvalidConfig: the scheduler is not vmkv's (no page-affine block pool).
        """
        if self.pool is None:
            raise InvalidConfig(f"vmkv's KV connector needs --scheduler-cls {plugin.SCHEDULER_CLS} (or vmkv.vllm.engine_args())")
        to_map, to_unmap = self.pool.free_block_queue.take_delta()
        self._step += 1
        self._flush = False
        slots = self._slot_delta(scheduler_output) if self._slots is not None else SlotDelta()
        if self.share is not None:
            self.share.built(self._step)
        return VmkvMetadata(self._step, self.pool.free_block_queue.layout.fingerprint, to_map, to_unmap,
                            self._trim_step, slots)

    def _slot_delta(self, scheduler_output: "SchedulerOutput") -> SlotDelta:
        """Contiguous mode: the step's slot changes, after checking its writes (:class:`WriteGuard`)."""
        holding = {request: [block.block_id for block in blocks] for request, blocks in self._holding().items()}
        self._guard.fresh(self.pool.take_handed_out())
        new = scheduler_output.scheduled_new_reqs
        cached = scheduler_output.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in new}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        writes = [(holding[r], computed[r], n) for r, n in scheduler_output.num_scheduled_tokens.items() if r in holding]
        self._guard.step(self._step, writes)
        return self._slots.update(holding)

    def _holding(self) -> dict[str, Any]:
        """vLLM's per-request block lists (``req_to_blocks`` of the one KV cache group)."""
        return self._manager.coordinator.single_type_managers[0].req_to_blocks

    def has_pending_work(self) -> bool:
        """True while page or slot changes, a ledger request or a give-back wait for a step to carry them."""
        if self.pool is None:
            return False
        stale = self._slots is not None and self._slots.has_stale(self._holding())
        return (self._flush or stale or self.pool.free_block_queue.has_delta()
                or (self.share is not None and self.share.pending()))

    def reset_cache(self) -> bool:
        """vmkv's trim: evict the pages only prefix-cached blocks keep mapped; the next step (asked for
        here) carries the unmaps and is recorded as ``trim_step``.
        """
        if self.pool is not None:
            self.pool.trim()
            self._flush = True
            self._trim_step = self._step + 1
        return True

    def connector_stats(self) -> VmkvConnectorStats | None:
        """In a shared budget, the ledger seat's gauges; else ``None`` (the workers report memory)."""
        if self.share is None:
            return None
        return VmkvConnectorStats(data={"ledger": self.share.gauges()})

    def shutdown(self) -> None:
        """Leave the ledger, if in one. Idempotent."""
        if self.share is not None:
            self.share.close()
            self.share = None
