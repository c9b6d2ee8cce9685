"""The sliding-window part of ``vmkv bench generate`` (issue 36): on GPT-OSS- and Gemma-3-shaped models
(random weights, a few layers), does VirtualCache hold no more K/V than DynamicCache, far less than StaticCache,
and generate as fast? (docs/benchmarks.md)"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from . import common

CACHES = ("dynamic", "static", "vmm", "vmm+vmkv", "paged+vmkv")
DEFAULT_CACHES = CACHES[:4]
BYTES_TARGET = 1.1  # VirtualCache's K/V bytes / DynamicCache's, at most
SPEED_TARGET = 1.0  # VirtualCache's tokens/s / DynamicCache's, at least
FULL_POINT = (4096, 256)  # issue 36's point: prompt tokens, new tokens
MAX_LEN = 8192  # the longest sequence the caches are sized for: StaticCache allocates it, VirtualCache reserves it


MODELS: dict[str, tuple[str, str, dict[str, Any], str]] = {  # name: (config class, model class, its fields, own attention)
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(  # eager: transformers runs GPT-OSS's sinks in its eager attention
        vocab_size=512, hidden_size=512, intermediate_size=256, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0), "eager"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, sliding_window=1024, query_pre_attn_scalar=256,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=8192, pad_token_id=0), "sdpa"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window-models", nargs="*", default=[], choices=list(MODELS),
                        help="also run the sliding-window part on these models (default none; docs/benchmarks.md)")
    parser.add_argument("--window-point", type=int, nargs=2, default=list(FULL_POINT), metavar=("PROMPT", "NEW"),
                        help=f"the sliding-window part's prompt and new tokens (default {FULL_POINT[0]} {FULL_POINT[1]})")
    parser.add_argument("--window-max-len", type=int, default=MAX_LEN,
                        help=f"the longest sequence StaticCache and VirtualCache are sized for (default {MAX_LEN}, "
                             "at least prompt + new tokens)")
    parser.add_argument("--window-caches", nargs="+", default=list(DEFAULT_CACHES), choices=list(CACHES),
                        help=f"caches of the sliding-window part (default {' '.join(DEFAULT_CACHES)})")


def _make_cache(name: str, model: torch.nn.Module, max_len: int) -> Any:
    from transformers import DynamicCache, StaticCache

    import vmkv.hf

    if name == "dynamic":
        return DynamicCache(config=model.config)  # its sliding layers keep their window
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    return vmkv.hf.VirtualCache(name.split("+")[0], config=model.config, max_batch_size=1, max_seq_len=max_len)


def kv_bytes(cache: Any) -> tuple[int, int]:
    """(bytes held now, most bytes held at once) of a finished cache."""
    from vmkv.hf import VirtualCache

    if isinstance(cache, VirtualCache):
        return cache.stats()["bytes_in_use"], cache.peak_bytes
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)
    return held, held


def _run_once(model: torch.nn.Module, name: str, own: str, ids: torch.Tensor, new: int,
              max_len: int) -> tuple[Any, torch.Tensor]:
    import vmkv.hf

    model.set_attn_implementation("vmkv" if name.endswith("+vmkv") else own)
    cache = _make_cache(name, model, max_len)
    return cache, model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, **{vmkv.hf.cache_argument(): cache})


def _model_rows(name: str, args: argparse.Namespace, clock: str) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Every cache on one model, taking turns over ``args.repeats`` rounds: rows and per-round seconds."""
    import transformers

    config, model_class, fields, own = MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(getattr(transformers, config)(**fields)).to(args.device).eval()
    prompt, new = args.window_point
    max_len = max(args.window_max_len, prompt + new)
    ids = torch.randint(1, 512, (1, prompt), generator=torch.Generator().manual_seed(args.seed)).to(args.device)

    def row(cache_name: str, cache: Any, seconds: common.Spread) -> dict[str, Any]:
        held, peak = kv_bytes(cache)
        return {
            "model": name, "cache": cache_name, "window": model.config.sliding_window, "max_len": max_len, "prompt_len": prompt,
            "new_tokens": new, "batch": 1, "seconds": seconds.value, "seconds_low": seconds.low,
            "seconds_high": seconds.high, "tokens_per_s": new / seconds.value, "kv_bytes": held, "kv_peak_bytes": peak,
        }

    return common.generate_rounds(
        args.window_caches, args.repeats, args.device, clock, lambda cache: _run_once(model, cache, own, ids, new, max_len),
        args.failed, lambda cache: f"windows.{name}.{cache}", f"{name} ", row)


