"""Prometheus text exposition (format 0.0.4) of the engine's and the cache's statistics."""

from __future__ import annotations

import math
from typing import Any

from ..ledger import prometheus_lines

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, type, help, where in engine.stats(): ("engine"|"cache", key))
_METRICS: list[tuple[str, str, str, tuple[str, str]]] = [
    ("vmkv_kv_utilization", "gauge", "Bytes of stored tokens / bytes of pages in use (above 1 when pages are shared)",
     ("cache", "utilization")),
    ("vmkv_kv_pages_total", "gauge", "Pages in the KV pool", ("cache", "pages_total")),
    ("vmkv_kv_pages_in_use", "gauge", "Pages owned by sequences or kept as a slot's spare", ("cache", "pages_in_use")),
    ("vmkv_kv_pages_free", "gauge", "Pages on the free list", ("cache", "pages_free")),
    ("vmkv_kv_pages_shared", "gauge", "Pages owned by two or more sequences (fork, prefix hit)", ("cache", "shared_pages")),
    ("vmkv_kv_pages_shared_peak", "gauge", "Most pages shared at once after any step", ("engine", "shared_pages_peak")),
    ("vmkv_kv_pages_cached", "gauge", "Unreferenced pages kept for the prefix cache (evictable)", ("cache", "cached_pages")),
    ("vmkv_kv_pages_spare", "gauge", "Pages kept mapped in freed slots (VMM deferred reclaim)", ("cache", "pages_spare")),
    ("vmkv_kv_bytes_in_use", "gauge", "Bytes of pages in use", ("cache", "bytes_in_use")),
    ("vmkv_kv_tokens", "gauge", "Tokens stored for live sequences", ("cache", "tokens")),
    ("vmkv_kv_tokens_per_page", "gauge", "Tokens one page holds", ("cache", "tokens_per_page")),
    ("vmkv_kv_cow_copies_total", "counter", "Pages copied on write", ("cache", "cow_copies")),
    ("vmkv_kv_forks_total", "counter", "Sequences forked (n > 1)", ("cache", "forks")),
    ("vmkv_kv_evictions_total", "counter", "Cached pages evicted", ("cache", "evictions")),
    ("vmkv_prefix_cache_queries_total", "counter", "Prompts looked up in the prefix cache", ("cache", "prefix_queries")),
    ("vmkv_prefix_cache_hits_total", "counter", "Prompts that found cached pages", ("cache", "prefix_hits")),
    ("vmkv_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache",
     ("cache", "prefix_hit_tokens")),
    ("vmkv_prefix_cache_hit_rate", "gauge", "prefix_cache_hits / prefix_cache_queries", ("engine", "prefix_hit_rate")),
    ("vmkv_requests_running", "gauge", "Requests with a sequence in the cache", ("engine", "requests_running")),
    ("vmkv_requests_waiting", "gauge", "Requests with no sequence in the cache yet or any more", ("engine", "requests_waiting")),
    ("vmkv_sequences_running", "gauge", "Sequences in the cache", ("engine", "sequences_running")),
    ("vmkv_sequences_waiting", "gauge", "Sequences waiting for admission", ("engine", "sequences_waiting")),
    ("vmkv_sequences_preempted", "gauge", "Waiting sequences that were preempted and will resume",
     ("engine", "sequences_preempted")),
    ("vmkv_preemptions_total", "counter", "Sequences preempted (freed, recomputed later) for lack of pages",
     ("engine", "preemptions")),
    ("vmkv_requests_added_total", "counter", "Requests accepted", ("engine", "requests_added")),
    ("vmkv_requests_finished_total", "counter", "Requests completed", ("engine", "requests_finished")),
    ("vmkv_requests_aborted_total", "counter", "Requests aborted (client gone)", ("engine", "requests_aborted")),
    ("vmkv_requests_failed_total", "counter", "Requests the engine stopped alone because generating them failed",
     ("engine", "requests_failed")),
    ("vmkv_steps_total", "counter", "Engine steps (batched forwards)", ("engine", "steps")),
    ("vmkv_prompt_tokens_total", "counter", "Prompt tokens computed (recomputation included)", ("engine", "prompt_tokens")),
    ("vmkv_generation_tokens_total", "counter", "Tokens generated", ("engine", "generation_tokens")),
    ("vmkv_generation_tokens_per_second", "gauge", "Tokens generated per second, last 10 s", ("engine", "tokens_per_second")),
    ("vmkv_time_to_first_token_seconds_sum", "counter", "Sum of time to first token", ("engine", "ttft_seconds_sum")),
]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(stats: dict[str, Any]) -> str:
    """The Prometheus text of ``Engine.stats()`` output.

    Args:
        stats: ``{"engine": {...}, "cache": {...}}`` as ``Engine.stats()`` returns.

    Returns:
        Exposition text: one ``# HELP``/``# TYPE`` pair and one sample per metric, plus
        ``vmkv_info`` labelled with the model, mode and kernel.
    """
    engine, cache = stats["engine"], stats["cache"]
    labels = {"model": engine["model"], "kv_mode": cache["mode"], "kernel": cache["kernel"]}
    label_text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    lines = ["# HELP vmkv_info Model, KV mode and attention kernel of this server", "# TYPE vmkv_info gauge",
             f"vmkv_info{{{label_text}}} 1"]
    for name, kind, help_text, (section, key) in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {format_value(stats[section][key])}"]
    if "ledger" in cache:  # a shared budget: one gauge per member of the host's ledger
        lines += prometheus_lines(cache["ledger"])
    return "\n".join(lines) + "\n"


def format_value(value: float) -> str:
    """A sample as a person reads it: integers whole, others to 6 significant digits; ``NaN``/``+Inf``/``-Inf``."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return f"{value:.6g}"


def parse(text: str) -> dict[str, float]:
    """Samples of an exposition text without labels: ``{name: value}`` (used by tests and benchmarks)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
