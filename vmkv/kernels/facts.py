"""What this machine offers the attention kernels: optional packages, torch's FlashAttention
features, the GPU. Probed once per process and device, so the selection rule
(:mod:`vmkv.kernels.registry`) is a pure function of these facts (tests pass made-up ones)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import BackendUnavailable

OPTIONAL_PACKAGES = {"flash_attn": "flash_attn_with_kvcache", "flashinfer": "BatchDecodeWithPagedKVCacheWrapper"}
"""Optional packages with attention kernels, and what is imported from each."""


@functools.lru_cache(maxsize=None)
def optional_import(module: str, attribute: str) -> tuple[Any, str | None]:
    """Import ``module.attribute`` of an optional package, once per process: ``(object, None)``, or
    ``(None, why)`` when it is missing or its import fails (e.g. a wheel built for another torch).
    """
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        return None, f"{module} is not installed"
    try:
        return getattr(importlib.import_module(module), attribute), None
    except Exception as exc:  # noqa: BLE001 -- any failure of a third-party import means "unusable"
        return None, f"{module} is installed but importing {attribute} from it fails ({type(exc).__name__}: {exc})"


def optional_kernel(package: str) -> Callable[..., Any]:
    """The kernel entry point of optional ``package``.

    Raises:
        BackendUnavailable: the package is missing or its import fails (the message says which).
    """
    function, why = optional_import(package, OPTIONAL_PACKAGES[package])
    if function is None:
        raise BackendUnavailable(why)
    return function


def has_flash_attn() -> bool:
    """Whether the optional ``flash-attn`` package is installed (not whether it imports)."""
    return importlib.util.find_spec("flash_attn") is not None


def torch_varlen_features() -> set[str]:
    """Optional arguments of ``torch.nn.attention.varlen.varlen_attn`` in this torch (may be empty)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return set()
    params = inspect.signature(varlen_attn).parameters
    return {name for name in ("seqused_k", "block_table", "window_size", "enable_gqa") if name in params}


def _flash_forward_takes(argument: str) -> bool:
    """Whether this torch's ``aten::_flash_attention_forward`` has an argument named ``argument``."""
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(found.name == argument for found in schema.arguments)


def flash_varlen_has_seqused_k() -> bool:
    """Whether this torch's ``aten::_flash_attention_forward`` takes ``seqused_k`` (torch >= 2.5)."""
    return _flash_forward_takes("seqused_k")


def flash_varlen_has_window() -> bool:
    """Whether this torch's ``aten::_flash_attention_forward`` takes ``window_size_left``."""
    return _flash_forward_takes("window_size_left")


def flash_window_left(window: int) -> int:
    """FlashAttention's inclusive left window for transformers' sliding ``window``: ``window - 1``; -1 without one."""
    return window - 1 if window > 0 else -1


def flash_attn_variant(window: int, softcap: float) -> dict[str, Any]:
    """flash-attn's ``flash_attn_with_kvcache`` keyword arguments for a window and a soft-cap (none for a
    plain layer, so older releases run it). Not run here (GPU only).
    """
    extra: dict[str, Any] = {}
    if window > 0:
        extra["window_size"] = (flash_window_left(window), 0)
    if softcap > 0:
        extra["softcap"] = softcap
    return extra


def flash_attention_blockers(
    on_cuda: bool, capability: tuple[int, int] | None, dtype: torch.dtype | None, head_dim: int | None
) -> list[str]:
    """What FlashAttention needs that is missing, each as the object of "needs"; empty if nothing.

    The one statement of its requirements: compute capability 8.0+, float16 or bfloat16, a head_dim
    that is a multiple of 8 and at most 256. ``None`` arguments are not checked.
    """
    why = []
    if not on_cuda:
        why.append("a CUDA device")
    if capability is not None and capability < (8, 0):
        why.append(f"compute capability 8.0 or newer (the GPU is {capability[0]}.{capability[1]})")
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        why.append(f"float16 or bfloat16 (the cache holds {dtype})")
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        why.append(f"head_dim a multiple of 8 and <= 256 (got {head_dim})")
    return why


@dataclass(frozen=True)
class MachineFacts:
    """What the kernels need of the machine beyond the cache's shape.

    Args:
        capability: the GPU's compute capability; ``None``: no usable CUDA device.
        missing: why each optional package cannot be used (absent: it can).
        varlen_seqused: torch's FlashAttention varlen op takes ``seqused_k``.
        varlen_features: optional arguments of ``torch.nn.attention.varlen.varlen_attn``.
        triton_missing: why the Triton kernels cannot run on the device; ``None``: they can.
        varlen_window: torch's FlashAttention varlen op takes a window.
    """

    capability: tuple[int, int] | None = None
    missing: dict[str, str] = field(default_factory=dict)
    varlen_seqused: bool = False
    varlen_features: frozenset[str] = frozenset()
    triton_missing: str | None = "not probed"
    varlen_window: bool = False

    @classmethod
    def probe(cls, device: torch.device) -> "MachineFacts":
        """The facts of ``device`` on this machine (optional packages are imported only for CUDA)."""
        from .triton_attention import triton_available

        triton_ok, triton_why = triton_available(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return cls(triton_missing=None if triton_ok else triton_why)
        missing = {name: why for name in OPTIONAL_PACKAGES if (why := optional_import(name, OPTIONAL_PACKAGES[name])[1])}
        return cls(tuple(torch.cuda.get_device_capability(device)), missing, flash_varlen_has_seqused_k(),
                   frozenset(torch_varlen_features()), None if triton_ok else triton_why, flash_varlen_has_window())

    @classmethod
    def assumed_gpu(cls, capability: tuple[int, int] = (8, 0)) -> "MachineFacts":
        """The facts of a GPU of ``capability`` with this machine's packages (``vmkv info`` without a GPU)."""
        from .triton_attention import _import_triton

        missing = {name: why for name in OPTIONAL_PACKAGES if (why := optional_import(name, OPTIONAL_PACKAGES[name])[1])}
        return cls(capability, missing, flash_varlen_has_seqused_k(), frozenset(torch_varlen_features()), _import_triton(),
                   flash_varlen_has_window())

    def package_missing(self, name: str) -> str | None:
        """Why optional package ``name`` cannot be used (``None``: it can)."""
        return self.missing.get(name)
