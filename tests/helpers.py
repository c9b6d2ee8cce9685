"""Helpers several test modules share (test modules never import each other; conftest.py holds
fixtures only)."""

from __future__ import annotations

VLLM_RUN_TIMEOUT_S = 1800
"""Wall-clock limit for a subprocess that starts a vLLM engine (its processes, model load and
warm-up): a safety net against hangs, not a speed check. A busy 2-core machine takes minutes
(``docs/vllm.md``'s page overran 180 s at a load average of 10-14)."""
