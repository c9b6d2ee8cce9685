"""OpenAI-compatible HTTP server (FastAPI) over the vmkv serving engine. See ``docs/serving.md``."""

from __future__ import annotations

__all__ = ["create_app", "BackgroundServer"]


def __getattr__(name: str):  # FastAPI is imported only when the server is used
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
