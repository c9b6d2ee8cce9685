"""transformers ``generate()`` with vmkv's cache against DynamicCache, StaticCache and the ``bound``
(the least work any cache can do): tokens/s, KV bytes, ``update()``'s share of a step (docs/hf.md)."""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import common, windows

NAME = "generate"
DESCRIPTION = "transformers generate(): VirtualCache (vmm, paged) vs DynamicCache/StaticCache tokens/s and KV bytes"

CACHES = ("dynamic", "static", "vmm", "vmm+vmkv", "paged+vmkv", "bound", "static+compile", "vmm+compile",
          "vmm+compile+vmkv", "paged+compile+vmkv")
DEFAULT_CACHES = CACHES[:6]  # the +compile caches compile for each shape (seconds on a CPU, tens on a GPU): asked for
LONG_POINT = (512, 2048, 8)  # prompt tokens, new tokens, batch: issue 16's long point
TARGETS = {"main": 1.0, "long": 1.2, "static": 1.0}  # VirtualCache speed / the other cache's
# per compiled VirtualCache: its speed / the other cache's (issue 28): compiling must not slow the eager
# cache of the same attention down, and must keep up with the same compile over StaticCache
COMPILE_TARGETS = {"vmm+compile": {"vmm": 0.95, "static+compile": 1.0},
                   "vmm+compile+vmkv": {"vmm+vmkv": 0.95, "static+compile": 1.0},
                   "paged+compile+vmkv": {"paged+vmkv": 0.95, "static+compile": 1.0}}
