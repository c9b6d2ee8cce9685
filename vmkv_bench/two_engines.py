"""Two engine processes with alternating bursts: static halves of the KV budget vs one shared budget
(``shared_budget``, :mod:`vmkv.ledger`), judged on p99 time to first token (docs/shared-budget.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import vmkv

from . import common

NAME = "two_engines"
DESCRIPTION = "two engines, alternating bursts: static halves of the KV budget vs one shared budget"
ROOT = Path(__file__).resolve().parent.parent
PAGE_SIZE = "4KiB"  # the default model: 8 tokens a page, 32 KiB a pool page
SCHEMA = {
    "setup": "static (each engine total/2) or shared (one ledger of the total)",
    "round": "round index (setups alternate within a round)",
    "completed": "requests completed, both engines",
    "preemptions": "sequences preempted for lack of pages, both engines",
    "ttft_p50_ms": "median time to first token from scheduled arrival, ms",
    "ttft_p99_ms": "99th percentile time to first token, ms",
    "peak_resident_mib": "peak of both page stores' resident bytes together (kernel's count), MiB",
    "budget_mib": "the total KV budget, MiB",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", default=None, help="total KV budget of both engines (default 8MiB; smoke 4MiB)")
    parser.add_argument("--bursts", type=int, default=None, help="bursts, alternating engines (default 6; smoke 2)")
    parser.add_argument("--burst-requests", type=int, default=None, help="requests a burst (default 12; smoke 8)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens a request (default 64)")
    parser.add_argument("--output-len", type=int, default=None, help="tokens generated a request (default 48; smoke 24)")
    parser.add_argument("--period", type=float, default=None, help="seconds between bursts (default 3; smoke 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of both setups (default 3; smoke 1)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if args.smoke else full)

    return {
        "budget": vmkv.parse_size(pick(args.budget, "8MiB", "4MiB"), name="--budget"),
        "bursts": pick(args.bursts, 6, 2), "burst_requests": pick(args.burst_requests, 12, 8),
        "prompt_len": args.prompt_len, "output_len": pick(args.output_len, 48, 24),
        "period": pick(args.period, 3.0, 2.0), "rounds": pick(args.rounds, 3, 1),
    }


def make_trace(opts: dict[str, Any], seed: int) -> list[list[dict[str, Any]]]:
    """Per engine, its requests: ``{"at": seconds after start, "prompt": token ids, "max_tokens"}``;
    burst ``k`` goes to engine ``k % 2`` at ``k * period``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    per_engine: list[list[dict[str, Any]]] = [[], []]
    for burst in range(opts["bursts"]):
        for _ in range(opts["burst_requests"]):
            prompt = torch.randint(3, 250, (opts["prompt_len"],), generator=gen).tolist()
            per_engine[burst % 2].append({"at": burst * opts["period"], "prompt": prompt, "max_tokens": opts["output_len"]})
    return per_engine


# ---- one engine process -----------------------------------------------------------------------
def member_main() -> None:
    """An engine process: JSON commands (``open``, ``run``, ``close``) a line on stdin, answers on stdout."""
    import torch

    from vmkv.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    engine = None
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "open":
            engine = Engine.from_config(EngineConfig(memory_budget=command["memory_budget"], page_size=PAGE_SIZE,
                                                     max_num_seqs=command["slots"], max_seq_len=command["max_seq_len"],
                                                     shared_budget=command["shared_budget"]))
            answer: dict[str, Any] = {"memfd": engine.cache.ranges.vm._fd}
        elif command["op"] == "run":
            answer = replay(engine, command["requests"], command["start"])
        else:
            engine.close()
            engine, answer = None, {}
        print(json.dumps(answer), flush=True)


def replay(engine: Any, requests: list[dict[str, Any]], start: float) -> dict[str, Any]:
    """Add each request at ``start + at`` (``time.monotonic``, shared by the processes), step
    until all finish; return each request's TTFT from its scheduled arrival and the preemptions."""
    from vmkv.engine import SamplingParams

    before = engine.stats()["engine"]["preemptions"]
    due = sorted(requests, key=lambda r: r["at"])
    scheduled: dict[str, float] = {}
    ttft: list[float] = []
    completed = 0
    while due or engine.has_unfinished():
        now = time.monotonic()
        while due and start + due[0]["at"] <= now:
            request = due.pop(0)
            rid = engine.add_request(request["prompt"], SamplingParams(max_tokens=request["max_tokens"], temperature=0))
            scheduled[rid] = start + request["at"]
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, start + due[0]["at"] - now)))
            continue
        for out in engine.step():
            if out.finished:
                completed += out.error is None
                if out.metrics.first_token_time is not None:
                    ttft.append(out.metrics.first_token_time - scheduled[out.request_id])
    return {"ttft": ttft, "completed": completed, "preemptions": engine.stats()["engine"]["preemptions"] - before}


class _Engine:
    """The parent's handle on an engine process."""

    def __init__(self) -> None:
        code = "from vmkv_bench.two_engines import member_main; member_main()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def ask(self, **command: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return read_answer(self.proc)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)


