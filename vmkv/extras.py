"""Optional packages: the install hint of an extra (vmkv installs from a clone:
``pip install -e '.[NAME]'``), whether a module is installed, and a call whose failure is a reason.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable


def install_hint(extra: str) -> str:
    """``"pip install -e '.[EXTRA]' (in a vmkv clone)"``."""
    return f"pip install -e '.[{extra}]' (in a vmkv clone)"


def installed(name: str) -> bool:
    """Whether module ``name`` is installed (a dotted name whose parent is missing is not)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def attempt(fn: Callable[[], Any]) -> tuple[Any, str]:
    """``(fn(), "")``, or ``(None, "Type: message")`` if it raises: every reason reported, none hidden."""
    try:
        return fn(), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"
