"""Decode attention (``vmkv bench decode``): VMM in every kernel and layout vs paged vs dense tensors,
against the read bandwidth; and :class:`DecodeStep`, the one decode-step harness the GPU check uses too."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

import vmkv
import vmkv.config
from vmkv.kernels import registry
from vmkv.kernels.base import MODE_ADDRESSING
from vmkv.vmm.views import unguarded

from . import common

NAME = "decode"
DESCRIPTION = "decode-step attention: VMM (each kernel and layout) vs paged kernels vs dense tensors, bytes/s vs read bandwidth"

SCHEMA = {
    "batch": "sequences in the decode step",
    "context": "tokens cached per sequence before the step",
    "candidate": "vmm:LAYOUT:KERNEL, dense:KERNEL or paged:KERNEL (docs/benchmarks.md)",
    "selected": "the kernel the cache itself runs for this layout / the paged kernel paged mode picks",
    "ms": "median ms per decode step (one layer)",
    "ms_low": "fastest round, ms (from 5 rounds on, the single fastest and slowest rounds are left out)",
    "ms_high": "slowest round, ms (same rule)",
    "gbps": "K/V bytes the step reads / median time, GB/s",
    "bw_fraction": "gbps / read bandwidth measured in the same rounds (median of per-round ratios)",
    "max_abs_diff": "largest |output - reference| (SDPA on each sequence's source K/V)",
}
READ_PROBE_BYTES = 256 * 2**20


# ---- the harness -------------------------------------------------------------------------------
class DecodeStep:
    """``batch`` sequences of ``context`` cached tokens plus the step's own, the same K/V in layer 0 of every
    cache of ``configs`` (label -> (mode, config)), one query each, and the fp32 reference."""

    def __init__(self, configs: dict[str, tuple[str, vmkv.KVCacheConfig]], batch: int, context: int, q_heads: int,
                 seed: int = 0, optional: typing.Collection[str] = ()) -> None:
        config = next(iter(configs.values()))[1]
        heads, dim = config.num_kv_heads, config.head_dim
        gen = torch.Generator().manual_seed(seed)

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen).to(dtype=config.dtype, device=config.device)

        k, v = randn(batch, context + 1, heads, dim), randn(batch, context + 1, heads, dim)  # [B, C + 1, Hkv, D]
        self.q = randn(batch, q_heads, dim)  # [B, Hq, D]: one new token each
        self.batch, self.context, self.scale = batch, context, dim**-0.5
        self.kv_bytes = batch * (context + 1) * config.layer_token_bytes * 2  # what one layer's step reads
        self.caches: dict[str, vmkv.KVCacheBase] = {}
        self.plans: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}
        for label, (mode, cfg) in configs.items():
            try:
                self._fill(label, vmkv.open_cache(cfg, mode), k, v)
            except vmkv.VMKVError as exc:  # e.g. a page size this layout cannot use
                if label not in optional:
                    self.close()
                    raise
                self.skipped[label] = f"{type(exc).__name__}: {exc}"
        q = self.q.float().reshape(batch, heads, q_heads // heads, dim)  # [B, Hkv, group, D]
        self.reference = F.scaled_dot_product_attention(q, k.float().transpose(1, 2), v.float().transpose(1, 2),
                                                        scale=self.scale).reshape(batch, q_heads, dim)

    def _fill(self, label: str, cache: vmkv.KVCacheBase, k: torch.Tensor, v: torch.Tensor) -> None:
        self.caches[label] = cache
        batch, heads, dim = k.shape[0], k.shape[2], k.shape[3]
        for seq in range(batch):
            cache.add(seq)
        plan = cache.begin_step({seq: self.context for seq in range(batch)})
        cache.write(0, k[:, :-1].reshape(-1, heads, dim), v[:, :-1].reshape(-1, heads, dim), plan)
        self.plans[label] = plan = cache.begin_step({seq: 1 for seq in range(batch)})
        cache.write(0, k[:, -1], v[:, -1], plan)

    def storage(self, label: str) -> tuple[torch.Tensor, torch.Tensor]:
        """What a kernel reads from cache ``label``: its slot views (plain tensors) or block pools."""
        cache = self.caches[label]
        return tuple(map(unguarded, cache.kv_cache(0))) if cache.mode == "vmm" else cache.block_pool(0)

    def call(self, label: str, name: str,
             kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> Callable[[], torch.Tensor] | str:
        """Kernel ``name`` over cache ``label``'s storage (or ``kv``) with its plan, or why it cannot run here."""
        mode, cfg = self.caches[label].mode, self.caches[label].config
        spec = registry.KernelSpec(MODE_ADDRESSING[mode], cfg.device, cfg.dtype, cfg.num_kv_heads, cfg.head_dim,
                                   block_size=cfg.block_size if mode == "paged" else None)
        why = registry.unavailable(name, spec)
        if why is not None:
            return f"kernel {name} cannot run here: {why}"
        kernel, (k, v) = registry.build(name, spec), kv or self.storage(label)
        q, plan, scale = self.q, self.plans[label], self.scale
        return lambda: kernel(q, k, v, plan, scale)

    def error(self, out: torch.Tensor) -> float:
        """Largest |out - reference|."""
        return (out.float().reshape(self.reference.shape) - self.reference).abs().max().item()

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()


