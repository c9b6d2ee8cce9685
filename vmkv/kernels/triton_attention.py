"""Triton attention over either cache addressing: split-KV decode and (chunked) causal prefill.

One kernel family reads K/V two ways, chosen by a compile-time switch (``PAGED``), so timing one
against the other measures block-table translation and nothing else:

* **paged** (``paged`` package): ``k, v: [num_blocks, block_size, Hkv, D]`` block pools and an
  int32 ``block_table: [B, max_blocks]``. Key ``p`` of sequence ``i`` is row ``p % block_size``
  of pool block ``block_table[i, p // block_size]``.
* **contiguous** (VMM mode, ``vmkv`` package): ``k, v: [max_batch, capacity, Hkv, D]``, any
  strides with a unit last one (views of larger reserved ranges: one layer of an all-layers
  tensor ``[B, S, L, H, D][:, :, layer]``, or a head-major ``[B, H, S, D].transpose(1, 2)``),
  and an int32 ``slots: [B]``. Key ``p`` of sequence ``i`` is ``k[slots[i], p]``.

Lengths ``kv_lens: int32 [B]`` (keys per sequence, this step's new ones included) live on the
device. Every load of K/V is masked by them: nothing at or past a sequence's length reaches the
result, and (lengths being clamped to what the storage holds) nothing outside the storage is
read. The callers' invariants, which the kernels cannot check without reading the device:
``slots[i] < max_batch``; ``block_table[i, j]`` is a valid pool block for every
``j < cdiv(kv_lens[i], block_size)`` (entries past that are never read, ``-1`` is fine).

Decode (``q: [B, Hq, D]``, one new token per sequence), FlashDecoding's two passes:

1. ``_decode_split_kernel``, grid ``(B, Hkv, num_splits)``. A program takes one sequence, one
   KV head and one *split* (a range of that sequence's keys): its ``G = Hq / Hkv`` query heads
   form one ``[G, D]`` tile (padded to 16 rows for ``tl.dot``), so each K/V tile is read once
   for the whole group. It walks its keys in tiles of ``BLOCK_N`` with the online softmax (a
   running max ``m``, sum ``l`` and accumulator per query head) and stores its partial output
   ``acc / l`` and log-sum-exp ``m + log2(l)`` (base 2) into float32 scratch.
2. ``_decode_merge_kernel``, grid ``(B, Hkv)``: ``out = sum_s w_s o_s / sum_s w_s`` with
   ``w_s = 2^(lse_s - max_s lse_s)``. With one split, pass 1 writes ``out`` itself and pass 2
   does not run.

Splitting a sequence's keys gives small batches enough programs to use every multiprocessor's
share of memory bandwidth; :func:`choose_num_splits` says how many.

Prefill (``q: [T, Hq, D]`` packed, ``cu_q: int32 [B + 1]``): ``_prefill_kernel``, grid
``(T // BLOCK_Q + B, Hkv)``. A program takes up to ``BLOCK_Q`` query tokens of one sequence
times the ``G`` query heads of one KV head (``BLOCK_M = BLOCK_Q * G`` rows), finds its sequence
by a binary search over ``cu_q``, and runs the online softmax over key tiles up to its last
query's position: query ``j`` of sequence ``i`` sits at position ``kv_lens[i] - q_len_i + j``
and sees keys ``0 ..`` that position (causal, bottom-right aligned over the cached prefix, so
plain prefill, chunked prefill and single-token rows are the same case).

Why the grids never depend on device lengths: a captured CUDA graph replays the same launches
every decode step while lengths grow on the device. So every host-side decision (grids, split
count, tile sizes) uses host ints known up front: batch size, head counts, ``T``, the storage's
shape and an upper bound on lengths. Each program reads its own length on the device and
derives its key range from it: the split ranges are ``cdiv(kv_len, num_splits)`` keys rounded up
to whole tiles, so a split that starts at or past ``kv_len`` does no work and stores a
log-sum-exp of -inf, which the merge weighs 0. No call here reads a device value on the host
(no ``.item()``, no ``.tolist()``, no sync); scratch can be preallocated
(:class:`DecodeWorkspace`) so a graph reuses it.

Compiled variants: Triton compiles one kernel per value of its ``tl.constexpr`` arguments. Here
those are fixed by a cache and layer (head counts, head dim, dtype, block size, addressing), and
everything that changes from step to step (lengths, batch size, ``T``, the split count) is a
runtime argument, so a cache compiles a handful of kernels on its first steps and no more (a
split count of 1 compiles apart: triton treats an int equal to 1 as a constant). Compile them
before capturing a CUDA graph (run one eager step first).

A sequence with no key (``kv_lens[i] == 0``) gets a decode output of zeros.

Variants (:class:`~vmkv.kernels.base.Variant`: ``window``, ``softcap``, ``sinks`` keyword
arguments of both calls). A window is a key range per query: each program starts at the key tile
holding its earliest query's first key, so tiles wholly before the window are never loaded, and
keys before that first key are masked out of every load, the block-table lookup included: an
entry of a block wholly before the window of the sequence's earliest query is never read (it may
be ``-1``). Decode's splits divide the window's keys, not the whole sequence, and the default
split count counts only them. A soft-cap applies to the scores; sinks join the softmax (pass 1
with one split, the merge with several; prefill in its one pass). The window is a runtime
argument (one compiled kernel serves every window), soft-capping and sinks compile apart.

Supported: head dims 16, 32, 64, 128, 256; float16, bfloat16, float32 (accumulation always in
float32; float32 dots in full IEEE precision, not TF32); GQA with ``Hq`` any multiple of
``Hkv``; any block size (blocks that hold whole key tiles, e.g. powers of two >= 64, take one
block-table entry per tile; smaller or odd ones look each key's block up). Devices: CUDA, or
CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton's first import in
the process; see :func:`triton_available`), which is how the tests run them.

The kernels themselves live in :mod:`vmkv.kernels.triton_kernels`, imported on first use, so
importing this module never needs triton.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..errors import BackendUnavailable, InvalidDevice, InvalidDtype, InvalidInput, InvalidShape, Unsupported
from ..validate import is_int, positive_int
from .base import Variant

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# choose_num_splits' constants: a split pays only where a sequence is long (the sweep: docs/gpu.md, "The split rule").
PROGRAMS_PER_SM = 1  # decode programs wanted per multiprocessor (one wave: each SM holds several programs at once)
MIN_KEYS_PER_SPLIT = 2048  # no split shorter: it does not pay for its float32 partial output and the merge launch
MAX_AUTO_SPLITS = 64  # the most splits choose_num_splits picks
MAX_NUM_SPLITS = 65535  # the most a caller may force (a CUDA grid's third dimension)
CPU_STAND_IN_SMS = 8  # "multiprocessors" of the CPU interpreter: any fixed number keeps CPU runs reproducible

_KERNELS_MODULE = "vmkv.kernels.triton_kernels"


# ---- availability -------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _import_triton() -> str | None:
    """Import triton once; ``None`` if it worked, else why not."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # noqa: BLE001 -- any failure of an optional import means "unusable"
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


