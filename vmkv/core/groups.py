"""A cache of layers of different windows: one core cache per window.

A page holds a block of tokens of every layer, so sliding and full layers (GPT-OSS, Gemma 3)
cannot share pages. :class:`LayerGroups` keeps a core cache per window, each with its own pages,
geometry, budget share and kernel (:func:`vmkv.sizing.layer_groups`); sequence verbs run in every
group, in the same slot, all or nothing (a group that refuses undoes the earlier ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import KVCacheConfig
from .base import KVCacheBase
from .sequence import SeqId
from .step import StepPlan


@dataclass(frozen=True)
class GroupedPlan:
    """One step in every group: the same sequences, counts and slots; each group's own rows and table."""

    plans: tuple[StepPlan, ...]

    def __getattr__(self, name: str) -> Any:
        if name in _SHARED:
            return getattr(self.plans[0], name)
        raise AttributeError(f"{name!r} differs between layer groups: read plans[g].{name}")


_SHARED = frozenset({"seq_ids", "slots", "starts", "q_lens", "kv_lens", "cu_q", "slots_t", "kv_lens_t", "causal_masks",
                     "offsets", "num_tokens", "is_decode", "batch_size", "max_q", "max_kv"})
"""The fields every group's plan of a step shares (the sequences, not the storage)."""