class ResidentSampler(threading.Thread):
    """The peak of several page stores' resident bytes together (``st_blocks`` of each memfd
    path, e.g. ``/proc/PID/fd/N``), sampled every ``interval`` seconds; ``samples`` counts them."""

    def __init__(self, paths: list[str], interval: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.paths, self.interval, self.peak, self.samples = paths, interval, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            total = 0
            for path in self.paths:
                with contextlib.suppress(OSError):  # the process exited
                    total += os.stat(path).st_blocks * 512
            self.peak = max(self.peak, total)
            self.samples += 1

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


def run_setup(engines: list[_Engine], setup: str, opts: dict[str, Any], trace: list[list[dict[str, Any]]],
              ledger: str) -> dict[str, Any]:
    """One replay of ``trace`` on both engines in ``setup``; the row's measurements."""
    total = opts["budget"]
    shared = f"{ledger}:{total},wait=1" if setup == "shared" else None
    memfds = [e.ask(op="open", memory_budget=total if shared else total // 2, slots=opts["burst_requests"],
                    max_seq_len=opts["prompt_len"] + opts["output_len"] + 8, shared_budget=shared)["memfd"] for e in engines]
    sampler = ResidentSampler([f"/proc/{e.proc.pid}/fd/{fd}" for e, fd in zip(engines, memfds)])
    sampler.start()
    start = time.monotonic() + 0.5
    try:
        for engine, requests in zip(engines, trace):
            engine.proc.stdin.write(json.dumps({"op": "run", "requests": requests, "start": start}) + "\n")
            engine.proc.stdin.flush()
        answers = [read_answer(engine.proc) for engine in engines]
    finally:
        peak = sampler.stop()
        for engine in engines:
            engine.ask(op="close")
    ttft = sorted(t for a in answers for t in a["ttft"])
    return {"completed": sum(a["completed"] for a in answers), "preemptions": sum(a["preemptions"] for a in answers),
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * _percentile(ttft, 0.99),
            "peak_resident_mib": peak / 2**20, "budget_mib": total / 2**20}


def read_answer(proc: subprocess.Popen, timeout: float = 600) -> dict[str, Any]:
    """The next JSON line ``proc`` writes to its stdout, within ``timeout`` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        err = proc.stderr.read()[-3000:] if proc.stderr is not None else ""
        raise RuntimeError(f"two_engines: a child process gave no answer (exit {proc.wait()}) {err}".rstrip())
    return json.loads(line)


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.check_device(args.device)
    if args.device != "cpu":
        raise vmkv.InvalidConfig("two_engines runs on the CPU only: shared_budget is host-only for now")
    opts = _options(args)
    trace = make_trace(opts, args.seed)
    engines = [_Engine(), _Engine()]
    rows = []
    try:
        for round_index in range(opts["rounds"]):
            for setup in common.rotated(("static", "shared"), round_index):
                ledger = f"bench-{os.getpid()}-{round_index}"
                rows.append({"setup": setup, "round": round_index, **run_setup(engines, setup, opts, trace, ledger)})
    finally:
        for engine in engines:
            engine.close()
    summary = {setup: {key: statistics.median(r[key] for r in rows if r["setup"] == setup)
                       for key in ("completed", "preemptions", "ttft_p50_ms", "ttft_p99_ms", "peak_resident_mib")}
               for setup in ("static", "shared")}
    return common.make_result(NAME, SCHEMA, rows, summary, config=opts)


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """Which setup serves the bursts better, on per-round p99 and p50 TTFT; unreliable where the shared
    run held more than the budget or completed less."""
    rows, summary = result["rows"], result["summary"]
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[row["setup"]] = row
    pairs = [r for r in by_round.values() if len(r) == 2]
    broken = any(r["shared"]["peak_resident_mib"] > r["shared"]["budget_mib"] for r in pairs)
    lost = any(r["shared"]["completed"] < r["static"]["completed"] for r in pairs)
    why = "shared resident KV went past the budget" if broken else "the shared setup completed fewer requests" if lost else ""
    out = []
    for key, label in (("ttft_p99_ms", "p99"), ("ttft_p50_ms", "p50")):
        question = f"{label} time to first token, alternating bursts: static halves / shared budget"
        ratios = common.Spread.of([r["static"][key] / r["shared"][key] for r in pairs])
        if why:
            out.append(common.unreliable(f"{NAME}.{label}_ttft", question, why, ratios))
            continue
        note = (f"preemptions {summary['static']['preemptions']:.0f} static vs {summary['shared']['preemptions']:.0f} "
                f"shared; peak resident {summary['static']['peak_resident_mib']:.1f} vs "
                f"{summary['shared']['peak_resident_mib']:.1f} MiB of {rows[0]['budget_mib']:.1f}")
        out.append(common.ratio_verdict(f"{NAME}.{label}_ttft", question, ratios, "shared", "static", note=note))
    return out
