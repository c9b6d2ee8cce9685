"""The scheduler side of the plugin: what runs in vLLM's engine-core process, beside vLLM's scheduler.

* :mod:`.scheduler` -- :class:`VmkvScheduler` (``--scheduler-cls vmkv.vllm.scheduler.VmkvScheduler``):
  vLLM's scheduler with the page-affine block pool installed;
* :mod:`.block_pool` -- :class:`~.block_pool.PageAffineBlockPool`: vLLM's ``BlockPool`` handing out
  blocks page by page;
* :mod:`.free_blocks` -- :class:`~.free_blocks.PageAwareFreeBlocks`: which free block next, which
  pages mapped (no vLLM import);
* :mod:`.connector` -- the KV connector's scheduler half: each step's page (and slot) changes;
* :mod:`.share` -- the engine's seat in a host-wide ledger (``shared_budget``).

The worker side is :mod:`vmkv.vllm.worker`; the pieces both sides read are in :mod:`vmkv.vllm`
itself (settings, layout, the per-step metadata).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scheduler import VmkvAsyncScheduler, VmkvScheduler

__all__ = ["VmkvScheduler", "VmkvAsyncScheduler"]


def __getattr__(name: str) -> Any:
    """``vmkv.vllm.scheduler.VmkvScheduler`` (and its async twin), the ``--scheduler-cls`` path
    vLLM resolves by name.

    Imported on first use, not with the package: the class subclasses vLLM's scheduler, and the
    side's vLLM-free modules (:mod:`.free_blocks`) must import without vLLM.
    """
    if name in __all__:
        from . import scheduler  # imports vLLM (see the docstring)

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
