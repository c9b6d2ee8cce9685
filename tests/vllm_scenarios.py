"""End-to-end runs of vLLM with and without vmkv on the tiny model, for tests/test_vllm.py.

Run as a script (vLLM spawns processes, so this is not imported by pytest)::

    python tests/vllm_scenarios.py OUT.json MODEL_DIR SCENARIO...

Scenarios (each writes its part of OUT.json):

* ``stock``    stock vLLM: greedy tokens of the workload, worker RSS.
* ``vmkv``     vmkv, budget = vLLM's buffer, no page kept for the prefix cache alone
               (``max_cached=0``): tokens, memory samples every step, stats after the requests
               finish and after a trim, Prometheus metrics.
* ``preempt``  vmkv with a physical budget too small for the first wave (vLLM must preempt) and
               two units for the prefix cache: tokens, preemptions, prefix hits of the second wave.
* ``tp2``      vmkv with tensor parallelism 2 (CPU: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
* ``tp2stock`` stock vLLM with tensor parallelism 2.
* ``ledger``   two vmkv engines in one host-wide ledger smaller than what both take alone
               (:data:`LEDGER_BUDGET`): A bursts while B idles, then B; B's engine is killed
               (SIGKILL) holding pages and A bursts again; then A runs both bursts alone. Tokens,
               prefix hits and the ledger's members after each phase, and the peak resident bytes
               of both page stores (sampled from outside, the kernel's count).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

KV_BYTES = 256 * 2**20  # vLLM's KV buffer: 1024 blocks of 128 tokens (256 KiB each, 2 layers)
PAGE = "512KiB"  # one page per layer holds 4 blocks: a unit is 4 blocks = 512 tokens = 1 MiB
PREEMPT_BUDGET = 2 * 2**20  # 2 units: 7 blocks besides block 0, for a first wave needing 11
PREEMPT_CACHED = 2 * 2**20  # the prefix cache alone may keep 2 units mapped
PREFIX = [(7 * i + 3) % 250 for i in range(300)]  # a 300-token prefix: two full blocks to share


LEDGER_BUDGET = 8 * 2**20  # 64 pages of 128 KiB: 32 blocks of 128 tokens (both layers) for both engines
LEDGER_PAGE = "128KiB"  # one block per page per layer: a unit is one block, 2 pages
LEDGER_KV_BYTES = 16 * 2**20  # each engine's own buffer: 64 blocks, it could take 16 MiB alone
LEDGER_BURST = (4, 600, 100)  # 4 requests of 600 prompt tokens, 100 new: 24 blocks, 6 MiB an engine


def burst(seed: int) -> list[list[int]]:
    count, length, _ = LEDGER_BURST
    return [[(seed * 31 + 7 * i + 13 * r) % 250 for i in range(length)] for r in range(count)]


def workload() -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and output lengths: a first wave of four requests (two share PREFIX),
    then a second wave, run after the first finished, that finds PREFIX in the prefix cache."""
    prompts = [
        PREFIX + [11, 12, 13],
        PREFIX + [21, 22],
        [(5 * i + 1) % 250 for i in range(180)],
        [(3 * i + 2) % 250 for i in range(40)],
        PREFIX + [31, 32, 33, 34],
        PREFIX[:200] + [41],
    ]
    outputs = [160, 200, 120, 250, 100, 140]
    return prompts, outputs


def run_workload(llm, vmkv: bool, sample_every: int) -> dict:
    from vllm import SamplingParams

    from vmkv_bench.vllm_harness import drive

    prompts, outputs = workload()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    first = drive.run(llm, prompts[:4], params[:4], vmkv=vmkv, sample_every=sample_every)
    second = drive.run(llm, prompts[4:], params[4:], vmkv=vmkv, sample_every=sample_every)
    tokens = {**first.tokens, **{str(int(k) + 4): v for k, v in second.tokens.items()}}
    cached = {**first.cached_tokens, **{str(int(k) + 4): v for k, v in second.cached_tokens.items()}}
    samples = [s for r in (first, second) for s in r.as_dict()["samples"]]
    return {"tokens": tokens, "cached_tokens": cached, "samples": samples}