UPDATE_SHARE_TARGET = 0.05  # most of a decode step update() may take
MODELS: dict[str, dict[str, Any]] = {
    "small": {},  # vmkv.models.DEFAULT_MODEL as it is
    "mid": {"num_hidden_layers": 12, "hidden_size": 768, "intermediate_size": 2048,
            "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64},
    "1b": {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rope_theta": 500000.0,
           "tie_word_embeddings": True},  # Llama-3.2-1B's shape, random weights (no download)
}
SCHEMA = {
    "model": "small, mid or 1b (docs/benchmarks.md)",
    "workload": "greedy, or beamW for beam search of width W",
    "batch": "prompts per generate() call",
    "cache": "cache (and attention) under test (docs/hf.md)",
    "kernel": "attention kernel that ran (VirtualCache with vmkv attention: the core's kernel; else transformers' sdpa)",
    "prompt_len": "prompt tokens",
    "point": "main (the --prompt-len/--new-tokens grid) or long (--long-point)",
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
    parser.add_argument("--models", nargs="+", default=["small", "mid"], choices=list(MODELS),
                        help="model sizes (default small mid; 1b: Llama-3.2-1B's shape, about 5 GB in float32, for GPUs)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[256, 2048],
                        help="generated tokens, one run each (default 256 2048)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="greedy batch sizes (default 1 8)")
    parser.add_argument("--beam-width", type=int, default=4, help="beam search width, 0 to skip (default 4)")
    parser.add_argument("--beam-new-tokens", type=int, default=64, help="beam search tokens (default 64)")
    parser.add_argument("--static-len", type=int, default=None,
                        help="StaticCache max_cache_len (default: prompt + new tokens, what the run needs)")
    parser.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES), choices=list(CACHES),
                        help=f"caches to compare (default {' '.join(DEFAULT_CACHES)})")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, every cache once per round (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on shared CPUs)")
    parser.add_argument("--clock", default="auto", choices=["auto", *common.CLOCKS],
                        help="auto: the thread's CPU time on CPU with one thread, else wall time")
    parser.add_argument("--long-point", action="store_true",
                        help=f"also run the long point: {LONG_POINT[0]}-token prompts + {LONG_POINT[1]} new tokens, "
                             f"B={LONG_POINT[2]}, greedy (target >= {TARGETS['long']}x DynamicCache)")
    parser.add_argument("--profile", action="store_true",
                        help="one cProfile'd run per cache and point: seconds in SDPA, torch.cat, linear, cache updates")
    windows.add_arguments(parser)


def _smoke(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{
        **vars(args), "models": ["small"], "prompt_len": 16, "new_tokens": [4], "batch_sizes": [2],
        "beam_new_tokens": 4, "repeats": 1, "window_point": [160, 4], "window_max_len": 512,
    })


def _bound_cache(num_layers: int, capacity: int) -> Any:
    """The ``bound`` reference (docs/hf.md): a transformers ``Cache`` whose layers preallocate
    ``capacity`` positions and return views of the stored length."""
    from transformers import Cache
    from transformers.cache_utils import DynamicLayer

    class BoundLayer(DynamicLayer):
        """DynamicLayer's contract (``keys``/``values`` hold every stored token) over preallocated
        storage: ``update`` copies the new states in place instead of concatenating."""

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            batch, heads, _, dim = key_states.shape  # key_states: [B, H, S, D]
            self.dtype, self.device = key_states.dtype, key_states.device
            self._k = key_states.new_zeros(batch, heads, capacity, dim)
            self._v = value_states.new_zeros(batch, heads, capacity, value_states.shape[-1])
            self.keys, self.values = self._k.narrow(2, 0, 0), self._v.narrow(2, 0, 0)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, new = self.keys.shape[2], key_states.shape[2]
            self._k.narrow(2, start, new).copy_(key_states)
            self._v.narrow(2, start, new).copy_(value_states)
            self.keys, self.values = self._k.narrow(2, 0, start + new), self._v.narrow(2, 0, start + new)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.keys.shape[2] if self.is_initialized else 0

        def _refuse(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError("the bound reference runs greedy points only (its rows never move)")

        reorder_cache = batch_repeat_interleave = batch_select_indices = crop = _refuse

    return Cache(layers=[BoundLayer() for _ in range(num_layers)])


def _make_cache(name: str, model: torch.nn.Module, args: argparse.Namespace, max_batch: int, total: int) -> Any:
    from transformers import DynamicCache, StaticCache

    import vmkv.hf

    if name == "dynamic":
        return DynamicCache()
    if name == "bound":
        return _bound_cache(model.config.num_hidden_layers, total)
    if name in ("static", "static+compile"):
        return StaticCache(config=model.config, max_cache_len=args.static_len or total)
    if name in COMPILE_TARGETS:
        return vmkv.hf.VirtualCache(name.split("+")[0], config=model.config, compile=True, max_batch_size=max_batch,
                                    max_seq_len=args.static_len or total)
    return vmkv.hf.VirtualCache(name.split("+")[0], max_batch_size=max_batch, max_seq_len=total + 1)


def _kv_bytes(cache: Any) -> tuple[int, int, int]:
    """(peak bytes held, bytes the stored tokens need, page bytes) of a finished cache."""
    from vmkv.hf import VirtualCache

    if isinstance(cache, VirtualCache):
        stats = cache.stats()
        return cache.peak_bytes, stats["token_bytes"], stats["page_bytes"]
    held = sum(getattr(layer, "_k", layer.keys).nbytes + getattr(layer, "_v", layer.values).nbytes
               for layer in cache.layers)  # the bound reference holds its preallocated storage
    first = cache.layers[0].keys  # [B, H, S, D]
    need = first.shape[0] * int(cache.get_seq_length()) * first[0, :, 0].nbytes * 2 * len(cache.layers)
    return held, need, 0


@dataclass(frozen=True)
class Point:
    """One workload: ``batch`` prompts of ``prompt_len`` tokens, ``new_tokens`` generated with ``beams`` beams."""

    prompt_len: int
    batch: int
    beams: int
    new_tokens: int
    kind: str = "main"  # "main" (the option grid) or "long" (--long-point)


def _run_once(model: torch.nn.Module, args: argparse.Namespace, point: Point, name: str,
              cache: Any = None) -> tuple[Any, torch.Tensor]:
    """One generate() of ``point`` with cache ``name`` (or ``cache``, made as ``name``'s): ``(cache, output ids)``."""
    from transformers import CompileConfig

    import vmkv.hf

    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 256, (point.batch, point.prompt_len), generator=gen).to(args.device)
    model.set_attn_implementation("vmkv" if "vmkv" in name else "sdpa")
    if cache is None:
        cache = _make_cache(name, model, args, point.batch * point.beams, point.prompt_len + point.new_tokens)
    kwargs = {vmkv.hf.cache_argument(): cache}
    if "+compile" in name:
        kwargs["compile_config"] = CompileConfig()
        kwargs["compile_config"]._compile_all_devices = True  # transformers compiles by itself only on GPUs
    return cache, model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=point.new_tokens,
                                 min_new_tokens=point.new_tokens, do_sample=False, num_beams=point.beams,
                                 pad_token_id=model.config.pad_token_id, **kwargs)


