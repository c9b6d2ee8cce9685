"""The worker side of the plugin: what runs in every vLLM worker process (any rank, any node).

* :mod:`.allocate` -- vLLM's ``allocate_kv_cache`` over a vmkv reservation (installed by
  :func:`vmkv.vllm.register` in every vLLM process);
* :mod:`.kvbuffer` -- :class:`~.kvbuffer.KVBuffer`: the reservation and its physical page store
  (no vLLM import);
* :mod:`.connector` -- the KV connector's worker half: applies each step's page (and slot)
  changes before the step's forward pass;
* :mod:`.extension` -- :class:`VmkvWorkerExtension`
  (``--worker-extension-cls vmkv.vllm.worker.VmkvWorkerExtension``): stats for ``collective_rpc``.

The scheduler side is :mod:`vmkv.vllm.scheduler`; the pieces both sides read are in
:mod:`vmkv.vllm` itself (settings, layout, the per-step metadata).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .extension import VmkvWorkerExtension


def __getattr__(name: str) -> Any:
    """``vmkv.vllm.worker.VmkvWorkerExtension``, the ``--worker-extension-cls`` path vLLM resolves
    by name.

    Imported on first use, not with the package: it reaches vLLM's KV connector, and the side's
    vLLM-free module (:mod:`.kvbuffer`) must import without vLLM.
    """
    if name == "VmkvWorkerExtension":
        from .extension import VmkvWorkerExtension  # imports vLLM (see the docstring)

        return VmkvWorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["VmkvWorkerExtension"]
