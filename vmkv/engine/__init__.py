"""Serving engine: continuous batching, chunked prefill, preemption, per-request sampling, n > 1 by
``cache.fork``, prefix caching, a Llama-family runner and CUDA-graph decode steps (docs/serving.md).

    engine = Engine.from_config(EngineConfig(kv_mode="vmm"))
    rid = engine.add_request("prompt", SamplingParams(max_tokens=16))
    outputs = engine.step()          # RequestOutput per request that progressed
"""

from __future__ import annotations

from .engine import Engine, EngineConfig
from .loop import EngineLoop
from .request import CompletionOutput, RequestMetrics, RequestOutput
from .runner import DEFAULT_MODEL_NAME, LoadedModel, ModelRunner, load_model
from .sampling import GREEDY_TEMPERATURE, InvalidParameter, SamplingParams
from .scheduler import SchedulerConfig

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineLoop",
    "SamplingParams",
    "InvalidParameter",
    "GREEDY_TEMPERATURE",
    "SchedulerConfig",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "LoadedModel",
    "ModelRunner",
    "load_model",
    "DEFAULT_MODEL_NAME",
]
