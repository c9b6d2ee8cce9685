"""What the vLLM plugin adds to one engine step, hook by hook (the costs part of ``vmkv bench vllm``).

End to end (:mod:`vmkv_bench.vllm_client`) a few percent drown in the machine's noise; here each
piece the plugin puts on a step's path is timed in isolation, on a real engine in the middle of
the client's workload (``requests`` requests of ``input_len`` prompt tokens, decoding, all
running), next to what stock vLLM spends on the same call:

* scheduler side, per running request and step: ``BlockPool.get_num_free_blocks`` (the page-aware
  free count), ``KVCacheManager.allocate_slots`` for one decode token (through the plugin's
  ``allocate_new_blocks`` wrapper); per step: ``build_connector_meta`` and
  ``has_pending_push_work``;
* worker side, per step: applying an empty step's metadata and ``get_kv_connector_stats``;
* bytes per step: the pickled ``SchedulerOutput`` (what vLLM sends its workers) and the
  connector's metadata and stats inside it and the worker's answer;
* KV pages: minor page faults in the attention layers over one whole run (vmkv's pages are
  faulted in as KV is first written to them; stock's buffer was touched whole at start).

Each engine runs in its own child process (``python -m vmkv_bench.vllm_costs``), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its scheduler and worker can be reached, :data:`ROUNDS`
times, alternating with the other engine's; a call's time is the best of 5 repeats of ``timeit``
loops in each child and the least over the children (a load spike on a shared machine inflates
one child's loops, not the minimum). The per-request calls are compared within the vmkv child, their
loops alternating: the plugin's free count against a stock ``BlockPool``'s of the same size, and
``allocate_slots`` through the plugin's wrapper against vLLM's own method on the same manager
(``*_us`` against ``*_stock_us``); the stock child gives stock's step time, bytes and faults.

The verdict: the plugin's added microseconds per step at ``requests`` running requests, as a share
of stock's step (its wall time per step over a run of the same work, the least of 3 runs per child
and of the children: the step and the calls alike measured at the machine's quietest).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import resource
import subprocess
import sys
import tempfile
import time
import timeit
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from . import common

PER_REQUEST = ("get_num_free_blocks_us", "allocate_slots_decode_us")  # each against its ``*_stock_us`` twin
PER_STEP = ("build_connector_meta_us", "has_pending_push_work_us", "worker_apply_empty_us", "worker_stats_us")
ROUNDS = 2  # child processes per engine, alternating
SHARE_TARGET = 0.03  # the plugin's hooks: at most 3 % of a step (the client target leaves 3 %)


def per_call_us(fn: Callable[[], Any], number: int = 2000) -> float:
    """Microseconds per call of ``fn``: the best of 5 ``timeit`` loops of ``number`` calls."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def paired_us(first: Callable[[], Any], second: Callable[[], Any], number: int = 2000,
              second_within: Callable[[], ContextManager[Any]] = nullcontext) -> tuple[float, float]:
    """Microseconds per call of ``first`` and ``second`` (each loop of ``second`` inside
    ``second_within()``), their ``timeit`` loops alternating (5 each, the best of each kept): a
    load spike hits both, so their difference holds."""
    firsts, seconds = [], []
    for _ in range(5):
        firsts.append(timeit.timeit(first, number=number))
        with second_within():
            seconds.append(timeit.timeit(second, number=number))
    return min(firsts) / number * 1e6, min(seconds) / number * 1e6


