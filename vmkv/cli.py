"""The ``vmkv`` command: ``info``, ``bench``, ``serve`` and ``ledger``.

::

    vmkv info                          backends, page granularity, kernels per mode and why
    vmkv bench                         the quick default suite (CPU, a few minutes): tables,
                                       JSON and PNG plots in --out (default bench-out/)
    vmkv bench --full                  every benchmark with its own, fuller defaults (docs)
    vmkv bench <name> [options]        one benchmark with its own options (--help lists them)
    vmkv bench --list                  the registry
    vmkv serve [options]               the OpenAI-compatible server (vmkv.server.cli)
    vmkv ledger NAME [--reap]          a host-wide KV budget's members, holdings and verdict

Benchmark modules are imported only when needed; one that is missing or fails to import is
reported plainly and the others still run. Every module follows the contract described in
:mod:`benchmarks.common` (``NAME``, ``DESCRIPTION``, ``add_arguments``, ``run``, optional ``plot``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import mmap
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from .extras import install_hint

COMMON_OPTIONS = ("device", "smoke", "seed", "out")
BENCH_EXTRA = ("matplotlib", "tqdm", "transformers")  # what the bench extra brings (plots, bars, generate)


@dataclass(frozen=True)
class Entry:
    """A registered benchmark: its module and the options the quick default suite runs it with
    (``vmkv bench <name>`` alone runs the module's own, fuller defaults). ``in_suite=False``:
    not in the quick suite, only in ``--full`` and by name."""

    name: str
    module: str
    suite_argv: list[str] = field(default_factory=list)
    in_suite: bool = True


REGISTRY: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        Entry("memory", "benchmarks.memory",
              ["--requests", "sharegpt=120", "alpaca=300", "--budget", "sharegpt=1GiB", "alpaca=256MiB", "--page-sizes", "2MiB"]),
        Entry("decode", "benchmarks.decode",
              ["--batches", "1", "8", "32", "--contexts", "512", "2048", "--repeat", "7", "--paged-kernels", "selected"]),
        Entry("mapping", "benchmarks.mapping", ["--steps", "128", "--rounds", "11", "--pages", "128", "--decode-page-sizes", "4KiB"]),
        Entry("sharing", "benchmarks.sharing", ["--traces", "alpaca", "--requests", "3", "--widths", "2", "6"]),
        Entry("generate", "benchmarks.generate",
              ["--models", "small", "--prompt-len", "64", "--new-tokens", "256", "--batch-sizes", "8",
               "--beam-new-tokens", "32", "--caches", "dynamic", "static", "vmm", "vmm+vmkv", "bound", "--repeats", "7"]),
        Entry("serve", "benchmarks.serve",
              ["--concurrency", "1", "8", "--rates", "16", "inf", "--requests", "16", "--output-len", "16", "--repeats", "7",
               "--rate-repeats", "1"]),
        Entry("vllm", "benchmarks.vllm", in_suite=False),  # vLLM stock vs the vmkv plugin: needs vLLM, minutes
        Entry("two_engines", "benchmarks.two_engines", in_suite=False),  # two engine processes, alternating bursts
    )
}


# ---- vmkv info ---------------------------------------------------------------------------------
def _try(fn: Callable[[], Any]) -> tuple[Any, str]:
    """``(value, "")`` or ``(None, reason)`` if ``fn`` raises."""
    try:
        return fn(), ""
    except Exception as exc:  # noqa: BLE001 - every reason is reported, none is hidden
        return None, f"{type(exc).__name__}: {exc}"


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def info_lines() -> list[str]:
    """What ``vmkv info`` prints: versions, backends, granularity, kernels per mode with reasons."""
    import torch

    import vmkv

    from .kernels.contiguous import select_contiguous_kernel, torch_varlen_features
    from .vm import HostVirtualMemory

    lines = [f"vmkv {vmkv.__version__}  python {platform.python_version()}  torch {torch.__version__}  ({platform.platform()})", ""]
    lines.append("Virtual-memory backends")
    _, why = _try(lambda: HostVirtualMemory(mmap.PAGESIZE, 1).close())
    lines.append(f"  host  {'available' if why == '' else 'unavailable: ' + why}; granularity {mmap.PAGESIZE} B (Linux mmap + memfd)")
    cuda_gran, cuda_why = _try(_cuda_granularity)
    if cuda_why:
        lines.append(f"  cuda  unavailable: {cuda_why}")
    else:
        lines.append(f"  cuda  available on {torch.cuda.get_device_name()}; granularity {cuda_gran} B (CUDA driver VMM)")
    features = torch_varlen_features()
    lines += ["", "Contiguous (VMM) mode kernels"]
    lines.append(f"  cpu   {select_contiguous_kernel(torch.device('cpu'))[0]} (torch SDPA: a step's decode rows in one batched call or one call per sequence, by a measured rule)")
    lines += _cuda_contiguous_lines()
    lines += ["", "Paged mode kernels"]
    lines += _paged_kernel_lines(features)
    lines += ["", "Optional packages"]
    for extra, names in (("hf", ["transformers"]), ("serve", ["fastapi", "uvicorn"]), ("bench", ["matplotlib", "tqdm"]),
                         ("cuda", ["cuda.bindings"]), ("flash", ["flash_attn"]), ("optional", ["flashinfer"])):
        states = ", ".join(f"{n} {'yes' if _installed_safe(n) else 'no'}" for n in names)
        lines.append(f"  [{extra}] {states}")
    return lines


def _installed_safe(name: str) -> bool:
    try:
        return _installed(name)
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        return False


def _cuda_granularity() -> int:
    import torch

    from .vm import granularity

    return granularity(torch.device("cuda"))


def _cuda_contiguous_lines() -> list[str]:
    """The CUDA contiguous kernels as the selector judges them, for an sm80+ GPU (this machine's
    own GPU when it has one) and a float16 cache of head_dim 128: this machine's flash-attn and torch."""
    import torch

    from .kernels.contiguous import (
        CudaKernelFacts,
        choose_contiguous_kernel,
        contiguous_kernel_unavailable,
        flash_varlen_has_seqused_k,
        optional_import,
    )

    device = torch.device("cuda", 0)
    facts = CudaKernelFacts.probe(device)
    where = "this GPU"
    if facts.capability is None:
        facts = CudaKernelFacts((8, 0), optional_import("flash_attn", "flash_attn_with_kvcache")[1], flash_varlen_has_seqused_k())
        where = "an sm80+ GPU"
    lines = []
    for name in ("flash_attn_with_kvcache", "varlen_attn_seqused"):
        why = contiguous_kernel_unavailable(name, device, torch.float16, 128, facts)
        lines.append(f"  {'cuda' if not lines else '    '}  {name}: {why or 'available'}")
    name, _ = choose_contiguous_kernel(device, torch.float16, 128, facts)
    lines.append(f"        chosen on {where}, float16, head_dim 128: {name}")
    return lines


def _paged_kernel_lines(features: set[str]) -> list[str]:
    import torch

    try:
        from .kernels.paged import KERNELS, choose_paged_kernel
    except ImportError as exc:
        return [f"  paged mode unavailable: {exc}"]
    lines = [f"  kernels: {', '.join(KERNELS)}"]
    flash, flashinfer = _installed("flash_attn"), _installed("flashinfer")
    cases = (("cpu", torch.float32, 16), ("cuda", torch.float16, 16), ("cuda", torch.float16, 256))
    for device, dtype, block in cases:
        name, why = choose_paged_kernel(torch.device(device), dtype, 128, block,
                                        flash_attn=flash, flashinfer=flashinfer, varlen_features=features)
        dtype_name = str(dtype).removeprefix("torch.")
        lines.append(f"  {device:4s}  {dtype_name}, block {block:3d}: {name} ({why})")
    return lines


# ---- vmkv bench --------------------------------------------------------------------------------
def _common_parser(defaults: bool) -> argparse.ArgumentParser:
    """The options every benchmark takes; without ``defaults`` they stay unset when absent
    (so options given before the benchmark name are not overwritten by defaults after it)."""
    parser = argparse.ArgumentParser(add_help=False)
    pick = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=pick("cpu"), help="where the caches live (default cpu)")
    parser.add_argument("--smoke", action="store_true", default=pick(False), help="tiny sizes: seconds per benchmark (CI)")
    parser.add_argument("--seed", type=int, default=pick(0), help="seed of traces and data (default 0)")
    parser.add_argument("--out", type=Path, default=pick(Path("bench-out")), help="directory for JSON, PNG and report.md (default bench-out/)")
    parser.add_argument("--no-plots", action="store_true", default=pick(False), help="write JSON only")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=pick(None), help="progress bars (default: when stderr is a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false", default=pick(None))
    return parser


