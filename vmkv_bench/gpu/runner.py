"""Running the GPU check: each section in a process of its own, within one time budget; the JSON
and the one-screen summary.

A CUDA fault kills the context of the process it happens in, so each section gets a fresh
process (``gpu_check.py --worker NAME``) that writes ``DIR/sections/NAME.json``; a crash, a hang
past its time limit or a missing result is a failed section with the process's last output.
``DIR/gpu_check.json`` is rewritten after every section, so an interrupted run keeps what
finished. Before a section starts, its estimate is compared with what is left of ``--budget-s``;
one that does not fit is skipped with the reason (recorded, not a failure), and a section's
process never runs past the budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from vmkv.kernels import registry as kernel_registry
from vmkv.vm.cuda import TorchCudaRuntime

from .registry import Context, Section, SectionSkipped, optional_packages, run_process
from .sections import BY_NAME, SECTIONS

DEFAULT_BUDGET_S = 480
"""Eight minutes: the whole check on an H200 (GPU time is lent by the quarter hour)."""
EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3
HEADLINE_WIDTH = 110


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` lists the sections with their estimates)."""
    names = [section.name for section in SECTIONS]
    listing = "\n".join(f"  {s.name:16s} ~{s.estimate_s:3.0f} s  {s.about}" for s in SECTIONS)
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description="Check and measure everything CUDA in vmkv, in one run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"sections (estimated seconds on an H200):\n{listing}\n\n"
               "Exit status: 0 passed, 1 a section failed, 2 bad arguments, 3 no CUDA GPU. See docs/gpu.md.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="directory for gpu_check.json (default: gpu-check-out)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few iterations (a dry run of the code paths)")
    alone = [section.name for section in SECTIONS if section.alone]
    parser.add_argument("--sections", nargs="+", default=[n for n in names if n not in alone], choices=names,
                        metavar="SECTION", help="which sections to run, in this order (default: all but "
                        f"{', '.join(alone) or 'none'}, which run only when named)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds the whole run may take (default {DEFAULT_BUDGET_S}): a section whose estimate does "
                             "not fit in what is left is skipped, with the reason")
    parser.add_argument("--list", action="store_true", help="list the sections with their estimates and exit")
    parser.add_argument("--kernels", nargs="+", default=kernel_registry.names("slots"), choices=kernel_registry.names("slots"),
                        help="contiguous kernels for the decode section (default: all; those that cannot run are skipped with the reason)")
    parser.add_argument("--tests", nargs="+", default=["tests/test_cuda.py", "tests/test_triton_kernels.py"],
                        help="pytest paths for the tests section (default: the CUDA backend's tests and the Triton kernels', "
                             "which run compiled on the GPU)")
    parser.add_argument("--test-timeout", type=int, default=240, help="seconds allowed for the tests section's pytest (default 240)")
    parser.add_argument("--section-timeout", type=int, default=360,
                        help="seconds one section's process may run unless it sets its own (default 360); the budget left caps it")
    parser.add_argument("--worker", choices=[*names, "write_probe"], help=argparse.SUPPRESS)  # one section, inside its process
    parser.add_argument("--seconds", type=float, default=360.0, help=argparse.SUPPRESS)  # the worker's time limit
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")
    return args


def resolve_device(name: str) -> torch.device:
    """``cuda`` becomes ``cuda:N`` of torch's current device (when there is one)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ---- inside a section's process --------------------------------------------------------------
def run_worker(args: argparse.Namespace) -> int:
    """Run section ``args.worker`` and write ``DIR/sections/NAME.json``; returns 0 (a failure is in the file)."""
    deadline = time.monotonic() + args.seconds
    device = resolve_device(args.device)
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # a dry run on a shared CPU: idle OpenMP threads spinning only slow it down
    if args.worker == "write_probe":
        from .core import write_to_an_empty_page

        write_to_an_empty_page(device)
        return 0
    ctx = Context(device, args.smoke, args.out, args, deadline)
    try:
        result = BY_NAME[args.worker].run(ctx)
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
    """Where the process of section ``name`` writes its entry."""
    return out_dir / "sections" / f"{name}.json"


def worker_command(name: str, args: argparse.Namespace, seconds: float) -> list[str]:
    """The command of section ``name``'s process, which may run ``seconds``."""
    from .registry import SCRIPT

    cmd = [sys.executable, str(SCRIPT), "--worker", name, "--device", args.device, "--out", str(args.out),
           "--kernels", *args.kernels, "--tests", *args.tests, "--test-timeout", str(args.test_timeout),
           "--seconds", f"{seconds:.1f}"]
    return cmd + (["--smoke"] if args.smoke else [])