def measure(model: Path, kv_bytes: int, options: dict[str, Any], *, requests: int, input_len: int,
            output_len: int, seed: int, rounds: int = ROUNDS) -> dict[str, Any]:
    """Both engines' costs (each from ``rounds`` child processes, alternating) and the summary with
    the verdict line.

    Returns:
        ``{"stock": {...}, "vmkv": {...}, "summary": {...}, "config": {...}}``.

    Raises:
        RuntimeError: a child process failed (its stderr's end is in the message).
    """
    config = {"model": str(model), "kv_bytes": kv_bytes, "options": options, "requests": requests,
              "input_len": input_len, "output_len": output_len, "seed": seed, "rounds": rounds}
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "vmkv": []}
    for _ in range(rounds):  # stock, vmkv, stock, vmkv: a load spike on the machine hits one child, not one engine
        for name in runs:
            runs[name].append(_child({**config, "vmkv": name == "vmkv"}))
    out: dict[str, Any] = {name: best(mine) for name, mine in runs.items()}
    out["summary"] = summary(out["stock"], out["vmkv"], requests)
    out["config"] = config
    return out


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's costs over its child runs: the least time per call (``*_us``) and per step,
    the rest (bytes, fault counts: the same every run) from the first."""
    out = dict(runs[0])
    for key in out:
        if key.endswith("_us") or key == "step_ms":
            out[key] = min(run[key] for run in runs)
    return out


def _child(config: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vmkv-vllm-costs-") as tmp:
        answer = Path(tmp) / "costs.json"
        done = subprocess.run([sys.executable, "-m", "vmkv_bench.vllm_costs", json.dumps(config), str(answer)],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not answer.exists():
            raise RuntimeError(f"vllm_costs: the {'vmkv' if config['vmkv'] else 'stock'} child failed "
                               f"(exit {done.returncode}): {done.stderr[-3000:]}")
        return json.loads(answer.read_text())


def summary(stock: dict[str, Any], vmkv: dict[str, Any], requests: int) -> dict[str, Any]:
    """The plugin's added microseconds per step (per-request calls times ``requests``, plus the
    per-step hooks stock does not have), its share of stock's step, and a verdict line."""
    added = {key: requests * (vmkv[key] - vmkv[key.replace("_us", "_stock_us")]) for key in PER_REQUEST}
    added.update({key: vmkv[key] for key in PER_STEP})
    total = sum(added.values())
    share = total / (stock["step_ms"] * 1000)
    faults = vmkv["attention_faults_per_run"] - stock["attention_faults_per_run"]
    verdict = (f"the plugin adds {total:.0f} us to a step at {requests} running requests, {100 * share:.1f} % of "
               f"stock's {stock['step_ms']:.1f} ms step ({'within' if share <= SHARE_TARGET else 'ABOVE'} "
               f"{100 * SHARE_TARGET:.0f} %); {vmkv['scheduler_output_bytes'] - stock['scheduler_output_bytes']} more "
               f"bytes to the workers per step; {faults} more page faults in attention per run (KV written to "
               f"pages mapped on demand)")
    return {"added_us_per_step": added, "total_us_per_step": total, "share_of_stock_step": share,
            "extra_attention_faults_per_run": faults, "verdict": verdict}


def verdicts(costs: dict[str, Any]) -> list[common.Verdict]:
    """One answer: the share of stock's step that the plugin's hooks add (timed in isolation)."""
    s = costs["summary"]
    share = s["share_of_stock_step"]
    within = share <= SHARE_TARGET
    return [common.Verdict(
        key="vllm.costs.share", question="vLLM plugin: its hooks' time per step, share of stock's step",
        result=f"{100 * share:.1f} %", spread=f"least over {costs.get('config', {}).get('rounds', ROUNDS)} children of 5 timeit loops each", side="vmkv" if within else "stock",
        winner=f"{'within' if within else 'above'} {100 * SHARE_TARGET:.0f} %", reference=f"<= {100 * SHARE_TARGET:.0f} %",
        agrees=within, value=share, low=share, high=share, note=f"{s['total_us_per_step']:.0f} us a step")]


