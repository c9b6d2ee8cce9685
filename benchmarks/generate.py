"""transformers ``generate()`` with vmkv's cache against DynamicCache and StaticCache (issue 4).

The embedded default model (``vmkv.models.default_hf_model``: a seeded Llama, 4 layers, 8 query /
4 KV heads of 32) generates ``--new-tokens`` after a ``--prompt-len`` prompt of random bytes,
greedily, at each batch size, then with beam search (width ``--beam-width``, batch 1). Every
cache runs the same work; runs take turns (``--repeats``) and the median time is kept.

Caches::

    dynamic      transformers DynamicCache (concatenates K/V every step), SDPA
    static       transformers StaticCache(max_cache_len=--static-len), SDPA over the whole length
    vmm          VirtualCache("vmm"), the model's SDPA over zero-copy views of the valid length
    vmm+vmkv     VirtualCache("vmm"), attn_implementation="vmkv": the cache's contiguous kernel
    paged+vmkv   VirtualCache("paged"), attn_implementation="vmkv": the paged kernel

``min_new_tokens = max_new_tokens`` keeps every run to the same length (no early EOS).
KV bytes: DynamicCache and StaticCache report their tensors' bytes at the end (their peak, not
counting DynamicCache's transient concatenation copy); VirtualCache the most pool bytes in use
after any step. ``need_bytes`` is what the stored tokens take (rows x columns x bytes a token).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from . import common

NAME = "generate"
DESCRIPTION = "transformers generate(): VirtualCache (vmm, paged) vs DynamicCache/StaticCache tokens/s and KV bytes"

CACHES = ("dynamic", "static", "vmm", "vmm+vmkv", "paged+vmkv")
SCHEMA = {
    "workload": "greedy or beam<width>",
    "batch": "prompts per generate() call",
    "cache": "cache (and attention) under test, see the module docstring",
    "attention": "the model's attn_implementation",
    "kernel": "attention kernel that ran (VirtualCache: the core's kernel; else transformers' sdpa)",
    "prompt_len": "prompt tokens",
    "new_tokens": "tokens generated per sequence",
    "seconds": "median wall time of generate(), s",
    "tokens_per_s": "batch * new_tokens / seconds",
    "kv_peak_bytes": "most KV bytes held at once, B",
    "kv_need_bytes": "bytes the stored tokens take (rows x columns x bytes/token), B",
    "page_bytes": "bytes of one pool page (all layers, K and V); 0 for transformers caches",
    "same_tokens_as_dynamic": "generated ids identical to DynamicCache's",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this benchmark (the CLI adds --device, --smoke, --seed, --out)."""
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--new-tokens", type=int, default=2048, help="generated tokens (default 2048)")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated greedy batch sizes (default 1,8)")
    parser.add_argument("--beam-width", type=int, default=4, help="beam search width, 0 to skip (default 4)")
    parser.add_argument("--beam-new-tokens", type=int, default=None, help="beam search tokens (default --new-tokens)")
    parser.add_argument("--static-len", type=int, default=8192, help="StaticCache max_cache_len (default 8192)")
    parser.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated subset of {','.join(CACHES)}")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cache, taking turns (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on shared CPUs)")


def _smoke(args: argparse.Namespace) -> argparse.Namespace:
    """Tiny sizes for CI: seconds, not minutes."""
    return argparse.Namespace(**{
        **vars(args), "prompt_len": 16, "new_tokens": 4, "batch_sizes": "2", "beam_new_tokens": 4,
        "static_len": 32, "repeats": 1,
    })


def _make_cache(name: str, model: torch.nn.Module, args: argparse.Namespace, max_batch: int) -> Any:
    from transformers import DynamicCache, StaticCache

    import vmkv.hf

    if name == "dynamic":
        return DynamicCache()
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=args.static_len)
    mode = name.split("+")[0]
    total = args.prompt_len + max(args.new_tokens, args.beam_new_tokens or 0) + 1
    return vmkv.hf.VirtualCache(mode, max_batch_size=max_batch, max_seq_len=total)


