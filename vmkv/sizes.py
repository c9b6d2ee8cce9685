"""Byte sizes given as ints or human strings ("64KiB", "2GiB", "1.5 MB")."""

from __future__ import annotations

import re

from .errors import InvalidConfig

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Return a byte count from an int or a string such as ``"64KiB"``, ``"2GiB"`` or ``"1.5GB"``.

    Args:
        value: a non-negative int, or a number followed by an optional unit (B, KiB, MiB, GiB,
            TiB, KB, MB, GB, TB; K/M/G/T mean the binary units).
        name: the field name used in the error message.

    Returns:
        The size in bytes.

    Raises:
        InvalidConfig: the value is negative, not a whole number of bytes, or not understood.
    """
    if isinstance(value, bool):
        raise InvalidConfig(f"{name} must be an int or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidConfig(f"{name} must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidConfig(f"{name}: cannot read {value!r}; use an int or e.g. '64KiB', '2GiB'")
        nbytes = float(match.group(1)) * _UNITS[unit]
        if nbytes < 0:
            raise InvalidConfig(f"{name} must be >= 0, got {value!r}")
        if nbytes != int(nbytes):
            raise InvalidConfig(f"{name}: {value!r} is not a whole number of bytes")
        return int(nbytes)
    raise InvalidConfig(f"{name} must be an int or a string like '2GiB', got {type(value).__name__}")


def format_size(nbytes: float) -> str:
    """Return ``nbytes`` in the largest binary unit that keeps the number >= 1 (e.g. '2.0 MiB')."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
