"""The plugin's per-step message: what the scheduler side sends every worker with each step (vLLM 0.32).

vLLM sends every scheduled step (``SchedulerOutput``) from the scheduler to all workers of all
tensor- and pipeline-parallel ranks, local or remote, with a KV connector's metadata attached
(``KVConnectorMetadata``, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``). The
connector's scheduler half builds :class:`VmkvMetadata`
(:class:`vmkv.vllm.scheduler.connector.VmkvConnectorScheduler`), every worker half applies it
(:class:`vmkv.vllm.worker.connector.VmkvConnectorWorker`); both sides import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .contiguous.assign import SlotDelta


@dataclass
class VmkvMetadata(KVConnectorMetadata):
    """One step's page changes, sent to every worker.

    Attributes:
        step: 1, 2, 3, ... in scheduling order.
        fingerprint: the scheduler's :attr:`~vmkv.vllm.layout.KVLayout.fingerprint`.
        map_pages / unmap_pages: virtual pages of the KV buffer to map / unmap.
        trim_step: the step that carries the latest trim (the first step built after the trim
            was asked for: this one or an earlier one); 0 before any trim.
        slots: contiguous mode: the step's slot changes (freed before the page unmaps, mapped
            after the page maps); empty in paged mode.
    """

    step: int
    fingerprint: str
    map_pages: list[int] = field(default_factory=list)
    unmap_pages: list[int] = field(default_factory=list)
    trim_step: int = 0
    slots: SlotDelta = field(default_factory=SlotDelta)