def _kv_bytes(cache: Any) -> tuple[int, int, int]:
    """(peak bytes held, bytes the stored tokens need, page bytes) of a finished cache."""
    from vmkv.hf import VirtualCache

    if isinstance(cache, VirtualCache):
        stats = cache.stats()
        return cache.peak_bytes, stats["token_bytes"], stats["page_bytes"]
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    first = cache.layers[0].keys  # [B, H, S, D]
    need = first.shape[0] * int(cache.get_seq_length()) * first[0, :, 0].nbytes * 2 * len(cache.layers)
    return held, need, 0


def _kernel(name: str, cache: Any) -> str:
    if "vmkv" in name:
        return cache.core.kernel
    return "sdpa (transformers)"


def _workload(
    model: torch.nn.Module, args: argparse.Namespace, caches: list[str], batch: int, beams: int, new_tokens: int
) -> list[dict[str, Any]]:
    """Time every cache on one workload; runs take turns so machine drift hits all alike."""
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 256, (batch, args.prompt_len), generator=gen).to(args.device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, num_beams=beams, pad_token_id=model.config.pad_token_id,
    )
    import vmkv.hf

    cache_kw = vmkv.hf.cache_argument()  # transformers 5.19: past_key_values=, 5.24: cache=
    times: dict[str, list[float]] = {name: [] for name in caches}
    last: dict[str, tuple[Any, torch.Tensor]] = {}
    for _ in range(args.repeats):
        for name in caches:
            model.set_attn_implementation("vmkv" if "vmkv" in name else "sdpa")
            cache = _make_cache(name, model, args, max_batch=batch * beams)
            common.synchronize(args.device)
            start = time.perf_counter()
            out = model.generate(ids, **{cache_kw: cache}, **kwargs)
            common.synchronize(args.device)
            times[name].append(time.perf_counter() - start)
            if name in last and hasattr(last[name][0], "close"):
                last[name][0].close()
            last[name] = (cache, out)
    reference = last[caches[0]][1] if caches[0] == "dynamic" else None
    rows = []
    for name in caches:
        cache, out = last[name]
        seconds = statistics.median(times[name])
        peak, need, page = _kv_bytes(cache)
        rows.append({
            "workload": "greedy" if beams == 1 else f"beam{beams}", "batch": batch, "cache": name,
            "attention": "vmkv" if "vmkv" in name else "sdpa", "kernel": _kernel(name, cache),
            "prompt_len": args.prompt_len, "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": batch * new_tokens / seconds, "kv_peak_bytes": peak, "kv_need_bytes": need,
            "page_bytes": page,
            "same_tokens_as_dynamic": True if reference is None else bool(torch.equal(out, reference)),
        })
        if hasattr(cache, "close"):
            cache.close()
    return rows


def _ratio(rows: list[dict[str, Any]], workload: str, batch: int, field: str, a: str, b: str) -> float | None:
    pick = {r["cache"]: r[field] for r in rows if r["workload"] == workload and r["batch"] == batch}
    if a not in pick or b not in pick or not pick[b]:
        return None
    return pick[a] / pick[b]


