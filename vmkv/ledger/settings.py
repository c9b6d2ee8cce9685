"""What a user sets: the ``shared_budget`` string, the ledger's path, and a budget's and member's limits."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import InvalidConfig
from ..sizes import format_size, parse_size
from .format import MAX_BUDGET

LEDGER_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def ledger_path(name: str) -> str:
    """The file of ledger ``name``: ``/dev/shm/vmkv-ledger.NAME``, or ``name`` itself if it is a path.

    Raises:
        InvalidConfig: the name is empty or has characters other than letters, digits, ``_.-``.
    """
    if "/" in name:
        return name
    if not _NAME.match(name):
        raise InvalidConfig(f"ledger name {name!r}: use 1-64 letters, digits, '_', '.' or '-' (or a path)")
    return os.path.join(LEDGER_DIR, f"vmkv-ledger.{name}")


def check_budget(budget: int) -> int:
    """Return ``budget`` if a ledger can record it.

    Raises:
        InvalidConfig: it is not 1 B to ``MAX_BUDGET`` (8 EiB).
    """
    if not 0 < budget <= MAX_BUDGET:
        raise InvalidConfig(f"a shared budget must be 1 B to {MAX_BUDGET} B (8 EiB), got {budget} B")
    return budget


def member_max(budget: int, page_bytes: int, min_bytes: int, max_bytes: int | None, label: str) -> int:
    """The most bytes a member may hold: ``max_bytes`` (``None``: the budget), at most the budget, in whole pages.

    Raises:
        InvalidConfig: no page fits, or ``min_bytes`` is above it.
    """
    high = budget if max_bytes is None else min(max_bytes, budget)
    high -= high % page_bytes if page_bytes > 0 else 0
    if page_bytes <= 0 or high <= 0 or min_bytes > high:
        raise InvalidConfig(f"ledger member {label!r}: page_bytes {page_bytes}, min {min_bytes} and max "
                            f"{max_bytes} leave no page within the budget {format_size(budget)}")
    return high


@dataclass(frozen=True)
class SharedBudget:
    """A parsed ``shared_budget`` setting: ``"NAME:SIZE[,min=SIZE][,max=SIZE][,member=LABEL][,wait=SECONDS]"``.

    Attributes:
        name: the ledger's name (or path).
        budget: bytes the ledger holds for all members together.
        min_bytes: bytes this member is never asked to give back.
        max_bytes: bytes this member never holds more than (``None``: the whole budget).
        member: the label ``vmkv ledger`` shows (``None``: the program name and pid).
        wait_s: how long a member short of budget waits for others before ``OutOfPages``.
    """

    name: str
    budget: int
    min_bytes: int = 0
    max_bytes: int | None = None
    member: str | None = None
    wait_s: float = 2.0

    @classmethod
    def parse(cls, text: str) -> "SharedBudget":
        """Read a ``shared_budget`` string.

        Raises:
            InvalidConfig: it is not ``NAME:SIZE`` with optional ``,min=``, ``,max=``, ``,member=``,
                ``,wait=``; the size is 0 or past ``MAX_BUDGET``; ``max`` is 0; ``min`` is above
                ``max`` or the budget.
        """
        if not isinstance(text, str) or ":" not in text:
            raise InvalidConfig(f"shared_budget must be 'NAME:SIZE[,min=SIZE][,max=SIZE][,member=LABEL][,wait=SECONDS]', "
                                f"got {text!r}")
        name, _, rest = text.partition(":")
        size, *options = rest.split(",")
        fields: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key.strip() not in ("min", "max", "member", "wait") or key.strip() in fields:
                raise InvalidConfig(f"shared_budget: {option!r} is not min=SIZE, max=SIZE, member=LABEL or "
                                    "wait=SECONDS (each once)")
            fields[key.strip()] = value.strip()
        ledger_path(name)  # validates the name
        budget = check_budget(parse_size(size.strip(), name="shared_budget size"))
        low = parse_size(fields.get("min", "0"), name="shared_budget min")
        high = parse_size(fields["max"], name="shared_budget max") if "max" in fields else None
        if high == 0:
            raise InvalidConfig(f"shared_budget {text!r}: max must be > 0 (leave it out for no limit of its own)")
        if low > (budget if high is None else min(high, budget)):
            raise InvalidConfig(f"shared_budget {text!r}: the budget must be > 0 and min <= max <= budget")
        member = fields.get("member")
        if member is not None and not 0 < len(member.encode()) <= 32:
            raise InvalidConfig(f"shared_budget member label must be 1-32 bytes, got {member!r}")
        try:
            wait_s = float(fields.get("wait", "2"))
        except ValueError:
            wait_s = -1.0
        if not 0 <= wait_s <= 3600:
            raise InvalidConfig(f"shared_budget wait must be 0-3600 seconds, got {fields['wait']!r}")
        return cls(name, budget, low, high, member, wait_s)
