"""``--worker-extension-cls vmkv.vllm.worker.VmkvWorkerExtension``: ``vmkv_stats`` and
``vmkv_process`` on every worker, through ``LLM.collective_rpc``.
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
        """``{"pid", "rss_bytes"}`` of this worker process (stock engines too)."""
        return {"pid": os.getpid(), "rss_bytes": process_rss_bytes()}

    def vmkv_stats(self) -> dict[str, Any]:
        """This worker's KV memory counters.

        Raises:
            InvalidConfig: the engine runs without vmkv's connector.
        """
        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if not isinstance(connector, VmkvConnector) or connector.connector_worker is None:
            raise InvalidConfig("vmkv_stats: this engine runs without vmkv's KV connector")
        return connector.connector_worker.worker_stats()
