"""Control of a running ``vllm.LLM`` with the plugin, from the user's process (no vLLM import):
per-worker stats and trim, through vLLM's public ``collective_rpc`` and ``reset_prefix_cache``.
"""

from __future__ import annotations

import time
from typing import Any


def stats(llm: Any) -> list[dict[str, Any]]:
    """Every worker's KV memory stats (``LLM.collective_rpc`` on the worker extension): ``resident_bytes``,
    ``mapped_pages``, ``maps``, ``unmaps``, ``page_size``, ``budget_pages``, ``buffer_bytes``,
    ``applied_step``, ``trim_step`` and ``rss_bytes``.
    """
    return llm.collective_rpc("vmkv_stats")


def trim(llm: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Give the memory of idle KV pages back to the OS and return the workers' stats after it.

    ``LLM.reset_prefix_cache(reset_connector=True)`` evicts the pages only prefix-cached blocks keep
    mapped; the unmaps reach the workers with the next step, numbered ``trim_step``, so this waits
    until every worker applied a step carrying a trim newer than any seen before.

    Raises:
        TimeoutError: the workers did not apply the trim within ``timeout`` seconds.
    """
    before = max(s["trim_step"] for s in stats(llm))
    llm.reset_prefix_cache(reset_connector=True)
    deadline = time.monotonic() + timeout
    while True:
        now = stats(llm)
        if min(s["trim_step"] for s in now) > before:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not apply the trim within {timeout} s")
        time.sleep(0.02)
