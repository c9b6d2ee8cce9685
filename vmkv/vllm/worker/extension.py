"""``--worker-extension-cls vmkv.vllm.worker.VmkvWorkerExtension``: the plugin's calls on every worker.

vLLM mixes the class named by ``--worker-extension-cls`` into every worker, so its methods can be
called on all of them through ``LLM.collective_rpc`` (what :func:`vmkv.vllm.stats` does):
``vmkv_stats`` (the worker half's KV memory counters) and ``vmkv_process`` (pid and resident set,
also on stock engines, so both can be measured the same way). Worker side.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

from ...errors import InvalidConfig
from ..connector import VmkvConnector
from .kvbuffer import process_rss_bytes


class VmkvWorkerExtension:
    """Methods mixed into every vLLM worker (``--worker-extension-cls``), for ``collective_rpc``."""

    def vmkv_process(self) -> dict[str, int]:
        """``{"pid", "rss_bytes"}`` of this worker process (works without vmkv's connector too,
        so stock engines can be measured the same way)."""
        return {"pid": os.getpid(), "rss_bytes": process_rss_bytes()}

    def vmkv_stats(self) -> dict[str, Any]:
        """This worker's KV memory counters
        (:meth:`~vmkv.vllm.worker.connector.VmkvConnectorWorker.worker_stats`).

        Raises:
            InvalidConfig: the engine runs without vmkv's connector.
        """
        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if not isinstance(connector, VmkvConnector) or connector.connector_worker is None:
            raise InvalidConfig("vmkv_stats: this engine runs without vmkv's KV connector")
        return connector.connector_worker.worker_stats()
