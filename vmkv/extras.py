"""How to install an optional extra: one sentence, used by every message that names one.

vmkv is not on a package index: it installs from a clone of its repository, so an extra is
``pip install -e '.[NAME]'`` run in the clone (``pip install 'vmkv[NAME]'`` would fail).
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """``"pip install -e '.[EXTRA]' (in a vmkv clone)"``."""
    return f"pip install -e '.[{extra}]' (in a vmkv clone)"