def _workload(
    model: torch.nn.Module, args: argparse.Namespace, point: Point, clock: str,
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Time every cache on one point, the caches taking turns; rows and per-round seconds."""
    caches = [name for name in args.caches if name != "bound" or point.beams == 1]  # the bound's rows never move: greedy only
    for name in [name for name in caches if "+compile" in name and name not in args.failed]:
        try:  # an untimed run compiles (dynamo, inductor) before the rounds
            warm, _ = _run_once(model, args, point, name)
            if hasattr(warm, "close"):
                warm.close()
        except Exception as exc:  # noqa: BLE001 - reported, the others go on
            args.failed[name] = f"{type(exc).__name__}: {exc}"

    def row(name: str, cache: Any, seconds: common.Spread) -> dict[str, Any]:
        peak, need, page = _kv_bytes(cache)
        return {
            "model": args.model, "workload": "greedy" if point.beams == 1 else f"beam{point.beams}", "batch": point.batch,
            "cache": name, "kernel": cache.core.kernel if "vmkv" in name else "sdpa (transformers)",
            "prompt_len": point.prompt_len, "point": point.kind, "new_tokens": point.new_tokens, "seconds": seconds.value,
            "seconds_low": seconds.low, "seconds_high": seconds.high,
            "tokens_per_s": point.batch * point.new_tokens / seconds.value, "kv_peak_bytes": peak, "kv_need_bytes": need,
            "page_bytes": page,
        }

    return common.generate_rounds(caches, args.repeats, args.device, clock, lambda name: _run_once(model, args, point, name),
                                  args.failed, str, "", row)


UPDATE_ROUNDS = 3  # untimed runs update_share measures (at most --repeats)


def update_share(model: torch.nn.Module, args: argparse.Namespace, point: Point) -> dict[str, float]:
    """``update()``'s share of a ``vmm`` decode step at ``point``: the median of a few untimed runs, with their range."""
    runs = [_update_share_once(model, args, point) for _ in range(max(1, min(UPDATE_ROUNDS, args.repeats)))]
    spread = common.Spread.of([run["share"] for run in runs])
    middle = sorted(runs, key=lambda run: run["share"])[len(runs) // 2]
    return {**middle, "share_low": spread.low, "share_high": spread.high, "runs": len(runs)}


def _update_share_once(model: torch.nn.Module, args: argparse.Namespace, point: Point) -> dict[str, float]:
    """One untimed run of ``vmm``, timed from outside the library: the cache passed to generate() times its
    ``update``, forward hooks the step, ``stats()["map_step_ns"]`` the page mapping (first two steps left out)."""
    from vmkv.hf import VirtualCache

    now = common.CLOCKS["cpu" if args.device == "cpu" else "wall"]  # no other thread: map_ahead is off
    spent = {"update": 0.0, "mapping_ns": 0, "steps": 0.0, "count": 0}
    step = {"forwards": 0, "decode": False, "began": 0.0, "mapped": 0}

    class TimedCache(VirtualCache):
        def update(self, *a: Any, **kw: Any) -> Any:
            start = now()
            try:
                return super().update(*a, **kw)
            finally:
                if step["decode"]:
                    spent["update"] += now() - start

    cache = TimedCache("vmm", max_batch_size=point.batch, max_seq_len=point.prompt_len + point.new_tokens + 1)

    def before(module: torch.nn.Module, a: tuple, kw: dict) -> None:
        ids = kw.get("input_ids", a[0] if a else None)
        step["forwards"] += 1
        step["decode"] = step["forwards"] > 2 and ids is not None and ids.shape[1] == 1
        if step["decode"]:
            step["mapped"], step["began"] = cache.core.stats()["map_step_ns"], now()

    def after(module: torch.nn.Module, a: tuple, kw: dict, out: Any) -> None:
        if step["decode"]:
            spent["steps"] += now() - step["began"]
            spent["count"] += 1
            spent["mapping_ns"] += cache.core.stats()["map_step_ns"] - step["mapped"]

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True), model.register_forward_hook(after, with_kwargs=True)]
    try:
        _run_once(model, args, point, "vmm", cache)
        cache.close()
    finally:
        for hook in hooks:
            hook.remove()
    steps = max(1, spent["count"])
    return {"update_ms_per_step": 1e3 * spent["update"] / steps, "mapping_ms_per_step": spent["mapping_ns"] / 1e6 / steps,
            "step_ms": 1e3 * spent["steps"] / steps,
            "share": spent["update"] / spent["steps"] if spent["steps"] else 0.0, "decode_steps": spent["count"]}


