"""``VmkvConnector``: the map/unmap lists travel with each step to every rank (vLLM 0.32).

vLLM sends every scheduled step (``SchedulerOutput``) from the scheduler to all workers of all
tensor- and pipeline-parallel ranks, local or remote, and lets a KV connector attach its own
metadata (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, ``KVConnectorBase_V1``):

* scheduler half: ``build_connector_meta`` runs at the end of ``Scheduler.schedule``
  (``vllm/v1/core/sched/scheduler.py``), after every block of the step was allocated. It takes
  the pages the :class:`~vmkv.vllm.block_pool.PageAffineBlockPool` mapped and unmapped since the
  previous step (:meth:`~vmkv.vllm.free_blocks.PageAwareFreeBlocks.take_delta`).
* worker half: ``handle_preemptions`` is the first thing ``execute_model`` does with the step
  (V1 runner, ``vllm/v1/worker/gpu_model_runner.py``, also the CPU runner; V2 runner,
  ``ActiveKVConnector.pre_forward`` in ``vllm/v1/worker/gpu/kv_connector.py``). The worker applies
  the lists there: it waits for the device, unmaps, then maps, before the forward pass writes a
  new block. ``start_load_kv`` applies them too if that has not happened (it is idempotent): in
  0.32 it runs *after* the forward unless ``has_sync_kv_loads``, and V1's ``_update_states``
  (which may copy into new blocks) runs before it, so it alone would be too late.

Unmapping is safe by construction: a page is unmapped only in the metadata of a step scheduled
after the step that last used it, and the worker synchronizes the device before unmapping.
Steps are numbered; a worker refuses a gap or a layout fingerprint that differs from the
scheduler's (e.g. pipeline stages with different layer counts) with a clear error.

In a host-wide ledger (``shared_budget``) the scheduler half holds the engine's seat
(:class:`~vmkv.vllm.share.EngineShare`): each built step is recorded, each finished step
(``VmkvScheduler.update_from_output``) gives back the grants its unmaps freed, and requests from
other members are served at the start of ``schedule()``.

When pages change while no request runs (requests finished, or a trim), the connector reports
``has_pending_push_work`` so the engine runs one more (empty) step that carries the unmaps. The
step that carries a trim is numbered in every later metadata (``trim_step``), so a caller waiting
for its trim (:func:`vmkv.vllm.trim`) waits for that step, not for any step.

Also here: the worker's counters as ``KVConnectorStats`` (logged by vLLM and exported as
Prometheus metrics ``vllm:vmkv_kv_resident_bytes``, ``vllm:vmkv_kv_mapped_pages``,
``vllm:vmkv_kv_page_maps_total``, ``vllm:vmkv_kv_page_unmaps_total``, and in a shared budget the
scheduler's seat as ``vllm:vmkv_ledger_held_bytes``, ``vllm:vmkv_ledger_idle_bytes``,
``vllm:vmkv_ledger_reclaims_total``; vLLM only collects and
unregisters names under ``vllm:``), and ``SupportsHMA`` (without it
vLLM turns the hybrid KV cache manager off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from ..errors import BackendError, InvalidConfig
from ..ledger import SharedBudget
from . import settings as plugin
from .block_pool import PageAffineBlockPool
from .kvbuffer import KVBuffer, process_rss_bytes
from .layout import KVLayout, check_supported, meta_layout
from .share import EngineShare
from .slots import SlotAssigner, SlotDelta, SlotSpace, WriteGuard

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class VmkvMetadata(KVConnectorMetadata):
    """One step's page changes, sent to every worker.

    Attributes:
        step: 1, 2, 3, ... in scheduling order.
        fingerprint: the scheduler's :attr:`KVLayout.fingerprint`.
        map_pages / unmap_pages: virtual pages of the KV buffer to map / unmap.
        trim_step: the step that carries the latest trim (the first step built after the trim
            was asked for: this one or an earlier one); 0 before any trim.
        slots: contiguous mode: the step's slot changes (freed before the page unmaps, mapped
            after the page maps); empty in paged mode.
    """

    step: int
    fingerprint: str
    map_pages: list[int] = field(default_factory=list)
    unmap_pages: list[int] = field(default_factory=list)
    trim_step: int = 0
    slots: SlotDelta = field(default_factory=SlotDelta)


def budget_settings(config: plugin.PluginConfig, layout: KVLayout) -> tuple[int, int]:
    """``(budget_pages, max_idle_units)`` of ``config`` over ``layout``; the scheduler and every
    worker compute them the same way (in a shared budget no more pages than the ledger holds)."""
    pages = layout.num_pages if config.budget is None else min(config.budget // layout.page_size, layout.num_pages)
    if config.shared_budget is not None:
        pages = min(pages, SharedBudget.parse(config.shared_budget).budget // layout.page_size)
    cached = pages * layout.page_size // 8 if config.max_cached is None else config.max_cached
    unit_bytes = layout.max_pages_per_unit * layout.page_size
    return pages, cached // unit_bytes


def slot_geometry(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int]:
    """``(slots, blocks per slot)`` of contiguous mode: ``max_num_seqs`` slots of ``max_model_len``
    tokens in whole blocks (the scheduler and every worker compute them the same way)."""
    block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    return vllm_config.scheduler_config.max_num_seqs, -(-vllm_config.model_config.max_model_len // block_size)


class VmkvConnectorStats(KVConnectorStats):
    """Per-rank memory counters: ``data = {"ranks": {rank: {...}}}``, and in a shared budget the
    scheduler's ``"ledger": {"held_bytes", "idle_bytes", "reclaims"}``; a newer snapshot of a rank
    (or of the ledger seat) replaces the older one, so aggregating over workers and over time are
    the same operation."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "VmkvConnectorStats":
        ranks = {**self.data.get("ranks", {}), **other.data.get("ranks", {})}
        ledger = other.data.get("ledger") or self.data.get("ledger")
        return VmkvConnectorStats(data={"ranks": ranks, **({"ledger": ledger} if ledger else {})})

    def reduce(self) -> dict[str, int | float]:
        ranks = self.data.get("ranks", {}).values()
        keys = ("resident_bytes", "mapped_pages", "maps", "unmaps")
        ledger = {f"ledger_{key}": value for key, value in self.data.get("ledger", {}).items()}
        return {"ranks": len(ranks), **{key: sum(r[key] for r in ranks) for key in keys}, **ledger}

    def is_empty(self) -> bool:
        return not self.data.get("ranks") and not self.data.get("ledger")


