"""vmkv inside vLLM 0.32: vLLM keeps scheduling and parallelism, vmkv backs its KV buffer.

vLLM allocates all KV as one buffer held from start to finish; with this plugin the buffer is a
vmkv reservation whose pages are mapped only while blocks in them hold data. Modules by the side
of vLLM they run on: :mod:`vmkv.vllm.scheduler` (engine core), :mod:`vmkv.vllm.worker` (every
worker), :mod:`vmkv.vllm.contiguous` (``kv_mode="contiguous"``), and shared ones (connector,
metadata, metrics, layout, settings, control); map: docs/vllm.md, "How it works".

Enabled by ``VMKV_VLLM=1`` (the ``vllm.general_plugins`` entry point :func:`register`) plus the
engine arguments :func:`engine_args` returns. This module imports no vLLM code.
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
    """The ``vllm.general_plugins`` entry point, called in every vLLM process: with ``VMKV_VLLM=1`` it
    checks the version and covers vLLM's KV allocation. Safe to call more than once.

    Raises:
        UnsupportedVllm: ``VMKV_VLLM=1`` with a vLLM other than 0.32.x.
    """
    if not enabled():
        return
    version = check_vllm()
    # vLLM's internals only now, with the plugin asked for: this module is imported by every vLLM
    # process (and by users without vLLM), so it imports no vLLM code itself
    from .contiguous.backend import install_platform_hook, register_custom_backend
    from .worker.allocate import install

    install_platform_hook()  # answers vmkv's backend only for engines with kv_mode="contiguous"
    register_custom_backend()
    if install():
        logger.info("vmkv: vLLM %s KV cache backed by vmkv virtual memory (%s=1)", version, ENV_FLAG)


__all__ = [
    "SUPPORTED_VLLM", "ENV_FLAG", "CONNECTOR_NAME", "CONNECTOR_MODULE", "SCHEDULER_CLS", "WORKER_EXTENSION_CLS",
    "INSTALL_HINT", "KV_MODES", "UnsupportedVllm", "PluginConfig", "check_vllm", "vllm_version", "enabled", "register",
    "engine_args", "serve_flags", "stats", "trim", "describe",
]