def load_module(entry: Entry) -> tuple[ModuleType | None, str]:
    """Import a benchmark module; ``(None, reason)`` if it is missing or fails to import."""
    try:
        module = importlib.import_module(entry.module)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported and skipped
        return None, f"{entry.module} could not be imported ({type(exc).__name__}: {exc})"
    missing = [attr for attr in ("NAME", "add_arguments", "run") if not hasattr(module, attr)]
    if missing:
        return None, f"{entry.module} does not follow the benchmark contract (missing {', '.join(missing)})"
    return module, ""


def _module_args(module: ModuleType, entry: Entry, argv: list[str], common: argparse.Namespace) -> argparse.Namespace:
    """Parse a module's own options from ``argv``; common options may also appear there."""
    parser = argparse.ArgumentParser(prog=f"vmkv bench {entry.name}", description=getattr(module, "DESCRIPTION", None),
                                     parents=[_common_parser(defaults=False)])
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    for name, value in vars(common).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    if args.progress is None:
        args.progress = sys.stderr.isatty()
    return args


def run_one(module: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Run a benchmark, write its JSON (with its verdicts) and plots, print its table and verdicts;
    return an index record."""
    from benchmarks import common

    start = time.perf_counter()
    result = module.run(args)
    seconds = time.perf_counter() - start
    result["verdicts"] = _verdicts(module, result)
    json_path = common.write_json(result, args.out)
    plots: list[str] = []
    if not args.no_plots and hasattr(module, "plot"):
        plots, why = _try(lambda: module.plot(result, args.out))
        if why:
            print(f"[{result['name']}] no plot: {why}", file=sys.stderr)
            plots = []
    print(f"\n== {result['name']} ({seconds:.0f} s) ==")
    if hasattr(module, "table"):  # the module's own condensed view of its rows
        print(common.format_table(module.table(result)))
    else:
        print(common.format_table(result["rows"], list(result["schema"]) if result.get("schema") else None))
    if result["verdicts"]:
        print()
        print(common.format_verdicts(result["verdicts"]))
    # file names, not paths: suite.json and report.md live in the same directory as the files
    return {"name": result["name"], "status": "ok", "seconds": seconds, "json": json_path.name,
            "plots": [Path(p).name for p in plots],
            "verdicts": result["verdicts"]}


def _verdicts(module: ModuleType, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The module's verdicts as JSON dicts (none if it gives none); a failure becomes a line."""
    if not hasattr(module, "verdicts"):
        return []
    verdicts, why = _try(lambda: [v.as_dict() for v in module.verdicts(result)])
    if why:
        print(f"[{result['name']}] no verdict: {why}", file=sys.stderr)
        return [{"key": f"{result['name']}.error", "question": f"{result['name']}: verdict", "result": "error",
                 "spread": "", "winner": "no verdict", "side": "", "reliable": False, "note": why}]
    return verdicts


def _suite_names(requested: str | None, full: bool) -> list[str]:
    """The benchmark asked for, else the quick suite, or with ``full`` every registered one."""
    if requested:
        return [requested]
    return [name for name, entry in REGISTRY.items() if entry.in_suite or full]


def bench(ns: argparse.Namespace) -> int:
    """``vmkv bench``: one benchmark, or the default suite; returns the exit status."""
    if ns.list:
        for name, entry in REGISTRY.items():
            module_ok = importlib.util.find_spec(entry.module) is not None
            print(f"{name:10s} {entry.module}{'' if module_ok else '  (missing)'}{'  [suite]' if entry.in_suite else ''}")
        return 0
    if ns.name is not None and ns.name not in REGISTRY:
        print(f"vmkv bench: unknown benchmark {ns.name!r}; choose from {', '.join(REGISTRY)}", file=sys.stderr)
        return 2
    device_error = _device_unavailable(ns.device)
    if device_error:  # said once, before any benchmark runs or any file is written
        print(f"vmkv bench: {device_error}", file=sys.stderr)
        return 2
    common_ns = argparse.Namespace(**{k: getattr(ns, k) for k in (*COMMON_OPTIONS, "no_plots", "progress")})
    out = common_ns.out  # a single benchmark may set --out after its name: then its own wins
    records = []
    names = _suite_names(ns.name, ns.full)
    for name in names:
        entry = REGISTRY[name]
        module, why = load_module(entry)
        if module is None:
            print(f"[{name}] skipped: {why}", file=sys.stderr)
            records.append({"name": name, "status": "unavailable", "reason": why})
            continue
        preset = [] if ns.smoke or ns.full else list(entry.suite_argv)  # the module's own sizes
        args = _module_args(module, entry, ns.rest if ns.name else preset, common_ns)
        device_error = _device_unavailable(args.device)  # --device given after the benchmark's name
        if device_error:
            print(f"vmkv bench: {device_error}", file=sys.stderr)
            return 2
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out if ns.name else out
        if len(names) > 1:
            print(f"[{len(records) + 1}/{len(names)}] {name}: {getattr(module, 'DESCRIPTION', '')}", file=sys.stderr)
        try:
            records.append({**run_one(module, args), "options": ns.rest if ns.name else preset})
        except Exception as exc:  # noqa: BLE001 - one failing benchmark does not stop the suite
            print(f"[{name}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            if ns.name:
                traceback.print_exc()
            records.append({"name": name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"})
    out.mkdir(parents=True, exist_ok=True)
    report = write_report(out, _merge_records(out / "suite.json", records))
    _print_suite(records, out, report)
    return 0 if all(r["status"] == "ok" for r in records) else 1


def _device_unavailable(device: str) -> str:
    """Why benchmarks cannot run on ``device`` ('' if they can)."""
    from benchmarks.common import check_device

    _, why = _try(lambda: check_device(device))
    return why.split(": ", 1)[-1]


def _merge_records(path: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Update ``suite.json`` in the output directory with ``records`` (one per benchmark name,
    the newest wins, registry order) so one benchmark run alone keeps the others' results."""
    by_name = {r["name"]: r for r in (json.loads(path.read_text())["records"] if path.exists() else [])}
    by_name.update({r["name"]: r for r in records})
    order = [name for name in REGISTRY if name in by_name] + [name for name in by_name if name not in REGISTRY]
    merged = [by_name[name] for name in order]
    path.write_text(json.dumps({"records": merged}, indent=1, default=str) + "\n")
    return merged


def _print_suite(records: list[dict[str, Any]], out: Path, report: Path) -> None:
    """The run's index (status, seconds, files written), then the verdict table, last."""
    from benchmarks.common import format_table, format_verdicts

    table = [{"benchmark": r["name"], "status": r["status"], "seconds": f"{r['seconds']:.0f}" if "seconds" in r else "",
              "detail": r.get("reason") or ", ".join(Path(p).name for p in [r["json"], *r.get("plots", [])])}
             for r in records]
    print("\n" + format_table(table, wrap={"detail": 70}))
    written = [report.name, "suite.json"] if any(r["status"] == "ok" for r in records) else []
    if written:
        print(f"\nresults in {out}/: {', '.join(written)} and the files above")
    verdicts = [v for r in records if r["status"] == "ok" for v in r.get("verdicts", [])]
    if verdicts:
        print("\n== verdict ==")
        print(format_verdicts(verdicts))


def write_report(out: Path, records: list[dict[str, Any]]) -> Path:
    """``out/report.md``: the verdict table first, then every result's command, table and plots."""
    from benchmarks.common import format_table, format_verdicts

    ok = [r for r in records if r["status"] == "ok"]
    parts = ["# vmkv benchmark results", ""]
    verdicts = [v for r in ok for v in r.get("verdicts", [])]
    if verdicts:
        parts += ["## Verdict", "", format_verdicts(verdicts, markdown=True), ""]
    for record in records:
        parts += [f"## {record['name']}", ""]
        if record["status"] != "ok":
            parts += [f"{record['status']}: {record.get('reason', '')}", ""]
            continue
        path = out / Path(record["json"]).name
        if not path.exists():
            parts += [f"(its result file {path.name} is no longer in {out})", ""]
            continue
        result = json.loads(path.read_text())
        command = " ".join(["vmkv bench", record["name"], *(record.get("options") or [])])
        parts += [f"`{command}`: {record['seconds']:.0f} s", ""]
        if result["rows"]:
            columns = list(result["schema"]) if result.get("schema") else None
            parts += [format_table(result["rows"], columns, markdown=True), ""]
        parts += [f"![{record['name']}]({Path(p).name})" for p in record.get("plots", [])] + [""]
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path


# ---- vmkv serve --------------------------------------------------------------------------------
def serve(rest: list[str]) -> int:
    """``vmkv serve``: parse ``rest`` with :mod:`vmkv.server.cli` and run the server."""
    try:
        server_cli = importlib.import_module("vmkv.server.cli")
        parser = argparse.ArgumentParser(prog="vmkv serve", description="OpenAI-compatible server over a vmkv cache")
        server_cli.add_arguments(parser)
    except ImportError as exc:
        print(f"vmkv serve needs the serve extra: {install_hint('serve')} ({exc})", file=sys.stderr)
        return 2
    try:
        return int(server_cli.run(parser.parse_args(rest)) or 0)
    except ImportError as exc:
        print(f"vmkv serve needs the serve extra: {install_hint('serve')} ({exc})", file=sys.stderr)
        return 2


# ---- entry point -------------------------------------------------------------------------------
class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that refuses unknown options with its own usage (plain argparse hands
    them back to the top-level parser, whose usage does not list the subcommand's options)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (benchmark and server options are parsed by their own modules)."""
    import vmkv

    parser = argparse.ArgumentParser(prog="vmkv", description="KV-cache memory managed like virtual memory: info, benchmarks, server")
    parser.add_argument("--version", action="version", version=f"vmkv {vmkv.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    sub.add_parser("info", help="backends, page granularity, kernels per mode and why")
    bench_parser = sub.add_parser(
        "bench", parents=[_common_parser(defaults=True)], help="run the benchmark suite or one benchmark",
        description="Without a name: the quick default suite. With a name: that benchmark; "
                    "`vmkv bench <name> --help` lists its options.",
    )
    bench_parser.add_argument("--list", action="store_true", help="list the registered benchmarks")
    bench_parser.add_argument("--full", action="store_true",
                              help="suite: run every benchmark with its own (fuller) defaults, not the quick presets")
    bench_parser.add_argument("name", nargs="?", help=f"one of: {', '.join(REGISTRY)}")
    bench_parser.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    serve_parser = sub.add_parser("serve", add_help=False, help="OpenAI-compatible server (vmkv serve --help)")
    serve_parser.add_argument("rest", nargs=argparse.REMAINDER)
    ledger_parser = sub.add_parser("ledger", help="members of a shared KV budget (shared_budget=NAME:SIZE)")
    ledger_parser.add_argument("name", help="the ledger's name (or path)")
    ledger_parser.add_argument("--reap", action="store_true", help="first free what dead members hold")
    return parser


def show_ledger(name: str, reap: bool) -> int:
    """``vmkv ledger NAME``: print the ledger's report; 1 if it does not exist or cannot be read."""
    from .errors import VMKVError
    from .ledger import report

    try:
        print("\n".join(report(name, reap=reap)))
    except FileNotFoundError:
        print(f"vmkv ledger: no ledger named {name!r} (it appears when a cache with shared_budget='{name}:SIZE' "
              "opens, and goes with its last member)", file=sys.stderr)
        return 1
    except VMKVError as exc:
        print(f"vmkv ledger: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vmkv`` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve` belongs to the server's own parser
        return serve(argv[1:])
    ns = build_parser().parse_args(argv)
    if ns.command == "bench" and not ns.list:
        missing = [name for name in BENCH_EXTRA if not _installed_safe(name)]
        if missing:
            print(f"vmkv bench needs the bench extra: {install_hint('bench')} (missing: {', '.join(missing)})",
                  file=sys.stderr)
            return 2
    if ns.command == "info":
        print("\n".join(info_lines()))
        return 0
    if ns.command == "ledger":
        return show_ledger(ns.name, ns.reap)
    return bench(ns)


if __name__ == "__main__":
    sys.exit(main())
