"""transformers ``generate()`` with vmkv's cache against DynamicCache and StaticCache (issues 4, 11).

A seeded random Llama (``vmkv.models.default_hf_model``) generates ``--new-tokens`` after a
``--prompt-len`` prompt of random bytes, greedily, for each model size, batch size and output
length, then with beam search (width ``--beam-width``, batch 1). Models::

    small   the embedded default: 4 layers, hidden 256, 8 query / 4 KV heads of 32
    mid     12 layers, hidden 768, 12 query / 4 KV heads of 64

Caches::

    dynamic      transformers DynamicCache (concatenates K/V every step), SDPA
    static       transformers StaticCache sized to the run (prompt + new tokens), SDPA over it all
    vmm          VirtualCache("vmm"), the model's SDPA over zero-copy views of the valid length
    vmm+vmkv     VirtualCache("vmm"), attn_implementation="vmkv": the cache's contiguous kernel
    paged+vmkv   VirtualCache("paged"), attn_implementation="vmkv": the paged kernel

Every cache runs the same work; the caches take turns for ``--repeats`` rounds and the median is
kept, with the min-max over rounds; ratios are taken round by round. On CPU with one torch thread
the clock is the thread's CPU time (other processes of a shared machine cannot inflate it).
``min_new_tokens = max_new_tokens`` keeps every run to the same length (no early EOS).
KV bytes: DynamicCache and StaticCache report their tensors' bytes at the end (their peak, not
counting DynamicCache's transient concatenation copy); VirtualCache the most pool bytes in use
after any step. ``need_bytes`` is what the stored tokens take (rows x columns x bytes a token).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from . import common

NAME = "generate"
DESCRIPTION = "transformers generate(): VirtualCache (vmm, paged) vs DynamicCache/StaticCache tokens/s and KV bytes"

CACHES = ("dynamic", "static", "vmm", "vmm+vmkv", "paged+vmkv")
MODELS: dict[str, dict[str, Any]] = {
    "small": {},  # vmkv.models.DEFAULT_MODEL as it is
    "mid": {"num_hidden_layers": 12, "hidden_size": 768, "intermediate_size": 2048,
            "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64},
}
SCHEMA = {
    "model": "small or mid (see the module docstring)",
    "workload": "greedy, or beamW for beam search of width W",
    "batch": "prompts per generate() call",
    "cache": "cache (and attention) under test, see the module docstring",
    "kernel": "attention kernel that ran (VirtualCache with vmkv attention: the core's kernel; else transformers' sdpa)",
    "prompt_len": "prompt tokens",
    "new_tokens": "tokens generated per sequence",
    "seconds": "median time of generate() over the rounds, s",
    "seconds_low": "fastest round, s (from 5 rounds on, the single fastest and slowest are left out)",
    "seconds_high": "slowest round, s (same rule)",
    "tokens_per_s": "batch * new_tokens / seconds",
    "kv_peak_bytes": "most KV bytes held at once, B",
    "kv_need_bytes": "bytes the stored tokens take (rows x columns x bytes/token), B",
    "page_bytes": "bytes of one pool page (all layers, K and V); 0 for transformers caches",
    "same_tokens_as_dynamic": "generated ids identical to DynamicCache's",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this benchmark (the CLI adds --device, --smoke, --seed, --out)."""
    parser.add_argument("--models", nargs="+", default=["small", "mid"], choices=list(MODELS), help="model sizes (default small mid)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[256, 2048], help="generated tokens, one run each (default 256 2048)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="greedy batch sizes (default 1 8)")
    parser.add_argument("--beam-width", type=int, default=4, help="beam search width, 0 to skip (default 4)")
    parser.add_argument("--beam-new-tokens", type=int, default=64, help="beam search tokens (default 64)")
    parser.add_argument("--static-len", type=int, default=None, help="StaticCache max_cache_len (default: prompt + new tokens, what the run needs)")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES), help="caches to compare (default all)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, every cache once per round (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on shared CPUs)")
    parser.add_argument("--clock", default="auto", choices=["auto", *common.CLOCKS],
                        help="auto: the thread's CPU time on CPU with one thread, else wall time")


