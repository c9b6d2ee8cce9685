"""Stock vLLM and vLLM + vmkv in contiguous mode on the same work, for tests/test_vllm_contiguous.py.

Run as a script (vLLM spawns processes, so pytest does not import it)::

    python tests/vllm_contiguous_scenarios.py OUT.json MODEL_DIR [stock] [contig] [tp2]

Both engines get the same settings, small enough that one engine exercises every case:
a KV cache of 36 blocks (vLLM must preempt in wave A), a token budget of 128 per step (the
302-token prompts are prefilled in chunks), at most 4 requests at once (slots are reused).

* wave A: four requests, two sharing a 300-token prefix (9 full blocks): preemption, chunked
  prefill, prefix hits; the contiguous engine's slot counters are sampled every step.
* wave B: the prefix again, after wave A finished: hits the prefix cache.
* wave C: ``n=3`` seeded sampling of one prompt; the slots are sampled after its prefill.

``tp2`` runs wave A in contiguous mode with tensor parallelism 2 (CPU:
``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Writes per engine: tokens, stock's top-2 logprob gap per position, cached prompt tokens,
preemptions, and (contiguous) the worker's stats per step and at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

BLOCK = 32
KV_BYTES = 36 * BLOCK * 2 * 4 * 64 * 4  # 36 blocks of the tiny model (2 layers, 4 KV heads x (K|V) 64 x fp32)
ENGINE = {"block_size": BLOCK, "max_num_seqs": 4, "max_num_batched_tokens": 128, "disable_log_stats": False}
OPTIONS = {"page_size": "256KiB", "kv_mode": "contiguous", "max_cached": KV_BYTES}  # the prefix cache keeps what stock keeps
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


def engine_run(model: str, contiguous: bool, tp: int = 1) -> dict:
    from vllm import SamplingParams

    from vmkv import vllm as plugin
    from vmkv.vllm import drive

    start = time.perf_counter()
    llm = drive.engine(model, vmkv=contiguous, kv_cache_bytes=KV_BYTES, max_model_len=1024,
                       options=OPTIONS if contiguous else None, tensor_parallel_size=tp, **ENGINE)
    started = time.perf_counter() - start
    sample = (lambda: plugin.stats(llm)[0]) if contiguous else None
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for _, n in WAVE_A + WAVE_B]
    result = {"start_s": started}
    result["a"] = serve(llm, [p for p, _ in WAVE_A], greedy[:4], sample)
    if tp > 1:
        result["final"] = plugin.stats(llm)
        llm.llm_engine.engine_core.shutdown()
        return result
    result["b"] = serve(llm, [p for p, _ in WAVE_B], greedy[4:], sample)
    n3 = SamplingParams(n=3, max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    result["c"] = serve(llm, [N3_PROMPT], [n3], sample)
    result["preemptions"] = sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    if contiguous:
        time.sleep(0.3)
        result["final"] = plugin.stats(llm)
    result["seconds"] = time.perf_counter() - start
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> None:
    out, model, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:] or ["stock", "contig", "tp2"]
    results = {}
    for name in names:
        if name == "tp2":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        results[name] = engine_run(model, name != "stock", 2 if name == "tp2" else 1)
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