def collect(cmd: list[str], result: Path, timeout: float) -> dict[str, Any]:
    """Run one section's process and read what it wrote; a crash, a timeout or a missing result
    is a failed section with the process's last output."""
    result.unlink(missing_ok=True)
    done = run_process(cmd, timeout)
    seconds = round(done.seconds, 1)
    if done.returncode == 0 and result.exists():
        return {**json.loads(result.read_text()), "seconds": seconds}
    return {"status": "failed", "error": f"the section's process {done.ended} before reporting", "seconds": seconds,
            "first_errors": first_errors(done.output), "output_tail": done.output[-3000:]}


ERROR_MARKS = ("Error", "error:", "Assertion", "Traceback", "what():")
"""What marks a line worth keeping from a crashed section's output (a C++ abort ends with a long
stack of frames that pushes the cause out of the tail)."""


def first_errors(output: str, lines: int = 12) -> list[str]:
    """The first ``lines`` lines of ``output`` that say what went wrong (:data:`ERROR_MARKS`),
    each line once (a device assertion repeats itself for every GPU thread)."""
    found: list[str] = []
    for line in output.splitlines():
        if any(mark in line for mark in ERROR_MARKS) and line not in found:
            found.append(line[:300])
            if len(found) == lines:
                break
    return found


# ---- the parent ------------------------------------------------------------------------------
def plan(section: Section, args: argparse.Namespace, device: torch.device, left: float) -> tuple[dict[str, Any] | None, float]:
    """Whether ``section`` runs now: ``(entry, 0)`` if it is skipped (why, in the entry), else
    ``(None, its process's time limit)``."""
    reason = section.skip_reason(device, args.smoke)
    if reason is not None:
        return {"status": "skipped", "reason": reason, "seconds": 0.0}, 0.0
    if section.estimate_s > left:
        return {"status": "skipped", "over_budget": True, "seconds": 0.0,
                "reason": f"over budget: needs ~{section.estimate_s:.0f} s (estimate on an H200), {max(left, 0):.0f} s "
                          f"left of --budget-s {args.budget_s:g}"}, 0.0
    return None, min(section.timeout_s or args.section_timeout, left)


