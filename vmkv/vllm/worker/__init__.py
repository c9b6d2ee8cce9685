"""The worker side of the plugin (every vLLM worker process): the KV allocation over a vmkv
reservation, the :class:`~.kvbuffer.KVBuffer` (no vLLM), the connector's worker half and
:class:`VmkvWorkerExtension`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .extension import VmkvWorkerExtension


def __getattr__(name: str) -> Any:
    """``VmkvWorkerExtension``, imported on first use so the side's vLLM-free modules import without vLLM."""
    if name == "VmkvWorkerExtension":
        from .extension import VmkvWorkerExtension  # imports vLLM (see the docstring)

        return VmkvWorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["VmkvWorkerExtension"]