PROFILED = {"scaled_dot_product_attention": "sdpa_s", "cat": "cat_s", "linear": "linear_s"}  # torch built-in -> key


def profile_point(model: torch.nn.Module, args: argparse.Namespace, point: Point) -> dict[str, dict[str, float]]:
    """One cProfile'd generate() per cache at ``point`` (thread CPU time): seconds in SDPA,
    ``torch.cat``, the linear layers, the cache's ``update`` (cumulative) and in all."""
    import cProfile
    import pstats

    out: dict[str, dict[str, float]] = {}
    for name in [name for name in args.caches if name not in args.failed]:
        profiler = cProfile.Profile(common.CLOCKS["cpu" if args.device == "cpu" else "wall"])
        profiler.enable()
        cache, _ = _run_once(model, args, point, name)
        profiler.disable()
        if hasattr(cache, "close"):
            cache.close()
        stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, calls, tottime, cumtime, callers)
        found = {"sdpa_s": 0.0, "cat_s": 0.0, "linear_s": 0.0, "cache_update_s": 0.0,
                 "total_s": sum(entry[2] for entry in stats.values())}
        for (filename, _, function), (_, _, tottime, cumtime, _) in stats.items():
            builtin = function.removeprefix("<built-in method ").removesuffix(">").rsplit(".", 1)[-1]
            if function.startswith("<built-in method") and builtin in PROFILED:  # e.g. torch._C._nn.linear
                found[PROFILED[builtin]] += tottime
            elif function == "update" and ("cache_utils" in filename or "vmkv/hf" in filename):
                found["cache_update_s"] = max(found["cache_update_s"], cumtime)  # Cache.update, not its layers'
        out[name] = {k: round(v, 3) for k, v in found.items()}
    return out


def _case_key(row: dict[str, Any]) -> str:
    key = f"{row['model']}/{row['workload']}/b{row['batch']}/{row['new_tokens']}"
    return f"{key}/prompt{row['prompt_len']}" if row.get("point") == "long" else key


def _points(args: argparse.Namespace) -> list[Point]:
    work = [Point(args.prompt_len, b, 1, n) for n in args.new_tokens for b in args.batch_sizes]
    if args.beam_width > 1:
        work.append(Point(args.prompt_len, 1, args.beam_width, args.beam_new_tokens))
    if args.long_point:
        prompt, new, batch = (16, 8, 2) if args.smoke else LONG_POINT
        work.append(Point(prompt, batch, 1, new, "long"))
    return work


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vmkv.models import default_hf_model

    common.check_device(args.device)
    args = argparse.Namespace(**{**vars(_smoke(args) if args.smoke else args), "failed": {}})
    warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
    rows: list[dict[str, Any]] = []
    samples: dict[str, dict[str, list[float]]] = {}
    overhead: dict[str, dict[str, float]] = {}
    profiles: dict[str, dict[str, dict[str, float]]] = {}
    with common.torch_threads(args.threads if args.device == "cpu" else None):
        clock = common.pick_clock(args.clock, args.device, torch.get_num_threads())
        for model_name in args.models:
            model = default_hf_model(device=args.device, **MODELS[model_name])
            margs = argparse.Namespace(**{**vars(args), "model": model_name})
            for point in common.progress(_points(args), f"generate {model_name}", enabled=getattr(args, "progress", False)):
                found, times = _workload(model, margs, point, clock)
                rows += found
                key = _case_key(found[0])
                samples[key] = times
                if point.beams == 1 and "vmm" in times:
                    overhead[key] = update_share(model, margs, point)
                if args.profile:
                    profiles[key] = profile_point(model, margs, point)
            del model
        window_part = windows.run_part(args, clock)
    config = {**{k: v for k, v in vars(args).items() if k not in ("out", "progress", "failed")}, "clock": clock}
    summary = {**_summary(rows, samples), "failed": args.failed}
    return common.make_result(NAME, SCHEMA, rows, summary, config=config, samples=samples, update_overhead=overhead,
                              profiles=profiles, windows=window_part)