class LayerGroups:
    """Core caches over the layers of each window, behind the core cache's API.

    Args:
        config: the whole model's config (``layer_windows`` differ between layers).
        groups: per group, the model's layers it holds (ascending) and its core cache.
    """

    def __init__(self, config: KVCacheConfig, groups: list[tuple[list[int], KVCacheBase]]) -> None:
        self.config = config
        self.groups = [core for _, core in groups]
        self.layers = [layers for layers, _ in groups]
        self.mode = self.groups[0].mode
        self.kernel = "+".join(dict.fromkeys(core.kernel for core in self.groups))
        self._where = {layer: (g, local) for g, layers in enumerate(self.layers) for local, layer in enumerate(layers)}

    def group_of(self, layer: int) -> tuple[KVCacheBase, int]:
        """The core cache holding ``layer`` and the layer's index there."""
        g, local = self._where[self._layer(layer)]
        return self.groups[g], local

    def _layer(self, layer: int) -> int:
        from ..validate import as_layer

        return as_layer(layer, self.config.num_layers)

    # ---- sequences: every group, one slot -------------------------------------------------------
    def add(self, seq_id: SeqId, token_ids: Sequence[int] | None = None) -> int:
        """``KVCacheBase.add`` in every group (the same slot in each); all or nothing."""
        return self._start(lambda core, slot: core.add(seq_id, token_ids, slot=slot), seq_id)

    def fork(self, src_id: SeqId, dst_id: SeqId) -> int:
        """``KVCacheBase.fork`` in every group (the same slot in each); all or nothing."""
        return self._start(lambda core, slot: core.fork(src_id, dst_id, slot=slot), dst_id)

    def _start(self, start: Callable[[KVCacheBase, int | None], int], seq_id: SeqId) -> int:
        slot = start(self.groups[0], None)
        done = [self.groups[0]]
        try:
            for core in self.groups[1:]:
                start(core, slot)
                done.append(core)
        except BaseException:
            for core in done:
                core.free(seq_id)
            raise
        return slot

    def free(self, seq_id: SeqId) -> None:
        for core in self.groups:
            core.free(seq_id)

    def truncate(self, seq_id: SeqId, length: int) -> None:
        """``KVCacheBase.truncate`` in every group, once every group would take it."""
        self.check_truncate(seq_id, length)
        for core in self.groups:
            core.truncate(seq_id, length)

    def check_truncate(self, seq_id: SeqId, length: int) -> None:
        for core in self.groups:
            core.check_truncate(seq_id, length)

    def reserve(self, seq_id: SeqId, num_tokens: int) -> None:
        """``KVCacheBase.reserve`` in every group, once every group has the room (a refusing group would
        leave the earlier ones holding pages)."""
        for core in self.groups:
            core.check_reserve(seq_id, num_tokens)
        for core in self.groups:
            core.reserve(seq_id, num_tokens)

    def trim(self, keep_cached: bool = False) -> int:
        return sum(core.trim(keep_cached) for core in self.groups)

    # ---- steps ------------------------------------------------------------------------------------
    def begin_step(self, batch: Mapping[SeqId, int | Sequence[int]], *, undoable: bool = False) -> GroupedPlan:
        """``KVCacheBase.begin_step`` in every group, undoably, so a refusing group leaves the others as
        they were; ``undoable``: as a whole.
        """
        plans: list[StepPlan] = []
        try:
            for core in self.groups:  # (the last group's step need not be undoable unless asked)
                plans.append(core.begin_step(batch, undoable=undoable or core is not self.groups[-1]))
        except BaseException:
            for core, plan in zip(reversed(self.groups[: len(plans)]), reversed(plans)):
                core.cancel_step(plan)
            raise
        return GroupedPlan(tuple(plans))

    def cancel_step(self, plan: GroupedPlan) -> None:
        for core, group_plan in zip(reversed(self.groups), reversed(plan.plans)):
            core.cancel_step(group_plan)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: GroupedPlan) -> None:
        g, local = self._where[self._layer(layer)]
        self.groups[g].write(local, k, v, plan.plans[g])

    def write_batch(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: GroupedPlan) -> tuple[torch.Tensor, torch.Tensor]:
        g, local = self._where[self._layer(layer)]
        return self.groups[g].write_batch(local, k, v, plan.plans[g])

    def attention(self, layer: int, q: torch.Tensor, plan: GroupedPlan, **kwargs: Any) -> torch.Tensor:
        g, local = self._where[self._layer(layer)]
        return self.groups[g].attention(local, q, plan.plans[g], **kwargs)

    def written(self, plan: GroupedPlan) -> None:
        for core, group_plan in zip(self.groups, plan.plans):
            core.written(group_plan)

    def wait_for_mapping(self) -> None:
        for core in self.groups:
            core.wait_for_mapping()

    # ---- a layer's storage -------------------------------------------------------------------
    def kv(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        core, local = self.group_of(layer)
        return core.kv(seq_id, local)

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        core, local = self.group_of(layer)
        return core.kv_cache(local)

    def block_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        core, local = self.group_of(layer)
        return core.block_pool(local)

    def layer_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        core, local = self.group_of(layer)
        return core.layer_storage(local)

    # ---- queries -------------------------------------------------------------------------------
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self.groups[0]

    def __len__(self) -> int:
        return len(self.groups[0])

    @property
    def seq_ids(self) -> list[SeqId]:
        return self.groups[0].seq_ids

    def seq_len(self, seq_id: SeqId) -> int:
        return self.groups[0].seq_len(seq_id)

    def slot(self, seq_id: SeqId) -> int:
        return self.groups[0].slot(seq_id)

    @property
    def bytes_in_use(self) -> int:
        return sum(core.bytes_in_use for core in self.groups)

    def stats(self) -> dict[str, Any]:
        """Memory totals over the groups, sequence counts once, and each group's ``stats()`` under ``"groups"``."""
        per_group = [dict(core.stats(), layers=layers) for layers, core in zip(self.layers, self.groups)]
        stats = {key: value for key, value in per_group[0].items() if key not in _PER_GROUP}
        stats.update({key: sum(group[key] for group in per_group) for key in _SUMMED if key in stats})
        stats.update(kernel=self.kernel, groups=per_group, window=None,
                     utilization=stats["token_bytes"] / stats["bytes_in_use"] if stats["bytes_in_use"] else 0.0)
        return stats

    def state(self) -> tuple:
        return tuple(core.state() for core in self.groups)

    def check(self) -> None:
        for core in self.groups:
            core.check()

    def close(self) -> None:
        for core in self.groups:
            core.close()

    def __enter__(self) -> "LayerGroups":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SUMMED = frozenset({"pages_total", "pages_free", "pages_in_use", "pages_spare", "shared_pages", "cached_pages", "map_step_ns",
                     "bytes_in_use", "token_bytes", "cow_copies", "evictions", "map_ahead_errors", "resident_bytes",
                     "reserved_bytes", "pages_mapped_ahead", "pool_bytes", "num_blocks", "window_releases"})
"""``stats()`` totals over the groups; sequence and token counts are reported once."""
_PER_GROUP = frozenset({"page_bytes", "tokens_per_page", "page_size", "block_size", "layout", "backend"})
"""``stats()`` that differ between groups: under ``"groups"`` only."""