def run_part(args: argparse.Namespace, clock: str) -> dict[str, Any]:
    """The part's result: ``{"rows": [...], "samples": {model: {cache: seconds}}}`` (empty without ``--window-models``)."""
    parts = {name: _model_rows(name, args, clock) for name in args.window_models}  # model -> (rows, samples)
    return {"rows": [row for rows, _ in parts.values() for row in rows],
            "samples": {name: times for name, (_, times) in parts.items()}}


def verdicts(part: dict[str, Any], failed: dict[str, str]) -> list[common.Verdict]:
    """Per model: VirtualCache's K/V bytes against DynamicCache's (target <= 1.1x) and StaticCache's,
    and its tokens/s against DynamicCache's (target >= 1.0x); wrong tokens make a line unreliable."""
    out = []
    for model, times in part["samples"].items():
        rows = {r["cache"]: r for r in part["rows"] if r["model"] == model}
        ours = [name for name in ("vmm", "vmm+vmkv", "paged+vmkv") if name in rows]
        first = next(iter(rows.values()), None)
        if first is None:
            continue
        where = f"{model}, {first['prompt_len']}+{first['new_tokens']} tokens, window {first['window']}"
        why = [f"{key.split('.')[-1]} failed: {text}" for key, text in failed.items() if key.startswith(f"windows.{model}.")]
        why += [f"{name} generated other tokens than DynamicCache" for name, r in rows.items() if not r["same_tokens_as_dynamic"]]
        if not ours or "dynamic" not in rows or why:
            out.append(common.unreliable(f"generate.windows.{model}", f"sliding-window KV, {where}",
                                         "; ".join(why) or "VirtualCache or DynamicCache did not run"))
            continue
        least = min(ours, key=lambda name: rows[name]["kv_bytes"])
        held, dynamic = rows[least]["kv_bytes"], rows["dynamic"]["kv_bytes"]
        peak = f"; its peak {rows[least]['kv_peak_bytes'] / 2**20:.1f} MiB while the prompt's pages were mapped"
        out.append(common.ratio_verdict(
            f"generate.windows.{model}.kv_vs_dynamic", f"K/V bytes held after generate(), {where}: VirtualCache vs "
            "DynamicCache", common.Spread.exact(dynamic / held), "VirtualCache (less memory)", "DynamicCache (less memory)",
            target=1 / BYTES_TARGET, reference=f"target: VirtualCache <= {BYTES_TARGET}x DynamicCache",
            note=f"{least}: {held / 2**20:.2f} MiB, DynamicCache {dynamic / 2**20:.2f} MiB ({held / dynamic:.2f}x){peak}"))
        if "static" in rows:
            static = rows["static"]["kv_bytes"]
            out.append(common.ratio_verdict(
                f"generate.windows.{model}.kv_vs_static", f"K/V bytes held after generate(), {where}: VirtualCache vs "
                "StaticCache", common.Spread.exact(static / held), "VirtualCache (less memory)", "StaticCache (less memory)",
                note=f"StaticCache {static / 2**20:.2f} MiB: sized, as VirtualCache, for {first['max_len']} tokens, "
                     "its full layers allocate them all (its sliding layers their window)"))
        fastest = max(ours, key=lambda name: common.Timings(times).ratio("dynamic", name).value)
        ratio = common.Timings(times).ratio("dynamic", fastest)
        out.append(common.ratio_verdict(
            f"generate.windows.{model}.vs_dynamic", f"generate() tokens/s, {where}: VirtualCache vs DynamicCache",
            ratio, "VirtualCache", "DynamicCache", target=SPEED_TARGET, note=f"fastest VirtualCache: {fastest}"))
    return out


def table(part: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per model and cache: tokens/s, K/V held, peak."""
    return [{"model": r["model"], "cache": r["cache"], "point": f"{r['prompt_len']}+{r['new_tokens']}",
             "tok/s": round(r["tokens_per_s"], 1), "KV held MiB": round(r["kv_bytes"] / 2**20, 2),
             "KV peak MiB": round(r["kv_peak_bytes"] / 2**20, 2), "same tokens": r["same_tokens_as_dynamic"]}
            for r in part["rows"]]