def metric_values(llm, prefix: str) -> dict[str, float]:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(prefix):
            out[metric.name] = getattr(metric, "value", None)
    return out


def scenario(name: str, model: str) -> dict:
    from vmkv import vllm as plugin
    from vmkv_bench.vllm_harness import drive

    start = time.perf_counter()
    if name in ("stock", "tp2stock"):
        tp = 2 if name == "tp2stock" else 1
        llm = drive.engine(model, vmkv=False, kv_cache_bytes=KV_BYTES, tensor_parallel_size=tp)
        init_rss = sum(p["rss_bytes"] for p in llm.collective_rpc("vmkv_process"))
        result = run_workload(llm, vmkv=False, sample_every=0 if tp > 1 else 8)
        result["init_rss_bytes"] = init_rss
    elif name in ("vmkv", "tp2"):
        tp = 2 if name == "tp2" else 1
        llm = drive.engine(model, vmkv=True, kv_cache_bytes=KV_BYTES, options={"page_size": PAGE, "max_cached": 0},
                           tensor_parallel_size=tp, disable_log_stats=False)
        result = {"init_stats": plugin.stats(llm)}
        result.update(run_workload(llm, vmkv=True, sample_every=1 if tp == 1 else 0))
        time.sleep(0.5)  # the engine runs one more (empty) step that carries the last unmaps
        result["finished_stats"] = plugin.stats(llm)
        result["trimmed_stats"] = plugin.trim(llm)
        result["metrics"] = metric_values(llm, "vllm:vmkv_")
    elif name == "preempt":
        llm = drive.engine(model, vmkv=True, kv_cache_bytes=KV_BYTES, disable_log_stats=False,
                           options={"page_size": PAGE, "budget": PREEMPT_BUDGET, "max_cached": PREEMPT_CACHED})
        result = run_workload(llm, vmkv=True, sample_every=1)
        result["preemptions"] = metric_values(llm, "vllm:num_preemptions")
        time.sleep(0.5)
        result["finished_stats"] = plugin.stats(llm)
        result["trimmed_stats"] = plugin.trim(llm)
    elif name == "ledger":
        return ledger_scenario(model) | {"seconds": time.perf_counter() - start}
    else:
        raise SystemExit(f"unknown scenario {name}")
    result["seconds"] = time.perf_counter() - start
    llm.llm_engine.engine_core.shutdown()
    return result


