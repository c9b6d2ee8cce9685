"""The benchmark suite behind ``vmkv bench``: the registry, the quick presets per device, the
checks made before anything runs, running, the verdict table and ``report.md``.

::

    vmkv bench                         the quick suite on the CPU (a few minutes): tables, JSON and
                                       PNG plots in --out (default bench-out/), the verdict last
    vmkv bench --device cuda           the quick suite's GPU preset (every benchmark on CUDA)
    vmkv bench --full                  every benchmark with its own, fuller defaults (docs)
    vmkv bench <name> [options]        one benchmark with its own options (--help lists them)
    vmkv bench --list                  the registry

The ``vmkv`` command finds this module through the ``vmkv.commands`` entry point pyproject.toml
declares (``bench = "vmkv_bench.suite"``): the library never imports the benchmarks.
``python -m vmkv_bench.suite [options]`` is ``vmkv bench [options]``.

Before any benchmark runs: its options are parsed, the device is checked, each benchmark's
``refusals`` (if it has one) says what its options would ask of the device's backend that the
backend refuses (a page size that is not a multiple of the granularity, say), and every output
directory is created and a probe file written and removed there: any of these failing is one
line on stderr and exit status 2, with nothing run. Benchmark modules are
imported only when needed; one that is missing or fails to import is reported plainly and the
others still run. Every module follows the contract described in :mod:`vmkv_bench.common`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from vmkv.extras import attempt, install_hint, installed

HELP = "run the benchmark suite or one benchmark"
DEVICES = ("cpu", "cuda")
COMMON_OPTIONS = ("device", "smoke", "seed", "out", "no_plots", "progress")
BENCH_EXTRA = ("matplotlib", "tqdm", "transformers")  # what the bench extra brings (plots, bars, generate)


@dataclass(frozen=True)
class Entry:
    """A registered benchmark: its module and, per device, the options the quick suite runs it
    with (``vmkv bench <name>`` alone runs the module's own, fuller defaults). ``in_suite=False``:
    not in the quick suite, only in ``--full`` and by name."""

    name: str
    module: str
    presets: dict[str, list[str]] = field(default_factory=dict)
    in_suite: bool = True


def _same_on(devices: tuple[str, ...], options: list[str]) -> dict[str, list[str]]:
    """One preset for each of ``devices``."""
    return {device: list(options) for device in devices}


# The GPU presets (`vmkv bench --device cuda`) keep the whole suite within about 3 minutes on an
# H200 (docs/benchmarks.md says how that was estimated) and measure a model large enough for the
# GPU's work to show where a model runs: generate's 1b model (Llama-3.2-1B's shape, random weights).
REGISTRY: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        Entry("memory", "vmkv_bench.memory", {
            "cpu": ["--requests", "sharegpt=120", "alpaca=300", "--budget", "sharegpt=1GiB", "alpaca=256MiB", "--page-sizes", "2MiB"],
            # half the requests on CUDA: every 2 MiB page maps and unmaps through the driver (96 s on an H200 at the CPU's)
            "cuda": ["--requests", "sharegpt=60", "alpaca=150", "--budget", "sharegpt=1GiB", "alpaca=256MiB", "--page-sizes", "2MiB"],
        }),
        Entry("decode", "vmkv_bench.decode", {
            "cpu": ["--batches", "1", "8", "32", "--contexts", "512", "2048", "--repeat", "7", "--paged-kernels", "selected"],
            "cuda": ["--batches", "8", "32", "--contexts", "2048", "8192", "--repeat", "7", "--paged-kernels", "selected",
                     "--threads", "0"],
        }),
        Entry("mapping", "vmkv_bench.mapping", {
            "cpu": ["--steps", "128", "--rounds", "11", "--pages", "128", "--decode-page-sizes", "4KiB"],
            "cuda": ["--steps", "128", "--rounds", "7", "--pages", "128", "--page-sizes", "2MiB", "--decode-page-sizes", "2MiB",
                     "--shape", "llama3-8b", "--layout", "all_layers"],
        }),
        Entry("sharing", "vmkv_bench.sharing", {
            "cpu": ["--traces", "alpaca", "--requests", "3", "--widths", "2", "6"],
            # the same replays (the trace draws stay under 512 tokens) in a 4x smaller budget: CUDA creates its pages at open
            "cuda": ["--traces", "alpaca", "--requests", "3", "--widths", "2", "6", "--max-seq-len", "512"],
        }),
        Entry("generate", "vmkv_bench.generate", {
            "cpu": ["--models", "small", "--prompt-len", "64", "--new-tokens", "256", "--batch-sizes", "8",
                    "--beam-new-tokens", "32", "--caches", "dynamic", "static", "vmm", "vmm+vmkv", "bound", "--repeats", "7"],
            # StaticCache is left out on CUDA: generate() compiles the model for it there (tens of seconds a shape)
            "cuda": ["--models", "1b", "--prompt-len", "64", "--new-tokens", "64", "--batch-sizes", "8",
                     "--beam-new-tokens", "16", "--caches", "dynamic", "vmm", "vmm+vmkv", "bound", "--repeats", "3"],
        }),
        Entry("serve", "vmkv_bench.serve", {
            "cpu": ["--concurrency", "1", "8", "--rates", "16", "inf", "--requests", "16", "--output-len", "16", "--repeats", "7",
                    "--rate-repeats", "1"],
            "cuda": ["--concurrency", "1", "8", "--rates", "16", "inf", "--requests", "16", "--output-len", "16", "--repeats", "5",
                     "--rate-repeats", "1"],
        }),
        Entry("vllm", "vmkv_bench.vllm", in_suite=False),  # vLLM stock vs the vmkv plugin: needs vLLM, minutes
        Entry("two_engines", "vmkv_bench.two_engines", in_suite=False),  # two engine processes, alternating bursts
    )
}


# ---- options -----------------------------------------------------------------------------------
def common_parser(defaults: bool) -> argparse.ArgumentParser:
    """The options every benchmark takes; without ``defaults`` they stay unset when absent
    (so options given before the benchmark name are not overwritten by defaults after it)."""
    parser = argparse.ArgumentParser(add_help=False)
    pick = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    parser.add_argument("--device", choices=list(DEVICES), default=pick("cpu"),
                        help="where the caches live (default cpu; cuda runs the GPU presets)")
    parser.add_argument("--smoke", action="store_true", default=pick(False), help="tiny sizes: seconds per benchmark (CI)")
    parser.add_argument("--seed", type=int, default=pick(0), help="seed of traces and data (default 0)")
    parser.add_argument("--out", type=Path, default=pick(Path("bench-out")), help="directory for JSON, PNG and report.md (default bench-out/)")
    parser.add_argument("--no-plots", action="store_true", default=pick(False), help="write JSON only")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=pick(None), help="progress bars (default: when stderr is a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false", default=pick(None))
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``vmkv bench`` (a benchmark's own options are parsed by its module)."""
    parser = argparse.ArgumentParser(
        prog="vmkv bench", parents=[common_parser(defaults=True)],
        description="Without a name: the quick suite (its presets for --device). With a name: that benchmark; "
                    "`vmkv bench <name> --help` lists its options.",
    )
    parser.add_argument("--list", action="store_true", help="list the registered benchmarks")
    parser.add_argument("--full", action="store_true",
                        help="suite: run every benchmark with its own (fuller) defaults, not the quick presets")
    parser.add_argument("name", nargs="?", help=f"one of: {', '.join(REGISTRY)}")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    return parser


def preset(entry: Entry, device: str, *, smoke: bool = False, full: bool = False) -> list[str]:
    """The options the suite runs ``entry`` with on ``device``: none with ``smoke`` or ``full``
    (the module's own sizes), else its quick preset for that device (none if it has none).

    Raises:
        vmkv.InvalidConfig: ``device`` is not one of :data:`DEVICES`.
    """
    import vmkv

    if device not in DEVICES:
        raise vmkv.InvalidConfig(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    return [] if smoke or full else list(entry.presets.get(device, []))


def module_args(module: ModuleType, entry: Entry, argv: list[str], common: argparse.Namespace) -> argparse.Namespace:
    """Parse a module's own options from ``argv`` (common options may also appear there; those
    not given take ``common``'s values).

    Raises:
        SystemExit: an option the module does not take (argparse prints the usage).
    """
    parser = argparse.ArgumentParser(prog=f"vmkv bench {entry.name}", description=getattr(module, "DESCRIPTION", None),
                                     parents=[common_parser(defaults=False)])
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    for name, value in vars(common).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    if args.progress is None:
        args.progress = sys.stderr.isatty()
    return args


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


# ---- checks made before anything runs ----------------------------------------------------------
def device_unavailable(device: str) -> str:
    """Why benchmarks cannot run on ``device`` ('' if they can)."""
    from vmkv_bench.common import check_device

    _, why = attempt(lambda: check_device(device))
    return why.split(": ", 1)[-1]


def granularity(device: str) -> int:
    """The smallest page the backend of ``device`` maps (4 KiB on the host, 2 MiB on CUDA)."""
    import torch

    from vmkv.vm import granularity as backend_granularity

    return backend_granularity(torch.device(device))


PROBE_BYTES = 4096


def unwritable(out: Path) -> str:
    """Why results cannot be written to the directory ``out`` ('' if they can): it is created
    (with its parents) and a probe file written, flushed to the disk and removed there. On
    failure, the directories this call created are removed again.

    Returns:
        The reason, e.g. ``"Not a directory"`` or ``"No space left on device"``; ``""`` when writable.
    """
    created = [p for p in (out, *out.parents) if not p.exists()]
    probe = out / f".vmkv-bench-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"\0" * PROBE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())  # a full disk refuses the blocks here, not at open
        probe.unlink()
    except OSError as exc:
        if probe.is_file():
            probe.unlink()
        for path in created:  # deepest first
            if path.is_dir():
                path.rmdir()
        return exc.strerror or str(exc)
    return ""


@dataclass
class Job:
    """One benchmark the run will start: its entry, module, parsed options and what they were."""

    entry: Entry
    module: ModuleType
    args: argparse.Namespace
    options: list[str]


def _refused(job: Job, pages: Callable[[str], int]) -> str:
    """What ``job``'s options ask of its device's backend that the backend refuses ('' if
    nothing): the module's ``refusals``, pure, with the device's granularity."""
    if not hasattr(job.module, "refusals"):
        return ""
    gran = pages(job.args.device)
    refused, why = attempt(lambda: job.module.refusals(job.args, gran))
    if why:  # an option the module itself refuses (an unknown allocator, say)
        return why
    if not refused:
        return ""
    what = "; ".join(f"{label}: {why}" for label, why in refused.items())
    return f"on {job.args.device} (pages are multiples of {gran} B) the backend refuses {what}"


def preflight(jobs: list[Job], pages: Callable[[str], int] | None = None) -> str:
    """Every check made before a benchmark runs: the devices, what each benchmark's options ask
    of its device's backend (``pages``: device -> granularity, default :func:`granularity`),
    then the output directories (the one check that writes, so last). The first failure as one
    line; '' if none."""
    for device in dict.fromkeys(job.args.device for job in jobs):
        why = device_unavailable(device)
        if why:
            return why
    for job in jobs:
        why = _refused(job, pages or granularity)
        if why:
            return f"{job.entry.name} cannot run with its options: {why}"
    for out in dict.fromkeys(job.args.out for job in jobs):
        why = unwritable(out)
        if why:
            return f"cannot write results to --out {out}: {why}"
    return ""


# ---- running -----------------------------------------------------------------------------------
def run_one(module: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Run a benchmark, write its JSON (with its verdicts) and plots, print its table and verdicts;
    return an index record."""
    from vmkv_bench import common

    start = time.perf_counter()
    result = module.run(args)
    seconds = time.perf_counter() - start
    result["verdicts"] = _verdicts(module, result)
    json_path = common.write_json(result, args.out)
    plots: list[str] = []
    if not args.no_plots and hasattr(module, "plot"):
        plots, why = attempt(lambda: module.plot(result, args.out))
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
    verdicts, why = attempt(lambda: [v.as_dict() for v in module.verdicts(result)])
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


def _jobs(ns: argparse.Namespace) -> tuple[list[Job], list[dict[str, Any]]]:
    """Every benchmark of the run with its options parsed (nothing runs yet), and a record for
    each that could not be imported."""
    common_ns = argparse.Namespace(**{k: getattr(ns, k) for k in COMMON_OPTIONS})
    jobs, unavailable = [], []
    for name in _suite_names(ns.name, ns.full):
        entry = REGISTRY[name]
        module, why = load_module(entry)
        if module is None:
            print(f"[{name}] skipped: {why}", file=sys.stderr)
            unavailable.append({"name": name, "status": "unavailable", "reason": why})
            continue
        options = list(ns.rest) if ns.name else preset(entry, ns.device, smoke=ns.smoke, full=ns.full)
        jobs.append(Job(entry, module, module_args(module, entry, options, common_ns), options))
    return jobs, unavailable


def _run_jobs(jobs: list[Job], single: bool) -> list[dict[str, Any]]:
    """Run every job in turn: one failing benchmark does not stop the others."""
    records = []
    for number, job in enumerate(jobs, 1):
        name = job.entry.name
        if len(jobs) > 1:
            print(f"[{number}/{len(jobs)}] {name}: {getattr(job.module, 'DESCRIPTION', '')}", file=sys.stderr)
        try:
            records.append({**run_one(job.module, job.args), "options": job.options})
        except Exception as exc:  # noqa: BLE001 - one failing benchmark does not stop the suite
            print(f"[{name}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            if single:
                traceback.print_exc()
            records.append({"name": name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"})
    return records


def run(ns: argparse.Namespace) -> int:
    """One benchmark, or the suite, from parsed ``vmkv bench`` options; returns the exit status."""
    why = device_unavailable(ns.device)
    if why:  # said once, before any benchmark is imported, runs, or any file is written
        print(f"vmkv bench: {why}", file=sys.stderr)
        return 2
    jobs, unavailable = _jobs(ns)
    why = preflight(jobs)
    if why:
        print(f"vmkv bench: {why}", file=sys.stderr)
        return 2
    out = jobs[0].args.out if ns.name and jobs else ns.out  # a single benchmark may set --out after its name
    records = unavailable + _run_jobs(jobs, single=bool(ns.name))
    try:
        out.mkdir(parents=True, exist_ok=True)
        report = write_report(out, _merge_records(out / "suite.json", records))
    except OSError as exc:
        print(f"vmkv bench: cannot write the report to {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    _print_suite(records, out, report)
    return 0 if all(r["status"] == "ok" for r in records) else 1


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
    from vmkv_bench.common import format_table, format_verdicts

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
    from vmkv_bench.common import format_table, format_verdicts

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


def print_registry() -> None:
    """``vmkv bench --list``: every benchmark, its module (or that it is missing), whether the
    quick suite runs it and on which devices it has a preset."""
    for name, entry in REGISTRY.items():
        module_ok = installed(entry.module)
        presets = f"  [suite: {', '.join(entry.presets)}]" if entry.in_suite else ""
        print(f"{name:11s} {entry.module}{'' if module_ok else '  (missing)'}{presets}")


def main(argv: list[str] | None = None) -> int:
    """``vmkv bench`` (the ``vmkv.commands`` entry point's command): returns the exit status.

    Raises:
        SystemExit: ``--help``, or an option ``vmkv bench`` or the benchmark does not take.
    """
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.list:
        print_registry()
        return 0
    missing = [name for name in BENCH_EXTRA if not installed(name)]
    if missing:
        print(f"vmkv bench needs the bench extra: {install_hint('bench')} (missing: {', '.join(missing)})", file=sys.stderr)
        return 2
    if ns.name is not None and ns.name not in REGISTRY:
        print(f"vmkv bench: unknown benchmark {ns.name!r}; choose from {', '.join(REGISTRY)}", file=sys.stderr)
        return 2
    return run(ns)


if __name__ == "__main__":
    sys.exit(main())
