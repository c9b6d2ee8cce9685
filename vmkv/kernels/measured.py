"""The measured constants and kernel orders the selection reads, from ``measured.json`` beside
this module: each entry records the machine, the command and the date that produced it, so a
figure is never quoted in code and a rule never outlives the measurement behind it unnoticed."""

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
    """The preference order of kernels for one device type and addressing, and where it comes from.

    Attributes:
        kernels: names, preferred first: the first that can run is chosen for prefill and mixed
            steps (a decode-only kernel is passed over there), and for decode steps unless
            ``decode`` orders them.
        provisional: names placed by reasoning, not yet measured on that device.
        source: ``"machine; command; date: result"`` for ``vmkv info`` and the logs.
        decode: the order for decode steps (the entry's ``"decode"``, else ``kernels``): a kernel
            measured faster at decode than at prefill is placed here alone.
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
