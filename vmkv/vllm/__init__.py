"""vmkv inside vLLM 0.32: vLLM keeps scheduling and parallelism, vmkv backs its KV buffer.

vLLM allocates every layer's KV cache as one ``torch.zeros`` buffer sized to its whole KV budget,
so a worker holds that memory from start to finish. With this plugin the buffer is a vmkv
reservation (:mod:`vmkv.vm`: host memory on CPU, CUDA VMM on GPU) in which physical pages are
mapped only while vLLM blocks that live in them hold data. Four pieces, one focused module each:

* :mod:`vmkv.vllm.worker` -- the KV buffer: covers ``allocate_kv_cache`` (worker side).
* :mod:`vmkv.vllm.block_pool` and :mod:`vmkv.vllm.free_blocks` -- which blocks vLLM hands out:
  packed into pages, idle prefix-cache pages given back whole, free blocks counted from the physical
  budget (scheduler side); installed by :mod:`vmkv.vllm.scheduler` (``--scheduler-cls``).
* :mod:`vmkv.vllm.connector` -- the map/unmap lists travel with every step to every rank as KV
  connector metadata (vLLM's own scheduler->worker path), plus stats and Prometheus metrics.
* :mod:`vmkv.vllm.layout` -- which buffer pages each block occupies (both sides agree on it).
* :mod:`vmkv.vllm.share` -- the engine's seat in a host-wide ledger (``shared_budget``): grants
  held by the scheduler, idle pages given back at a step boundary.
* :mod:`vmkv.vllm.settings` -- the settings (:class:`PluginConfig`) and names every module shares;
  :mod:`vmkv.vllm.control` -- stats and trim of a running engine.

Enabling it (see ``docs/vllm.md``): ``VMKV_VLLM=1`` in the environment activates the
``vllm.general_plugins`` entry point :func:`register` in every vLLM process, and the engine
gets three arguments, returned by :func:`engine_args` for ``vllm.LLM`` and printed for
``vllm serve`` by ``python -m vmkv.vllm``.

This module imports no vLLM code: importing it works without vLLM installed, and every
function that needs vLLM raises one clear :class:`~vmkv.errors.BackendUnavailable`.
"""

from __future__ import annotations

import logging

from ..errors import UnsupportedVllm
from .control import stats, trim
from .settings import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    ENV_FLAG,
    INSTALL_HINT,
    KV_MODES,
    SCHEDULER_CLS,
    SUPPORTED_VLLM,
    WORKER_EXTENSION_CLS,
    PluginConfig,
    check_vllm,
    describe,
    enabled,
    engine_args,
    serve_flags,
    vllm_version,
)

logger = logging.getLogger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point; vLLM calls it in every process it starts.

    Does nothing unless ``VMKV_VLLM=1``. Then it checks the vLLM version and covers vLLM's KV
    allocation function (:func:`vmkv.vllm.worker.install`). Safe to call more than once.

    Raises:
        UnsupportedVllm: ``VMKV_VLLM=1`` with a vLLM other than 0.32.x.
    """
    if not enabled():
        return
    version = check_vllm()
    from .contiguous import install_platform_hook, register_custom_backend
    from .worker import install

    install_platform_hook()  # answers vmkv's backend only for engines with kv_mode="contiguous"
    register_custom_backend()
    if install():
        logger.info("vmkv: vLLM %s KV cache backed by vmkv virtual memory (%s=1)", version, ENV_FLAG)


__all__ = [
    "SUPPORTED_VLLM", "ENV_FLAG", "CONNECTOR_NAME", "CONNECTOR_MODULE", "SCHEDULER_CLS", "WORKER_EXTENSION_CLS",
    "INSTALL_HINT", "KV_MODES", "UnsupportedVllm", "PluginConfig", "check_vllm", "vllm_version", "enabled", "register",
    "engine_args", "serve_flags", "stats", "trim", "describe",
]
