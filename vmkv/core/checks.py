"""Checks of a cache call's arguments: each returns the clean value or raises a typed error
before anything changes (the calls of :class:`~vmkv.core.base.KVCacheBase` run them first)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import KVCacheConfig
from ..errors import InvalidDevice, InvalidDtype, InvalidInput, InvalidShape, SequenceTooLong, StalePlan, UnknownSequence
from ..validate import as_int, as_layer, as_token_ids
from .sequence import LiveSequence, SeqId
from .step import StepPlan

Step = tuple[LiveSequence, int, "list[int] | None"]
"""One entry of a step: the sequence, its new tokens, their ids (``None``: only a count given)."""


def get_sequence(seqs: Mapping[SeqId, LiveSequence], seq_id: Any) -> LiveSequence:
    """The live sequence ``seq_id``.

    Raises:
        UnknownSequence: no such sequence (or an unhashable id).
    """
    try:
        return seqs[seq_id]
    except (KeyError, TypeError):
        raise UnknownSequence(f"unknown sequence {seq_id!r}; add() it first") from None


def check_length(seq: LiveSequence, total: int, max_seq_len: int) -> None:
    """Raise ``SequenceTooLong`` if ``seq`` would hold ``total`` tokens, past ``max_seq_len``."""
    if total > max_seq_len:
        raise SequenceTooLong(f"sequence {seq.seq_id!r} would hold {total} tokens, past max_seq_len={max_seq_len}")


def parse_batch(batch: Any, seqs: Mapping[SeqId, LiveSequence], max_seq_len: int) -> list[Step]:
    """``(sequence, new tokens, their ids or None)`` per entry of a ``begin_step`` batch.

    Raises:
        InvalidInput: not a non-empty mapping, or a count/ids that is neither.
        UnknownSequence, SequenceTooLong.
    """
    if not isinstance(batch, Mapping):
        raise InvalidInput(f"begin_step takes a mapping {{seq_id: count or token ids}}, got {type(batch).__name__}")
    if not batch:
        raise InvalidInput("begin_step needs at least one sequence")
    steps: list[Step] = []
    for seq_id, new in batch.items():
        seq = get_sequence(seqs, seq_id)
        if type(new) is int and new >= 1:  # the common case (a count), checked cheaply
            ids, count = None, new
        elif isinstance(new, torch.Tensor) and new.dim() == 0:
            raise InvalidInput(f"sequence {seq_id!r}: a 0-d tensor is ambiguous; pass an int count or a list of token ids")
        elif isinstance(new, (bool, float)) or (hasattr(new, "__index__") and not hasattr(new, "__len__")):
            ids, count = None, as_int(new, f"new tokens of {seq_id!r}", minimum=1)  # a count (NumPy ints too)
        else:  # token ids: a list, tuple, range, 1-D tensor or array
            ids = as_token_ids(new, 1)
            count = len(ids)
        check_length(seq, seq.length + count, max_seq_len)
        steps.append((seq, count, ids))
    return steps


def check_plan(plan: Any, owner: object, version: int, layer: Any, num_layers: int) -> int:
    """Validate a plan of the cache ``owner`` at ``version`` and a layer index; return the layer.

    Raises:
        InvalidInput: not a plan, or no such layer.
        StalePlan: a plan of another cache, or of an older version of this one.
    """
    if not isinstance(plan, StepPlan):
        raise InvalidInput(f"plan must be the StepPlan returned by begin_step, got {type(plan).__name__}")
    if plan.owner is not owner:
        raise StalePlan("this plan was built by another cache; call begin_step on this one")
    if plan.version != version:
        raise StalePlan("the cache changed since this plan was built; call begin_step again")
    return as_layer(layer, num_layers)


def check_tensor(name: str, tensor: Any, shape: tuple[int, ...], config: KVCacheConfig,
                 dims: str = "[tokens, kv_heads, head_dim]") -> None:
    """Refuse ``tensor`` unless it has ``shape`` (named ``dims``) and the cache's dtype and device.

    Raises:
        InvalidInput, InvalidShape, InvalidDtype, InvalidDevice.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInput(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != shape:  # torch.Size is a tuple: no copy
        raise InvalidShape(f"{name} must have shape {list(shape)} ({dims}), got {list(tensor.shape)}")
    if tensor.dtype != config.dtype:
        raise InvalidDtype(f"{name} has dtype {tensor.dtype}; the cache holds {config.dtype}")
    if tensor.device != config.device:
        raise InvalidDevice(f"{name} is on {tensor.device}; the cache lives on {config.device}")


def check_query(q: Any, plan: StepPlan, config: KVCacheConfig) -> None:
    """Refuse queries unless ``[plan.num_tokens, n * kv_heads, head_dim]`` of the cache's dtype and device.

    Raises:
        InvalidInput, InvalidShape, InvalidDtype, InvalidDevice.
    """
    heads = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0
    if heads == 0 or heads % config.num_kv_heads:
        raise InvalidShape(
            f"q must have shape [{plan.num_tokens}, n * {config.num_kv_heads}, {config.head_dim}] "
            f"([tokens, q_heads, head_dim]), got {list(getattr(q, 'shape', []))}"
        )
    check_tensor("q", q, (plan.num_tokens, heads, config.head_dim), config, "[tokens, q_heads, head_dim]")
