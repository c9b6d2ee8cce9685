"""The one runner: ``vmkv bench`` (:func:`main`: benchmarks in this process) and the GPU check
(:func:`check_main`: each section in a process of its own, within a time budget)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from vmkv.extras import attempt, install_hint, installed
from vmkv.validate import as_device

from .registry import BENCHMARKS, SECTIONS, Entry

HELP = "run the benchmark suite or one benchmark"
DEVICES = ("cpu", "cuda")
COMMON_OPTIONS = ("device", "smoke", "seed", "out", "no_plots", "progress")
BENCH_EXTRA = ("matplotlib", "tqdm", "transformers")  # what the bench extra brings (plots, bars, generate)
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"  # the GPU check's command; its sections' processes run it with --worker
DEFAULT_BUDGET_S = 480  # the whole GPU check on an H200: GPU time is lent by the quarter hour
EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3
HEADLINE_WIDTH = 110
OPTIONAL_PACKAGES = {"flash-attn": ("flash_attn", "flash-attn"), "FlashInfer": ("flashinfer", "flashinfer-python"),
                     "vLLM": ("vllm", "vllm"), "triton": ("triton", "triton")}  # shown -> (module, distribution)
ERROR_MARKS = ("Error", "error:", "Assertion", "Traceback", "what():")  # lines kept from a crashed section's output


# ---- processes, for both commands ----------------------------------------------------------------
@dataclass(frozen=True)
class Finished:
    """How a process run by :func:`run_process` ended (``returncode`` None: killed at its limit)."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def ended(self) -> str:
        """``exit status 0``, ``killed by SIGSEGV``, ``timed out after 5 s``."""
        if self.returncode is None:
            return f"timed out after {self.seconds:.0f} s"
        if self.returncode >= 0:
            return f"exit status {self.returncode}"
        signals = {s.value: s.name for s in signal.Signals}
        return f"killed by {signals.get(-self.returncode, f'signal {-self.returncode}')}"


def run_process(cmd: list[str], timeout: float) -> Finished:
    """Run ``cmd`` in a session of its own; at ``timeout`` kill it with all it started (nothing left on the GPU)."""
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(timeout, 0.1))
        returncode: int | None = proc.returncode
    except BaseException as exc:  # out of time, or this process interrupted: the whole group goes
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        out, err = proc.communicate()
        returncode = None
    return Finished(returncode, out or "", err or "", time.monotonic() - began)


# ---- vmkv bench ----------------------------------------------------------------------------------
@dataclass
class Job:
    """A benchmark about to run: its entry, parsed options, module and the options it was given."""

    entry: Entry
    args: argparse.Namespace
    module: ModuleType
    options: list[str]


def common_parser(defaults: bool) -> argparse.ArgumentParser:
    """The options every benchmark takes; without ``defaults`` absent ones stay unset (given before the name)."""
    parser = argparse.ArgumentParser(add_help=False)
    pick = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    parser.add_argument("--device", choices=list(DEVICES), default=pick("cpu"),
                        help="where the caches live (default cpu; cuda runs the GPU presets)")
    parser.add_argument("--smoke", action="store_true", default=pick(False), help="tiny sizes: seconds per benchmark (CI)")
    parser.add_argument("--seed", type=int, default=pick(0), help="seed of traces and data (default 0)")
    parser.add_argument("--out", type=Path, default=pick(Path("bench-out")),
                        help="directory for JSON, PNG and report.md (default bench-out/)")
    parser.add_argument("--no-plots", action="store_true", default=pick(False), help="write JSON only")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=pick(None),
                          help="progress bars (default: when stderr is a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false", default=pick(None))
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vmkv bench", parents=[common_parser(defaults=True)],
        description="Without a name: the quick suite (its presets for --device). With a name: that benchmark; "
                    "`vmkv bench <name> --help` lists its options.",
    )
    parser.add_argument("--list", action="store_true", help="list the registered benchmarks")
    parser.add_argument("--full", action="store_true",
                        help="suite: run every benchmark with its own (fuller) defaults, not the quick presets")
    parser.add_argument("name", nargs="?", help=f"one of: {', '.join(BENCHMARKS)}")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    return parser


