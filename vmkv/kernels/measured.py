"""The measured constants and kernel orders the selection reads, from ``measured.json``: each entry
records its machine, command and date, so no figure is quoted in code.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PATH = Path(__file__).with_name("measured.json")


@functools.cache
def _data() -> dict[str, Any]:
    return json.loads(PATH.read_text())


@dataclass(frozen=True)
class Order:
    """The preference order of kernels for one device type and addressing.

    Attributes:
        kernels: preferred first; the first that can run is chosen (decode too, unless ``decode``).
        provisional: names placed by reasoning, not yet measured on that device.
        source: ``"machine; command; date: result"`` for ``vmkv info`` and the logs.
        decode: the order for decode steps (the entry's ``"decode"``, else ``kernels``).
    """

    kernels: tuple[str, ...]
    provisional: frozenset[str]
    source: str
    decode: tuple[str, ...]


def order(device_type: str, addressing: str) -> Order:
    """The order for ``device_type`` (``"cpu"``, ``"cuda"``) and ``addressing`` (``"slots"``, ``"blocks"``)."""
    entry = _data()["order"][f"{device_type}/{addressing}"]
    source = f"{entry['machine']}; {entry['command']}; {entry['date']}: {entry['result']}"
    kernels = tuple(entry["kernels"])
    return Order(kernels, frozenset(entry.get("provisional", ())), source, tuple(entry.get("decode", kernels)))


def batch_rule_constants(device_type: str = "cpu") -> dict[str, float]:
    """The fitted constants of :class:`vmkv.kernels.contiguous.BatchRule` for ``device_type``."""
    entry = _data()["batch_rule"][device_type]
    return {name: float(entry[name]) for name in ("call_us", "key_us", "run_key_us", "real_key_us", "fixed_us")}
