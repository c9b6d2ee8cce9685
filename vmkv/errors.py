"""Every error vmkv raises, in one place.

Invariant: an error is raised before any state changes, or after the call rolled back, so a
failed call leaves the cache as it was; exceptions: ``trim()``'s ``BackendError`` (the pages are
free already) and a failed rollback, which marks the cache broken. Each class derives from
:class:`VMKVError` and the built-in a Python user expects (``ValueError``, ``LookupError``, ...).
"""

from __future__ import annotations


class VMKVError(Exception):
    """Base class of every error raised by vmkv."""


class InvalidConfig(VMKVError, ValueError):
    """A configuration value is out of range or inconsistent (the message names the field)."""


class InvalidInput(VMKVError, ValueError):
    """A tensor or argument passed to a cache call has the wrong shape, dtype, device or value."""


class InvalidShape(InvalidInput):
    """A tensor has the wrong shape."""


class InvalidDtype(InvalidInput):
    """A tensor has the wrong dtype."""


class InvalidDevice(InvalidInput):
    """A tensor lives on the wrong device."""


class UnknownSequence(VMKVError, LookupError):
    """A call named a sequence id the cache does not hold."""

    def __str__(self) -> str:  # LookupError/KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvalidParameter(InvalidInput):
    """A request parameter (engine, server) is out of range; ``param`` names the field, as OpenAI's does.

    Args:
        param: the field, e.g. ``"temperature"``.
        message: what is wrong, naming the field.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Unsupported(VMKVError, NotImplementedError):
    """A feature vmkv does not provide here, e.g. a ``transformers`` cache method a
    ``VirtualCache`` cannot serve (the message says why)."""


class DuplicateSequence(VMKVError, ValueError):
    """``add``/``fork`` named a sequence id that already exists."""


class SequenceTooLong(VMKVError, ValueError):
    """A sequence would grow past ``max_seq_len``."""


class NoFreeSlot(VMKVError, RuntimeError):
    """All ``max_batch_size`` slots are held by live sequences."""


class BackendUnavailable(VMKVError, RuntimeError):
    """A virtual-memory backend or kernel cannot run here (e.g. "CUDA driver not available")."""


class UnsupportedVllm(BackendUnavailable):
    """The installed vLLM is not the release series the ``vmkv.vllm`` plugin was written for."""


class BackendError(VMKVError, RuntimeError):
    """The operating system or the CUDA driver refused a virtual-memory call."""


class OutOfPages(VMKVError, MemoryError):
    """The page pool cannot supply the pages a call needs (nothing was allocated)."""


class OutOfMappings(OutOfPages, BackendError):
    """The process ran out of memory mappings (``vm.max_map_count``); the call was rolled back. Free or
    preempt sequences, use larger pages, or raise the limit.
    """


class LedgerError(VMKVError, RuntimeError):
    """A host-wide KV ledger (:mod:`vmkv.ledger`, the ``shared_budget`` setting) cannot be used."""


class LedgerCorrupt(LedgerError):
    """A ledger file is not a vmkv ledger, or breaks an invariant: refused, never trusted."""


class LedgerMismatch(LedgerError):
    """A ledger of that name exists with another budget or format version, or has no free slot."""


class StalePlan(VMKVError, RuntimeError):
    """A step plan was used after the cache changed (a sequence was freed, trimmed, forked...)."""


class ConcurrentUse(VMKVError, RuntimeError):
    """Two threads called into one cache at the same time. A cache serves one thread at a time
    (``stats()`` excepted): serialise calls with your own lock, or keep the cache on one thread."""


class CacheClosed(VMKVError, RuntimeError):
    """The cache was used after ``close()``."""


__all__ = [
    "VMKVError",
    "InvalidConfig",
    "InvalidInput",
    "InvalidShape",
    "InvalidDtype",
    "InvalidDevice",
    "InvalidParameter",
    "Unsupported",
    "UnknownSequence",
    "DuplicateSequence",
    "SequenceTooLong",
    "NoFreeSlot",
    "OutOfPages",
    "OutOfMappings",
    "LedgerError",
    "LedgerCorrupt",
    "LedgerMismatch",
    "StalePlan",
    "ConcurrentUse",
    "CacheClosed",
    "BackendUnavailable",
    "UnsupportedVllm",
    "BackendError",
]
