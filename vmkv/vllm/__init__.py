"""vmkv inside vLLM 0.32: vLLM keeps scheduling and parallelism, vmkv backs its KV buffer.

vLLM allocates every layer's KV cache as one ``torch.zeros`` buffer sized to its whole KV budget,
so a worker holds that memory from start to finish. With this plugin the buffer is a vmkv
reservation (:mod:`vmkv.vm`: host memory on CPU, CUDA VMM on GPU) in which physical pages are
mapped only while vLLM blocks that live in them hold data. The package is split by the side of
vLLM a module runs on:

* :mod:`vmkv.vllm.scheduler` -- the scheduler side (the engine-core process): which blocks vLLM
  hands out, packed into pages, idle prefix-cache pages given back whole, free blocks counted from
  the physical budget; the connector's scheduler half; the engine's seat in a host-wide ledger.
  ``--scheduler-cls vmkv.vllm.scheduler.VmkvScheduler`` installs it.
* :mod:`vmkv.vllm.worker` -- the worker side (every worker): the KV buffer behind vLLM's
  ``allocate_kv_cache``, the connector's worker half that maps and unmaps, and
  ``--worker-extension-cls vmkv.vllm.worker.VmkvWorkerExtension``.
* :mod:`vmkv.vllm.contiguous` -- contiguous mode (``kv_mode="contiguous"``): request slots over
  the buffer, its page rule, and vLLM's attention backend over the slots.
* Shared by both sides: :mod:`vmkv.vllm.connector` (the one connector class vLLM loads, holding
  the half of its role), :mod:`vmkv.vllm.metadata` (the per-step message, scheduler -> every
  rank), :mod:`vmkv.vllm.metrics` (stats and Prometheus metrics), :mod:`vmkv.vllm.layout`
  (which buffer pages each block occupies), :mod:`vmkv.vllm.settings` (:class:`PluginConfig` and
  the names); in the user's process, :mod:`vmkv.vllm.control` (stats and trim of a running engine).

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
    allocation function (:func:`vmkv.vllm.worker.allocate.install`). Safe to call more than once.

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