class VmkvPromMetrics(KVConnectorPromMetrics):
    """Gauges and counters of the KV memory vmkv maps, summed over ranks, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls: Any, name: str, doc: str) -> dict[int, Any]:
            metric = cls(name=name, documentation=doc, labelnames=labelnames)
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        self._resident = per_engine(self._gauge_cls, "vllm:vmkv_kv_resident_bytes", "Bytes of memory behind vmkv's KV page stores")
        self._mapped = per_engine(self._gauge_cls, "vllm:vmkv_kv_mapped_pages", "KV buffer pages mapped by vmkv")
        self._maps = per_engine(self._counter_cls, "vllm:vmkv_kv_page_maps", "KV buffer pages mapped, cumulative")
        self._unmaps = per_engine(self._counter_cls, "vllm:vmkv_kv_page_unmaps", "KV buffer pages unmapped, cumulative")
        self._held = per_engine(self._gauge_cls, "vllm:vmkv_ledger_held_bytes",
                                "Bytes of the host-wide KV budget this engine holds")
        self._idle = per_engine(self._gauge_cls, "vllm:vmkv_ledger_idle_bytes",
                                "Bytes this engine could give back to the host-wide KV budget when asked")
        self._reclaims = per_engine(self._counter_cls, "vllm:vmkv_ledger_reclaims",
                                    "Pages this engine gave back to the host-wide KV budget on request")
        self._seen: dict[tuple[int, str], int] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        totals = VmkvConnectorStats(data=transfer_stats_data).reduce()
        counters = []
        if totals["ranks"]:  # a step's stats may carry the scheduler's ledger seat only
            self._resident[engine_idx].set(totals["resident_bytes"])
            self._mapped[engine_idx].set(totals["mapped_pages"])
            counters += [("maps", self._maps), ("unmaps", self._unmaps)]
        if "ledger_held_bytes" in totals:
            self._held[engine_idx].set(totals["ledger_held_bytes"])
            self._idle[engine_idx].set(totals["ledger_idle_bytes"])
            counters.append(("ledger_reclaims", self._reclaims))
        for key, counter in counters:
            grown = totals[key] - self._seen.get((engine_idx, key), 0)
            if grown > 0:
                counter[engine_idx].inc(grown)
            self._seen[(engine_idx, key)] = totals[key]


class VmkvConnector(KVConnectorBase_V1, SupportsHMA):
    """vmkv's KV connector: moves page maps, transfers no KV (see the module docstring).

    Raises:
        InvalidConfig: ``kv_connector_extra_config`` holds an unknown key or a bad size.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = plugin.PluginConfig.from_extra_config(dict(self._kv_transfer_config.kv_connector_extra_config))
        self._pool: Any = None  # scheduler: the PageAffineBlockPool
        self.share: EngineShare | None = None  # scheduler, in a shared budget: the ledger seat
        self._step = 0
        self._flush = False
        self._trim_step = 0  # scheduler: the step carrying the latest trim; worker: that step, once applied
        self._buffer: KVBuffer | None = None  # worker: the KV buffer
        self._layout: KVLayout | None = None
        self._applied = 0
        self._rank = getattr(vllm_config.parallel_config, "rank", 0)
        self._vllm_config = vllm_config
        self._slots: SlotAssigner | None = None  # scheduler, contiguous mode
        self._guard: WriteGuard | None = None
        self.slot_space: SlotSpace | None = None  # worker, contiguous mode

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a preempted request just recomputes

    # ---- scheduler side -------------------------------------------------------------------------
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
        budget_pages, max_idle_units = budget_settings(self.config, kv_layout)
        logger.info("vmkv: %s; %s", plugin.describe(self.config), kv_layout)
        return kv_layout, budget_pages, max_idle_units

    def slot_mapping_bound(self, kv_cache_config: Any, num_views: int) -> int:
        """Host mappings contiguous mode may need at most: every block of every full slot mapped on
        its own in each head's K and V of ``num_views`` layers, splitting their ranges (0 in paged mode)."""
        if self.config.kv_mode != "contiguous":
            return 0
        max_slots, max_blocks = slot_geometry(self._vllm_config, kv_cache_config)
        pieces = 2 * kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads * num_views
        return 2 * max_slots * max_blocks * pieces + pieces

    def _start_slots(self, vllm_config: "VllmConfig") -> None:
        from .contiguous import check_model

        check_model(vllm_config, self._kv_cache_config)
        max_slots, max_blocks = slot_geometry(vllm_config, self._kv_cache_config)
        self._slots = SlotAssigner(max_slots, max_blocks)
        self._guard = WriteGuard(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)

    def _slot_delta(self, scheduler_output: "SchedulerOutput") -> SlotDelta:
        """Contiguous mode: the step's slot changes, after checking its writes (:class:`WriteGuard`)."""
        manager = self._pool_manager()
        holding = {request: [block.block_id for block in blocks] for request, blocks in manager.req_to_blocks.items()}
        self._guard.fresh(self._pool.take_handed_out())
        new = scheduler_output.scheduled_new_reqs
        cached = scheduler_output.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in new}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        writes = [(holding[r], computed[r], n) for r, n in scheduler_output.num_scheduled_tokens.items() if r in holding]
        self._guard.step(self._step, writes)
        return self._slots.update(holding)

    def _pool_manager(self) -> Any:
        return self._kv_cache_manager.coordinator.single_type_managers[0]

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._kv_cache_manager = kv_cache_manager
        pool = kv_cache_manager.block_pool
        self._pool = pool if isinstance(pool, PageAffineBlockPool) else None
        if self._pool is not None and self._slots is not None:
            self._pool.track_handed_out = True

    def join_ledger(self, ranks: int, wake: Any) -> EngineShare | None:
        """Join the ``shared_budget`` ledger, if the settings name one, for the bound pool.

        Args:
            ranks: workers that each map every page (tensor x pipeline parallel ranks).
            wake: wakes the engine-core loop (:func:`vmkv.vllm.share.engine_wake`), or ``None``.

        Raises:
            OutOfPages: the ledger cannot grant what the pool maps from the start.
        """
        if self.config.shared_budget is None or self._pool is None:
            return None
        queue = self._pool.free_block_queue
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

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> VmkvMetadata:
        """The pages mapped and unmapped since the previous step.

        Raises:
            InvalidConfig: the scheduler is not vmkv's (no page-affine block pool).
        """
        if self._pool is None:
            raise InvalidConfig(f"vmkv's KV connector needs --scheduler-cls {plugin.SCHEDULER_CLS} (or vmkv.vllm.engine_args())")
        to_map, to_unmap = self._pool.free_block_queue.take_delta()
        self._step += 1
        self._flush = False
        slots = self._slot_delta(scheduler_output) if self._slots is not None else SlotDelta()
        if self.share is not None:
            self.share.built(self._step)
        return VmkvMetadata(self._step, self._pool.free_block_queue.layout.fingerprint, to_map, to_unmap,
                            self._trim_step, slots)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def has_pending_push_work(self) -> bool:
        """True while page changes or slot frees wait for a step to carry them, or a ledger request
        or give-back waits for one (the engine then steps)."""
        if self._pool is None:
            return False
        stale = self._slots is not None and self._slots.has_stale(self._pool_manager().req_to_blocks)
        return (self._flush or stale or self._pool.free_block_queue.has_delta()
                or (self.share is not None and self.share.pending()))

    def reset_cache(self) -> bool:
        """vmkv's trim: evict the pages only prefix-cached blocks keep mapped; the next step
        (requested here even if nothing changed) carries the unmaps and is recorded as the trim's
        step (``trim_step`` in every later metadata and in the workers' stats)."""
        if self._pool is not None:
            self._pool.trim()
            self._flush = True
            self._trim_step = self._step + 1
        return True

    # ---- worker side ----------------------------------------------------------------------------
    def attach(self, buffer: KVBuffer, layout: KVLayout, views: dict[str, Any], kv_cache_config: Any) -> None:
        """Take the KV buffer :func:`vmkv.vllm.worker.allocate_kv_cache` built (a new one replaces
        the old: vLLM re-allocates after profiling); in contiguous mode reserve the slots over it.

        Raises:
            InvalidConfig: contiguous mode cannot map this buffer's blocks into slots.
        """
        if self.slot_space is not None:
            self.slot_space.close()
            self.slot_space = None
        if self._buffer is not None and self._buffer is not buffer:
            self._buffer.close()
        self._buffer, self._layout, self._applied, self._trim_step = buffer, layout, 0, 0
        if self.config.kv_mode == "contiguous":
            max_slots, max_blocks = slot_geometry(self._vllm_config, kv_cache_config)
            block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
            self.slot_space = SlotSpace(buffer, views, kv_cache_config.num_blocks, block_size, max_slots, max_blocks)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """vLLM hands over the KV tensors; they must be views of vmkv's buffer.

        Raises:
            InvalidConfig: the buffer was allocated by vLLM itself (``VMKV_VLLM=1`` was not set in
                this worker process), or not from vmkv's buffer.
        """
        if self._buffer is None:
            raise InvalidConfig(f"vmkv's KV connector is configured but this worker's KV cache was allocated by vLLM: "
                                f"set {plugin.ENV_FLAG}=1 in the environment of every vLLM process")
        low, high = self._buffer.addr, self._buffer.addr + self._buffer.nbytes
        for name, tensor in kv_caches.items():
            if not low <= tensor.data_ptr() < high:
                raise InvalidConfig(f"vmkv: KV cache {name} does not live in vmkv's KV buffer")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """First hook of every step on every worker: apply the step's page changes."""
        self._apply(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._apply(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def _apply(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, VmkvMetadata):
            raise InvalidConfig(f"vmkv's KV connector got {type(meta).__name__} metadata")
        if meta.step <= self._applied:
            return
        if self._buffer is None or self._layout is None:
            raise InvalidConfig(f"vmkv: no KV buffer on this worker; set {plugin.ENV_FLAG}=1 for every vLLM process")
        if meta.step != self._applied + 1:
            raise BackendError(f"vmkv: step {meta.step} arrived after step {self._applied}; page changes were lost")
        if meta.fingerprint != self._layout.fingerprint:
            raise BackendError(f"vmkv: this worker's KV layout ({self._layout}) differs from the scheduler's "
                               "(e.g. pipeline stages with different layer counts): unsupported")
        space = self.slot_space
        if space is not None:
            space.free(meta.slots.frees)  # before the pages behind them go
        self._buffer.apply(meta.unmap_pages, meta.map_pages)
        if space is not None:
            space.map(meta.slots.maps)  # after the pages behind them came
        self._applied, self._trim_step = meta.step, meta.trim_step

    def worker_stats(self) -> dict[str, Any]:
        """This worker's counters (see :func:`vmkv.vllm.stats`).

        Raises:
            InvalidConfig: this worker has no vmkv KV buffer.
        """
        if self._buffer is None:
            raise InvalidConfig(f"vmkv: no KV buffer on this worker; set {plugin.ENV_FLAG}=1 for every vLLM process")
        slots = self.slot_space.stats() if self.slot_space is not None else {}
        return {**self._buffer.stats(), **slots, "kv_mode": self.config.kv_mode,
                "applied_step": self._applied, "trim_step": self._trim_step,
                "rss_bytes": process_rss_bytes(),
                "pid": os.getpid(), "rank": self._rank}

    def get_kv_connector_stats(self) -> VmkvConnectorStats | None:
        if self.share is not None:  # the scheduler half in a shared budget: its ledger seat
            return VmkvConnectorStats(data={"ledger": self.share.gauges()})
        if self._buffer is None:
            return None
        return VmkvConnectorStats(data={"ranks": {self._rank: self._buffer.stats()}})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> VmkvConnectorStats:
        return VmkvConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> VmkvPromMetrics:
        return VmkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.slot_space is not None:
            self.slot_space.close()
            self.slot_space = None
        if self.share is not None:
            self.share.close()
            self.share = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
