"""Decode attention: VMM (every registered contiguous kernel, every layout) vs paged vs dense.

For each batch size B and context length C, B sequences of C tokens (plus the step's new token)
are written into one VMM cache per layout that ``vmkv.KVCacheConfig`` accepts and into a paged
cache, with identical K/V; then one decode step (one new token per sequence, attention of
layer 0 only) is timed, every candidate taking its turn in every round::

    vmm:<layout>:<kernel>   each slots kernel of ``vmkv.kernels.registry`` that can run
                            here (e.g. sdpa_per_sequence, one SDPA call per sequence; a batched
                            kernel, one call for all rows), on that layout's virtual tensors
    dense:<kernel>          the same kernel on ordinary torch tensors of the same shape (what
                            virtual memory costs: nothing, if the ratio is 1.0)
    paged:<kernel>          each paged kernel asked for, over the paged cache's block pools
    read                    ``torch.sum`` over 256 MiB: the machine's read bandwidth, measured
                            in the same rounds as the kernels

The VMM caches hold two layers (layer 0 is timed), so a layout that interleaves layers shows
its real strides. Kernels and layouts are found by name at run time: one added to
``vmkv.kernels.contiguous`` or ``vmkv.config`` is measured without touching this file; one that cannot
run here is reported with the reason, one that raises or gives a wrong answer is reported and
left out of the verdict.

Achieved bandwidth counts the K and V bytes a step must read (sum of lengths x kv_heads x
head_dim x bytes x 2). Every output is checked against SDPA on the source K/V of each sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

import vmkv
import vmkv.config
from vmkv.kernels import registry
from vmkv.kernels.base import AttentionKernel
from vmkv.vmm.views import unguarded

from . import common

NAME = "decode"
DESCRIPTION = "decode-step attention: VMM (each kernel and layout) vs paged kernels vs dense tensors, bytes/s vs read bandwidth"

SCHEMA = {
    "batch": "sequences in the decode step",
    "context": "tokens cached per sequence before the step",
    "candidate": "vmm:LAYOUT:KERNEL, dense:KERNEL or paged:KERNEL (see the module docstring)",
    "selected": "the kernel the cache itself runs for this layout / the paged kernel paged mode picks",
    "ms": "median ms per decode step (one layer)",
    "ms_low": "fastest round, ms (from 5 rounds on, the single fastest and slowest rounds are left out)",
    "ms_high": "slowest round, ms (same rule)",
    "gbps": "K/V bytes the step reads / median time, GB/s",
    "bw_fraction": "gbps / read bandwidth measured in the same rounds (median of per-round ratios)",
    "max_abs_diff": "largest |output - reference| (SDPA on each sequence's source K/V)",
}
READ_PROBE_BYTES = 256 * 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options (the CLI adds --device, --smoke, --seed, --out)."""
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on a shared CPU; 0 keeps torch's default)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8 32; smoke 1 2)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths (default 512 2048 8192; smoke 64 128)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default float32 on CPU, float16 on CUDA")
    parser.add_argument("--page-size", default="2MiB", help="VMM page size")
    parser.add_argument("--layouts", nargs="+", default=None, help="VMM layouts (default: every layout vmkv.KVCacheConfig accepts)")
    parser.add_argument("--kernels", nargs="+", default=None, help="contiguous (slots) kernels (default: every one vmkv.kernels.registry has that can run here)")
    parser.add_argument("--block-size", type=int, default=None, help="paged block size (default 16 on CPU, 256 on CUDA: FlashAttention's paged kernels need multiples of 256)")
    parser.add_argument("--paged-kernels", nargs="+", default=None, help="paged kernels to time; 'selected' is the one paged mode picks here (default: selected gather_sdpa)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds, every candidate once per round (default 7; smoke 2)")
    parser.add_argument("--clock", default="auto", choices=["auto", *common.CLOCKS],
                        help="auto: the thread's CPU time on CPU with one thread (a shared machine cannot inflate it), else wall time")


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
    """Contiguous kernels that can run here, and why the others cannot.

    Raises:
        vmkv.InvalidConfig: a kernel name that ``vmkv.kernels.registry`` has no slots kernel of.
    """
    unknown = sorted(set(args.kernels) - set(registry.names("slots")))
    if unknown:
        raise vmkv.InvalidConfig(f"unknown kernels {unknown}; known: {registry.names('slots')}")
    dtype = common.cache_config({"num_layers": 1, "num_kv_heads": 1, "head_dim": args.head_dim, "dtype": args.dtype}, args.device).dtype
    runnable, skipped = [], {}
    spec = registry.KernelSpec("slots", torch.device(args.device), dtype, args.kv_heads, args.head_dim)
    for name in args.kernels:
        why = registry.unavailable(name, spec)
        if why is None:
            runnable.append(name)
        else:
            skipped[name] = why
    return runnable, skipped


