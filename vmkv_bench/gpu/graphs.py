"""The ``engine_graphs`` section: the engine's decode steps as CUDA graphs, their logits against eager
ones across page boundaries and their speed-up at 32 sequences, both modes (docs/gpu.md)."""

from __future__ import annotations

import time
from contextlib import closing
from typing import Any

import torch

import vmkv
from vmkv.engine import Engine, SamplingParams
from vmkv.engine.graphs import DecodeGraphs, unsupported
from vmkv.engine.runner import LoadedModel, ModelRunner, cache_config_for, load_model

from ..common import synchronize
from ..runner import Context, SectionSkipped

SPEED_TARGET = 2.0
LOGIT_TOLERANCE = 1e-4  # max |diff| / max |logit| in float32 (two kernels summing in another order)


def _cache(loaded: LoadedModel, mode: str, slots: int, max_seq_len: int, budget: str) -> vmkv.KVCacheBase:
    config = cache_config_for(loaded.model, max_batch_size=slots, max_seq_len=max_seq_len, memory_budget=budget,
                              block_size=16, prefix_caching=False)
    return vmkv.open_cache(config, mode=mode)


def _why_not(loaded: LoadedModel, mode: str) -> str | None:
    with _cache(loaded, mode, 2, 64, "8MiB") as cache:
        return unsupported(cache)


def compare_outputs(loaded: LoadedModel, mode: str, smoke: bool) -> dict[str, Any]:
    """Eager vs captured logits of the same decode steps, float32, across page boundaries:
    ``max_rel_diff`` is max |diff| / max |logit| over every step and sequence."""
    batch, prompt, steps = (2, 20, 6) if smoke else (8, 1000, 40)
    eager_cache, graph_cache = (_cache(loaded, mode, batch + 1, 2048, "64MiB" if smoke else "1GiB") for _ in range(2))
    with eager_cache, graph_cache:
        graphs = DecodeGraphs(loaded.model, graph_cache)
        runners = ((eager_cache, ModelRunner(loaded.model)), (graph_cache, ModelRunner(loaded.model, graphs)))
        gen = torch.Generator().manual_seed(0)
        tokens = {i: torch.randint(0, 256, (prompt + 3 * i,), generator=gen).tolist() for i in range(batch)}
        for cache, _ in runners:
            for seq in tokens:
                cache.add(seq)
        worst, pages_before = 0.0, graph_cache.stats()["pages_in_use"]
        feed = dict(tokens)
        for step in range(steps + 1):
            logits = [runner.execute(cache, cache.begin_step(feed), list(feed.values()), [True] * batch)
                      for cache, runner in runners]
            if step:  # decode steps (step 0 is the eager prefill on both)
                worst = max(worst, float((logits[0] - logits[1]).abs().max() / logits[0].abs().max()))
            feed = {seq: [int(t)] for seq, t in zip(tokens, logits[0].argmax(-1).tolist())}
        return {"mode": mode, "sequences": batch, "prompt_tokens": f"{prompt}-{prompt + 3 * (batch - 1)}",
                "decode_steps": steps, "max_rel_diff": worst, "pages_mapped_while_decoding":
                graph_cache.stats()["pages_in_use"] - pages_before, "graphs": graphs.stats.as_dict()}


def decode_speed(loaded: LoadedModel, mode: str, smoke: bool) -> dict[str, Any]:
    """Decode tokens per second of the engine with and without graphs (a warm-up run each)."""
    batch, new = (3, 4) if smoke else (32, 128)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 256 for j in range(16)] for i in range(batch)]
    found: dict[str, Any] = {}
    for graphs in (False, True):
        cache = _cache(loaded, mode, batch + 1, 512, "64MiB" if smoke else "1GiB")
        with closing(Engine(loaded, cache, cuda_graphs=graphs)) as engine:
            engine.generate(prompts, params)  # warm-up: Triton compiles, the graphs capture
            synchronize(cache.config.device.type)
            began = time.perf_counter()
            engine.generate(prompts, params)
            synchronize(cache.config.device.type)
            seconds = time.perf_counter() - began
            found["graphs" if graphs else "eager"] = {"seconds": seconds, "tokens_per_s": batch * new / seconds}
            if graphs:
                found["captured"] = engine.stats()["engine"]["cuda_graphs"]["captured"]
    found["speedup"] = found["graphs"]["tokens_per_s"] / found["eager"]["tokens_per_s"]
    return {"mode": mode, "sequences": batch, "new_tokens": new, **found}


def engine_graphs_section(ctx: Context) -> dict[str, Any]:
    """Both parts in both modes; a mode that cannot capture here is skipped with why (all: SectionSkipped)."""
    device, smoke = ctx.device, ctx.smoke
    exact = load_model(None, dtype="float32", device=str(device))
    native = exact if device.type != "cuda" else load_model(None, device=str(device))
    result: dict[str, Any] = {"outputs": {}, "speed": {}, "skipped": {}, "failures": []}
    for mode in ("vmm", "paged"):
        why = _why_not(exact, mode)
        if why is not None:
            result["skipped"][mode] = why
            continue
        outputs = result["outputs"][mode] = compare_outputs(exact, mode, smoke)
        if outputs["max_rel_diff"] > LOGIT_TOLERANCE:
            result["failures"].append(f"{mode}: captured logits differ from eager ones by {outputs['max_rel_diff']:.2e} "
                                      f"of the largest logit (tolerance {LOGIT_TOLERANCE})")
        result["speed"][mode] = decode_speed(native, mode, smoke)
    if not result["outputs"]:
        raise SectionSkipped("; ".join(f"{mode}: {why}" for mode, why in result["skipped"].items()))
    result["target"] = f"graphs >= {SPEED_TARGET}x without at 32 sequences"
    return result


def engine_graphs_headline(result: dict[str, Any]) -> str:
    """Graphs' decode speed-up per mode, and the target."""
    parts = [f"{mode} {found['speedup']:.2f}x" for mode, found in result["speed"].items()]
    met = all(found["speedup"] >= SPEED_TARGET for found in result["speed"].values())
    return f"decode with CUDA graphs: {', '.join(parts)} without (target >= {SPEED_TARGET}x {'met' if met else 'missed'})"