def _run_child(config: dict[str, Any]) -> dict[str, Any]:
    """In this process: start the engine, time its hooks mid-decode, count faults over a run."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from vmkv_bench.vllm_harness import drive

    vm = config["vmkv"]
    llm = drive.engine(config["model"], vmkv=vm, kv_cache_bytes=config["kv_bytes"],
                       max_model_len=2 * (config["input_len"] + config["output_len"]),
                       options=config["options"] if vm else None)
    rng = random.Random(config["seed"])
    params = SamplingParams(max_tokens=config["output_len"], ignore_eos=True, temperature=0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(3, 250) for _ in range(config["input_len"])] for _ in range(config["requests"])]

    n = config["requests"]
    drive.run(llm, prompts()[:8], [params] * 8, vmkv=vm)  # warm-up
    steps = [drive.run(llm, prompts(), [params] * n, vmkv=vm) for _ in range(3)]
    out: dict[str, Any] = {"step_ms": min(r.wall_s / r.steps for r in steps) * 1000}
    out["attention_faults_per_run"] = _attention_faults(llm, lambda: drive.run(llm, prompts(), [params] * n, vmkv=vm))
    out.update(_hook_costs(llm, prompts(), params))
    return out


def _attention_faults(llm: Any, run: Callable[[], Any]) -> int:
    """Minor page faults inside the model's attention layers over ``run()``."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    count = [0]
    start: list[int] = []
    hooks = []
    for name, module in runner.model.named_modules():
        if name.endswith("self_attn"):
            hooks.append(module.register_forward_pre_hook(lambda *_: start.append(_faults())))
            hooks.append(module.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + _faults() - start.pop())))
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return count[0]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _hook_costs(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """Time the hooks with every request running, 8 steps into decoding (fewer for short outputs). The engine is not usable
    afterwards (a step was scheduled and never run; the connector numbered thousands of steps)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    for i, prompt in enumerate(prompts):
        engine.add_request(f"costs-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(min(8, params.max_tokens // 2)):  # decoding, none finished
        engine.step()
    manager = scheduler.kv_cache_manager
    request = next(iter(scheduler.running))
    out: dict[str, Any] = {}
    out["get_num_free_blocks_us"], out["get_num_free_blocks_stock_us"] = paired_us(
        manager.block_pool.get_num_free_blocks, _stock_pool(manager.block_pool).get_num_free_blocks)
    def decode() -> Any:
        return manager.allocate_slots(request, 1)

    out["allocate_slots_decode_us"], out["allocate_slots_decode_stock_us"] = paired_us(
        decode, decode, second_within=lambda: _stock_allocation(manager))
    output = scheduler.schedule()
    out["scheduler_output_bytes"] = len(pickle.dumps(output))
    meta = output.kv_connector_metadata
    out["connector_metadata_bytes"] = len(pickle.dumps(meta)) if meta is not None else 0
    connector = scheduler.connector
    out["build_connector_meta_us"] = per_call_us(lambda: connector.build_connector_meta(output)) if connector else 0.0
    out["has_pending_push_work_us"] = per_call_us(connector.has_pending_push_work) if connector else 0.0
    out["worker_apply_empty_us"] = out["worker_stats_us"] = 0.0
    out["worker_stats_bytes"] = 0
    if has_kv_transfer_group():
        worker = get_kv_transfer_group()
        out["worker_stats_us"] = per_call_us(worker.get_kv_connector_stats)
        out["worker_stats_bytes"] = len(pickle.dumps(worker.get_kv_connector_stats()))
        out["worker_apply_empty_us"] = _apply_cost(worker.connector_worker)
    return out


def _stock_pool(pool: Any) -> Any:
    """A stock ``BlockPool`` with ``pool``'s block count and settings (its free count is what
    ``get_num_free_blocks`` costs without the plugin)."""
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(pool.num_gpu_blocks, pool.enable_caching, pool.hash_block_size)


@contextmanager
def _stock_allocation(manager: Any) -> Iterator[None]:
    """Within the block, every group manager runs vLLM's own ``allocate_new_blocks`` (the plugin's
    wrapper taken off; the same pool); the wrappers are back afterwards. A stock engine has none."""
    singles = manager.coordinator.single_type_managers
    wrappers = [single.__dict__.pop("allocate_new_blocks", None) for single in singles]
    try:
        yield
    finally:
        for single, wrapper in zip(singles, wrappers):
            if wrapper is not None:
                single.allocate_new_blocks = wrapper


def _apply_cost(worker: Any) -> float:
    """Microseconds the worker half of the connector spends on a step's metadata that changes no page."""
    from vmkv.vllm.metadata import VmkvMetadata

    applied = worker._applied
    fingerprint = worker.layout.fingerprint

    def apply() -> None:
        worker._applied = applied
        worker.apply(VmkvMetadata(applied + 1, fingerprint))

    try:
        return per_call_us(apply)
    finally:
        worker._applied = applied


if __name__ == "__main__":
    started = time.perf_counter()
    result = _run_child(json.loads(sys.argv[1]))
    result["child_s"] = time.perf_counter() - started
    Path(sys.argv[2]).write_text(json.dumps(result))