def _summary(rows: list[dict[str, Any]], args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for batch in batches:
        for ours in ("vmm", "vmm+vmkv", "paged+vmkv"):
            key = ours.replace("+", "_")
            for base in ("dynamic", "static"):
                summary[f"{key}_vs_{base}_b{batch}"] = _ratio(rows, "greedy", batch, "tokens_per_s", ours, base)
    beam = f"beam{args.beam_width}"
    for ours in ("vmm", "vmm+vmkv", "paged+vmkv"):
        key = ours.replace("+", "_")
        summary[f"{beam}_{key}_speed_vs_dynamic"] = _ratio(rows, beam, 1, "tokens_per_s", ours, "dynamic")
        summary[f"{beam}_{key}_kv_vs_dynamic"] = _ratio(rows, beam, 1, "kv_peak_bytes", ours, "dynamic")
    waste = [
        (r["kv_peak_bytes"] - r["kv_need_bytes"]) / (r["page_bytes"] * r["batch"])
        for r in rows if r["page_bytes"] and r["workload"] == "greedy"
    ]
    summary["greedy_max_waste_pages_per_seq"] = max(waste) if waste else None
    summary["goals"] = {
        "vmm >= 1.3x dynamic": _best(summary, "vmm", "dynamic", batches, 1.3),
        "vmm >= 1.5x static": _best(summary, "vmm", "static", batches, 1.5),
        "kv within one page per sequence": None if not waste else max(waste) <= 1.0,
        "beam >= 1.5x dynamic speed": _any(summary, f"{beam}_%s_speed_vs_dynamic", lambda v: v >= 1.5),
        "beam <= 60% dynamic KV": _any(summary, f"{beam}_%s_kv_vs_dynamic", lambda v: v <= 0.6),
    }
    summary["all_same_tokens_as_dynamic"] = all(r["same_tokens_as_dynamic"] for r in rows)
    return summary


def _best(summary: dict[str, Any], mode: str, base: str, batches: list[int], goal: float) -> dict[str, Any]:
    """Per batch size: the better of the two VMM variants (model SDPA or the vmkv attention) vs ``base``."""
    out = {}
    for batch in batches:
        values = [summary.get(f"{key}_vs_{base}_b{batch}") for key in ("vmm", "vmm_vmkv")]
        values = [v for v in values if v is not None]
        out[f"b{batch}"] = None if not values else max(values) >= goal
    return out


def _any(summary: dict[str, Any], pattern: str, test: Callable[[float], bool]) -> dict[str, Any]:
    return {
        key: None if summary.get(pattern % key) is None else test(summary[pattern % key])
        for key in ("vmm", "vmm_vmkv", "paged_vmkv")
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns ``{"name", "schema", "rows", "summary", ...}``.

    Raises:
        vmkv.InvalidConfig: an unknown cache name or device.
        vmkv.BackendUnavailable: ``--device cuda`` without a GPU.
    """
    import vmkv
    from vmkv.models import default_hf_model

    common.check_device(args.device)
    if args.smoke:
        args = _smoke(args)
    caches = [name.strip() for name in args.caches.split(",") if name.strip()]
    unknown = sorted(set(caches) - set(CACHES))
    if unknown:
        raise vmkv.InvalidConfig(f"unknown caches {unknown}; choose from {list(CACHES)}")
    available, why = common.paged_available()
    if not available:
        caches = [name for name in caches if not name.startswith("paged")]
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
    model = default_hf_model(device=args.device)
    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    rows = []
    for batch in batches:
        rows += _workload(model, args, caches, batch, 1, args.new_tokens)
    if args.beam_width > 1:
        rows += _workload(model, args, caches, 1, args.beam_width, args.beam_new_tokens or args.new_tokens)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    extra = {"config": config, "paged_note": why} if why else {"config": config}
    return common.make_result(NAME, SCHEMA, rows, _summary(rows, args, batches), **extra)


def plot(result: dict[str, Any], out_dir: Path) -> list[str]:
    """Two bar charts: tokens/s and KV bytes per workload and cache. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    groups = sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda g: (g[0] != "greedy", g[1]))
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for field, label, fname in [
        ("tokens_per_s", "tokens / s", "generate_throughput.png"),
        ("kv_peak_bytes", "peak KV MiB", "generate_kv_bytes.png"),
    ]:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(caches)
        for i, name in enumerate(caches):
            values = []
            for workload, batch in groups:
                match = [r[field] for r in rows if (r["workload"], r["batch"], r["cache"]) == (workload, batch, name)]
                value = match[0] if match else 0
                values.append(value / 2**20 if field == "kv_peak_bytes" else value)
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=name)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{w} b={b}" for w, b in groups])
        ax.set_ylabel(label)
        ax.set_title(f"generate(): prompt {rows[0]['prompt_len']}, {rows[0]['new_tokens']} new tokens")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(str(path))
    return paths