def _interpreted(fn: Any) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


def _interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _interpreter_state() -> str | None:
    """Whether CPU tensors can run here: ``None`` if Triton's interpreter runs our kernels, else
    why not.

    Triton decides per ``@triton.jit`` function, when it is defined, whether it runs compiled or
    in the interpreter (``TRITON_INTERPRET=1``). Its own library functions (``tl.max``,
    ``tl.sum``...) are defined when triton is imported and ours when :mod:`triton_kernels` is,
    so the variable must be set before both: before triton's first import in the process.
    """
    import triton.language as tl

    if not _interpreted(tl.max):
        return (
            "Triton runs kernels on CPU tensors only in its interpreter, and triton was imported without it: "
            "set TRITON_INTERPRET=1 before triton's first import in the process"
        )
    module = sys.modules.get(_KERNELS_MODULE)
    if module is not None and not _interpreted(module._decode_split_kernel):
        return "the Triton kernels were defined (first used) without TRITON_INTERPRET=1: they run compiled, for CUDA tensors only"
    if module is None and not _interpret_requested():
        return "TRITON_INTERPRET=1 was unset after triton's import: the kernels, defined on first use, would run compiled"
    return None


def triton_available(device: torch.device | str | None = None) -> tuple[bool, str | None]:
    """Whether the Triton kernels can run on ``device`` here.

    Args:
        device: where the tensors live; ``None``: CUDA if torch sees a GPU, else the CPU.

    Returns:
        ``(True, None)``, or ``(False, why)``: triton is not importable; the device is CUDA and
        torch sees no GPU; the device is the CPU and the kernels would not run in Triton's
        interpreter (``TRITON_INTERPRET=1`` must be set before triton's first import in the
        process, see :func:`_interpreter_state`); or another device type.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and "triton" not in sys.modules and not _interpret_requested():
        return False, ("Triton runs kernels on CPU tensors only in its interpreter: set TRITON_INTERPRET=1 before "
                       "triton's first import in the process")  # (known without importing triton)
    why = _import_triton()
    if why is not None:
        return False, why
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        return True, None
    if dev.type == "cpu":
        why = _interpreter_state()
        return why is None, why
    return False, f"the Triton kernels run on CUDA devices (or on CPU tensors in Triton's interpreter), not on {dev.type}"


def _require(device: torch.device) -> Any:
    """The kernel module, imported (the kernels defined) on first use.

    Raises:
        BackendUnavailable: :func:`triton_available` says no; the message says why.
    """
    ok, why = triton_available(device)
    if not ok:
        raise BackendUnavailable(f"Triton attention kernels unavailable: {why}")
    return importlib.import_module(_KERNELS_MODULE)


# ---- split count --------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device | str) -> int:
    """The number of multiprocessors of a CUDA device (queried once per device), or
    ``CPU_STAND_IN_SMS`` for any other device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return CPU_STAND_IN_SMS
    return _cuda_sm_count(dev.index if dev.index is not None else torch.cuda.current_device())


