"""Control of a running ``vllm.LLM`` with the plugin: per-worker stats and trim (no vLLM import).

Runs in the user's process, the one holding the ``LLM``; the calls reach the workers (stats) and
the engine core (trim) through vLLM.

Both go through vLLM's own public calls (``LLM.collective_rpc`` on the worker extension,
``LLM.reset_prefix_cache``), so they work on any ``LLM`` object started with
:func:`vmkv.vllm.engine_args`.
"""

from __future__ import annotations

import time
from typing import Any


def stats(llm: Any) -> list[dict[str, Any]]:
    """Every worker's KV memory stats (``LLM.collective_rpc`` on the worker extension).

    Each dict: ``resident_bytes`` (the kernel's count of memory behind the page store),
    ``mapped_pages``, ``maps``, ``unmaps``, ``page_size``, ``budget_pages``, ``buffer_bytes``,
    ``applied_step``, ``trim_step`` (the step that carried the latest trim, 0 before any) and
    ``rss_bytes`` (the worker process's resident set).
    """
    return llm.collective_rpc("vmkv_stats")


def trim(llm: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Give the memory of idle KV pages back to the OS and return the workers' stats after it.

    ``LLM.reset_prefix_cache(reset_connector=True)`` empties vLLM's prefix cache when no request
    holds blocks, and otherwise evicts the pages that only prefix-cached blocks keep mapped; the
    unmaps reach every worker with the first engine step scheduled after the trim (the connector
    asks for one and numbers it: ``trim_step``), so this waits until every worker has applied a
    step carrying a trim newer than the newest any worker had seen before. Steps scheduled
    before the trim (a busy engine, or steps in flight under async scheduling) do not count.
    Trims asked for by several callers at once may end each other's waits.

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