def _smoke(args: argparse.Namespace) -> argparse.Namespace:
    """Tiny sizes for CI: seconds, not minutes."""
    return argparse.Namespace(**{
        **vars(args), "models": ["small"], "prompt_len": 16, "new_tokens": [4], "batch_sizes": [2],
        "beam_new_tokens": 4, "repeats": 1,
    })


def _make_cache(name: str, model: torch.nn.Module, args: argparse.Namespace, max_batch: int, total: int) -> Any:
    from transformers import DynamicCache, StaticCache

    import vmkv.hf

    if name == "dynamic":
        return DynamicCache()
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=args.static_len or total)
    return vmkv.hf.VirtualCache(name.split("+")[0], max_batch_size=max_batch, max_seq_len=total + 1)


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


def _workload(
    model: torch.nn.Module, args: argparse.Namespace, batch: int, beams: int, new_tokens: int, clock: str,
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Time every cache on one workload, the caches taking turns; rows and per-round seconds."""
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 256, (batch, args.prompt_len), generator=gen).to(args.device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, num_beams=beams, pad_token_id=model.config.pad_token_id,
    )
    import vmkv.hf

    cache_kw = vmkv.hf.cache_argument()  # transformers 5.19: past_key_values=, 5.24: cache=
    now = common.CLOCKS[clock]
    caches = list(args.caches)
    times: dict[str, list[float]] = {name: [] for name in caches}
    last: dict[str, tuple[Any, torch.Tensor]] = {}
    for round_ in range(args.repeats):
        for name in caches[round_ % len(caches):] + caches[: round_ % len(caches)]:
            if name in args.failed:
                continue
            model.set_attn_implementation("vmkv" if "vmkv" in name else "sdpa")
            cache = _make_cache(name, model, args, batch * beams, args.prompt_len + new_tokens)
            common.synchronize(args.device)
            start = now()
            try:
                out = model.generate(ids, **{cache_kw: cache}, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a cache that cannot run is reported, the others go on
                args.failed[name] = f"{type(exc).__name__}: {exc}"
                print(f"[generate] {name} left out: {args.failed[name]}", file=sys.stderr)
                continue
            common.synchronize(args.device)
            times[name].append(now() - start)
            if name in last and hasattr(last[name][0], "close"):
                last[name][0].close()
            last[name] = (cache, out)
    caches = [name for name in caches if name in last]
    times = {name: times[name] for name in caches}
    reference = last["dynamic"][1] if "dynamic" in last else None
    rows = []
    for name in caches:
        cache, out = last[name]
        seconds = common.Spread.of(times[name])
        peak, need, page = _kv_bytes(cache)
        rows.append({
            "model": args.model, "workload": "greedy" if beams == 1 else f"beam{beams}", "batch": batch, "cache": name,
            "kernel": cache.core.kernel if "vmkv" in name else "sdpa (transformers)",
            "prompt_len": args.prompt_len, "new_tokens": new_tokens, "seconds": seconds.value,
            "seconds_low": seconds.low, "seconds_high": seconds.high,
            "tokens_per_s": batch * new_tokens / seconds.value, "kv_peak_bytes": peak, "kv_need_bytes": need,
            "page_bytes": page, "same_tokens_as_dynamic": True if reference is None else bool(torch.equal(out, reference)),
        })
        if hasattr(cache, "close"):
            cache.close()
    return rows, times


def _case_key(row: dict[str, Any]) -> str:
    return f"{row['model']}/{row['workload']}/b{row['batch']}/{row['new_tokens']}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns ``{"name", "schema", "rows", "summary", ...}``.

    Raises:
        vmkv.BackendUnavailable: ``--device cuda`` without a GPU.
    """
    from vmkv.models import default_hf_model

    common.check_device(args.device)
    if args.smoke:
        args = _smoke(args)
    available, why = common.paged_available()
    caches = [name for name in args.caches if available or not name.startswith("paged")]
    args = argparse.Namespace(**{**vars(args), "caches": caches, "failed": {}})
    warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
    rows: list[dict[str, Any]] = []
    samples: dict[str, dict[str, list[float]]] = {}
    with common.torch_threads(args.threads if args.device == "cpu" else None):
        clock = common.pick_clock(args.clock, args.device, torch.get_num_threads())
        for model_name in args.models:
            model = default_hf_model(device=args.device, **MODELS[model_name])
            margs = argparse.Namespace(**{**vars(args), "model": model_name})
            work = [(b, 1, n) for n in args.new_tokens for b in args.batch_sizes]
            if args.beam_width > 1:
                work.append((1, args.beam_width, args.beam_new_tokens))
            for batch, beams, new_tokens in common.progress(work, f"generate {model_name}", enabled=getattr(args, "progress", False)):
                found, times = _workload(model, margs, batch, beams, new_tokens, clock)
                rows += found
                samples[_case_key(found[0])] = times
            del model
    config = {k: v for k, v in vars(args).items() if k not in ("out", "progress", "failed")}
    config["clock"] = clock
    extra = {"config": config, "samples": samples, **({"paged_note": why} if why else {})}
    summary = {**_summary(rows, samples), "failed": args.failed}
    return common.make_result(NAME, SCHEMA, rows, summary, **extra)


def _summary(rows: list[dict[str, Any]], samples: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per case: tokens/s of every cache relative to DynamicCache (median of per-round ratios)."""
    summary: dict[str, Any] = {"all_same_tokens_as_dynamic": all(r["same_tokens_as_dynamic"] for r in rows)}
    for key, times in samples.items():
        if "dynamic" in times:
            timings = common.Timings(times)
            summary[f"{key} speed vs dynamic"] = {
                name: round(timings.ratio("dynamic", name).value, 3) for name in times if name != "dynamic"
            }
    return summary


def _best_vmm(timings: common.Timings) -> str | None:
    names = [name for name in ("vmm", "vmm+vmkv") if name in timings.samples]
    return min(names, key=timings.median) if names else None


def _wrong(case: list[dict[str, Any]], names: list[str], failed: dict[str, str]) -> str:
    """Why the caches ``names`` cannot be compared on ``case`` (its rows): one raised, or one
    generated other tokens than DynamicCache (``""``: all ran and agree)."""
    rows = {r["cache"]: r for r in case}
    why = [f"{name} failed: {failed[name]}" for name in names if name in failed]
    why += [f"{name} generated other tokens than DynamicCache" for name in names
            if name in rows and not rows[name]["same_tokens_as_dynamic"]]
    return "; ".join(why)


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """Per model, at its largest greedy case: the faster VirtualCache (VMM) vs DynamicCache and vs
    StaticCache; and beam search's KV memory against DynamicCache's. A comparison where a compared
    cache raised or generated other tokens than DynamicCache is unreliable and names it."""
    out = []
    rows = result["rows"]
    failed = result["summary"].get("failed", {})
    caches = result.get("config", {}).get("caches", CACHES)
    ours = [name for name in ("vmm", "vmm+vmkv") if name in caches]
    for model in dict.fromkeys(r["model"] for r in rows):
        greedy = [r for r in rows if r["model"] == model and r["workload"] == "greedy"]
        if greedy:
            top = max(greedy, key=lambda r: (r["batch"] * r["new_tokens"], r["new_tokens"]))
            case = [r for r in greedy if _case_key(r) == _case_key(top)]
            timings = common.Timings(result["samples"][_case_key(top)])
            vmm = _best_vmm(timings)
            where = f"{model} model, B={top['batch']}, {top['new_tokens']} new tokens"
            for base, label in (("dynamic", "DynamicCache"), ("static", "StaticCache")):
                key, question = f"generate.{model}.vs_{base}", f"generate() tokens/s, {where}: VirtualCache vs {label}"
                why = _wrong(case, [*ours, base], failed) if base in caches and ours else ""
                if why:
                    out.append(common.unreliable(key, question, why))
                elif vmm and base in timings.samples:
                    out.append(common.ratio_verdict(
                        key, question, timings.ratio(base, vmm), "VirtualCache", label, note=f"fastest VirtualCache: {vmm}",
                    ))
        beam = {r["cache"]: r for r in rows if r["model"] == model and r["workload"].startswith("beam")}
        vmm_beam = [beam[name] for name in ("vmm", "vmm+vmkv") if name in beam]
        why = _wrong(list(beam.values()), [*ours, "dynamic"], failed) if beam and ours and "dynamic" in caches else ""
        if why:
            out.append(common.unreliable(f"generate.{model}.beam_kv", f"beam search peak KV bytes, {model} model: "
                                         "VirtualCache vs DynamicCache", why))
        elif vmm_beam and "dynamic" in beam:
            least = min(vmm_beam, key=lambda r: r["kv_peak_bytes"])
            ratio = beam["dynamic"]["kv_peak_bytes"] / least["kv_peak_bytes"]
            out.append(common.ratio_verdict(
                f"generate.{model}.beam_kv", f"beam search (width {least['workload'][4:]}) peak KV bytes, {model} model: "
                "VirtualCache vs DynamicCache", common.Spread.exact(ratio), "VirtualCache (less memory)", "DynamicCache (less memory)",
                note="copy-on-write shares the beams' common pages",
            ))
    return out


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The terminal table: per case, tokens/s of each cache (median) and whether outputs match."""
    out = []
    for key in result["samples"]:
        mine = [r for r in result["rows"] if _case_key(r) == key]
        line: dict[str, Any] = {"model": mine[0]["model"], "workload": mine[0]["workload"], "batch": mine[0]["batch"],
                                "new_tokens": mine[0]["new_tokens"]}
        for r in mine:
            line[f"{r['cache']} tok/s"] = round(r["tokens_per_s"], 1)
        line["same tokens"] = all(r["same_tokens_as_dynamic"] for r in mine)
        out.append(line)
    return out


def plot(result: dict[str, Any], out_dir: Path) -> list[str]:
    """``generate_throughput.png`` (tokens/s per case and cache, min-max bars) and
    ``generate_kv_bytes.png`` (peak KV bytes, log axis). Returns the PNG paths."""
    plt = common.pyplot()
    rows = result["rows"]
    cases = list(result["samples"])
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    labels = []
    for key in cases:
        r = next(r for r in rows if _case_key(r) == key)
        labels.append(f"{r['model']}\n{r['workload']} B={r['batch']}\n{r['new_tokens']} new")
    paths = []
    width = 0.8 / len(caches)
    for field, ylabel, fname, title in [
        ("tokens_per_s", "tokens / s (median; bars: min-max)", "generate_throughput.png", "generate() throughput per cache"),
        ("kv_peak_bytes", "peak KV bytes (MiB, log scale)", "generate_kv_bytes.png", "generate() peak KV memory per cache"),
    ]:
        fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(cases) + 3), 4.4))
        for i, name in enumerate(caches):
            values, errors = [], [[], []]
            for key in cases:
                match = [r for r in rows if _case_key(r) == key and r["cache"] == name]
                r = match[0] if match else None
                if field == "kv_peak_bytes":
                    values.append(r[field] / 2**20 if r else 0)
                    errors[0].append(0)
                    errors[1].append(0)
                else:
                    value = r[field] if r else 0
                    values.append(value)
                    errors[0].append(value - r["batch"] * r["new_tokens"] / r["seconds_high"] if r else 0)
                    errors[1].append(r["batch"] * r["new_tokens"] / r["seconds_low"] - value if r else 0)
            bars = ax.bar([c + i * width for c in range(len(cases))], values, width,
                          yerr=errors if field != "kv_peak_bytes" else None, capsize=2, label=name)
            if field == "kv_peak_bytes":
                ax.bar_label(bars, labels=[f"{v:.3g}" if v else "" for v in values], fontsize=7, padding=1)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel(ylabel)
        if field == "kv_peak_bytes":
            from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

            ax.set_yscale("log")
            positive = [r[field] / 2**20 for r in rows if r[field]]
            ax.set_ylim(min(positive) / 2, max(positive) * 2)
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        clock = f", {result['config'].get('clock', 'wall')} clock" if field == "tokens_per_s" else ""
        ax.set_title(f"{title}; prompt {rows[0]['prompt_len']} tokens{clock}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        paths.append(common.save_figure(fig, out_dir, fname))
    return paths


if __name__ == "__main__":  # python -m benchmarks.generate [options] runs `vmkv bench generate [options]`
    from vmkv.cli import main

    sys.exit(main(["bench", NAME, *sys.argv[1:]]))