def _summary(rows: list[dict[str, Any]], samples: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"all_same_tokens_as_dynamic": all(r["same_tokens_as_dynamic"] for r in rows)}
    for key, times in samples.items():
        if "dynamic" in times:
            timings = common.Timings(times)
            summary[f"{key} speed vs dynamic"] = {name: round(timings.ratio("dynamic", name).value, 3)
                                                  for name in times if name != "dynamic"}
    return summary


def _best_vmm(timings: common.Timings, base: str) -> str | None:
    names = [name for name in ("vmm", "vmm+vmkv") if name in timings.samples and base in timings.samples]
    return max(names, key=lambda name: timings.ratio(base, name).value, default=None)


def _wrong(case: list[dict[str, Any]], names: list[str], failed: dict[str, str]) -> str:
    rows = {r["cache"]: r for r in case}
    why = [f"{name} failed: {failed[name]}" for name in names if name in failed]
    why += [f"{name} generated other tokens than DynamicCache" for name in names
            if name in rows and not rows[name]["same_tokens_as_dynamic"]]
    return "; ".join(why)


def _target_note(ratio: common.Spread, target: float, profile: dict[str, dict[str, float]] | None = None,
                 bound: common.Spread | None = None) -> str:
    """Whether ``ratio`` meets ``target`` (as ``agrees`` shows it), and if not by how much, what the bound
    reached and where the profile says the time went."""
    status = common.target_status(ratio, target)
    if ratio.value >= target:
        return f"target >= {target}x {status}"
    short = f"by {target - ratio.value:.2f}x (needs {100 * (target / ratio.value - 1):.0f} % more speed)"
    note = f"target >= {target}x missed {short}" if status == "missed" else f"target >= {target}x {status}; short {short}"
    if bound is not None:
        note += f"; the bound: {common.number_text(bound.value)}"
    if profile:
        parts = [f"{name} " + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in found.items() if v >= 0.005)
                 for name, found in profile.items()]
        note += "; profile (s): " + "; ".join(parts)
    return note


def _point_verdicts(result: dict[str, Any], model: str, case: list[dict[str, Any]], label: str,
                    ours: list[str]) -> list[common.Verdict]:
    """VirtualCache (the faster of vmm, vmm+vmkv) vs DynamicCache and vs StaticCache on ``case`` (the rows of
    one point), each against its target, then the bound's and the compiled caches'; ``label`` prefixes the keys."""
    failed = result["summary"].get("failed", {})
    caches = result.get("config", {}).get("caches", CACHES)
    top = case[0]
    timings = common.Timings(result["samples"][_case_key(top)])
    profiled = result.get("profiles", {}).get(_case_key(top), {})
    key = f"generate.{model}.{label}"
    asked = f"generate() tokens/s, {model} model, B={top['batch']}, {top.get('prompt_len', '?')}+{top['new_tokens']} tokens: "
    out = []
    for base, name in (("dynamic", "DynamicCache"), ("static", "StaticCache")):
        target = TARGETS["static"] if base == "static" else TARGETS["long" if label else "main"]
        vmm = _best_vmm(timings, base)
        ratio, note = (timings.ratio(base, vmm) if vmm else None), ""
        if ratio:
            bound = timings.ratio(base, "bound") if "bound" in timings.samples else None
            profile = {n: profiled[n] for n in (vmm, base) if n in profiled}
            note = f"fastest VirtualCache: {vmm}; " + _target_note(ratio, target, profile, bound)
        out += common.judged(f"{key}vs_{base}", f"{asked}VirtualCache vs {name}",
                             _wrong(case, [*ours, base], failed) if base in caches and ours else "",
                             ratio, "VirtualCache", name, target=target, note=note)
    return out + _bound_verdicts(timings, case, failed, key, asked, ours) + _compile_verdicts(timings, case, failed, key, asked)