def headline(section: Section, entry: dict[str, Any]) -> str:
    """The summary's text for one section: its headline if it passed, else why it did not."""
    if entry["status"] != "passed":
        return entry.get("error") or entry.get("reason") or ""
    try:
        return section.headline(entry["result"])
    except Exception as exc:  # a headline must not fail a section that passed
        return f"(no headline: {type(exc).__name__}: {exc})"


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One screen: per section its status, seconds, estimate and headline; what is missing; the JSON."""
    rows = [("section", "status", "seconds", "est.", "headline / why")]
    for name, entry in report["sections"].items():
        seconds = f"{entry['seconds']:.0f}" if entry.get("seconds") else "-"
        text = entry.get("headline", "")
        rows.append((name, entry["status"], seconds, f"{BY_NAME[name].estimate_s:.0f}",
                     text if len(text) <= HEADLINE_WIDTH else text[:HEADLINE_WIDTH - 3] + "..."))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row[:4], widths)), row[4]]).rstrip() for row in rows]
    missing = [name for name, version in report["optional_packages"].items() if version is None]
    if missing:
        lines.append(f"not installed here (sections that would use them skip or fall back): {', '.join(missing)}")
    lines.append(f"{report['seconds']:.0f} s of a {report['budget_s']:g} s budget; everything in {report['json']}")
    return lines


def verdict(report: dict[str, Any]) -> str:
    """One line: what passed, what was skipped, what failed and why; on CUDA, what decode over VMM
    pages costs with the kernel the cache selected (``cache_kernel``)."""
    by_status: dict[str, list[str]] = {"passed": [], "skipped": [], "failed": []}
    for name, entry in report["sections"].items():
        by_status[entry["status"]].append(name)
    over = sum(1 for entry in report["sections"].values() if entry.get("over_budget"))
    line = (f"gpu_check on {report['device']}: {len(by_status['passed'])} passed, {len(by_status['skipped'])} skipped"
            + (f" ({over} over budget)" if over else ""))
    if by_status["failed"]:
        firsts = [f"{name} ({(report['sections'][name].get('error') or '')[:80]})" for name in by_status["failed"]]
        return f"{line}, {len(by_status['failed'])} FAILED: " + "; ".join(firsts)
    decode = report["sections"].get("decode", {}).get("result", {})
    kernel = decode.get("cache_kernel")
    if kernel and report["device"].startswith("cuda"):  # the kernel the cache runs, not the best-looking one
        row = decode["kernels"].get(kernel, {})
        if "vmm_over_dense" in row:
            line += f"; decode over VMM pages costs {row['vmm_over_dense']:.2f}x dense with {kernel}, the cache's kernel (1.00 = free)"
        else:
            line += f"; the cache's kernel {kernel} was not timed ({row.get('skipped', 'not in --kernels')})"
    addressing = report["sections"].get("vllm_addressing", {}).get("result")
    if addressing:
        over_stock = addressing["summary"]["contiguous_over_stock"]
        line += (f"; inside vLLM contiguous mode ({', '.join(addressing['summary']['contiguous_kernels'])}) runs at "
                 f"{statistics.median(over_stock):.2f}x stock output tokens/s (rounds {min(over_stock):.2f}-{max(over_stock):.2f})")
    return line + "."


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The command. ``started``: ``time.monotonic()`` when the process started (the budget counts from there)."""
    started = time.monotonic() if started is None else started
    args = parse_args(argv)
    if args.list:
        for section in SECTIONS:
            print(f"{section.name:16s} ~{section.estimate_s:3.0f} s  {section.about}")
        print(f"{'total':16s} ~{sum(s.estimate_s for s in SECTIONS):3.0f} s  if every section can run here; --budget-s "
              f"(default {DEFAULT_BUDGET_S}) skips what does not fit")
        return 0
    if args.worker:
        return run_worker(args)
    device = torch.device(args.device)
    if device.type == "cuda":
        reason = TorchCudaRuntime().unavailable_reason()
        if reason is not None:
            print(f"gpu_check: no CUDA GPU here ({reason}); nothing was checked (dry run: --device cpu --smoke)")
            return EXIT_NO_GPU
    device = resolve_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    report: dict[str, Any] = {"device": str(device), "smoke": args.smoke, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "budget_s": args.budget_s, "optional_packages": optional_packages(), "json": str(path),
                              "seconds": 0.0, "sections": {}}
    for name in args.sections:
        section = BY_NAME[name]
        left = args.budget_s - (time.monotonic() - started)
        entry, timeout = plan(section, args, device, left)
        if entry is None:
            print(f"[gpu_check] {name} (~{section.estimate_s:.0f} s, {left:.0f} s left) ...", flush=True)
            entry = collect(worker_command(name, args, timeout), section_file(args.out, name), timeout)
        entry["estimate_s"] = section.estimate_s
        entry["headline"] = headline(section, entry)
        report["sections"][name] = entry
        report["seconds"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(report, indent=2, default=str))  # after every section
        print(f"[gpu_check] {name}: {entry['status']}  {entry['headline'][:160]}", flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    path.write_text(json.dumps(report, indent=2, default=str))
    print()
    print("\n".join(summary_lines(report)))
    print(verdict(report))
    return EXIT_FAILED if any(entry["status"] == "failed" for entry in report["sections"].values()) else 0
