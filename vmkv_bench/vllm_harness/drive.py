"""Run stock and vmkv vLLM engines (``vllm.LLM``) in the same environment but for the plugin's flag,
feed them requests and sample their KV memory. vLLM spawns processes: use a main guard."""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, Sequence

from vmkv.vllm import settings as plugin
from vmkv.vllm.control import stats as vmkv_stats

ENTRY_POINT = "vmkv.vllm:register"
RESERVED_CPUS = "VLLM_CPU_NUM_OF_RESERVED_CPU"
"""Set alike for stock and vmkv: vLLM's CPU platform reserves one more core for any KV connector,
which on 2 cores leaves the workers none."""
SETTLE_S = 1.5
"""vLLM's workers busy-poll their queue for 1 s after a step: let the idle engines go quiet before a run."""


def ensure_entry_point() -> Path | None:
    """Make the plugin's ``vllm.general_plugins`` entry point visible to the processes vLLM spawns."""
    if any(ep.value == ENTRY_POINT for ep in metadata.entry_points(group="vllm.general_plugins")):
        return None
    root = Path(tempfile.mkdtemp(prefix="vmkv-entry-point-"))
    info = root / "vmkv_vllm_plugin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vmkv-vllm-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nvmkv = {ENTRY_POINT}\n")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")]))
    return root


def engine(model: str | Path, *, vmkv: bool, kv_cache_bytes: int, max_model_len: int = 2048,
           options: dict[str, Any] | None = None, **llm_kwargs: Any) -> Any:
    """A ``vllm.LLM`` over ``model``, stock or with vmkv."""
    from vllm import LLM

    if vmkv:
        ensure_entry_point()
        llm_kwargs.update(plugin.engine_args(**(options or {})))
    else:
        llm_kwargs.setdefault("worker_extension_cls", plugin.WORKER_EXTENSION_CLS)
    ranks = llm_kwargs.get("tensor_parallel_size", 1) * llm_kwargs.get("pipeline_parallel_size", 1)
    llm_kwargs.setdefault("enforce_eager", True)
    llm_kwargs.setdefault("dtype", "float32")
    environment = {plugin.ENV_FLAG: "1" if vmkv else None, RESERVED_CPUS: os.environ.get(RESERVED_CPUS) or str(ranks),
                   "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}  # None: unset
    with _environment(environment):
        return LLM(model=str(model), kv_cache_memory_bytes=kv_cache_bytes, max_model_len=max_model_len, **llm_kwargs)


@contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_environment(values)
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@dataclass
class Sample:
    """One look at the engine between steps."""

    t: float
    running: int
    live_tokens: int
    mapped_bytes: int
    resident_bytes: int
    rss_bytes: int


@dataclass
class RunResult:
    """What :func:`run` returns: tokens and cached tokens per request, samples, timing, steps."""

    tokens: dict[str, list[int]]
    cached_tokens: dict[str, int]
    samples: list[Sample]
    wall_s: float
    output_tokens: int
    steps: int

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples": [asdict(s) for s in self.samples]}


def memory_sample(llm: Any, vmkv: bool, t: float, running: int, live_tokens: int) -> Sample:
    """Ask every worker for its memory now."""
    if not vmkv:
        return Sample(t, running, live_tokens, 0, 0, sum(p["rss_bytes"] for p in llm.collective_rpc("vmkv_process")))
    stats = vmkv_stats(llm)
    totals = (sum(s[key] for s in stats) for key in ("mapped_bytes", "resident_bytes", "rss_bytes"))
    return Sample(t, running, live_tokens, *totals)


def run(llm: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], *, vmkv: bool,
        arrivals: Sequence[float] | None = None, sample_every: int = 0) -> RunResult:
    """Serve ``prompts`` (token ids) with ``params`` (``SamplingParams``), arriving at ``arrivals``."""
    engine_ = llm.llm_engine
    arrivals = list(arrivals) if arrivals is not None else [0.0] * len(prompts)
    order = sorted(range(len(prompts)), key=arrivals.__getitem__)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    live: dict[str, int] = {}
    samples: list[Sample] = []
    start = time.perf_counter()
    next_request, steps = 0, 0
    while next_request < len(order) or engine_.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_request < len(order) and arrivals[order[next_request]] <= now:
            i = order[next_request]
            engine_.add_request(str(i), {"prompt_token_ids": list(prompts[i])}, params[i])
            live[str(i)] = len(prompts[i])
            next_request += 1
        if not engine_.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, arrivals[order[next_request]] - now)))
            continue
        for out in engine_.step():
            live[out.request_id] = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                cached[out.request_id] = out.num_cached_tokens or 0
                live.pop(out.request_id, None)
        steps += 1
        if sample_every and steps % sample_every == 0:
            samples.append(memory_sample(llm, vmkv, time.perf_counter() - start, len(live), sum(live.values())))
    return RunResult(tokens, cached, samples, time.perf_counter() - start, sum(len(t) for t in tokens.values()), steps)