def dense_copy(view: torch.Tensor) -> torch.Tensor:
    """An ordinary copy of ``view`` in fresh memory (``contiguous()`` may return the view itself)."""
    return torch.empty(view.shape, dtype=view.dtype, device=view.device).copy_(view)


@dataclass(frozen=True)
class Shape:
    """The GPU check's decode workload: ``batch`` sequences of ``seq_len`` tokens (the last decoded now)."""

    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    iters: int  # kernel calls per timed sample
    repeats: int  # timed samples per variant (the median is reported)
    map_pages: int  # pages in the map/unmap measurement
    paged_block: int  # block_size of the paged caches


FULL = Shape(32, 2048, 32, 8, 128, "float16", iters=50, repeats=7, map_pages=256, paged_block=256)
SMOKE = Shape(4, 64, 4, 2, 16, "float32", iters=2, repeats=2, map_pages=16, paged_block=16)

# The largest |output - fp32 reference| a correct kernel shows on random K/V is a few eps of its
# dtype times |o|; these leave about 5 eps. A dropped, repeated or foreign token errs by 1e-2 or more.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}


def decode_config(device: torch.device, shape: Shape, **fields: Any) -> vmkv.KVCacheConfig:
    """One layer sized to hold ``shape``'s sequences twice over, in pages of the backend's granularity."""
    from vmkv.vm import granularity

    token_bytes = shape.kv_heads * shape.head_dim * torch.empty((), dtype=getattr(torch, shape.dtype)).element_size()
    page = math.lcm(granularity(device) if device.type == "cuda" else 4096, token_bytes)
    values = dict(num_layers=1, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.dtype, device=device,
                  max_batch_size=shape.batch, max_seq_len=shape.seq_len, page_size=page, prefix_caching=False,
                  memory_budget=2 * shape.batch * -(-shape.seq_len // (page // token_bytes)) * page)
    return vmkv.KVCacheConfig(**{**values, **fields})


def compare_ms(fns: dict[str, Callable[[], Any]], device: torch.device, shape: Shape) -> dict[str, float]:
    """Median ms per call of each variant: interleaved rounds, each sample ``shape.iters`` calls."""
    batches = {name: (lambda fn=fn: [fn() for _ in range(shape.iters)]) for name, fn in fns.items()}
    timings = common.time_interleaved(batches, device.type, repeat=shape.repeats, warmup=2)
    return {name: timings.median(name) * 1e3 / shape.iters for name in fns}


# ---- the benchmark -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: stable on a shared CPU; 0 keeps torch's default)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8 32; smoke 1 2)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="context lengths (default 512 2048 8192; smoke 64 128)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default float32 on CPU, float16 on CUDA")
    parser.add_argument("--page-size", default="2MiB", help="VMM page size")
    parser.add_argument("--layouts", nargs="+", default=None,
                        help="VMM layouts (default: every layout vmkv.KVCacheConfig accepts)")
    parser.add_argument("--kernels", nargs="+", default=None,
                        help="contiguous (slots) kernels (default: every one vmkv.kernels.registry has that can run here)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="paged block size (default 16 on CPU, 256 on CUDA: "
                             "FlashAttention's paged kernels need multiples of 256)")
    parser.add_argument("--paged-kernels", nargs="+", default=None,
                        help="paged kernels to time; 'selected' is the one paged mode picks here "
                             "(default: selected gather_sdpa)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds, every candidate once per round (default 7; smoke 2)")
    parser.add_argument("--clock", default="auto", choices=["auto", *common.CLOCKS],
                        help="auto: the thread's CPU time on CPU with one thread (a shared machine cannot inflate it), "
                             "else wall time")


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options whose defaults depend on ``--smoke`` and ``--device``."""
    smoke, cuda = args.smoke, args.device == "cuda"
    return argparse.Namespace(**{
        **vars(args),
        "batches": args.batches or ([1, 2] if smoke else [1, 8, 32]),
        "contexts": args.contexts or ([64, 128] if smoke else [512, 2048, 8192]),
        "dtype": args.dtype or ("float16" if cuda else "float32"),
        "block_size": args.block_size or (256 if cuda else 16),
        "repeat": args.repeat or (2 if smoke else 7),
        "layouts": args.layouts or list(typing.get_args(vmkv.config.Layout)),
        "kernels": args.kernels or registry.names("slots"),
    })


def _runnable_kernels(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    unknown = sorted(set(args.kernels) - set(registry.names("slots")))
    if unknown:
        raise vmkv.InvalidConfig(f"unknown kernels {unknown}; known: {registry.names('slots')}")
    dtype = common.cache_config({"num_layers": 1, "num_kv_heads": 1, "head_dim": args.head_dim, "dtype": args.dtype},
                                args.device).dtype
    spec = registry.KernelSpec("slots", torch.device(args.device), dtype, args.kv_heads, args.head_dim)
    why = {name: registry.unavailable(name, spec) for name in args.kernels}
    return [name for name in args.kernels if why[name] is None], {name: w for name, w in why.items() if w is not None}


@dataclass
class _Candidate:
    name: str
    fn: Callable[[], torch.Tensor]
    selected: bool


def _case(args: argparse.Namespace, batch: int, context: int) -> DecodeStep:
    """A VMM cache of two layers per layout (layer 0 timed: interleaved layers show their real strides), and the paged one."""
    configs = {label: (mode, _config(args, batch, context, mode, fields)) for label, mode, fields in _caches(args)}
    return DecodeStep(configs, batch, context, args.q_heads, seed=args.seed,
                      optional=[label for label, (mode, _) in configs.items() if mode == "vmm"])


def _candidates(case: DecodeStep, kernels: list[str], paged_kernels: list[str], layout: str) -> list[_Candidate]:
    """Each kernel on each VMM layout and on dense copies, each paged kernel; why others cannot run: ``case.skipped``."""
    out, dense = [], {}

    def add(name: str, call: Callable[[], torch.Tensor] | str, selected: bool) -> None:
        if isinstance(call, str):
            case.skipped[name] = call
        else:
            out.append(_Candidate(name, call, selected))

    for label, cache in case.caches.items():
        if cache.mode == "vmm":
            k, v = case.storage(label)
            dense.setdefault(tuple(k.shape), (dense_copy(k), dense_copy(v), label))
            for name in kernels:
                add(f"{label}:{name}", case.call(label, name), name == cache.kernel)
    for shape, (k, v, label) in dense.items():
        prefix = "dense" if len(dense) == 1 else f"dense{list(shape)}"
        for name in kernels:
            add(f"{prefix}:{name}", case.call(label, name, (k, v)),
                any(c.selected and c.name == f"vmm:{layout}:{name}" for c in out))
    for name in paged_kernels:
        add(f"paged:{name}", case.call("paged", name), name == case.caches["paged"].kernel)
    return out


def _caches(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    vmm = [(f"vmm:{layout}", "vmm", {"layout": layout, "page_size": args.page_size, "num_layers": 2}) for layout in args.layouts]
    return [*vmm, ("paged", "paged", {"block_size": args.block_size})]


def _config(args: argparse.Namespace, batch: int, context: int, mode: str, fields: dict[str, Any]) -> vmkv.KVCacheConfig:
    """A ``mode`` cache holding ``batch`` sequences of ``context`` tokens and the step's: their pages, one spare each."""
    fields = dict(fields)
    shape = {"num_layers": fields.pop("num_layers", 1), "num_kv_heads": args.kv_heads, "head_dim": args.head_dim,
             "dtype": args.dtype}
    probe = common.cache_config(shape, args.device, **fields)
    # a pool page is tokens_per_page tokens of every piece, whatever the layout
    tokens_per_page = (fields["block_size"] if mode == "paged"
                       else vmkv.parse_size(fields["page_size"]) // probe.tensor_token_bytes(fields["layout"]))
    pages = batch * (-(-(context + 1) // max(1, tokens_per_page)) + 1)
    budget = pages * max(1, tokens_per_page) * probe.bytes_per_token
    return common.cache_config(shape, args.device, max_batch_size=batch, max_seq_len=context + 1,
                               memory_budget=budget, prefix_caching=False, **fields)


def refusals(args: argparse.Namespace, granularity: int) -> dict[str, str]:
    args = _defaults(args)
    planned = [(f"{label} at B={batch} C={context}", mode, _config(args, batch, context, mode, fields))
               for batch in args.batches for context in args.contexts for label, mode, fields in _caches(args)]
    return common.cache_refusals(planned, granularity)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with common.torch_threads(getattr(args, "threads", None)):
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    common.check_device(args.device)
    args = _defaults(args)
    kernels, skipped = _runnable_kernels(args)
    if not kernels:
        raise vmkv.BackendUnavailable(f"no contiguous kernel can run here: {skipped}")
    clock = common.pick_clock(args.clock, args.device, torch.get_num_threads())
    config_layout = common.cache_config({"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}, args.device).layout
    probe = common.read_bandwidth_probe(args.device, READ_PROBE_BYTES)
    grid = [(b, c) for b in args.batches for c in args.contexts]
    rows, wrong, samples, selected_paged, selected_vmm = [], {}, {}, "", {}
    for batch, context in common.progress(grid, "decode grid", enabled=getattr(args, "progress", False)):
        need, free = _bytes_needed(args, batch, context), common.available_memory()
        if args.device == "cpu" and free is not None and need > 0.8 * free:
            skipped[f"B={batch} C={context}"] = (f"needs about {need / 2**30:.1f} GiB (caches, dense copies, source K/V), "
                                                 f"{free / 2**30:.1f} GiB available")
            print(f"[decode] B={batch} C={context} left out: {skipped[f'B={batch} C={context}']}", file=sys.stderr)
            continue
        case = _case(args, batch, context)
        try:
            selected_paged = case.caches["paged"].kernel
            selected_vmm.update({label.split(":", 1)[1]: c.kernel for label, c in case.caches.items() if c.mode == "vmm"})
            found, samples[f"{batch},{context}"] = _measure_point(args, case, kernels, probe, clock, config_layout,
                                                                  skipped, wrong)
            rows += found
        finally:
            case.close()
    reads = [s["read_bytes"] / t / 1e9 for s in samples.values() for t in s["seconds"]["read"]]
    bandwidth = common.Spread.of(reads) if reads else None
    config = {**{k: getattr(args, k) for k in ("kv_heads", "q_heads", "head_dim", "dtype", "page_size", "block_size",
                                                "repeat", "layouts", "kernels")},
              "clock": clock, "default_layout": config_layout, "threads": getattr(args, "threads", None) or "torch default"}
    summary = {"kernels": {"contiguous": kernels, "paged_selected": selected_paged, "vmm_selected": selected_vmm},
               "skipped": skipped, "wrong_outputs": wrong, "read_bandwidth_gbps": bandwidth.as_dict() if bandwidth else None,
               "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=None)}
    return common.make_result(NAME, SCHEMA, rows, summary, config=config, samples=samples)


CONTROL = "control"
"""A second, identical candidate of the verdicts' VMM kernel: its ratio to the first is this run's
noise floor, under which a difference is a tie."""


def _bytes_needed(args: argparse.Namespace, batch: int, context: int) -> int:
    """Host memory a grid point touches: source, each layout, paged, dense copy (x 1.2 for page rounding)."""
    probe = common.cache_config({"num_layers": 1, "num_kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                 "dtype": args.dtype}, args.device)
    one = 2 * batch * (context + 1) * probe.layer_token_bytes
    return int(one * (len(args.layouts) + 3) * 1.2)


def _measure_point(
    args: argparse.Namespace, case: DecodeStep, kernels: list[str], probe: tuple[Callable[[], Any], int], clock: str,
    layout: str, skipped: dict[str, str], wrong: dict[str, float],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Check, then time, every candidate of a point (with the read probe and the control): rows and raw samples."""
    read, read_bytes = probe
    wanted = args.paged_kernels or ["selected", "gather_sdpa"]
    selected = case.caches["paged"].kernel
    both = [name for name in kernels if name in registry.names("blocks")]  # read both addressings: measure both
    paged_kernels = list(dict.fromkeys([*(selected if name == "selected" else name for name in wanted), *both]))
    tolerance = 1e-4 if case.q.dtype == torch.float32 else 2e-2
    candidates, diffs = _checked(case, _candidates(case, kernels, paged_kernels, layout), tolerance, skipped, wrong)
    vmm = [c for c in candidates if c.name.startswith(f"vmm:{layout}:")]
    control = ([c for c in vmm if c.selected] or vmm or [None])[0]  # the verdicts' VMM kernel, timed twice
    fns = {**{c.name: c.fn for c in candidates}, "read": read, **({CONTROL: control.fn} if control else {})}
    timings = common.time_interleaved(fns, args.device, repeat=args.repeat, min_sample_s=0.01, clock=clock)
    skipped.update(case.skipped)
    rows = []
    for cand in candidates:
        ms = timings.spread(cand.name).scaled(1e3)
        share = timings.ratio("read", cand.name).scaled(case.kv_bytes / read_bytes)
        rows.append({
            "batch": case.batch, "context": case.context, "candidate": cand.name, "selected": cand.selected,
            "ms": ms.value, "ms_low": ms.low, "ms_high": ms.high,
            "gbps": case.kv_bytes / ms.value * 1e3 / 1e9, "bw_fraction": share.value, "max_abs_diff": diffs[cand.name],
        })
    return rows, {"kv_bytes": case.kv_bytes, "read_bytes": read_bytes, "seconds": timings.samples}


def _checked(case: DecodeStep, candidates: list[_Candidate], tolerance: float, skipped: dict[str, str],
             wrong: dict[str, float]) -> tuple[list[_Candidate], dict[str, float]]:
    """Candidates that run and match the reference, and each output's error; the others go to ``skipped``/``wrong``."""
    good, diffs = [], {}
    for cand in candidates:
        try:
            out = cand.fn()
        except Exception as exc:  # noqa: BLE001 - a kernel that fails on a layout is reported, not fatal
            skipped[cand.name] = f"{type(exc).__name__}: {exc}"
            continue
        diffs[cand.name] = case.error(out)
        if diffs[cand.name] > tolerance:
            wrong[f"{cand.name} at B={case.batch} C={case.context}"] = diffs[cand.name]
        else:
            good.append(cand)
    return good, diffs


def _failed(summary: dict[str, Any]) -> dict[str, str]:
    """Candidates that gave a wrong output anywhere, raised, or whose cache did not open -> why."""
    out: dict[str, str] = {}
    for key, diff in summary.get("wrong_outputs", {}).items():
        name, _, where = key.partition(" at ")
        out.setdefault(name, f"{name} gave a wrong output at {where} (max |diff| {diff:.2g})")
    for name, why in summary.get("skipped", {}).items():
        if name.startswith(("vmm:", "dense", "paged:")):
            out.setdefault(name, f"{name} failed: {why}")
    return out


def _compared(point: list[dict[str, Any]], name: str | None, prefix: str,
              failed: dict[str, str]) -> tuple[dict[str, Any] | None, str]:
    """Candidate ``name``'s row (else the fastest selected one of ``prefix``, else the fastest), or why it failed."""
    why = failed.get(prefix.rstrip(":")) or failed.get(name)
    if why:
        return None, why
    mine = [r for r in point if r["candidate"].startswith(prefix)]
    named = [r for r in mine if r["candidate"] == name] or [r for r in mine if r["selected"]] or mine
    return min(named, key=lambda r: r["ms"], default=None), ""


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """At the largest point: VMM vs paged, vs the same kernel on dense tensors, batched vs per sequence, and
    the bandwidth share; a candidate that failed makes its line unreliable, never replaced."""
    rows = result["rows"]
    if not rows:
        return []
    batch = max(r["batch"] for r in rows)
    context = max(r["context"] for r in rows if r["batch"] == batch)
    point = [r for r in rows if (r["batch"], r["context"]) == (batch, context)]
    timings = common.Timings(result["samples"][f"{batch},{context}"]["seconds"])
    where = f"B={batch}, {context} tokens"
    default_layout = result["config"]["default_layout"]
    summary = result["summary"]
    failed = _failed(summary)
    selected = summary["kernels"].get("vmm_selected", {}).get(default_layout)
    vmm, vmm_why = _compared(point, selected and f"vmm:{default_layout}:{selected}", f"vmm:{default_layout}:", failed)
    paged_selected = summary["kernels"].get("paged_selected")
    paged, paged_why = _compared(point, paged_selected and f"paged:{paged_selected}", "paged:", failed)

    margin, floor = common.TIE_MARGIN, ""
    if vmm and CONTROL in timings.samples:  # the same work timed twice: how far apart can equals be?
        control = timings.ratio(CONTROL, vmm["candidate"])
        margin = max(margin, *(abs(x - 1.0) for x in (control.low, control.value, control.high)))
        floor = f"; same kernel timed twice: {control.low:.2f}-{control.high:.2f}"

    def ratio(a: dict[str, Any], b: dict[str, Any]) -> common.Spread:
        return timings.ratio(b["candidate"], a["candidate"])  # time of b / time of a: > 1, a faster

    both = bool(vmm and paged)
    out = common.judged(
        "decode.vmm_vs_paged", f"decode attention, {where}: VMM vs paged (speed: paged's time over VMM's)",
        "; ".join(w for w in (vmm_why, paged_why) if w), ratio(vmm, paged) if both else None, "VMM", "paged",
        note=f"{vmm['candidate']} vs {paged['candidate']}{floor}" if both else "", tie_margin=margin)
    kernel = selected if vmm_why else vmm["candidate"].rsplit(":", 1)[-1] if vmm else None
    dense = next((r for r in point if r["candidate"].startswith("dense") and r["candidate"].endswith(f":{kernel}")), None)
    dense_why = "; ".join(why for name, why in failed.items() if name.startswith("dense") and name.endswith(f":{kernel}"))
    out += map(_cost_verdict, common.judged(
        "decode.vmm_vs_dense", f"decode attention, {where}: what virtual memory costs (VMM vs the same kernel on dense tensors)",
        "; ".join(w for w in (vmm_why, dense_why) if w), ratio(vmm, dense) if vmm and dense else None, "VMM", "dense",
        note=f"{kernel}{floor}", tie_margin=margin))
    out += _batched_verdict(point, timings, default_layout, failed, where, floor, margin)
    out += _addressing_verdicts(point, timings, default_layout, where, margin)
    best = min((r for r in point if r["candidate"].startswith("vmm:")), key=lambda r: r["ms"], default=None)
    if best:
        out.append(_bandwidth_verdict(result, best, timings, where))
    return out


BANDWIDTH_BOUND = 0.80
"""A kernel is bandwidth-bound when every kept round reads its K/V at this share of the read bandwidth."""


def _gbps(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def _bandwidth_verdict(result: dict[str, Any], best: dict[str, Any], timings: common.Timings, where: str) -> common.Verdict:
    """The fastest VMM candidate's K/V bytes per second as a share of the read bandwidth measured in the
    same rounds; bandwidth-bound only from :data:`BANDWIDTH_BOUND` on."""
    data = result["samples"][f"{best['batch']},{best['context']}"]
    share = timings.ratio("read", best["candidate"]).scaled(data["kv_bytes"] / data["read_bytes"])
    bound = common.Spread.of([data["read_bytes"] / t / 1e9 for t in data["seconds"]["read"]])
    line = common.number_text(BANDWIDTH_BOUND, "%")
    if share.low >= BANDWIDTH_BOUND:
        winner, side = f"bandwidth-bound (>= {line} of the read bandwidth)", "bandwidth-bound"
    elif share.high < BANDWIDTH_BOUND:
        winner, side = f"not bandwidth-bound (below {line} of the read bandwidth)", "not bandwidth-bound"
    else:
        winner, side = f"near the {line} line (rounds on both sides)", "tie"
    probe = f"torch.sum over {data['read_bytes'] // 2**20} MiB"
    return common.Verdict(
        key="decode.bandwidth",
        question=f"decode K/V bytes read per second, {where}: share of the device's read bandwidth ({probe}, same rounds)",
        result=f"{_gbps(best['gbps'])} GB/s = {common.number_text(share.value, '%')} of {_gbps(bound.value)} GB/s",
        spread=common.spread_text(share, "%"), winner=winner, side=side, value=share.value, low=share.low, high=share.high,
        note=(f"{best['candidate']}; read bandwidth {_gbps(bound.value)} GB/s ({_gbps(bound.low)}-{_gbps(bound.high)}), "
              f"threads: {result['config'].get('threads')}"),
    )


BATCHING_MATTERS = 0.10
"""Batched vs per-sequence decode wins only beyond 10 %: the calls batching saves are a small part
of a step, so smaller differences are noise that would flip the verdict between runs."""


def _addressing_verdicts(
    point: list[dict[str, Any]], timings: common.Timings, layout: str, where: str, margin: float,
) -> list[common.Verdict]:
    """Each kernel measured on both addressings, slots vs a block table: what translation alone costs."""
    names = {r["candidate"] for r in point}
    out = []
    for name in sorted(n for n in names if n.startswith("paged:")):
        kernel = name.split(":", 1)[1]
        on_slots = sorted(n for n in names if n.startswith("vmm:") and n.endswith(f":{kernel}"))
        slots = f"vmm:{layout}:{kernel}" if f"vmm:{layout}:{kernel}" in on_slots else next(iter(on_slots), None)
        if slots is not None:
            out.append(common.ratio_verdict(
                f"decode.{kernel}.slots_vs_blocks", f"decode attention, {where}: {kernel} reading VMM slots vs a block "
                "table (speed: the block table's time over the slots')", timings.ratio(name, slots),
                "slots", "block table", note=f"{slots} vs {name}", tie_margin=margin))
    return out


def _batched_verdict(
    point: list[dict[str, Any]], timings: common.Timings, layout: str, failed: dict[str, str], where: str, floor: str,
    margin: float,
) -> list[common.Verdict]:
    """The fastest batched kernel vs one SDPA per sequence; batched kernels that failed are named and left out."""
    key, prefix = "decode.batched_vs_per_sequence", f"vmm:{layout}:"
    per_name = f"{prefix}sdpa_per_sequence"
    per_seq = next((r for r in point if r["candidate"] == per_name), None)
    others = [r for r in point if r["candidate"].startswith(prefix) and r is not per_seq]
    left_out = [why for name, why in failed.items() if name.startswith(prefix) and name != per_name]
    question = f"decode attention, {where}: batched kernel vs one SDPA per sequence"
    # per-sequence failed or its cache did not open, or every batched kernel failed
    why = failed.get(per_name) or failed.get(prefix[:-1]) or ("; ".join(left_out) if per_seq and not others else "")
    if why:
        return [common.unreliable(key, question, why)]
    if not (per_seq and others):
        return []
    fastest = min(others, key=lambda r: r["ms"])
    name = fastest["candidate"].rsplit(":", 1)[-1]
    note = "; ".join([floor.removeprefix("; "), *(f"left out: {why}" for why in left_out)]).strip("; ")
    return [common.ratio_verdict(
        key, f"decode attention, {where}: {name} vs one SDPA per sequence",
        timings.ratio(per_seq["candidate"], fastest["candidate"]), name, "per-sequence", note=note,
        tie_margin=max(margin, BATCHING_MATTERS),
    )]


def _cost_verdict(verdict: common.Verdict) -> common.Verdict:
    """VMM vs dense answers "does virtual memory cost the kernel anything?": side ``dense`` (yes) or
    ``no cost`` (a tie or VMM faster: the same kernel reads the same bytes)."""
    margin, _, rounds = verdict.winner.removesuffix(")").partition(" (")  # "dense, 1.33x", "7 of 7 rounds"
    if verdict.side == "dense":
        return dataclasses.replace(verdict, winner=f"VMM costs time: dense {margin.removeprefix('dense, ')} faster"
                                   + (f" ({rounds})" if rounds else ""))
    if not verdict.side:  # not judged (one run, or unreliable)
        return verdict
    if verdict.side == "VMM":
        return dataclasses.replace(verdict, side="no cost", winner=f"no cost (VMM {margin.removeprefix('VMM, ')} faster"
                                   + (f", {rounds})" if rounds else ")"))
    return dataclasses.replace(verdict, side="no cost", winner=f"no cost ({margin})")


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    lines: dict[tuple[int, int], dict[str, Any]] = {}  # (batch, context) -> its line, in the rows' order
    for r in result["rows"]:
        line = lines.setdefault((r["batch"], r["context"]), {"batch": r["batch"], "context": r["context"]})
        line[r["candidate"] + ("*" if r["selected"] else "")] = round(r["ms"], 3)
    return list(lines.values())


def plot(result: dict[str, Any], out_dir) -> list[str]:
    """``decode_time.png``: ms per step vs context, a panel per batch size, a line per candidate."""
    plt = common.pyplot()
    from matplotlib.ticker import FuncFormatter

    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    styles = {"vmm": ("-", "o"), "dense": (":", "x"), "paged": ("--", "s")}
    fig, axes = plt.subplots(1, len(batches), figsize=(4.8 * len(batches), 4.4), squeeze=False)
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for ax, batch in zip(axes[0], batches):
        for name in names:
            mine = sorted((r for r in rows if r["batch"] == batch and r["candidate"] == name), key=lambda r: r["context"])
            if not mine:
                continue
            line, marker = styles.get(name.split(":")[0].split("[")[0], ("-", "."))
            ax.errorbar([r["context"] for r in mine], [r["ms"] for r in mine],
                        yerr=[[r["ms"] - r["ms_low"] for r in mine], [r["ms_high"] - r["ms"] for r in mine]],
                        linestyle=line, marker=marker, markersize=4, capsize=2, linewidth=1.2, label=name)
        ax.set_xscale("log", base=2)
        ax.set(title=f"decode step, batch {batch}", xlabel="context (tokens)", yscale="log", xticks=contexts,
               ylabel=f"ms per step, one layer ({result['config'].get('clock', 'wall')} clock)")
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * -(-len(labels) // 4) + 0.02, 1, 1))  # room below for the legend's rows of 4
    return [common.save_figure(fig, out_dir, "decode_time.png", tight=False)]
