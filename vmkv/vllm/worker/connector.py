"""The KV connector's worker half: every worker applies each step's page and slot changes.

``handle_preemptions``, the first thing ``execute_model`` does with a step (V1 runner
``vllm/v1/worker/gpu_model_runner.py``; V2 ``ActiveKVConnector.pre_forward``), frees slots,
waits for the device, unmaps, then maps pages and slots before the forward writes
(``start_load_kv`` in 0.32 comes too late). A page is unmapped only in a step scheduled after
the one that last used it; a gap in the step numbers or a foreign layout fingerprint is refused.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...errors import BackendError, InvalidConfig
from .. import settings as plugin
from ..contiguous.slots import SlotSpace
from ..contiguous.support import slot_geometry
from ..layout import KVLayout
from ..metadata import VmkvMetadata
from ..metrics import VmkvConnectorStats
from .kvbuffer import KVBuffer, process_rss_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class VmkvConnectorWorker:
    """The worker half of vmkv's KV connector (``vllm_config``: this worker's)."""

    def __init__(self, config: plugin.PluginConfig, vllm_config: "VllmConfig") -> None:
        self.config = config
        self._vllm_config = vllm_config
        self._rank = getattr(vllm_config.parallel_config, "rank", 0)
        self.buffer: KVBuffer | None = None  # the KV buffer (attach)
        self.layout: KVLayout | None = None
        self.slot_space: SlotSpace | None = None  # contiguous mode
        self._applied = 0  # the last step applied
        self._trim_step = 0  # the step carrying the latest trim, once applied

    def slot_mapping_bound(self, kv_cache_config: Any, num_views: int) -> int:
        """Host mappings contiguous mode may need at most (0 in paged mode)."""
        if self.config.kv_mode != "contiguous":
            return 0
        max_slots, max_blocks = slot_geometry(self._vllm_config, kv_cache_config)
        pieces = 2 * kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads * num_views
        return 2 * max_slots * max_blocks * pieces + pieces

    def attach(self, buffer: KVBuffer, layout: KVLayout, views: dict[str, Any], kv_cache_config: Any) -> None:
        """Take the KV buffer ``allocate_kv_cache`` built (a new one replaces the old); in contiguous mode
        reserve the slots over it.

        Raises:
            InvalidConfig: contiguous mode cannot map this buffer's blocks into slots.
        """
        if self.slot_space is not None:
            self.slot_space.close()
            self.slot_space = None
        if self.buffer is not None and self.buffer is not buffer:
            self.buffer.close()
        self.buffer, self.layout, self._applied, self._trim_step = buffer, layout, 0, 0
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
        if self.buffer is None:
            raise InvalidConfig(f"vmkv's KV connector is configured but this worker's KV cache was allocated by vLLM: "
                                f"set {plugin.ENV_FLAG}=1 in the environment of every vLLM process")
        low, high = self.buffer.addr, self.buffer.addr + self.buffer.nbytes
        for name, tensor in kv_caches.items():
            if not low <= tensor.data_ptr() < high:
                raise InvalidConfig(f"vmkv: KV cache {name} does not live in vmkv's KV buffer")

    def apply(self, meta: Any) -> None:
        """Apply one step's changes, once (a step applied already is skipped).

        Raises:
            InvalidConfig: not vmkv's metadata, or no vmkv KV buffer on this worker.
            BackendError: a step was lost, or the scheduler's KV layout differs from this worker's.
        """
        if not isinstance(meta, VmkvMetadata):
            raise InvalidConfig(f"vmkv's KV connector got {type(meta).__name__} metadata")
        if meta.step <= self._applied:
            return
        if self.buffer is None or self.layout is None:
            raise InvalidConfig(f"vmkv: no KV buffer on this worker; set {plugin.ENV_FLAG}=1 for every vLLM process")
        if meta.step != self._applied + 1:
            raise BackendError(f"vmkv: step {meta.step} arrived after step {self._applied}; page changes were lost")
        if meta.fingerprint != self.layout.fingerprint:
            raise BackendError(f"vmkv: this worker's KV layout ({self.layout}) differs from the scheduler's "
                               "(e.g. pipeline stages with different layer counts): unsupported")
        space = self.slot_space
        if space is not None:
            space.free(meta.slots.frees)  # before the pages behind them go
        self.buffer.apply(meta.unmap_pages, meta.map_pages)
        if space is not None:
            space.map(meta.slots.maps)  # after the pages behind them came
        self._applied, self._trim_step = meta.step, meta.trim_step

    def worker_stats(self) -> dict[str, Any]:
        """This worker's counters (see :func:`vmkv.vllm.stats`).

        Raises:
            InvalidConfig: this worker has no vmkv KV buffer.
        """
        if self.buffer is None:
            raise InvalidConfig(f"vmkv: no KV buffer on this worker; set {plugin.ENV_FLAG}=1 for every vLLM process")
        slots = self.slot_space.stats() if self.slot_space is not None else {}
        return {**self.buffer.stats(), **slots, "kv_mode": self.config.kv_mode,
                "applied_step": self._applied, "trim_step": self._trim_step,
                "rss_bytes": process_rss_bytes(),
                "pid": os.getpid(), "rank": self._rank}

    def connector_stats(self) -> VmkvConnectorStats | None:
        """This rank's KV memory for vLLM's stats (``None`` before the buffer exists)."""
        if self.buffer is None:
            return None
        return VmkvConnectorStats(data={"ranks": {self._rank: self.buffer.stats()}})

    def shutdown(self) -> None:
        """Release the slots and the KV buffer. Idempotent."""
        if self.slot_space is not None:
            self.slot_space.close()
            self.slot_space = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