@dataclass
class _Candidate:
    name: str
    fn: Callable[[], torch.Tensor]
    selected: bool


class _Case:
    """B sequences of C tokens in one VMM cache per layout, a paged cache and dense tensors."""

    def __init__(self, args: argparse.Namespace, batch: int, context: int) -> None:
        self.args, self.batch, self.context = args, batch, context
        self.shape = {"num_layers": 1, "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype}
        probe = common.cache_config(self.shape, args.device)
        self.kv_bytes = batch * (context + 1) * probe.layer_token_bytes * 2  # what one layer's step reads
        gen = torch.Generator().manual_seed(args.seed)
        dtype, device = probe.dtype, probe.device

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen).to(dtype=dtype, device=device)

        # source K/V: [B, C + 1, Hkv, D]; the last token is the decode step's own
        self.k_src = randn(batch, context + 1, args.kv_heads, args.head_dim)
        self.v_src = randn(batch, context + 1, args.kv_heads, args.head_dim)
        self.q = randn(batch, args.q_heads, args.head_dim)  # q: [B, Hq, D], one new token each
        self.scale = args.head_dim**-0.5
        self.caches: dict[str, vmkv.KVCacheBase] = {}
        self.plans: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}
        for label, mode, fields in _caches(args):
            try:
                self._fill(label, mode, fields)
            except vmkv.VMKVError as exc:  # e.g. a page size this layout cannot use
                if mode == "paged":
                    raise
                self.skipped[label] = f"{type(exc).__name__}: {exc}"
        self.expected = self._reference()  # then the source K/V can go: memory is tight at 32 x 8K
        del self.k_src, self.v_src

    def _fill(self, label: str, mode: str, fields: dict[str, Any]) -> None:
        """Open a cache, write every sequence's context, then the decode step's token (layer 0)."""
        cache = vmkv.open_cache(_config(self.args, self.batch, self.context, mode, fields), mode)
        try:
            for seq in range(self.batch):
                cache.add(seq)
                cache.write(0, self.k_src[seq, :-1], self.v_src[seq, :-1], cache.begin_step({seq: self.context}))
            plan = cache.begin_step({seq: 1 for seq in range(self.batch)})
            cache.write(0, self.k_src[:, -1], self.v_src[:, -1], plan)
        except BaseException:
            cache.close()
            raise
        self.caches[label], self.plans[label] = cache, plan

    def _reference(self) -> torch.Tensor:
        """SDPA per sequence on the source K/V, in float32: ``[B, Hq, D]``."""
        group = self.args.q_heads // self.args.kv_heads
        q = self.q.float().reshape(self.batch, self.args.kv_heads, group, -1)  # [B, Hkv, group, D]
        k = self.k_src.float().transpose(1, 2)  # [B, Hkv, C + 1, D]
        v = self.v_src.float().transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale).reshape(self.batch, self.args.q_heads, -1)

    def candidates(self, kernels: list[str], paged_kernels: list[str]) -> list[_Candidate]:
        """Every runnable candidate of this case (see the module docstring)."""
        out = []
        dense: dict[tuple, tuple[torch.Tensor, torch.Tensor, Any]] = {}
        for label, cache in self.caches.items():
            if cache.mode != "vmm":
                continue
            k_view, v_view = map(unguarded, cache.kv_cache(0))  # plain tensors: time the kernel alone
            plan = self.plans[label]
            dense.setdefault(tuple(k_view.shape), (_dense_copy(k_view), _dense_copy(v_view), plan))
            for name in kernels:
                kernel = registry.build(name, self._slots_spec(cache))
                out.append(_Candidate(f"{label}:{name}", self._call(kernel, k_view, v_view, plan), name == cache.kernel))
        default_layout = common.cache_config(self.shape, self.args.device).layout
        for shape, (k_dense, v_dense, plan) in dense.items():
            prefix = "dense" if len(dense) == 1 else f"dense{list(shape)}"
            for name in kernels:
                kernel = registry.build(name, self._slots_spec(self.caches[next(iter(self.caches))]))
                selected = any(c.selected and c.name == f"vmm:{default_layout}:{name}" for c in out)
                out.append(_Candidate(f"{prefix}:{name}", self._call(kernel, k_dense, v_dense, plan), selected))
        out += self._paged(paged_kernels)
        return out

    @staticmethod
    def _slots_spec(cache: vmkv.KVCacheBase) -> registry.KernelSpec:
        cfg = cache.config
        return registry.KernelSpec("slots", cfg.device, cfg.dtype, cfg.num_kv_heads, cfg.head_dim)

    def _call(self, kernel: AttentionKernel, k: torch.Tensor, v: torch.Tensor, plan: Any) -> Callable[[], torch.Tensor]:
        q, scale = self.q, self.scale
        return lambda: kernel(q, k, v, plan, scale)

    def _paged(self, names: list[str]) -> list[_Candidate]:
        cache, plan = self.caches["paged"], self.plans["paged"]
        cfg = cache.config
        spec = registry.KernelSpec("blocks", cfg.device, cfg.dtype, cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
        k_pool, v_pool = cache.block_pool(0)
        out = []
        for name in names:
            try:
                kernel = registry.make_kernel(spec, forced=name)
            except vmkv.VMKVError as exc:
                self.skipped[f"paged:{name}"] = f"{type(exc).__name__}: {exc}"
                continue
            out.append(_Candidate(f"paged:{name}", self._call(kernel, k_pool, v_pool, plan), name == cache.kernel))
        return out

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()


def _caches(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, mode, config fields)`` of every cache a grid point opens: one VMM cache of two
    layers per layout (layer 0 is timed), then the paged cache."""
    vmm = [(f"vmm:{layout}", "vmm", {"layout": layout, "page_size": args.page_size, "num_layers": 2}) for layout in args.layouts]
    return [*vmm, ("paged", "paged", {"block_size": args.block_size})]


def _config(args: argparse.Namespace, batch: int, context: int, mode: str, fields: dict[str, Any]) -> vmkv.KVCacheConfig:
    """The configuration of a ``mode`` cache with ``fields`` that holds ``batch`` sequences of
    ``context`` tokens plus the decode step's (a budget of their pages, one spare each)."""
    fields = dict(fields)
    shape = {"num_layers": fields.pop("num_layers", 1), "num_kv_heads": args.kv_heads, "head_dim": args.head_dim,
             "dtype": args.dtype}
    probe = common.cache_config(shape, args.device, **fields)
    tokens_per_page = (  # a pool page is tokens_per_page tokens of every piece, whatever the layout
        fields["block_size"] if mode == "paged"
        else vmkv.parse_size(fields["page_size"]) // probe.tensor_token_bytes(fields["layout"])
    )
    pages = batch * (-(-(context + 1) // max(1, tokens_per_page)) + 1)
    budget = pages * max(1, tokens_per_page) * probe.bytes_per_token
    return common.cache_config(shape, args.device, max_batch_size=batch, max_seq_len=context + 1,
                               memory_budget=budget, prefix_caching=False, **fields)


def refusals(args: argparse.Namespace, granularity: int) -> dict[str, str]:
    """What the grid's caches need that a backend of ``granularity`` refuses (see
    :func:`vmkv_bench.common.cache_refusals`): every layout's and the paged cache, at every point."""
    args = _defaults(args)
    planned = [(f"{label} at B={batch} C={context}", mode, _config(args, batch, context, mode, fields))
               for batch in args.batches for context in args.contexts for label, mode, fields in _caches(args)]
    return common.cache_refusals(planned, granularity)


def _dense_copy(view: torch.Tensor) -> torch.Tensor:
    """An ordinary, contiguous copy of ``view`` in freshly allocated memory (never the view itself,
    which ``contiguous()`` would return for a view that is contiguous already)."""
    return torch.empty(view.shape, dtype=view.dtype, device=view.device).copy_(view)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every candidate on every (batch, context) of the grid."""
    with common.torch_threads(getattr(args, "threads", None)):
        result = _run(args)
    result["config"]["threads"] = getattr(args, "threads", None) or "torch default"
    return result


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
        case = _Case(args, batch, context)
        try:
            selected_paged = case.caches["paged"].kernel
            selected_vmm.update({label.split(":", 1)[1]: c.kernel for label, c in case.caches.items() if c.mode == "vmm"})
            found, samples[f"{batch},{context}"] = _measure_point(case, kernels, probe, clock, config_layout, skipped, wrong)
            rows += found
        finally:
            case.close()
    reads = [s["read_bytes"] / t / 1e9 for s in samples.values() for t in s["seconds"]["read"]]
    bandwidth = common.Spread.of(reads) if reads else None
    config = {k: getattr(args, k) for k in ("kv_heads", "q_heads", "head_dim", "dtype", "page_size", "block_size",
                                             "repeat", "layouts", "kernels")}
    config["clock"] = clock
    config["default_layout"] = config_layout
    summary = {"kernels": {"contiguous": kernels, "paged_selected": selected_paged, "vmm_selected": selected_vmm},
               "skipped": skipped,
               "wrong_outputs": wrong, "read_bandwidth_gbps": bandwidth.as_dict() if bandwidth else None,
               "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=None)}
    return common.make_result(NAME, SCHEMA, rows, summary, config=config, samples=samples)


CONTROL = "control"
"""A second, identical candidate of the VMM kernel the verdicts are about: its ratio to the first
shows how far two timings of the same work differ on this machine in this run (the noise floor
under which a difference is called a tie)."""


def _control_of(candidates: list[_Candidate], layout: str) -> str | None:
    """The candidate the control repeats: the cache's own kernel on the default layout."""
    mine = [c.name for c in candidates if c.name.startswith(f"vmm:{layout}:")]
    chosen = [c.name for c in candidates if c.selected and c.name in mine]
    return (chosen or mine or [None])[0]


def _bytes_needed(args: argparse.Namespace, batch: int, context: int) -> int:
    """Host memory one grid point touches: K and V of one layer, once for the source, once per
    VMM layout, once for the paged cache and once for the dense copy (x 1.2 for page rounding)."""
    probe = common.cache_config({"num_layers": 1, "num_kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                 "dtype": args.dtype}, args.device)
    one = 2 * batch * (context + 1) * probe.layer_token_bytes
    return int(one * (len(args.layouts) + 3) * 1.2)


def _measure_point(
    case: _Case, kernels: list[str], probe: tuple[Callable[[], Any], int], clock: str, layout: str,
    skipped: dict[str, str], wrong: dict[str, float],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Check, then time, every candidate of one grid point (with the read probe and the control);
    its rows and its raw per-round samples."""
    args = case.args
    read, read_bytes = probe
    wanted = args.paged_kernels or ["selected", "gather_sdpa"]
    selected = case.caches["paged"].kernel
    both = [name for name in kernels if name in registry.names("blocks")]  # read both addressings: measure both
    paged_kernels = list(dict.fromkeys([*(selected if name == "selected" else name for name in wanted), *both]))
    tolerance = 1e-4 if case.q.dtype == torch.float32 else 2e-2
    candidates, diffs = _checked(case, case.candidates(kernels, paged_kernels), tolerance, skipped, wrong)
    fns = {c.name: c.fn for c in candidates}
    control = _control_of(candidates, layout)
    extra = {"read": read, **({CONTROL: fns[control]} if control else {})}
    timings = common.time_interleaved({**fns, **extra}, args.device, repeat=args.repeat, min_sample_s=0.01, clock=clock)
    skipped.update(case.skipped)
    rows = []
    for cand in candidates:
        ms = timings.spread(cand.name).scaled(1e3)
        share = timings.ratio("read", cand.name).scaled(case.kv_bytes / read_bytes)
        rows.append({
            "batch": case.batch, "context": case.context, "candidate": cand.name, "selected": cand.selected,
            "ms": ms.value, "ms_low": ms.low, "ms_high": ms.high,
            "gbps": case.kv_bytes / ms.value * 1e3 / 1e9, "bw_fraction": share.value,
            "max_abs_diff": diffs[cand.name],
        })
    return rows, {"kv_bytes": case.kv_bytes, "read_bytes": read_bytes, "seconds": timings.samples}


def _checked(case: _Case, candidates: list[_Candidate], tolerance: float, skipped: dict[str, str],
             wrong: dict[str, float]) -> tuple[list[_Candidate], dict[str, float]]:
    """The candidates that run and match the reference, and every output's largest difference;
    a candidate that raises goes to ``skipped``, one that differs to ``wrong`` (both reported)."""
    reference = case.expected
    good, diffs = [], {}
    for cand in candidates:
        try:
            out = cand.fn()
        except Exception as exc:  # noqa: BLE001 - a kernel that fails on a layout is reported, not fatal
            skipped[cand.name] = f"{type(exc).__name__}: {exc}"
            continue
        diffs[cand.name] = (out.float().reshape(reference.shape) - reference).abs().max().item()
        if diffs[cand.name] > tolerance:
            wrong[f"{cand.name} at B={case.batch} C={case.context}"] = diffs[cand.name]
        else:
            good.append(cand)
    return good, diffs


def _pick(point: list[dict[str, Any]], prefix: str, selected: bool | None = True) -> dict[str, Any] | None:
    """The row of ``point`` whose candidate starts with ``prefix`` (the selected one, if any)."""
    mine = [r for r in point if r["candidate"].startswith(prefix)]
    if selected:
        mine = [r for r in mine if r["selected"]] or mine
    return min(mine, key=lambda r: r["ms"]) if mine else None


def _failed(summary: dict[str, Any]) -> dict[str, str]:
    """Candidates that gave a wrong output anywhere in the grid, or raised, or whose cache could
    not open: candidate (or ``vmm:LAYOUT``) -> why, in words."""
    out: dict[str, str] = {}
    for key, diff in summary.get("wrong_outputs", {}).items():
        name, _, where = key.partition(" at ")
        out.setdefault(name, f"{name} gave a wrong output at {where} (max |diff| {diff:.2g})")
    for name, why in summary.get("skipped", {}).items():
        if name.startswith(("vmm:", "dense", "paged:")):
            out.setdefault(name, f"{name} failed: {why}")
    return out


def _compared(point: list[dict[str, Any]], name: str | None, prefix: str, failed: dict[str, str]) -> tuple[dict[str, Any] | None, str]:
    """The row of candidate ``name`` at ``point``, or why there is none because it (or the cache
    of ``prefix``, ``vmm:LAYOUT:``) failed; a ``name`` not measured at all (not asked for, or
    ``None``) falls back to :func:`_pick` of ``prefix``."""
    why = failed.get(prefix.rstrip(":")) or (failed.get(name) if name else None)
    if why:
        return None, why
    row = next((r for r in point if r["candidate"] == name), None)
    return row or _pick(point, prefix), ""


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """At the largest batch and context measured: VMM (the cache's own kernel, default layout)
    vs the paged mode's kernel, vs the same kernel on dense tensors, batched vs per-sequence,
    and the share of read bandwidth reached. A comparison whose candidate gave a wrong output
    (or failed) is an unreliable verdict naming it, never a comparison with a stand-in."""
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
    out = []

    def ratio(a: dict[str, Any], b: dict[str, Any]) -> common.Spread:
        return timings.ratio(b["candidate"], a["candidate"])  # time of b / time of a: > 1, a faster

    margin, floor = common.TIE_MARGIN, ""
    if vmm and CONTROL in timings.samples:  # the same work timed twice: how far apart can equals be?
        control = timings.ratio(CONTROL, vmm["candidate"])
        margin = max(margin, *(abs(x - 1.0) for x in (control.low, control.value, control.high)))
        floor = f"; same kernel timed twice: {control.low:.2f}-{control.high:.2f}"

    question = f"decode attention, {where}: VMM vs paged (speed: paged's time over VMM's)"
    if vmm_why or paged_why:
        out.append(common.unreliable("decode.vmm_vs_paged", question, "; ".join(w for w in (vmm_why, paged_why) if w)))
    elif vmm and paged:
        out.append(common.ratio_verdict(
            "decode.vmm_vs_paged", question, ratio(vmm, paged),
            "VMM", "paged", note=f"{vmm['candidate']} vs {paged['candidate']}{floor}", tie_margin=margin,
        ))
    kernel = selected if vmm_why else vmm["candidate"].rsplit(":", 1)[-1] if vmm else None
    dense = next((r for r in point if r["candidate"].startswith("dense") and r["candidate"].endswith(f":{kernel}")), None)
    dense_why = "; ".join(why for name, why in failed.items() if name.startswith("dense") and name.endswith(f":{kernel}"))
    question = f"decode attention, {where}: what virtual memory costs (VMM vs the same kernel on dense tensors)"
    if vmm_why or dense_why:
        out.append(common.unreliable("decode.vmm_vs_dense", question, "; ".join(w for w in (vmm_why, dense_why) if w)))
    elif vmm and dense:
        out.append(_cost_verdict(common.ratio_verdict(
            "decode.vmm_vs_dense", question, ratio(vmm, dense), "VMM", "dense", note=f"{kernel}{floor}", tie_margin=margin,
        )))
    out += _batched_verdict(point, timings, default_layout, failed, where, floor, margin)
    out += _addressing_verdicts(point, timings, default_layout, where, margin)
    best = min((r for r in point if r["candidate"].startswith("vmm:")), key=lambda r: r["ms"], default=None)
    if best:
        out.append(_bandwidth_verdict(result, best, timings, where))
    return out


BANDWIDTH_BOUND = 0.80
"""A kernel is called bandwidth-bound when every kept round reads its K/V at this share of the
device's read bandwidth or more; below it, a fifth or more of the bandwidth is left unused (at
50 %, half), which a faster kernel could still gain."""


def _gbps(value: float) -> str:
    """GB/s as read: ``"25.3"`` on a CPU, ``"3,878"`` on a GPU."""
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def _bandwidth_verdict(result: dict[str, Any], best: dict[str, Any], timings: common.Timings, where: str) -> common.Verdict:
    """The K/V bytes the fastest VMM candidate (``best``) reads per second at the verdicts'
    point, as a share of the bound measured in the same rounds: the device's read bandwidth
    (``torch.sum`` over the read probe's bytes); bandwidth-bound only from
    :data:`BANDWIDTH_BOUND` on."""
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
"""Batched vs per-sequence decode is judged a win only beyond 10 %: the calls it saves cost about
0.1 % of a step at 2K tokens on CPU (``python -m vmkv_bench.contiguous_decode``), so smaller
differences are noise and would flip the verdict from run to run."""


def _addressing_verdicts(
    point: list[dict[str, Any]], timings: common.Timings, layout: str, where: str, margin: float,
) -> list[common.Verdict]:
    """For each kernel measured on both addressings (the same kernel reading VMM slots and a
    block table, e.g. Triton): which wins and by how much, i.e. what block-table translation
    itself costs, nothing else differing."""
    names = {r["candidate"] for r in point}
    out = []
    for name in sorted(names):
        if not name.startswith("paged:"):
            continue
        kernel = name.split(":", 1)[1]
        on_slots = sorted(n for n in names if n.startswith("vmm:") and n.endswith(f":{kernel}"))
        slots = f"vmm:{layout}:{kernel}" if f"vmm:{layout}:{kernel}" in names else (on_slots or [None])[0]
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
    """The fastest batched kernel on ``layout`` vs one SDPA call per sequence; batched kernels
    that failed are left out and named; unreliable when per-sequence failed, or every batched one."""
    key, prefix = "decode.batched_vs_per_sequence", f"vmm:{layout}:"
    per_name = f"{prefix}sdpa_per_sequence"
    per_seq = next((r for r in point if r["candidate"] == per_name), None)
    others = [r for r in point if r["candidate"].startswith(prefix) and r is not per_seq]
    left_out = [why for name, why in failed.items() if name.startswith(prefix) and name != per_name]
    question = f"decode attention, {where}: batched kernel vs one SDPA per sequence"
    if failed.get(per_name) or failed.get(prefix[:-1]):
        return [common.unreliable(key, question, failed.get(per_name) or failed[prefix[:-1]])]
    if per_seq and not others and left_out:
        return [common.unreliable(key, question, "; ".join(left_out))]
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
    """VMM vs dense answers "does virtual memory cost the kernel anything?": dense faster beyond
    the noise means yes (side ``dense``); a tie, or VMM faster, means no (side ``no cost``: the
    same kernel reads the same bytes, so VMM "winning" is no separate answer)."""
    margin, _, rounds = verdict.winner.partition(" (")  # "dense, 1.33x", "7 of 7 rounds)"
    rounds = rounds.removesuffix(")")
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
    """The terminal table: one line per (batch, context), ms of each candidate (selected ones
    marked with *)."""
    out = []
    for batch, context in dict.fromkeys((r["batch"], r["context"]) for r in result["rows"]):
        line: dict[str, Any] = {"batch": batch, "context": context}
        for r in result["rows"]:
            if (r["batch"], r["context"]) == (batch, context):
                line[r["candidate"] + ("*" if r["selected"] else "")] = round(r["ms"], 3)
        out.append(line)
    return out


def plot(result: dict[str, Any], out_dir) -> list[str]:
    """``decode_time.png``: ms per step vs context, one panel per batch size, one line per candidate
    (median, bars from the fastest to the slowest round kept); the legend sits under the panels."""
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
        ax.set_title(f"decode step, batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"ms per step, one layer ({result['config'].get('clock', 'wall')} clock)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(contexts)
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    rows_of_legend = -(-len(labels) // 4)
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend + 0.02, 1, 1))
    return [common.save_figure(fig, out_dir, "decode_time.png", tight=False)]


if __name__ == "__main__":  # python -m vmkv_bench.decode [options] runs `vmkv bench decode [options]`
    from vmkv_bench.suite import main

    sys.exit(main([NAME, *sys.argv[1:]]))
