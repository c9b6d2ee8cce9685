"""Checks of user input every part of vmkv shares: each returns the clean value or raises a typed
error (integers: ``int`` or ``__index__``, never ``bool`` or ``float``; :func:`is_int` and
:func:`positive_int`: a Python ``int``, or one of the ``kind`` given).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable
from typing import Any

import torch

from .errors import InvalidConfig, InvalidInput, VMKVError


def is_int(value: Any, minimum: int | None = None, kind: type = int) -> bool:
    """Whether ``value`` is an int of ``kind`` (never a bool) and at least ``minimum`` (``None``: any)."""
    return isinstance(value, kind) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def positive_int(name: str, value: Any, error: type[VMKVError] = InvalidConfig, kind: type = int) -> int:
    """``value`` as an int if it is a positive one (of ``kind``, as :func:`is_int`).

    Raises:
        error: not a positive int (``"{name} must be a positive int, got {value!r}"``).
    """
    if not is_int(value, 1, kind):
        raise error(f"{name} must be a positive int, got {value!r}")
    return int(value)


def as_device(value: torch.device | str) -> torch.device:
    """``cpu`` or ``cuda[:N]`` as a torch device (``cuda`` is the current one).

    Raises:
        InvalidConfig: not a device string, or a device vmkv does not run on.
    """
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise InvalidConfig(f"device: {value!r} is not a device; use 'cpu' or 'cuda[:N]'") from None
    if device.type not in ("cpu", "cuda"):
        raise InvalidConfig(f"device: {device} is not supported; use 'cpu' or 'cuda[:N]'")
    if device.type == "cpu":  # torch has one CPU device: tensors say "cpu", so "cpu:0" is that one
        if device.index not in (None, 0):
            raise InvalidConfig(f"device: {device} does not exist; the CPU is 'cpu' (or 'cpu:0')")
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def as_int(value: Any, name: str, minimum: int | None = 0) -> int:
    """``value`` as an int ``>= minimum`` (any int with ``minimum=None``).

    Raises:
        InvalidInput: not an integer (bools and floats are not), or below ``minimum``.
    """
    if isinstance(value, (bool, float, torch.Tensor)):
        raise InvalidInput(f"{name} must be an int, got {type(value).__name__} {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidInput(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and number < minimum:
        raise InvalidInput(f"{name} must be >= {minimum}, got {number}")
    return number


def as_token_ids(value: Any, minimum: int = 0) -> list[int]:
    """Token ids as a list of ints: a list/tuple/range of ints, or a 1-D integer tensor/array.

    Raises:
        InvalidInput: a scalar, a string, a float, a 0-d tensor, or fewer than ``minimum`` ids.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise InvalidInput(f"token ids must be a 1-D integer tensor, got {value.dim()}-D {value.dtype}")
        tokens = value.tolist()
    elif isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidInput(f"token ids must be a sequence of ints, got {type(value).__name__}")
    else:
        try:
            tokens = [as_int(t, "a token id") for t in value]
        except TypeError:  # e.g. a 0-d NumPy array: iterable in type, not in fact
            raise InvalidInput(f"token ids must be a sequence of ints, got {type(value).__name__}") from None
    if len(tokens) < minimum:
        raise InvalidInput(f"need at least {minimum} token id(s), got {len(tokens)}")
    return tokens


def as_layer(value: Any, num_layers: int) -> int:
    """A layer index in ``0 .. num_layers - 1`` (negative indexes are refused, not wrapped)."""
    if type(value) is int and 0 <= value < num_layers:  # the common case, checked cheaply
        return value
    layer = as_int(value, "layer")
    if layer >= num_layers:
        raise InvalidInput(f"layer {layer} out of range 0..{num_layers - 1}")
    return layer


def as_scale(value: Any, head_dim: int) -> float:
    """The softmax scale: ``None`` means ``head_dim ** -0.5``; else a finite positive number."""
    if value is None:
        return head_dim**-0.5
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidInput(f"scale must be a finite number > 0 (or None), got {value!r}")
    return float(value)


def check_seq_id(seq_id: Any) -> None:
    """Sequence ids are any hashable value."""
    if not isinstance(seq_id, Hashable):
        raise InvalidInput(f"sequence ids must be hashable, got {type(seq_id).__name__}")
    try:
        hash(seq_id)
    except TypeError as exc:  # e.g. a tuple holding a list
        raise InvalidInput(f"sequence ids must be hashable: {exc}") from None
