"""The plugin's counters in vLLM's KV-connector stats and Prometheus metrics (vLLM 0.32): workers
report their rank's KV memory, the scheduler its ledger seat; exported as ``vllm:vmkv_*`` (vLLM
only collects names under ``vllm:``; the list: docs/vllm.md).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


class VmkvConnectorStats(KVConnectorStats):
    """Per-rank memory counters (``data["ranks"][rank]``) and the scheduler's ``"ledger"`` seat; a newer
    snapshot replaces the older, so aggregating over workers and over time are one operation.
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "VmkvConnectorStats":
        ranks = {**self.data.get("ranks", {}), **other.data.get("ranks", {})}
        ledger = other.data.get("ledger") or self.data.get("ledger")
        return VmkvConnectorStats(data={"ranks": ranks, **({"ledger": ledger} if ledger else {})})

    def reduce(self) -> dict[str, int | float]:
        ranks = self.data.get("ranks", {}).values()
        keys = ("resident_bytes", "mapped_pages", "maps", "unmaps")
        ledger = {f"ledger_{key}": value for key, value in self.data.get("ledger", {}).items()}
        return {"ranks": len(ranks), **{key: sum(r[key] for r in ranks) for key in keys}, **ledger}

    def is_empty(self) -> bool:
        return not self.data.get("ranks") and not self.data.get("ledger")


class VmkvPromMetrics(KVConnectorPromMetrics):
    """Gauges and counters of the KV memory vmkv maps, summed over ranks, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls: Any, name: str, doc: str) -> dict[int, Any]:
            metric = cls(name=name, documentation=doc, labelnames=labelnames)
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        self._resident = per_engine(self._gauge_cls, "vllm:vmkv_kv_resident_bytes",
                                    "Bytes of memory behind vmkv's KV page stores")
        self._mapped = per_engine(self._gauge_cls, "vllm:vmkv_kv_mapped_pages", "KV buffer pages mapped by vmkv")
        self._maps = per_engine(self._counter_cls, "vllm:vmkv_kv_page_maps", "KV buffer pages mapped, cumulative")
        self._unmaps = per_engine(self._counter_cls, "vllm:vmkv_kv_page_unmaps", "KV buffer pages unmapped, cumulative")
        self._held = per_engine(self._gauge_cls, "vllm:vmkv_ledger_held_bytes",
                                "Bytes of the host-wide KV budget this engine holds")
        self._idle = per_engine(self._gauge_cls, "vllm:vmkv_ledger_idle_bytes",
                                "Bytes this engine could give back to the host-wide KV budget when asked")
        self._reclaims = per_engine(self._counter_cls, "vllm:vmkv_ledger_reclaims",
                                    "Pages this engine gave back to the host-wide KV budget on request")
        self._seen: dict[tuple[int, str], int] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        totals = VmkvConnectorStats(data=transfer_stats_data).reduce()
        counters = []
        if totals["ranks"]:  # a step's stats may carry the scheduler's ledger seat only
            self._resident[engine_idx].set(totals["resident_bytes"])
            self._mapped[engine_idx].set(totals["mapped_pages"])
            counters += [("maps", self._maps), ("unmaps", self._unmaps)]
        if "ledger_held_bytes" in totals:
            self._held[engine_idx].set(totals["ledger_held_bytes"])
            self._idle[engine_idx].set(totals["ledger_idle_bytes"])
            counters.append(("ledger_reclaims", self._reclaims))
        for key, counter in counters:
            grown = totals[key] - self._seen.get((engine_idx, key), 0)
            if grown > 0:
                counter[engine_idx].inc(grown)
            self._seen[(engine_idx, key)] = totals[key]