def preset(entry: Entry, device: str, *, smoke: bool = False, full: bool = False) -> list[str]:
    """The quick preset of ``entry`` on ``device``; none with ``smoke`` or ``full`` (the module's own sizes)."""
    import vmkv

    if device not in DEVICES:
        raise vmkv.InvalidConfig(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    return [] if smoke or full else list(entry.presets.get(device, []))


def module_args(module: ModuleType, entry: Entry, argv: list[str], common: argparse.Namespace) -> argparse.Namespace:
    """A module's own options parsed from ``argv``; common options not given there take ``common``'s."""
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
    """Import a benchmark module; ``(None, reason)`` if it is missing, fails or breaks the contract."""
    module, why = attempt(entry.load)
    if why:
        return None, f"{entry.module} could not be imported ({why})"
    missing = [attr for attr in ("NAME", "add_arguments", "run") if not hasattr(module, attr)]
    if missing:
        return None, f"{entry.module} does not follow the benchmark contract (missing {', '.join(missing)})"
    return module, ""


def device_unavailable(device: str) -> str:
    """Why benchmarks cannot run on ``device`` ('' if they can)."""
    from .common import check_device

    _, why = attempt(lambda: check_device(device))
    return why.split(": ", 1)[-1]


def granularity(device: str) -> int:
    """The smallest page the backend of ``device`` maps."""
    import torch

    from vmkv.vm import granularity as backend_granularity

    return backend_granularity(torch.device(device))


def unwritable(out: Path) -> str:
    """Why results cannot be written to ``out`` ('' if they can): a probe file is written to the disk there
    and removed; on failure so is what this call created."""
    created = [p for p in (out, *out.parents) if not p.exists()]
    probe = out / f".vmkv-bench-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 4096)
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


def _refused(job: Job) -> str:
    """Why the backend of its device refuses what ``job``'s options ask of it ('' if nothing)."""
    if not hasattr(job.module, "refusals"):
        return ""
    gran = granularity(job.args.device)
    refused, why = attempt(lambda: job.module.refusals(job.args, gran))
    if why or not refused:  # why: an option the module itself refuses (an unknown allocator, say)
        return why
    what = "; ".join(f"{label}: {why}" for label, why in refused.items())
    return f"on {job.args.device} (pages are multiples of {gran} B) the backend refuses {what}"


def preflight(jobs: list[Job]) -> str:
    """Every check made before a benchmark runs, the first failure as one line ('' if none): the
    devices, what the options ask of the backend, then (the one check that writes) the outputs."""
    for device in dict.fromkeys(job.args.device for job in jobs):
        why = device_unavailable(device)
        if why:
            return why
    for job in jobs:
        why = _refused(job)
        if why:
            return f"{job.entry.name} cannot run with its options: {why}"
    for out in dict.fromkeys(job.args.out for job in jobs):
        why = unwritable(out)
        if why:
            return f"cannot write results to --out {out}: {why}"
    return ""


def run_one(module: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Run a benchmark, write its JSON and plots, print its table and verdicts; its ``suite.json`` record."""
    from . import common

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
    print(f"\n== {result['name']} ({seconds:.0f} s) ==")
    if hasattr(module, "table"):
        print(_tables(module.table(result)))
    else:
        print(common.format_table(result["rows"], list(result["schema"]) if result.get("schema") else None))
    if result["verdicts"]:
        print("\n" + common.format_verdicts(result["verdicts"]))
    # file names: suite.json and report.md live in the same directory
    return {"name": result["name"], "status": "ok", "seconds": seconds, "json": json_path.name,
            "plots": [Path(p).name for p in plots or []], "verdicts": result["verdicts"]}


def _tables(found: list[dict[str, Any]] | dict[str, list[dict[str, Any]]]) -> str:
    """A module's ``table()``: its rows, or several tables by title (``""``: untitled)."""
    from . import common

    if not isinstance(found, dict):
        return common.format_table(found)
    return "\n\n".join((f"{title}:\n" if title else "") + common.format_table(rows) for title, rows in found.items())


def _verdicts(module: ModuleType, result: dict[str, Any]) -> list[dict[str, Any]]:
    if not hasattr(module, "verdicts"):
        return []
    verdicts, why = attempt(lambda: [v.as_dict() for v in module.verdicts(result)])
    if why:
        print(f"[{result['name']}] no verdict: {why}", file=sys.stderr)
        return [{"key": f"{result['name']}.error", "question": f"{result['name']}: verdict", "result": "error",
                 "spread": "", "winner": "no verdict", "side": "", "reliable": False, "note": why}]
    return verdicts


def _run_here(job: Job, number: int, count: int, single: bool) -> dict[str, Any]:
    """Benchmark ``number`` of ``count`` in this process: one that fails is a record, and the others still run."""
    name = job.entry.name
    if count > 1:
        print(f"[{number}/{count}] {name}: {getattr(job.module, 'DESCRIPTION', '')}", file=sys.stderr)
    try:
        return {**run_one(job.module, job.args), "options": job.options}
    except Exception as exc:  # noqa: BLE001
        print(f"[{name}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        if single:
            traceback.print_exc()
        return {"name": name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}


def _jobs(ns: argparse.Namespace) -> tuple[list[Job], list[dict[str, Any]]]:
    """The run's benchmarks with their options parsed, and a record for each that could not be imported."""
    common_ns = argparse.Namespace(**{k: getattr(ns, k) for k in COMMON_OPTIONS})
    entries = [BENCHMARKS[ns.name]] if ns.name else [entry for entry in BENCHMARKS.values() if entry.in_suite or ns.full]
    jobs, unavailable = [], []
    for entry in entries:
        module, why = load_module(entry)
        if module is None:
            print(f"[{entry.name}] skipped: {why}", file=sys.stderr)
            unavailable.append({"name": entry.name, "status": "unavailable", "reason": why})
            continue
        options = list(ns.rest) if ns.name else preset(entry, ns.device, smoke=ns.smoke, full=ns.full)
        jobs.append(Job(entry, module_args(module, entry, options, common_ns), module, options))
    return jobs, unavailable


def run(ns: argparse.Namespace) -> int:
    """One benchmark, or the suite, from parsed ``vmkv bench`` options; the exit status."""
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
    records = unavailable + [_run_here(job, number, len(jobs), single=bool(ns.name)) for number, job in enumerate(jobs, 1)]
    try:
        out.mkdir(parents=True, exist_ok=True)
        report = write_report(out, _merge_records(out / "suite.json", records))
    except OSError as exc:
        print(f"vmkv bench: cannot write the report to {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    _print_suite(records, out, report)
    return 0 if all(r["status"] == "ok" for r in records) else 1


def read_records(suite: Path) -> list[dict[str, Any]]:
    """The records of ``suite.json`` (none if there is none)."""
    return json.loads(suite.read_text())["records"] if suite.exists() else []


def _merge_records(path: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``suite.json`` with ``records`` merged in: one benchmark run alone keeps the others' results."""
    by_name = {r["name"]: r for r in read_records(path)}
    by_name.update({r["name"]: r for r in records})
    order = [name for name in BENCHMARKS if name in by_name] + [name for name in by_name if name not in BENCHMARKS]
    merged = [by_name[name] for name in order]
    path.write_text(json.dumps({"records": merged}, indent=1, default=str) + "\n")
    return merged


def _print_suite(records: list[dict[str, Any]], out: Path, report: Path) -> None:
    """The run's index (status, seconds, files), then the verdict table, last."""
    from .common import format_table, format_verdicts

    table = [{"benchmark": r["name"], "status": r["status"], "seconds": f"{r['seconds']:.0f}" if "seconds" in r else "",
              "detail": r.get("reason") or ", ".join(Path(p).name for p in [r["json"], *r.get("plots", [])])}
             for r in records]
    print("\n" + format_table(table, wrap={"detail": 70}))
    if any(r["status"] == "ok" for r in records):
        print(f"\nresults in {out}/: {report.name}, suite.json and the files above")
    verdicts = [v for r in records if r["status"] == "ok" for v in r.get("verdicts", [])]
    if verdicts:
        print("\n== verdict ==\n" + format_verdicts(verdicts))


def write_report(out: Path, records: list[dict[str, Any]]) -> Path:
    """``out/report.md``: the verdict table first, then every result's command, table and plots."""
    from .common import format_table, format_verdicts

    parts = ["# vmkv benchmark results", ""]
    verdicts = [v for r in records if r["status"] == "ok" for v in r.get("verdicts", [])]
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


def main(argv: list[str] | None = None) -> int:
    """``vmkv bench`` (the ``vmkv.commands`` entry point): the exit status."""
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.list:  # every benchmark, its module (or that it is missing) and its presets
        for name, entry in BENCHMARKS.items():
            presets = f"  [suite: {', '.join(entry.presets)}]" if entry.in_suite else ""
            print(f"{name:11s} {entry.module}{'' if installed(entry.module) else '  (missing)'}{presets}")
        return 0
    missing = [name for name in BENCH_EXTRA if not installed(name)]
    if missing:
        print(f"vmkv bench needs the bench extra: {install_hint('bench')} (missing: {', '.join(missing)})", file=sys.stderr)
        return 2
    if ns.name is not None and ns.name not in BENCHMARKS:
        print(f"vmkv bench: unknown benchmark {ns.name!r}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    return run(ns)


# ---- the GPU check -------------------------------------------------------------------------------
class SectionSkipped(Exception):
    """A section cannot run here; the message says why (recorded, not a failure)."""


@dataclass(frozen=True)
class Context:
    """What a section gets in its process: the device under test (``cuda:N``; ``cpu``: the dry run),
    ``smoke``, the output directory, the command's options, and its deadline."""

    device: Any  # torch.device
    smoke: bool = False
    out: Path = Path("gpu-check-out")
    options: argparse.Namespace | None = None
    deadline: float = float("inf")

    @property
    def shape(self) -> Any:
        """The decode workload: tiny with ``--smoke``."""
        from .decode import FULL, SMOKE

        return SMOKE if self.smoke else FULL

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def package_version(name: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(name)
    return None


def optional_packages() -> dict[str, str | None]:
    """Each optional package's version, ``"installed"`` (no metadata) or ``None``; imports nothing."""
    return {shown: (package_version(dist) or "installed") if installed(module) else None
            for shown, (module, dist) in OPTIONAL_PACKAGES.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The GPU check's command line (``--help`` lists the sections with their estimates)."""
    from vmkv.kernels import registry as kernel_registry

    names = list(SECTIONS)
    listing = "\n".join(f"  {s.name:16s} ~{s.estimate_s:3.0f} s  {s.about}" for s in SECTIONS.values())
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description="Check and measure everything CUDA in vmkv, in one run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"sections (estimated seconds on an H200):\n{listing}\n\n"
               "Exit status: 0 passed, 1 a section failed, 2 bad arguments, 3 no CUDA GPU. See docs/gpu.md.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"),
                        help="directory for gpu_check.json (default: gpu-check-out)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few iterations (a dry run of the code paths)")
    alone = [s.name for s in SECTIONS.values() if s.alone]
    parser.add_argument("--sections", nargs="+", default=[n for n in names if n not in alone], choices=names,
                        metavar="SECTION", help="which sections to run, in this order (default: all but "
                        f"{', '.join(alone) or 'none'}, which run only when named)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds the whole run may take (default {DEFAULT_BUDGET_S}): a section whose estimate does "
                             "not fit in what is left is skipped, with the reason")
    parser.add_argument("--list", action="store_true", help="list the sections with their estimates and exit")
    parser.add_argument("--kernels", nargs="+", default=kernel_registry.names("slots"), choices=kernel_registry.names("slots"),
                        help="contiguous kernels for the decode section (default: all; those that cannot run are skipped "
                             "with the reason)")
    parser.add_argument("--tests", nargs="+", default=["tests/test_cuda.py", "tests/test_triton_kernels.py"],
                        help="pytest paths for the tests section (default: the CUDA backend's tests and the Triton kernels', "
                             "which run compiled on the GPU)")
    parser.add_argument("--test-timeout", type=int, default=240,
                        help="seconds allowed for the tests section's pytest (default 240)")
    parser.add_argument("--section-timeout", type=int, default=360,
                        help="seconds one section's process may run unless it sets its own (default 360); "
                             "the budget left caps it")
    parser.add_argument("--worker", choices=[*names, "write_probe"], help=argparse.SUPPRESS)  # one section, inside its process
    parser.add_argument("--seconds", type=float, default=360.0, help=argparse.SUPPRESS)  # the worker's time limit
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")
    return args


def run_worker(args: argparse.Namespace) -> int:
    """Inside a section's process: run it and write ``DIR/sections/NAME.json`` (a failure too)."""
    import torch

    deadline = time.monotonic() + args.seconds
    device = as_device(args.device)
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # a dry run on a shared CPU: idle OpenMP threads spinning only slow it down
    if args.worker == "write_probe":
        from .gpu.core import write_to_an_empty_page

        write_to_an_empty_page(device)
        return 0
    try:
        result = SECTIONS[args.worker].load()(Context(device, args.smoke, args.out, args, deadline))
        failures = result.pop("failures", [])
        entry: dict[str, Any] = {"status": "failed" if failures else "passed", "result": result}
        if failures:
            entry["error"] = "; ".join(failures)
    except SectionSkipped as exc:
        entry = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # recorded: the parent reports it and goes on
        entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    path = section_file(args.out, args.worker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=2, default=str))
    return 0


def section_file(out_dir: Path, name: str) -> Path:
    return out_dir / "sections" / f"{name}.json"


def worker_command(name: str, args: argparse.Namespace, seconds: float) -> list[str]:
    """The command of section ``name``'s process, which may run ``seconds``."""
    cmd = [sys.executable, str(SCRIPT), "--worker", name, "--device", args.device, "--out", str(args.out),
           "--kernels", *args.kernels, "--tests", *args.tests, "--test-timeout", str(args.test_timeout),
           "--seconds", f"{seconds:.1f}"]
    return cmd + (["--smoke"] if args.smoke else [])


def collect(cmd: list[str], result: Path, timeout: float) -> dict[str, Any]:
    """Run a section's process and read its result; a crash, timeout or no result fails it, with its output."""
    result.unlink(missing_ok=True)
    done = run_process(cmd, timeout)
    seconds = round(done.seconds, 1)
    if done.returncode == 0 and result.exists():
        return {**json.loads(result.read_text()), "seconds": seconds}
    return {"status": "failed", "error": f"the section's process {done.ended} before reporting", "seconds": seconds,
            "first_errors": first_errors(done.output), "output_tail": done.output[-3000:]}


def first_errors(output: str, lines: int = 12) -> list[str]:
    """The first ``lines`` lines of ``output`` that say what went wrong, each once (a device
    assertion repeats itself for every GPU thread; a C++ abort's frames push it out of the tail)."""
    marked = (line[:300] for line in output.splitlines() if any(mark in line for mark in ERROR_MARKS))
    return list(dict.fromkeys(marked))[:lines]


def run_section(section: Entry, args: argparse.Namespace, left: float) -> dict[str, Any]:
    """The entry of ``section`` run in a process of its own, within its time limit and the ``left`` seconds of the budget."""
    timeout = min(section.timeout_s or args.section_timeout, left)
    print(f"[gpu_check] {section.name} (~{section.estimate_s:.0f} s, {left:.0f} s left) ...", flush=True)
    return collect(worker_command(section.name, args, timeout), section_file(args.out, section.name), timeout)


def skipped(section: Entry, args: argparse.Namespace, device: Any, left: float) -> dict[str, Any] | None:
    """The entry of ``section`` if it is skipped now (why, in it), else None."""
    reason = section.load(section.skip)(device, args.smoke) if section.skip else None
    if reason is not None:
        return {"status": "skipped", "reason": reason, "seconds": 0.0}
    if section.estimate_s > left:
        return {"status": "skipped", "over_budget": True, "seconds": 0.0,
                "reason": f"over budget: needs ~{section.estimate_s:.0f} s (estimate on an H200), {max(left, 0):.0f} s "
                          f"left of --budget-s {args.budget_s:g}"}
    return None


def headline(section: Entry, entry: dict[str, Any]) -> str:
    """The summary's text for a section: its headline if it passed, else why not."""
    if entry["status"] != "passed":
        return entry.get("error") or entry.get("reason") or ""
    text, why = attempt(lambda: section.load(section.headline)(entry["result"]))
    return f"(no headline: {why})" if why else text  # a headline must not fail a section that passed


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One screen: per section its status, seconds, estimate and headline; what is missing; the JSON."""
    rows = [("section", "status", "seconds", "est.", "headline / why")]
    for name, entry in report["sections"].items():
        seconds = f"{entry['seconds']:.0f}" if entry.get("seconds") else "-"
        text = entry.get("headline", "")
        rows.append((name, entry["status"], seconds, f"{SECTIONS[name].estimate_s:.0f}",
                     text if len(text) <= HEADLINE_WIDTH else text[:HEADLINE_WIDTH - 3] + "..."))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row[:4], widths)), row[4]]).rstrip() for row in rows]
    missing = [name for name, version in report["optional_packages"].items() if version is None]
    if missing:
        lines.append(f"not installed here (sections that would use them skip or fall back): {', '.join(missing)}")
    lines.append(f"{report['seconds']:.0f} s of a {report['budget_s']:g} s budget; everything in {report['json']}")
    return lines


def verdict(report: dict[str, Any]) -> str:
    """One line: what passed, was skipped and failed (why); on CUDA what decode over VMM pages
    costs with the cache's own kernel, and contiguous mode inside vLLM against stock."""
    sections = report["sections"]
    statuses = [entry["status"] for entry in sections.values()]
    over = sum(1 for entry in sections.values() if entry.get("over_budget"))
    line = (f"gpu_check on {report['device']}: {statuses.count('passed')} passed, {statuses.count('skipped')} skipped"
            + (f" ({over} over budget)" if over else ""))
    failed = [f"{name} ({(entry.get('error') or '')[:80]})" for name, entry in sections.items() if entry["status"] == "failed"]
    if failed:
        return f"{line}, {len(failed)} FAILED: " + "; ".join(failed)
    decode = sections.get("decode", {}).get("result", {})
    kernel = decode.get("cache_kernel")
    if kernel and report["device"].startswith("cuda"):  # the kernel the cache runs, not the best-looking one
        row = decode["kernels"].get(kernel, {})
        if "vmm_over_dense" in row:
            line += (f"; decode over VMM pages costs {row['vmm_over_dense']:.2f}x dense with {kernel}, "
                     "the cache's kernel (1.00 = free)")
        else:
            line += f"; the cache's kernel {kernel} was not timed ({row.get('skipped', 'not in --kernels')})"
    addressing = sections.get("vllm_addressing", {}).get("result")
    if addressing:
        over_stock = addressing["summary"]["contiguous_over_stock"]
        line += (f"; inside vLLM contiguous mode ({', '.join(addressing['summary']['contiguous_kernels'])}) runs at "
                 f"{statistics.median(over_stock):.2f}x stock output tokens/s "
                 f"(rounds {min(over_stock):.2f}-{max(over_stock):.2f})")
    return line + "."


SMOKE_BENCHMARK = "mapping"  # the benchmark the dry run runs (seconds on a CPU)
VERDICT_KEYS = ("question", "result", "winner", "reliable")


def bench_command(device: Any, out: Path, smoke: bool) -> list[str]:
    """The main job's command on ``device``, its files in ``out``."""
    cmd = [sys.executable, "-m", "vmkv.cli", "bench", "--device", device.type, "--out", str(out)]
    return cmd + (["--smoke", "--no-plots", SMOKE_BENCHMARK] if smoke else [])


def bench_section(ctx: Context) -> dict[str, Any]:
    """The GPU check's ``bench`` section: ``vmkv bench --device cuda`` in a process of its own, within the section's
    time; its exit and every benchmark's verdicts."""
    out = ctx.out / "bench"
    out.mkdir(parents=True, exist_ok=True)
    suite = out / "suite.json"
    suite.unlink(missing_ok=True)  # the CLI merges into an existing one: keep only this run's records
    cmd = bench_command(ctx.device, out, ctx.smoke)
    done = run_process(cmd, ctx.seconds_left() - 10)
    benchmarks: dict[str, dict[str, Any]] = {}
    for record in read_records(suite):
        verdicts = [{key: verdict.get(key) for key in VERDICT_KEYS} for verdict in record.get("verdicts", [])]
        benchmarks[record["name"]] = {"status": record.get("status"), "seconds": record.get("seconds"),
                                      **({"reason": record["reason"]} if "reason" in record else {}), "verdicts": verdicts}
    not_ok = [name for name, entry in benchmarks.items() if entry["status"] != "ok"]
    failures = [] if done.returncode == 0 else [
        f"vmkv bench {done.ended}" + (f"; not ok: {', '.join(not_ok)}" if not_ok else "")]
    return {"command": " ".join(cmd), "exit": done.ended, "returncode": done.returncode, "seconds": round(done.seconds, 1),
            "benchmarks": benchmarks, "output_tail": done.output[-3000:], "failures": failures}


def bench_headline(result: dict[str, Any]) -> str:
    """The suite's exit and its benchmarks' counts."""
    statuses = [entry["status"] for entry in result["benchmarks"].values()]
    verdicts = sum(len(entry["verdicts"]) for entry in result["benchmarks"].values())
    return (f"{result['exit']}: {statuses.count('ok')} of {len(statuses)} benchmarks ok, {verdicts} verdicts "
            f"({result['seconds']:.0f} s)")


def check_main(argv: list[str] | None = None, started: float | None = None) -> int:
    """``python benchmarks/gpu_check.py``; ``started``: when its process started (the budget counts from there)."""
    import torch

    from vmkv.vm.cuda import TorchCudaRuntime

    started = time.monotonic() if started is None else started
    args = parse_args(argv)
    if args.list:
        for section in SECTIONS.values():
            print(f"{section.name:16s} ~{section.estimate_s:3.0f} s  {section.about}")
        print(f"{'total':16s} ~{sum(s.estimate_s for s in SECTIONS.values()):3.0f} s  if every section can run here; "
              f"--budget-s (default {DEFAULT_BUDGET_S}) skips what does not fit")
        return 0
    if args.worker:
        return run_worker(args)
    if torch.device(args.device).type == "cuda":
        reason = TorchCudaRuntime().unavailable_reason()
        if reason is not None:
            print(f"gpu_check: no CUDA GPU here ({reason}); nothing was checked (dry run: --device cpu --smoke)")
            return EXIT_NO_GPU
    device = as_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    report: dict[str, Any] = {"device": str(device), "smoke": args.smoke, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "budget_s": args.budget_s, "optional_packages": optional_packages(), "json": str(path),
                              "seconds": 0.0, "sections": {}}
    for section in (SECTIONS[name] for name in args.sections):  # one at least (nargs="+"), so the JSON is always written
        left = args.budget_s - (time.monotonic() - started)
        entry = skipped(section, args, device, left) or run_section(section, args, left)
        entry["estimate_s"] = section.estimate_s
        entry["headline"] = headline(section, entry)
        report["sections"][section.name] = entry
        report["seconds"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(report, indent=2, default=str))  # after every section: an interrupted run keeps what finished
        print(f"[gpu_check] {section.name}: {entry['status']}  {entry['headline'][:160]}", flush=True)
    print()
    print("\n".join(summary_lines(report)))
    print(verdict(report))
    return EXIT_FAILED if any(entry["status"] == "failed" for entry in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