def page_stores(llm) -> list[str]:
    """``/proc/PID/fd/N`` of every vmkv page store (memfd ``vmkv-pages``) of ``llm``'s workers."""
    from vmkv import vllm as plugin

    paths = []
    for pid in {s["pid"] for s in plugin.stats(llm)}:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:vmkv-pages"):
                    paths.append(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
    return paths


def ledger_member(model: str, shared_budget: str) -> None:
    """One engine of the ``ledger`` scenario, in its own process (``ledger-member SHARED_BUDGET``):
    answers JSON lines on its stdout (everything else that writes there goes to stderr):
    ``{"stores"}`` once started, then per command ``{"op": "burst", "seed"}`` -> tokens and
    cached tokens, ``{"op": "reset"}`` (empty the prefix cache), ``{"op": "quit"}``."""
    from vllm import SamplingParams

    from vmkv_bench.vllm_harness import drive

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM (and the processes it starts) log to stdout
    llm = drive.engine(model, vmkv=True, kv_cache_bytes=LEDGER_KV_BYTES, distributed_executor_backend="uni",
                       options={"page_size": LEDGER_PAGE, "max_cached": LEDGER_BUDGET, "shared_budget": shared_budget})
    params = [SamplingParams(max_tokens=LEDGER_BURST[2], temperature=0.0, ignore_eos=True)] * LEDGER_BURST[0]

    def answer(value: dict) -> None:
        answers.write(json.dumps(value) + "\n")
        answers.flush()

    answer({"stores": page_stores(llm)})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "burst":
            run = drive.run(llm, burst(command["seed"]), params, vmkv=True)
            answer({"tokens": run.tokens, "cached": run.cached_tokens})
        elif command["op"] == "reset":
            answer({"reset": llm.reset_prefix_cache()})
        else:
            break
    llm.llm_engine.engine_core.shutdown()


def ledger_scenario(model: str) -> dict:
    """Two :func:`ledger_member` processes, started together, in one ledger (module docstring)."""
    import subprocess
    import tempfile

    from vmkv.ledger import Ledger
    from vmkv_bench.two_engines import ResidentSampler, read_answer

    name = f"vmkv-test-vllm-{os.getpid()}"
    logs = {label: tempfile.NamedTemporaryFile("w+", prefix=f"vmkv-ledger-{label}-", suffix=".log") for label in "ab"}
    procs = {label: subprocess.Popen([sys.executable, __file__, "-", model, "ledger-member",
                                      f"{name}:{LEDGER_BUDGET},member={label},wait=20"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[label], text=True)
             for label in "ab"}

    def ask(label: str, timeout: float = 300, **command) -> dict:
        proc = procs[label]
        if command:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        try:
            return read_answer(proc, timeout)
        except RuntimeError as error:
            logs[label].seek(0)
            raise RuntimeError(f"{error}\n--- member {label} ---\n{logs[label].read()[-6000:]}") from None

    def members() -> dict:
        with Ledger(name, None) as ledger:
            return {m.name: {"held": m.held, "reclaims": m.reclaims, "request": m.request, "want": m.want, "pid": m.pid,
                             "alive": m.alive} for m in ledger.members()}

    def members_once(settled: Callable[[dict], bool], timeout: float = 300) -> dict:
        """The members once ``settled`` holds of them, or as they are after ``timeout`` seconds
        (then the test's assertions say what did not happen): a busy machine delays what the
        test asserts (a killed process's exit, a member's last step), so it waits for that, not
        for a fixed time."""
        deadline = time.monotonic() + timeout
        found = members()
        while not settled(found) and time.monotonic() < deadline:
            time.sleep(0.05)
            found = members()
        return found

    def answered(found: dict) -> bool:
        """No member waits for pages, and no request stands."""
        return not any(m["request"] or m["want"] for m in found.values())

    def phase(label: str, seed: int) -> dict:
        return {**ask(label, op="burst", seed=seed), "members": members_once(answered)}

    try:
        started = time.perf_counter()
        paths = {label: ask(label, timeout=900)["stores"] for label in "ab"}
        stores = paths["a"] + paths["b"]
        started = time.perf_counter() - started
        sampler = ResidentSampler(stores, interval=0.002)
        sampler.start()
        try:
            result = {"a1": phase("a", 1), "b": phase("b", 2)}
            # B's engine core (the member) and its worker are killed holding pages: A, short of budget
            # for its next burst, finds B dead and takes its pages back
            for pid in {members()["b"]["pid"], *(int(path.split("/")[2]) for path in paths["b"])}:
                os.kill(pid, signal.SIGKILL)
            procs["b"].kill()
            procs["b"].wait(120)
            # the kernel frees a killed process's memory, then its files (its ledger lock) in its own time
            result["killed"] = members_once(lambda found: not found["b"]["alive"])
            result["a2"] = phase("a", 1)
        finally:
            result["peak_resident_bytes"] = sampler.stop()
        result["stores"], result["samples"] = len(stores), sampler.samples
        ask("a", op="reset")  # A runs both bursts with the ledger to itself: the reference
        result["alone"] = {"a": ask("a", op="burst", seed=1)["tokens"], "b": ask("a", op="burst", seed=2)["tokens"]}
        result["start_s"] = started
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                if not proc.stdin.closed:
                    proc.stdin.close()  # end of commands: the member shuts its engine down
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for log in logs.values():
            log.close()
    return result


def main() -> None:
    out, model, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if names[0] == "ledger-member":
        return ledger_member(model, names[1])
    results = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        if name.startswith("tp2"):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        results[name] = scenario(name, model)
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
