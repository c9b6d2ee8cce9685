"""``VmkvConnector``: the map/unmap lists travel with each step to every rank (vLLM 0.32).

vLLM sends every step (``SchedulerOutput``) to all ranks with a KV connector's metadata attached
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, ``KVConnectorBase_V1``) and builds one
connector per process and role from ``kv_connector_module_path``. :class:`VmkvConnector` holds
the half of its role: the scheduler half (:mod:`vmkv.vllm.scheduler.connector`) builds each
step's page changes, the worker half (:mod:`vmkv.vllm.worker.connector`) applies them in
``handle_preemptions``. ``SupportsHMA`` is declared (else vLLM turns the hybrid KV cache manager
off); nothing is transferred.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from . import settings as plugin
from .metrics import VmkvConnectorStats, VmkvPromMetrics
from .scheduler.connector import VmkvConnectorScheduler
from .worker.connector import VmkvConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class VmkvConnector(KVConnectorBase_V1, SupportsHMA):
    """vmkv's KV connector: moves page maps, transfers no KV.

    Attributes:
        config: the plugin's settings (``kv_connector_extra_config``).
        connector_scheduler, connector_worker: the half of this process's role, the other ``None``.

    Raises:
        InvalidConfig: ``kv_connector_extra_config`` holds an unknown key or a bad size.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = plugin.PluginConfig.from_extra_config(dict(self._kv_transfer_config.kv_connector_extra_config))
        scheduler = role == KVConnectorRole.SCHEDULER
        self.connector_scheduler = VmkvConnectorScheduler(self.config, vllm_config, kv_cache_config) if scheduler else None
        self.connector_worker = None if scheduler else VmkvConnectorWorker(self.config, vllm_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a preempted request just recomputes

    # ---- scheduler side: vLLM calls these on the engine core's connector ------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.connector_scheduler is not None
        self.connector_scheduler.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_work()

    def reset_cache(self) -> bool:
        """vmkv's trim (:meth:`VmkvConnectorScheduler.reset_cache`)."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.reset_cache()

    # ---- worker side: vLLM calls these on every worker's connector ------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """First hook of every step on every worker: apply the step's page changes."""
        assert self.connector_worker is not None
        self.connector_worker.apply(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.has_connector_metadata():
            assert self.connector_worker is not None
            self.connector_worker.apply(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # ---- both sides -----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> VmkvConnectorStats | None:
        half = self.connector_scheduler or self.connector_worker
        return half.connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> VmkvConnectorStats:
        return VmkvConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> VmkvPromMetrics:
        return VmkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        (self.connector_scheduler or self.connector_worker).shutdown()
