"""The scheduler side of the plugin (vLLM's engine-core process): :class:`VmkvScheduler`, the
page-affine block pool, its free-block set (no vLLM), the connector's scheduler half and the
engine's ledger seat.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scheduler import VmkvAsyncScheduler, VmkvScheduler

__all__ = ["VmkvScheduler", "VmkvAsyncScheduler"]


def __getattr__(name: str) -> Any:
    """``VmkvScheduler`` (and its async twin), imported on first use so the side's vLLM-free modules
    import without vLLM.
    """
    if name in __all__:
        from . import scheduler  # imports vLLM (see the docstring)

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
