"""Stock vLLM and vLLM + vmkv in contiguous mode on the same work, for tests/test_vllm_contiguous.py.

Run as a script (vLLM spawns processes, so pytest does not import it)::

    python tests/vllm_contiguous_scenarios.py OUT.json MODEL_DIR MODEL4_DIR [stock] [contig] [stock4] [tp2]

``MODEL_DIR`` is the 2-layer tiny model, ``MODEL4_DIR`` the second CI model: 4 layers, 8 query /
4 KV heads of 64 (grouped-query attention), float32. Every engine gets the same settings, small
enough that one engine exercises every case: a KV cache of 36 blocks (vLLM must preempt in wave
A), a token budget of 128 per step (the 302-token prompts are prefilled in chunks), at most 4
requests at once (slots are reused).

* wave A: four requests, two sharing a 300-token prefix (9 full blocks): preemption, chunked
  prefill, prefix hits; the contiguous engine's slot counters are sampled every step.
* wave B: the prefix again, after wave A finished: hits the prefix cache.
* wave C: ``n=3`` seeded sampling of one prompt; the slots are sampled after its prefill.

``stock4`` runs waves A and B on the 4-layer model, stock; ``tp2`` the same in contiguous mode
with tensor parallelism 2 (CPU: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``), so one more engine covers
the second model (several prompts, prefix hits inside wave A and across waves, preemption,
chunked prefill) and TP=2. Writes per engine: tokens, stock's top-2 logprob gap per position, cached prompt tokens,
preemptions, and (contiguous) the worker's stats per step and at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

BLOCK = 32
KV_BLOCKS = 36
MODEL4 = {"num_layers": 4, "head_dim": 64}  # the second model (save_tiny_model's arguments)
ENGINE = {"block_size": BLOCK, "max_num_seqs": 4, "max_num_batched_tokens": 128, "disable_log_stats": False}
OPTIONS = {"page_size": "256KiB", "kv_mode": "contiguous"}
PREFIX = [(7 * i + 3) % 250 for i in range(300)]
WAVE_A = [(PREFIX + [11, 12], 200), (PREFIX + [21], 200), ([(5 * i + 1) % 250 for i in range(180)], 150),
          ([(3 * i + 2) % 250 for i in range(40)], 250)]
WAVE_B = [(PREFIX + [31, 32], 40)]
N3_PROMPT = [(11 * i + 5) % 250 for i in range(100)]


def serve(llm, requests, params, sample) -> dict:
    """Run ``requests`` to the end; ``sample()`` after every step (None: no samples)."""
    engine = llm.llm_engine
    for i, (prompt, param) in enumerate(zip(requests, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, param)
    out, samples = {}, []
    while engine.has_unfinished_requests():
        for result in engine.step():
            if result.finished:
                out[result.request_id] = {
                    "tokens": [list(c.token_ids) for c in result.outputs],
                    "gaps": [[_gap(step) for step in (c.logprobs or [])] for c in result.outputs],
                    "cached": result.num_cached_tokens or 0,
                }
        if sample is not None:
            samples.append(sample())
    return {"requests": out, "samples": samples}


def _gap(logprobs: dict) -> float:
    top = sorted((entry.logprob for entry in logprobs.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def kv_bytes(model: str) -> int:
    """vLLM's KV buffer of :data:`KV_BLOCKS` blocks of ``model`` (a :func:`save_tiny_model` directory)."""
    from vmkv_bench.vllm_harness.tiny import token_bytes

    config = json.loads((Path(model) / "config.json").read_text())
    return KV_BLOCKS * BLOCK * token_bytes(config["num_hidden_layers"], config["head_dim"])


def engine_run(model: str, contiguous: bool, tp: int = 1, n3: bool = True) -> dict:
    """One engine through waves A and B, and C when ``n3``."""
    from vllm import SamplingParams

    from vmkv import vllm as plugin
    from vmkv_bench.vllm_harness import drive

    start = time.perf_counter()
    kv = kv_bytes(model) // tp  # per rank: each holds 1/tp of the KV heads, so every engine gets 36 blocks
    options = {**OPTIONS, "max_cached": kv}  # the prefix cache keeps what stock keeps
    llm = drive.engine(model, vmkv=contiguous, kv_cache_bytes=kv, max_model_len=1024,
                       options=options if contiguous else None, tensor_parallel_size=tp, **ENGINE)
    started = time.perf_counter() - start
    sample = (lambda: plugin.stats(llm)[0]) if contiguous else None
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for _, n in WAVE_A + WAVE_B]
    result = {"start_s": started}
    result["a"] = serve(llm, [p for p, _ in WAVE_A], greedy[:4], sample)
    result["b"] = serve(llm, [p for p, _ in WAVE_B], greedy[4:], sample)
    if not n3:
        result["preemptions"] = _preemptions(llm)
        result["final"] = plugin.stats(llm) if contiguous else None
        llm.llm_engine.engine_core.shutdown()
        return result
    n3 = SamplingParams(n=3, max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    result["c"] = serve(llm, [N3_PROMPT], [n3], sample)
    result["preemptions"] = _preemptions(llm)
    if contiguous:
        time.sleep(0.3)
        result["final"] = plugin.stats(llm)
    result["seconds"] = time.perf_counter() - start
    llm.llm_engine.engine_core.shutdown()
    return result


def _preemptions(llm) -> int:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def main() -> None:
    out, model, model4 = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    names = sys.argv[4:] or ["stock", "contig", "stock4", "tp2"]
    results = {}
    for name in names:
        if name == "tp2":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        tiny = name in ("stock", "contig")
        results[name] = engine_run(model if tiny else model4, name not in ("stock", "stock4"), 2 if name == "tp2" else 1,
                                   n3=tiny)
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
