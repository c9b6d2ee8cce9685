"""The ``bench`` section: the main job, ``python -m vmkv.cli bench --device cuda``, in a process of its
own (killed with what it started when time runs out); its exit and every benchmark's verdicts recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..runner import Context, run_process

SMOKE_BENCHMARK = "mapping"
"""The benchmark the dry run runs (seconds on a CPU)."""
VERDICT_KEYS = ("question", "result", "winner", "reliable")


def bench_command(device: torch.device, out: Path, smoke: bool) -> list[str]:
    """The main job's command on ``device``, its files in ``out``."""
    cmd = [sys.executable, "-m", "vmkv.cli", "bench", "--device", device.type, "--out", str(out)]
    return cmd + (["--smoke", "--no-plots", SMOKE_BENCHMARK] if smoke else [])


def bench_section(ctx: Context) -> dict[str, Any]:
    """Run the main job's suite with what is left of the section's time and record what it says:
    its exit, and per benchmark ``status``, ``seconds``, ``reason`` or ``verdicts``."""
    device, smoke, timeout = ctx.device, ctx.smoke, ctx.seconds_left() - 10
    out = ctx.out / "bench"
    out.mkdir(parents=True, exist_ok=True)
    suite = out / "suite.json"
    suite.unlink(missing_ok=True)  # the CLI merges into an existing one: keep only this run's records
    cmd = bench_command(device, out, smoke)
    done = run_process(cmd, timeout)
    records = json.loads(suite.read_text())["records"] if suite.exists() else []
    benchmarks = {
        record["name"]: {
            "status": record.get("status"),
            "seconds": record.get("seconds"),
            **({"reason": record["reason"]} if "reason" in record else {}),
            "verdicts": [{key: verdict.get(key) for key in VERDICT_KEYS} for verdict in record.get("verdicts", [])],
        }
        for record in records
    }
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