def _compile_verdicts(timings: common.Timings, case: list[dict[str, Any]], failed: dict[str, str], key: str,
                      asked: str) -> list[common.Verdict]:
    """Each compiled VirtualCache against the eager cache of its attention and against ``static+compile``,
    each against its target (:data:`COMPILE_TARGETS`)."""
    out = []
    for ours, targets in COMPILE_TARGETS.items():
        eager = ours.replace("+compile", "")  # "vmm", "vmm+vmkv" or "paged+vmkv": the mode, then the attention if "vmkv"
        mode, *rest = eager.split("+")
        which = "" if ours == "vmm+compile" else "_" + eager.replace("+", "_")
        for base, target in targets.items():
            if ours not in timings.samples or base not in timings.samples:
                continue
            question = f"{asked}VirtualCache({mode!r}, compile=True){' with the vmkv attention' if rest else ''} vs {base}"
            ratio = timings.ratio(base, ours)
            why = _wrong(case, [ours, base], failed)
            out += common.judged(f"{key}compiled{which}_vs_{base.replace('+', '_')}", question, why, ratio, ours, base,
                                 target=target, note=_target_note(ratio, target))
    return out


def _bound_verdicts(timings: common.Timings, case: list[dict[str, Any]], failed: dict[str, str], key: str, asked: str,
                    ours: list[str]) -> list[common.Verdict]:
    """VirtualCache vs the bound (what vmkv's bookkeeping costs) and the bound vs DynamicCache (the most
    any cache that never copies K/V gains here)."""
    if "bound" not in timings.samples:
        return []
    vmm = _best_vmm(timings, "bound")
    out = common.judged(f"{key}vs_bound", f"{asked}VirtualCache vs the bound", _wrong(case, [*ours, "bound"], failed),
                        timings.ratio("bound", vmm) if vmm else None, "VirtualCache", "bound",
                        note=f"{vmm}: what vmkv's pages, plans and checks cost")
    if "dynamic" in timings.samples:
        out += common.judged(f"{key}bound_vs_dynamic", f"{asked}the bound vs DynamicCache", _wrong(case, ["bound"], failed),
                             timings.ratio("dynamic", "bound"), "bound", "DynamicCache",
                             note="the most a cache that never copies K/V gains here")
    return out


def _overhead_verdict(result: dict[str, Any], model: str) -> list[common.Verdict]:
    """``update()``'s share of a decode step at the model's largest measured greedy point."""
    measured = {key: found for key, found in result.get("update_overhead", {}).items() if key.startswith(f"{model}/")}
    if not measured:
        return []
    key_case, found = max(measured.items(), key=lambda item: item[1]["step_ms"])
    share, runs = found["share"], found.get("runs", 1)
    low, high = found.get("share_low", share), found.get("share_high", share)
    over = "one run" if runs == 1 else f"{common.number_text(low, '%')}-{common.number_text(high, '%')} over {runs} runs"
    met = share < UPDATE_SHARE_TARGET
    return [common.Verdict(
        key=f"generate.{model}.update_share", question=f"VirtualCache.update() CPU time per decode step, {key_case} (vmm)",
        result=common.number_text(share, "%"), spread=f"{found['update_ms_per_step']:.2f} of {found['step_ms']:.2f} ms a step "
        f"(median run), {found['decode_steps']} steps; {over}", winner="below target" if met else "above target",
        side="", reference=f"target < {common.number_text(UPDATE_SHARE_TARGET, '%')}", agrees=met, value=share, low=low,
        high=high, note="plan, page mapping, writes and views: all of the cache's per-step work"
        + (f"; of it page mapping {found['mapping_ms_per_step']:.2f} ms a step" if "mapping_ms_per_step" in found else "")
        + ("" if met else f"; missed by {100 * (share - UPDATE_SHARE_TARGET):.1f} points"),
    )]


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """Per model, at its largest greedy point (and the long one): VirtualCache vs DynamicCache and
    StaticCache, ``update()``'s share, beam search's KV; a cache that failed makes its line unreliable."""
    out = []
    rows = result["rows"]
    failed = result["summary"].get("failed", {})
    caches = result.get("config", {}).get("caches", CACHES)
    ours = [name for name in ("vmm", "vmm+vmkv") if name in caches]
    for model in dict.fromkeys(r["model"] for r in rows):
        for label, kind in (("", "main"), ("long_", "long")):
            greedy = [r for r in rows if r["model"] == model and r["workload"] == "greedy" and r.get("point", "main") == kind]
            if greedy:
                top = max(greedy, key=lambda r: (r["batch"] * r["new_tokens"], r["new_tokens"]))
                case = [r for r in greedy if _case_key(r) == _case_key(top)]
                out += _point_verdicts(result, model, case, label, ours)
        out += _overhead_verdict(result, model)
        beam = {r["cache"]: r for r in rows if r["model"] == model and r["workload"].startswith("beam")}
        vmm_beam = [beam[name] for name in ("vmm", "vmm+vmkv") if name in beam]
        why = _wrong(list(beam.values()), [*ours, "dynamic"], failed) if beam and ours and "dynamic" in caches else ""
        if why:
            out.append(common.unreliable(f"generate.{model}.beam_kv", f"beam search peak KV bytes, {model} model: "
                                         "VirtualCache vs DynamicCache", why))
        elif vmm_beam and "dynamic" in beam:
            least = min(vmm_beam, key=lambda r: r["kv_peak_bytes"])
            ratio = common.Spread.exact(beam["dynamic"]["kv_peak_bytes"] / least["kv_peak_bytes"])
            out.append(common.ratio_verdict(
                f"generate.{model}.beam_kv", f"beam search (width {least['workload'][4:]}) peak KV bytes, {model} model: "
                "VirtualCache vs DynamicCache", ratio, "VirtualCache (less memory)", "DynamicCache (less memory)",
                note="copy-on-write shares the beams' common pages"))
    return out + windows.verdicts(result.get("windows", {"samples": {}}), failed)


