"""The plugin's per-step message (vLLM 0.32's ``KVConnectorMetadata``): built by the connector's
scheduler half, applied by every worker half.
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
        trim_step: the step that carries the latest trim; 0 before any trim.
        slots: contiguous mode: the step's slot changes (freed before the unmaps, mapped after the
            maps); empty in paged mode.
    """

    step: int
    fingerprint: str
    map_pages: list[int] = field(default_factory=list)
    unmap_pages: list[int] = field(default_factory=list)
    trim_step: int = 0
    slots: SlotDelta = field(default_factory=SlotDelta)
