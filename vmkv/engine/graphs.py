"""Captured decode steps: the engine's CUDA graphs, one per batch-size bucket, in both modes.

A decode step is a few hundred small launches whose overhead sets a small batch's speed; a graph
replays them as one. It may replay only what never changes:

* fixed addresses: inputs live in persistent buffers (token ids, the cache's
  :class:`~vmkv.kernels.static_step.StaticStep`), filled before each replay; K/V never move.
* fixed shapes: a graph per bucket of batch sizes; padding rows point at a scratch sequence.
* lengths on the device: each layer attends through the capturable kernel.
* no page mapped inside: ``begin_step`` maps everything first; prefill steps run eagerly.

On a CPU :class:`EagerReplay` stands in, calling the recorded step again with the capture's
plan, so a step that depended on anything but its buffers would give other tokens: what the CPU
tests check.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..core.base import KVCacheBase
from ..core.step import StepPlan
from ..errors import InvalidConfig, Unsupported
from ..kernels.capturable import DecodeWorkspace
from ..kernels.static_step import PadRow, StaticStep
from ..kernels.triton_attention import choose_num_splits, multiprocessor_count
from .llama import LlamaForCausalLM

log = logging.getLogger("vmkv.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PAD_SEQUENCE = ("vmkv-graphs", "padding")  # the scratch sequence padding rows write into
SLOTS_TAKEN = 1  # cache slots the graphs take (the scratch sequence's)


def unsupported(cache: KVCacheBase) -> str | None:
    """Why decode steps over ``cache`` cannot be captured, or ``None`` if they can."""
    if cache.config.max_batch_size <= SLOTS_TAKEN:
        return f"captured decode steps need a cache of at least {SLOTS_TAKEN + 1} slots (one holds padding rows)"
    return None


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes captured for up to ``max_batch`` sequences: :data:`BUCKETS` below it and
    ``max_batch`` itself.

    Raises:
        InvalidConfig: ``max_batch`` < 1.
    """
    if max_batch < 1:
        raise InvalidConfig(f"CUDA graphs need at least one sequence slot, got {max_batch}")
    return tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``batch`` sequences, or ``None`` past the largest."""
    return next((b for b in buckets if b >= batch), None)


class Replay(Protocol):
    """A step function recorded once and replayed."""

    def capture(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``step`` (run it as needed) and return its output tensor."""

    def replay(self) -> torch.Tensor:
        """Run the recorded step again over the buffers' current contents; its output tensor."""


class CudaGraphReplay:
    """A ``torch.cuda.CUDAGraph`` of the step in a memory pool shared by the engine's buckets. It keeps
    the step function, and every tensor it closes over, as long as the graph: a graph replays raw
    addresses, and a tensor freed after capture would hand its memory to others.
    """

    def __init__(self, pool: object) -> None:
        self._pool = pool
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None
        self._step: Callable[[], torch.Tensor] | None = None

    def capture(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._step = step  # the graph's inputs live as long as the graph (class docstring)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles the Triton kernels and settles lazy allocations
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=self._pool):
            self._out = step()
        return self._out

    def replay(self) -> torch.Tensor:
        self._graph.replay()
        return self._out