def table(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The main grid's tokens/s per case and cache; the sliding-window part's, if it ran."""
    grid = []
    for key in result["samples"]:
        mine = [r for r in result["rows"] if _case_key(r) == key]
        grid.append({**{field: mine[0][field] for field in ("model", "workload", "batch", "prompt_len", "new_tokens")},
                     **{f"{r['cache']} tok/s": round(r["tokens_per_s"], 1) for r in mine},
                     "same tokens": all(r["same_tokens_as_dynamic"] for r in mine)})
    tables = {"": grid}
    if result.get("windows", {}).get("rows"):
        tables["sliding windows (K/V held after generate(), its peak)"] = windows.table(result["windows"])
    return tables


def _speed_range(row: dict[str, Any] | None) -> tuple[float, float]:
    """How far below and above a row's tokens/s its slowest and its fastest round reach (a plot's error bar)."""
    if row is None:
        return 0, 0
    tokens = row["batch"] * row["new_tokens"]
    return row["tokens_per_s"] - tokens / row["seconds_high"], tokens / row["seconds_low"] - row["tokens_per_s"]


def plot(result: dict[str, Any], out_dir: Path) -> list[str]:
    """``generate_throughput.png`` (tokens/s per case and cache, min-max bars) and
    ``generate_kv_bytes.png`` (peak KV bytes, log axis). Returns the PNG paths."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    plt = common.pyplot()
    rows = result["rows"]
    cells = {(_case_key(r), r["cache"]): r for r in rows}
    cases = list(result["samples"])
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    case_rows = {_case_key(r): r for r in rows}
    labels = [f"{r['model']}\n{r['workload']} B={r['batch']}\n{r['prompt_len']}+{r['new_tokens']}"
              for r in map(case_rows.get, cases)]
    clock = result["config"].get("clock", "wall")
    paths = []
    width = 0.8 / len(caches)
    for field, ylabel, fname, title in [
        ("tokens_per_s", "tokens / s (median; bars: min-max)", "generate_throughput.png",
         f"generate() throughput per cache (prompt + new tokens), {clock} clock"),
        ("kv_peak_bytes", "peak KV bytes (MiB, log scale)", "generate_kv_bytes.png",
         "generate() peak KV memory per cache (prompt + new tokens)"),
    ]:
        fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(cases) + 3), 4.4))
        kv = field == "kv_peak_bytes"
        for i, name in enumerate(caches):
            found = [cells.get((key, name)) for key in cases]
            values = [(r[field] / 2**20 if kv else r[field]) if r else 0 for r in found]
            errors = None if kv else list(zip(*map(_speed_range, found)))  # [below per case], [above per case]
            bars = ax.bar([c + i * width for c in range(len(cases))], values, width, yerr=errors, capsize=2, label=name)
            if kv:
                ax.bar_label(bars, labels=[f"{v:.3g}" if v else "" for v in values], fontsize=7, padding=1)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], labels, fontsize=8)
        ax.set(ylabel=ylabel, title=title)
        if kv:
            positive = [r[field] / 2**20 for r in rows if r[field]]
            ax.set(yscale="log", ylim=(min(positive) / 2, max(positive) * 2))
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        paths.append(common.save_figure(fig, out_dir, fname))
    return paths