def choose_num_splits(batch_size: int, kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """How many splits decode cuts each sequence's keys into (FlashDecoding's split-KV).

    Decode reads every key once and does little arithmetic per byte read, so its speed is memory
    bandwidth, which a GPU reaches only with several programs resident on every multiprocessor.
    One program per (sequence, KV head) gives ``batch_size * kv_heads`` programs, too few at
    small batches (32 sequences x 8 KV heads on a 132-SM GPU is under two per SM). Cutting each
    sequence's keys into ``n`` splits multiplies the programs by ``n``, at the cost of one
    float32 partial output per split and query head, and the merge pass.

    The rule: the fewest splits that give ``PROGRAMS_PER_SM * num_sms`` programs, but no split
    of the longest sequence shorter than ``MIN_KEYS_PER_SPLIT`` keys (a short split does not pay
    for its partial output and merge), and at most ``MAX_AUTO_SPLITS``; at least 1 (the sweep
    behind the constants: docs/gpu.md, "The split rule").

    Only host ints go in, so a captured CUDA graph keeps its launch shape: pass an upper bound
    on the lengths (e.g. ``max_seq_len``) as ``max_kv_len``; the kernel then divides each
    sequence's actual keys by the split count (shorter sequences get shorter splits).

    Args:
        batch_size: sequences in the step.
        kv_heads: KV heads of the layer.
        max_kv_len: an upper bound on any sequence's keys.
        num_sms: multiprocessors of the device (:func:`multiprocessor_count`).

    Returns:
        The split count, ``1 .. MAX_AUTO_SPLITS``.
    """
    programs = max(1, batch_size * kv_heads)
    wanted = -(-(PROGRAMS_PER_SM * max(1, num_sms)) // programs)
    longest = -(-max(0, max_kv_len) // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, longest, MAX_AUTO_SPLITS))


# ---- scratch ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeWorkspace:
    """Preallocated scratch of split-KV decode, reusable by every layer and step (and by a
    captured CUDA graph, whose launches must keep their addresses).

    Attributes:
        partial_out: float32 ``[max_batch, q_heads, max_splits, head_dim]``, each split's
            normalised partial output.
        partial_lse: float32 ``[max_batch, q_heads, max_splits]``, each split's base-2
            log-sum-exp (-inf: the split had no key).
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(
        cls, max_batch: int, q_heads: int, head_dim: int, max_splits: int, device: torch.device | str
    ) -> "DecodeWorkspace":
        """Scratch for up to ``max_batch`` sequences and ``max_splits`` splits (contents undefined:
        every launch writes what it reads).

        Raises:
            InvalidInput: a size is not a positive int, or ``max_splits`` > ``MAX_NUM_SPLITS``.
        """
        for name, value in (("max_batch", max_batch), ("q_heads", q_heads), ("head_dim", head_dim), ("max_splits", max_splits)):
            positive_int(name, value, InvalidInput, numbers.Integral)
        if max_splits > MAX_NUM_SPLITS:
            raise InvalidInput(f"max_splits must be at most {MAX_NUM_SPLITS}, got {max_splits}")
        partial_out = torch.empty(max_batch, q_heads, max_splits, head_dim, dtype=torch.float32, device=device)
        partial_lse = torch.empty(max_batch, q_heads, max_splits, dtype=torch.float32, device=device)
        return cls(partial_out, partial_lse)

    @property
    def max_splits(self) -> int:
        return self.partial_lse.shape[2]


# ---- validation ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Geometry:
    """What the launch needs to know of validated inputs (host ints only)."""

    batch: int
    q_heads: int
    kv_heads: int
    group: int
    head_dim: int
    paged: bool
    page_size: int  # paged: the block size; contiguous: 1 (unused)
    max_keys: int  # keys the storage holds per sequence: max_blocks * block_size, or capacity
    table: torch.Tensor  # block_table or slots


def _tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidInput(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _index_vector(name: str, t: Any, length: int, device: torch.device) -> None:
    """``t`` is an int32 ``[length]`` vector on ``device`` with a unit stride."""
    _tensor(name, t)
    if t.dtype != torch.int32:
        raise InvalidDtype(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        raise InvalidShape(f"{name} must have shape [{length}], got {list(t.shape)}")
    if t.device != device:
        raise InvalidDevice(f"{name} is on {t.device}, q on {device}")
    if length > 1 and t.stride(0) != 1:
        raise InvalidInput(f"{name} must have a unit stride, got {t.stride(0)}")


def _unit_last_stride(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise InvalidInput(f"{name} must have a unit last stride (other strides are free), got strides {t.stride()}")


def _check(
    q: Any, k: Any, v: Any, kv_lens: Any, block_table: Any, slots: Any, out: Any, batch: int
) -> _Geometry:
    """Validate what decode and prefill share; ``batch``: the sequence count (``q``'s first axis
    for decode, ``len(cu_q) - 1`` for prefill).

    Raises:
        InvalidInput, InvalidShape, InvalidDtype, InvalidDevice, Unsupported: see the callers.
    """
    q, k, v = _tensor("q", q), _tensor("k", k), _tensor("v", v)
    if q.dtype not in SUPPORTED_DTYPES:
        raise InvalidDtype(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidDtype(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 3:
        raise InvalidShape(f"q must be 3-D [tokens, q_heads, head_dim], got {list(q.shape)}")
    if k.dim() != 4 or v.shape != k.shape:
        raise InvalidShape(f"k and v must be 4-D and of one shape, got {list(k.shape)} and {list(v.shape)}")
    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[2]
    if k.shape[3] != head_dim:
        raise InvalidShape(f"q's head_dim {head_dim} differs from k's {k.shape[3]}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise InvalidShape(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise Unsupported(f"head_dim {head_dim} is not supported by the Triton kernels (supported: {SUPPORTED_HEAD_DIMS})")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise InvalidDevice(f"{name} is on {t.device}, q on {q.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _unit_last_stride(name, t)
    _index_vector("kv_lens", kv_lens, batch, q.device)

    if (block_table is None) == (slots is None):
        raise InvalidInput("pass exactly one of block_table (paged storage) and slots (contiguous storage)")
    if block_table is not None:
        _tensor("block_table", block_table)
        if block_table.dtype != torch.int32:
            raise InvalidDtype(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise InvalidShape(f"block_table must have shape [{batch}, max_blocks], got {list(block_table.shape)}")
        if block_table.device != q.device:
            raise InvalidDevice(f"block_table is on {block_table.device}, q on {q.device}")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise InvalidInput(f"block_table must have a unit last stride, got strides {block_table.stride()}")
        page_size = k.shape[1]
        if page_size == 0:
            raise InvalidShape("the block pools' block size (k.shape[1]) must be positive")
        max_keys, table, paged = block_table.shape[1] * page_size, block_table, True
    else:
        _index_vector("slots", slots, batch, q.device)
        page_size, max_keys, table, paged = 1, k.shape[1], slots, False

    if out is not None:
        _tensor("out", out)
        if out.shape != q.shape:
            raise InvalidShape(f"out must have q's shape {list(q.shape)}, got {list(out.shape)}")
        if out.dtype != q.dtype:
            raise InvalidDtype(f"out must have q's dtype {q.dtype}, got {out.dtype}")
        if out.device != q.device:
            raise InvalidDevice(f"out is on {out.device}, q on {q.device}")
        _unit_last_stride("out", out)
    return _Geometry(batch, q_heads, kv_heads, q_heads // kv_heads, head_dim, paged, page_size, max_keys, table)


def _scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise InvalidInput(f"scale must be a finite number or None, got {scale!r}")
    return float(scale)


def _variant(window: Any, softcap: Any, sinks: Any, geo: _Geometry, device: torch.device) -> Variant:
    """The validated variant of a call.

    Raises:
        InvalidInput, InvalidDtype, InvalidShape, InvalidDevice: as :class:`~vmkv.kernels.base.Variant`
            and :meth:`~vmkv.kernels.base.Variant.check`; sinks must also be contiguous.
    """
    variant = Variant(window, softcap, sinks)
    variant.check(geo.q_heads, device)
    if sinks is not None and geo.q_heads > 1 and sinks.stride(0) != 1:
        raise InvalidInput(f"sinks must have a unit stride, got {sinks.stride(0)}")
    return variant


def _variant_args(variant: Variant, sm_scale: float, q: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, bool]]:
    """The kernels' variant arguments: ``(SINKS, window, softcap_in, softcap_out)`` and the
    constexprs ``SOFTCAP``, ``HAS_SINKS`` (a pointer stands in for absent sinks: never read)."""
    softcap = variant.softcap
    runtime = (q if variant.sinks is None else variant.sinks, variant.window,
               sm_scale / softcap if softcap else 0.0, softcap * math.log2(math.e))
    return runtime, {"SOFTCAP": softcap > 0, "HAS_SINKS": variant.sinks is not None}


# ---- launch shapes ------------------------------------------------------------------------------
def _block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per tile: as many as keep one K tile at 16 KiB (64 keys of 256 bytes: head_dim 128
    in 16 bits; 32 or 16 keys for longer rows), so that with two pipeline stages a program's
    tiles fit the shared memory of every CUDA GPU since sm80 (about 100 KiB on the smallest)."""
    row_bytes = head_dim * dtype.itemsize
    return max(16, min(64, 16384 // row_bytes))


_NUM_WARPS = 4
_NUM_STAGES = 2
_MERGE_WARPS = 2


def _prefill_block_m(group: int, head_dim: int, dtype: torch.dtype) -> int:
    """Query rows (tokens x group heads) per prefill program: 64, 32 for rows over 512 bytes
    (float32 at head_dim 256: its Q tile alone would be 64 KiB), and never under one group."""
    row_bytes = head_dim * dtype.itemsize
    return max(_next_pow2(group), 64 if row_bytes <= 512 else 32)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 dots in IEEE precision (TF32 would drop to a 10-bit mantissa); 16-bit inputs
    ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- decode -------------------------------------------------------------------------------------
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    max_kv_len: int | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention, one query token per sequence, split-KV; one launch for the batch (two
    with more than one split).

    Args:
        q: ``[B, Hq, D]``, the new token of each sequence (any strides, unit last).
        k, v: paged: ``[num_blocks, block_size, Hkv, D]`` pools; contiguous: ``[max_batch,
            capacity, Hkv, D]`` (any strides, unit last).
        kv_lens: int32 ``[B]`` on the device, keys per sequence (the new token's included); 0 is
            allowed (the output is zeros).
        block_table: paged: int32 ``[B, max_blocks]``. Exactly one of it and ``slots``.
        slots: contiguous: int32 ``[B]``, each sequence's row of ``k``/``v``.
        scale: softmax scale, default ``D ** -0.5``.
        num_splits: splits per sequence; default :func:`choose_num_splits` (capped by the
            workspace). Any count up to ``MAX_NUM_SPLITS`` works, more splits than keys too
            (empty splits contribute nothing).
        max_kv_len: a host upper bound on ``kv_lens`` for the default split count (e.g.
            ``max_seq_len``); default: what the storage holds per sequence.
        out: ``[B, Hq, D]`` of ``q``'s dtype to write into (any strides, unit last); default a
            new tensor.
        workspace: scratch for more than one split (:class:`DecodeWorkspace`, at least ``B``
            rows, ``Hq`` heads, ``D``, and ``num_splits`` splits); default: allocated here.
        window, softcap, sinks: the layer's :class:`~vmkv.kernels.base.Variant` (sinks: float32
            ``[Hq]`` on the device, unit stride); defaults: plain attention.

    Returns:
        ``out``: ``[B, Hq, D]``, query head ``h`` attending over KV head ``h // (Hq / Hkv)``.

    Raises:
        InvalidShape: shapes disagree (``q``/``k``/``v``/``kv_lens``/``block_table``/``slots``/
            ``out``, ``Hq`` not a multiple of ``Hkv``, a workspace too small).
        InvalidDtype: a dtype other than float16/bfloat16/float32, ``q``/``k``/``v``/``out``
            dtypes differ, index tensors not int32, a workspace not float32.
        InvalidDevice: tensors on different devices.
        InvalidInput: a non-unit last stride, both or neither of ``block_table``/``slots``, a
            bad ``num_splits``/``max_kv_len``/``scale``/``window``/``softcap``/``sinks``.
        Unsupported: a head dim outside ``SUPPORTED_HEAD_DIMS``.
        BackendUnavailable: triton or a device to run it on is missing (the message says which).
    """
    q = _tensor("q", q)
    batch = q.shape[0] if q.dim() == 3 else 0
    geo = _check(q, k, v, kv_lens, block_table, slots, out, batch)
    sm_scale = _scale(scale, geo.head_dim)
    variant = _variant(window, softcap, sinks, geo, q.device)
    block_n = _block_n(geo.head_dim, q.dtype)
    if max_kv_len is not None and not is_int(max_kv_len, 0, numbers.Integral):
        raise InvalidInput(f"max_kv_len must be a non-negative int or None, got {max_kv_len!r}")
    if workspace is not None and not isinstance(workspace, DecodeWorkspace):
        raise InvalidInput(f"workspace must be a DecodeWorkspace, got {type(workspace).__name__}")
    if num_splits is None:
        bound = geo.max_keys if max_kv_len is None else min(int(max_kv_len), geo.max_keys)
        if variant.window:  # a query reads its window's keys, from the tile holding the first
            bound = min(bound, variant.window + block_n - 1)
        num_splits = choose_num_splits(batch, geo.kv_heads, bound, multiprocessor_count(q.device))
        if workspace is not None:
            num_splits = min(num_splits, workspace.max_splits)
    else:
        num_splits = positive_int("num_splits", num_splits, InvalidInput, numbers.Integral)
        if num_splits > MAX_NUM_SPLITS:
            raise InvalidInput(f"num_splits must be at most {MAX_NUM_SPLITS}, got {num_splits}")
    if num_splits > 1 and workspace is not None:
        _check_workspace(workspace, geo, num_splits, q.device)

    kernels = _require(q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits > 1:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(batch, geo.q_heads, geo.head_dim, num_splits, q.device)
        part_out = workspace.partial_out[:batch, :, :num_splits]
        part_lse = workspace.partial_lse[:batch, :, :num_splits]
    else:
        part_out, part_lse = out, out  # not read: pass 1 writes out itself

    runtime, constexprs = _variant_args(variant, sm_scale, q)
    kernels._decode_split_kernel[(batch, geo.kv_heads, num_splits)](
        q, k, v, kv_lens, geo.table, geo.table, out, part_out, part_lse, runtime[0],
        sm_scale * math.log2(math.e), geo.max_keys, num_splits, *runtime[1:],
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        geo.table.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=geo.group, BLOCK_G=max(16, _next_pow2(geo.group)), HEAD_DIM=geo.head_dim, BLOCK_N=block_n,
        PAGED=geo.paged, PAGE_SIZE=geo.page_size, DOT_PRECISION=_dot_precision(q.dtype),
        EMULATE_BF16=q.dtype == torch.bfloat16 and _interpreted(kernels._decode_split_kernel), **constexprs,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    if num_splits > 1:
        kernels._decode_merge_kernel[(batch, geo.kv_heads)](
            part_out, part_lse, out, runtime[0], num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            GROUP=geo.group, BLOCK_G=_next_pow2(geo.group), HEAD_DIM=geo.head_dim, HAS_SINKS=constexprs["HAS_SINKS"],
            num_warps=_MERGE_WARPS,
        )
    return out


def _check_workspace(workspace: DecodeWorkspace, geo: _Geometry, num_splits: int, device: torch.device) -> None:
    """The workspace fits this launch.

    Raises:
        InvalidDtype, InvalidShape, InvalidDevice: it does not.
    """
    po, pl = workspace.partial_out, workspace.partial_lse
    if po.dtype != torch.float32 or pl.dtype != torch.float32:
        raise InvalidDtype(f"the workspace must be float32, got {po.dtype} and {pl.dtype}")
    if po.device != device or pl.device != device:
        raise InvalidDevice(f"the workspace is on {po.device}, q on {device}")
    if (
        po.dim() != 4 or pl.dim() != 3 or po.shape[:3] != pl.shape
        or po.shape[0] < geo.batch or po.shape[1] != geo.q_heads or po.shape[2] < num_splits or po.shape[3] != geo.head_dim
        or po.stride(3) != 1 or pl.stride(2) != 1
    ):
        raise InvalidShape(
            f"the workspace ({list(po.shape)}, {list(pl.shape)}) does not fit {geo.batch} sequences x {geo.q_heads} "
            f"heads x {num_splits} splits x head_dim {geo.head_dim} (unit last strides)"
        )


# ---- prefill ------------------------------------------------------------------------------------
def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' keys, the cached prefix
    included (prefill, chunked prefill, decode rows mixed in); one launch for the batch.

    Query ``j`` of sequence ``i`` sits at position ``kv_lens[i] - q_len_i + j`` and sees keys
    ``0 ..`` that position (bottom-right aligned causal), from its window's first key with a
    window. The new tokens' K/V must already be in the storage.

    Args:
        q: ``[T, Hq, D]``, each sequence's new tokens in turn (any strides, unit last).
        k, v: as :func:`decode_attention`.
        cu_q: int32 ``[B + 1]`` on the device: sequence ``i``'s tokens are rows
            ``cu_q[i] .. cu_q[i + 1] - 1`` of ``q`` (``cu_q[0] == 0``, ``cu_q[B] == T``, a
            sequence may have none).
        kv_lens: int32 ``[B]`` on the device, keys per sequence, at least its new tokens.
        block_table, slots, scale, window, softcap, sinks: as :func:`decode_attention`.
        out: ``[T, Hq, D]`` of ``q``'s dtype to write into; default a new tensor.

    Returns:
        ``out``, ``[T, Hq, D]``.

    Raises:
        As :func:`decode_attention` (``cu_q`` must be int32 ``[B + 1]``).
    """
    cu_q = _tensor("cu_q", cu_q)
    if cu_q.dim() != 1 or cu_q.shape[0] < 1:
        raise InvalidShape(f"cu_q must have shape [batch + 1], got {list(cu_q.shape)}")
    batch = cu_q.shape[0] - 1
    geo = _check(q, k, v, kv_lens, block_table, slots, out, batch)
    _index_vector("cu_q", cu_q, batch + 1, q.device)
    sm_scale = _scale(scale, geo.head_dim)
    variant = _variant(window, softcap, sinks, geo, q.device)

    kernels = _require(q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0 or q.shape[0] == 0:
        return out
    block_m = _prefill_block_m(geo.group, geo.head_dim, q.dtype)
    block_q = block_m // geo.group  # query tokens per program
    grid = (q.shape[0] // block_q + batch, geo.kv_heads)
    runtime, constexprs = _variant_args(variant, sm_scale, q)
    kernels._prefill_kernel[grid](
        q, k, v, cu_q, kv_lens, geo.table, geo.table, out, runtime[0],
        sm_scale * math.log2(math.e), geo.max_keys, batch, *runtime[1:],
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        geo.table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=geo.group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=geo.head_dim, BLOCK_N=_block_n(geo.head_dim, q.dtype),
        PAGED=geo.paged, PAGE_SIZE=geo.page_size, DOT_PRECISION=_dot_precision(q.dtype),
        EMULATE_BF16=q.dtype == torch.bfloat16 and _interpreted(kernels._decode_split_kernel), **constexprs,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    return out


__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_DTYPES",
    "DecodeWorkspace",
    "choose_num_splits",
    "decode_attention",
    "multiprocessor_count",
    "prefill_attention",
    "triton_available",
]
