"""Worker side: vLLM 0.32's KV buffer becomes a vmkv reservation.

``allocate_kv_cache`` (``vllm/v1/worker/utils.py``) is imported by name into the V1 and V2 model
runners, so :func:`install` replaces it everywhere it is reachable. The replacement runs vLLM's
function on the ``meta`` device, reserves a :class:`~vmkv.vllm.worker.kvbuffer.KVBuffer` of the
same size and rebuilds each view over it, unmapped. vLLM's profiling cache (before connectors
exist) stays stock.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.logger import init_logger
from vllm.v1.worker import utils as worker_utils

from ...errors import InvalidConfig
from ...vm import open_backend
from .. import settings as plugin
from ..connector import VmkvConnector
from ..layout import buffer_bytes, check_supported, layout_from_views, vllm_allocate_kv_cache
from .connector import VmkvConnectorWorker
from .kvbuffer import KVBuffer

logger = init_logger(__name__)

_VLLM_ALLOCATE = vllm_allocate_kv_cache()


def _engine_connector() -> VmkvConnectorWorker | None:
    """The worker half of vmkv's connector here, or ``None`` when vLLM should allocate (profiling).

    Raises:
        InvalidConfig: ``VMKV_VLLM=1`` but the engine was configured without vmkv's connector.
    """
    if has_kv_transfer_group():
        connector = get_kv_transfer_group()
        if isinstance(connector, VmkvConnector) and connector.connector_worker is not None:
            return connector.connector_worker
        raise InvalidConfig(f"{plugin.ENV_FLAG}=1 but the engine's KV connector is {type(connector).__name__}, "
                            f"not {plugin.CONNECTOR_NAME}: unset {plugin.ENV_FLAG} or use vmkv.vllm.engine_args()")
    config = get_current_vllm_config_or_none()
    transfer = config.kv_transfer_config if config is not None else None
    if config is None or (transfer is not None and transfer.kv_connector == plugin.CONNECTOR_NAME):
        return None  # vLLM's profiling cache, allocated before the connector exists
    flags = " ".join(plugin.serve_flags())
    raise InvalidConfig(f"{plugin.ENV_FLAG}=1 but the engine was started without vmkv's scheduler and KV connector; "
                        f"add: {flags} (or unset {plugin.ENV_FLAG})")


def allocate_kv_cache(kv_cache_config: Any, device: torch.device, layout: Any,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
    """vLLM's ``allocate_kv_cache`` over a vmkv reservation: ``{layer name: KV view}`` with vLLM's shapes and strides.

    Raises:
        InvalidConfig: unsupported KV cache, a bad page size for the device, or ``VMKV_VLLM=1``
            without vmkv's connector.
        BackendUnavailable: the device's virtual-memory backend cannot run here.
    """
    connector = _engine_connector()
    if connector is None or not kv_cache_config.kv_cache_tensors:
        return _VLLM_ALLOCATE(kv_cache_config, device, layout, kernel_block_sizes)
    check_supported(kv_cache_config)
    views = _VLLM_ALLOCATE(kv_cache_config, torch.device("meta"), layout, kernel_block_sizes)
    nbytes = buffer_bytes(kv_cache_config)
    kv_layout = layout_from_views(views, kv_cache_config.num_blocks, nbytes, connector.config.page_size)
    budget_pages, _ = plugin.budget_settings(connector.config, kv_layout)
    # host: every mapped page may split the reservation's zero mapping in two (Linux vm.max_map_count),
    # and so may every block contiguous mode maps into a slot;
    # in a shared budget, CUDA pages exist only while mapped (the ledger counts what is mapped)
    views_count = len({v.storage_offset() for v in views.values()})
    mappings = 2 * budget_pages + 1 + connector.slot_mapping_bound(kv_cache_config, views_count)
    backend = open_backend(device, connector.config.page_size, budget_pages, max_mappings=mappings,
                           on_demand=connector.config.shared_budget is not None)
    buffer = KVBuffer(backend, nbytes)
    raw = buffer.tensor()  # raw: [nbytes] int8 over the reservation
    rebuilt: dict[int, torch.Tensor] = {}  # layers sharing one view keep sharing it
    out = {}
    for name, view in views.items():
        if id(view) not in rebuilt:
            rebuilt[id(view)] = torch.as_strided(raw.view(view.dtype), view.shape, view.stride(), view.storage_offset())
        out[name] = rebuilt[id(view)]
    connector.attach(buffer, kv_layout, out, kv_cache_config)
    logger.info("vmkv: KV buffer of %d B reserved on %s, %d physical pages of %d B (%s)", nbytes, device,
                budget_pages, connector.config.page_size, kv_layout)
    return out


allocate_kv_cache.__wrapped__ = _VLLM_ALLOCATE  # type: ignore[attr-defined]


def install() -> bool:
    """Put :func:`allocate_kv_cache` in place of vLLM's everywhere it is reachable by name; returns
    whether anything was replaced.
    """
    replaced = False
    if worker_utils.allocate_kv_cache is not allocate_kv_cache:
        worker_utils.allocate_kv_cache = allocate_kv_cache
        replaced = True
    for name, module in list(sys.modules.items()):
        # the module's own namespace only: getattr would import lazy attributes (transformers)
        if name.startswith("vllm.") and getattr(module, "__dict__", {}).get("allocate_kv_cache") is _VLLM_ALLOCATE:
            module.allocate_kv_cache = allocate_kv_cache
            replaced = True
    return replaced