class EagerReplay:
    """The CPU stand-in: replaying calls the recorded step function again (same closure and plan)."""

    def __init__(self) -> None:
        self._step: Callable[[], torch.Tensor] | None = None

    def capture(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._step = step
        return step()

    def replay(self) -> torch.Tensor:
        return self._step()


@dataclass
class GraphStats:
    """What the engine's graphs did (``Engine.stats()["engine"]["cuda_graphs"]``)."""

    captured: list[int] = field(default_factory=list)  # buckets captured, in order
    replays: int = 0
    padded_rows: int = 0  # padding rows replayed (bucket - batch, summed)

    def as_dict(self) -> dict:
        return {"captured": list(self.captured), "replays": self.replays, "padded_rows": self.padded_rows}


class DecodeGraphs:
    """The captured decode steps of one model over one cache (module docstring).

    Args:
        model: the engine's model (on the cache's device).
        cache: the engine's cache, with one slot more than the engine schedules (for padding).
        replay: makes one :class:`Replay` per bucket (default: CUDA graphs on CUDA, else eager).
        buckets: batch sizes to capture (default :func:`graph_buckets` of the slots left).

    Raises:
        Unsupported: :func:`unsupported` says why.
        InvalidConfig: a bucket larger than the slots left.
        OutOfPages: no page for the scratch sequence.
    """

    def __init__(self, model: LlamaForCausalLM, cache: KVCacheBase,
                 replay: Callable[[], Replay] | None = None, buckets: tuple[int, ...] | None = None) -> None:
        why = unsupported(cache)
        if why is not None:
            raise Unsupported(why)
        self.model, self.cache = model, cache
        config = cache.config
        self.device = torch.device(config.device)
        slots = config.max_batch_size - SLOTS_TAKEN
        self.buckets = buckets or graph_buckets(slots)
        if self.buckets[-1] > slots:
            raise InvalidConfig(f"the largest graph bucket ({self.buckets[-1]}) needs {self.buckets[-1] + SLOTS_TAKEN} "
                                f"slots (one for padding rows), the cache has {config.max_batch_size}")
        self.pad = self._pad_row()
        self.step = StaticStep(cache, self.buckets[-1], config.max_seq_len)
        self.ids = torch.zeros(self.buckets[-1], dtype=torch.int64, device=self.device)  # each row's new token
        self._replay_factory = replay or _default_replay(self.device)
        self._graphs: dict[int, Replay] = {}
        self.stats = GraphStats()

    def _pad_row(self) -> PadRow:
        """Start the scratch sequence (one token, one page) padding rows write into."""
        cache = self.cache
        cache.add(PAD_SEQUENCE)
        return PadRow.of(cache, cache.begin_step({PAD_SEQUENCE: 1}))

    def applies(self, plan: StepPlan) -> bool:
        """Whether ``plan`` runs captured: a decode step of at most the largest bucket."""
        return plan.is_decode and plan.batch_size <= self.buckets[-1]

    def run(self, plan: StepPlan, token_ids: list[int]) -> torch.Tensor:
        """Run the decode step ``plan`` (``begin_step`` mapped its pages) through its bucket's graph,
        capturing it first if needed; ``token_ids``: each sequence's new token, in plan order.

        Returns:
            float32 logits ``[B, vocab]`` (a view of the graph's output: read it before the next step).
        """
        bucket = bucket_for(plan.batch_size, self.buckets)
        self.step.load(plan, bucket, self.pad)
        self.ids[: plan.batch_size].copy_(torch.tensor(token_ids), non_blocking=True)
        if bucket not in self._graphs:
            self._capture(bucket, plan)
        out = self._graphs[bucket].replay()
        self.cache.written(plan)
        self.stats.replays += 1
        self.stats.padded_rows += bucket - plan.batch_size
        return out[: plan.batch_size]

    def _capture(self, bucket: int, plan: StepPlan) -> None:
        """Record the step function of ``bucket`` (the buffers hold this step's rows)."""
        self.cache.wait_for_mapping()  # no thread may synchronize the device during a capture
        replay = self._replay_factory()
        replay.capture(self._step_function(bucket, plan))
        self._graphs[bucket] = replay
        self.stats.captured.append(bucket)
        log.info("vmkv engine: captured the decode step of %d sequences (%s, %s decode)", bucket, type(replay).__name__,
                 self.step.kernel)

    def _step_function(self, bucket: int, plan: StepPlan) -> Callable[[], torch.Tensor]:
        """The decode step of ``bucket`` rows as a function of the buffers alone."""
        step, cache, model = self.step, self.cache, self.model
        ids, positions = self.ids[:bucket], step.columns[:bucket]
        logit_rows = torch.arange(bucket, device=self.device)
        out = torch.empty(bucket, model.shape.num_heads, model.shape.head_dim, dtype=model.lm_head.weight.dtype,
                          device=self.device)
        workspace = self._workspace(bucket)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [b, Hq, D]; k, v: [b, Hkv, D], one new token per row
            step.write(layer, k[:, :, None], v[:, :, None])
            return step.attend(layer, q, None, out=out, workspace=workspace)

        def run() -> torch.Tensor:  # (``plan`` is not read: ``attend`` replaces the plan's write and attention)
            return model(cache, plan, ids, positions, logit_rows, attention=attend)

        return run

    def _workspace(self, bucket: int) -> DecodeWorkspace | None:
        """The Triton kernel's split scratch for ``bucket`` rows, or ``None`` (one split, or another kernel)."""
        config = self.cache.config
        if self.step.kernel != "triton":
            return None
        splits = choose_num_splits(bucket, config.num_kv_heads, config.max_seq_len, multiprocessor_count(self.device))
        if splits == 1:
            return None
        return DecodeWorkspace.allocate(bucket, self.model.shape.num_heads, config.head_dim, splits, self.device)


def _default_replay(device: torch.device) -> Callable[[], Replay]:
    if device.type == "cuda":
        pool = torch.cuda.graph_pool_handle()
        return lambda: CudaGraphReplay(pool)
    return EagerReplay
