"""Attention over the paged cache: kernels that read K/V through a block table.

Every kernel gets one layer's block pools and the step's plan::

    k_pool, v_pool : [num_blocks, block_size, kv_heads, head_dim]
    q              : [T, q_heads, head_dim]            packed in plan order (T = sum(q_lens))
    plan.block_table : int32 [B, max_blocks]           pool block of each logical block, -1 = none

and returns ``[T, q_heads, head_dim]``, causal and bottom-right aligned over each sequence's cache.

    gather_sdpa               any   gather each sequence's blocks, then torch SDPA (the reference)
    blockwise_online_softmax  any   chunks of blocks merged by an online softmax
    sdpa_chunked              CPU   fused SDPA over runs of blocks read in place and gathered chunks
    varlen_attn_block_table   CUDA  torch's FlashAttention varlen op with ``block_table=``
    flash_attn_with_kvcache   CUDA  flash-attn with ``block_table=``
    flashinfer_decode         CUDA  FlashInfer batch decode (decode steps only)

Which one runs is :mod:`vmkv.kernels.registry`'s choice. Invariant: with a window, table entries
before a sequence's first needed block may be ``-1``, and no kernel reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from ..core.step import StepPlan
from ..validate import positive_int
from .base import ALL_FEATURES, PLAIN, AttentionKernel, Variant, first_key
from .facts import flash_attn_variant, flash_window_left, optional_kernel
from .variants import attend_sequence, needs_scores, sequence_mask, sink_weight, soft_cap

BLOCKWISE_CHUNK_TOKENS = 128  # keys per chunk of the blockwise kernel (the sweep: docs/paged.md, "Measured (CPU)")
DEFAULT_CHUNK_TOKENS: int | None = None  # a cache's default: each chunked kernel's own measured value


def _chunk_tokens(value: int | None, default: int) -> int:
    """``value`` validated (``None``: ``default``).

    Raises:
        InvalidConfig: not a positive int.
    """
    return default if value is None else positive_int("chunk_tokens", value)


class PagedKernel(AttentionKernel):
    """An attention kernel over block pools (``addressing = "blocks"``)."""

    addressing = "blocks"


# ---- CPU (and any device): the naive reference ------------------------------------------------
class GatherSDPA(PagedKernel):
    """Gather each sequence's (windowed) blocks into one contiguous K/V, then torch SDPA: simple, exact,
    one copy per layer. GQA decode rows run as ``[Hkv, G, D]`` queries, avoiding SDPA's slow
    ``enable_gqa`` CPU path.
    """

    name = "gather_sdpa"
    features = ALL_FEATURES

    def run(self, q, k_pool, v_pool, plan, meta, scale, variant=PLAIN):
        out = torch.empty_like(q)
        self.rows(q, k_pool, v_pool, plan, range(plan.batch_size), out, scale, variant)
        return out

    @staticmethod
    def rows(q, k_pool, v_pool, plan: StepPlan, indexes, out: torch.Tensor, scale: float | None,
             variant: Variant = PLAIN) -> None:
        """Attention of sequences ``indexes`` of ``plan``; writes their rows of ``out``."""
        block = k_pool.shape[1]
        offsets = plan.offsets
        for i in indexes:
            kv_len = plan.kv_lens[i]
            lo = first_key(plan.starts[i], variant.window)
            first = lo // block  # the first block read
            blocks = plan.block_table[i, first : -(-kv_len // block)]
            keys = slice(lo - first * block, kv_len - first * block)
            k_i = k_pool[blocks].flatten(0, 1)[keys].transpose(0, 1)[None]  # [1, Hkv, kv_len - lo, D]
            v_i = v_pool[blocks].flatten(0, 1)[keys].transpose(0, 1)[None]
            rows = slice(offsets[i], offsets[i + 1])
            out[rows] = attend_sequence(q[rows], k_i, v_i, scale, variant, sequence_mask(plan, i, lo, variant.window, q.device))


# ---- decode: runs of consecutive blocks read in place, the rest gathered in chunks ---------------
DEFAULT_SDPA_CHUNK_TOKENS = 256  # keys per gathered chunk (the sweep: docs/paged.md, "Measured (CPU)")
DEFAULT_MIN_RUN_TOKENS = 64  # a run of consecutive blocks this long is read in place, not gathered


@dataclass(frozen=True)
class _Piece:
    """Keys of one decode row: rows ``skip .. tokens - 1`` of pool blocks ``first ..`` read in place, or,
    when ``first`` is -1, of ``blocks`` gathered. Only the row's own keys are read.
    """

    first: int
    blocks: torch.Tensor | None
    tokens: int
    skip: int = 0


@dataclass(frozen=True)
class _DecodeRow:
    token: int  # packed index of the row's query
    pieces: tuple[_Piece, ...]


@dataclass(frozen=True)
class _PiecesMeta:
    rows: tuple[_DecodeRow, ...]
    prefill: tuple[int, ...]  # plan indexes of the sequences with several new tokens


class ChunkedSDPA(PagedKernel):
    """Torch's fused CPU SDPA over block pools.

    Decode rows: runs of at least ``min_run_tokens`` keys in consecutive blocks are read in place (a
    strided view, as in VMM mode), the other blocks gathered ``chunk_tokens`` at a time into a
    cache-sized scratch buffer; one SDPA call per piece, merged by log-sum-exp (exact). Prefill rows:
    :class:`GatherSDPA`. Why: SDPA needs uniform strides, and gathering a whole sequence costs a trip
    through memory (docs/paged.md, "Measured (CPU)").

    Args:
        block_size: tokens per pool block.
        chunk_tokens: keys per gathered chunk (rounded down to whole blocks, at least one);
            ``None``: :data:`DEFAULT_SDPA_CHUNK_TOKENS`.
        device: where the pools live (scratch buffers, reused call after call).
        min_run_tokens: shortest run read in place (``None``: :data:`DEFAULT_MIN_RUN_TOKENS`).

    Raises:
        InvalidConfig: ``chunk_tokens`` or ``min_run_tokens`` is not a positive int.
    """

    name = "sdpa_chunked"
    features = ALL_FEATURES

    def __init__(
        self, block_size: int, chunk_tokens: int | None = None, device: torch.device | str = "cpu",
        min_run_tokens: int | None = None,
    ) -> None:
        self._block_size = block_size
        self.chunk_tokens = _chunk_tokens(chunk_tokens, DEFAULT_SDPA_CHUNK_TOKENS)
        self.min_run_tokens = _chunk_tokens(min_run_tokens, DEFAULT_MIN_RUN_TOKENS)
        self._scratch = _Scratch(device)

    def plan(self, plan: StepPlan, q_heads: int, scale: float | None, variant: Variant = PLAIN) -> _PiecesMeta:
        offsets = plan.offsets
        rows = tuple(
            _DecodeRow(offsets[i], self._pieces(plan.block_table[i], n_kv, first_key(n_kv - 1, variant.window)))
            for i, (n, n_kv) in enumerate(zip(plan.q_lens, plan.kv_lens)) if n == 1
        )
        return _PiecesMeta(rows, tuple(i for i, n in enumerate(plan.q_lens) if n > 1))

    def _pieces(self, table_row: torch.Tensor, length: int, lo: int = 0) -> tuple[_Piece, ...]:
        """Split a sequence's keys ``lo .. length - 1`` into in-place runs and gathered chunks, in key order
        (blocks before ``lo``'s are never read).
        """
        block = self._block_size
        first = lo // block  # the first block read; below, positions count from its first row
        blocks = table_row[first : -(-length // block)].tolist()
        length -= first * block
        min_run = max(1, -(-self.min_run_tokens // block))
        per_chunk = max(1, self.chunk_tokens // block)
        pieces: list[_Piece] = []
        pending: list[int] = []  # blocks waiting to be gathered, in key order

        def flush(last_keys: int) -> None:  # last_keys: keys in the last pending block
            for lo in range(0, len(pending), per_chunk):
                part = pending[lo : lo + per_chunk]
                keys = len(part) * block - (block - last_keys if lo + per_chunk >= len(pending) else 0)
                pieces.append(_Piece(-1, torch.tensor(part, dtype=torch.long, device=table_row.device), keys))
            pending.clear()

        start = 0
        while start < len(blocks):
            end = start + 1
            while end < len(blocks) and blocks[end] == blocks[end - 1] + 1:
                end += 1
            if end - start >= min_run:
                flush(block)
                pieces.append(_Piece(blocks[start], None, min(end * block, length) - start * block))
            else:
                pending.extend(blocks[start:end])
            start = end
        flush(length - (len(blocks) - 1) * block if pending and pending[-1] == blocks[-1] else block)
        if lo % block:
            pieces[0] = replace(pieces[0], skip=lo % block)
        return tuple(pieces)

    def run(self, q, k_pool, v_pool, plan, meta: _PiecesMeta, scale, variant=PLAIN):
        out = torch.empty_like(q)
        kv_heads, dim = k_pool.shape[2], q.shape[2]
        group = q.shape[1] // kv_heads
        for row in meta.rows:
            q4 = q[row.token].reshape(1, kv_heads, group, dim)  # [1, Hkv, G, D]: a group's queries share a head
            out[row.token] = self._row(q4, k_pool, v_pool, row.pieces, scale, variant).reshape(q.shape[1:])
        if meta.prefill:
            GatherSDPA.rows(q, k_pool, v_pool, plan, meta.prefill, out, scale, variant)
        return out

    def _row(self, q4, k_pool, v_pool, pieces: tuple[_Piece, ...], scale: float | None, variant: Variant) -> torch.Tensor:
        """One decode row over its pieces: ``[1, Hkv, G, D]``."""
        acc = lse = None
        for piece in pieces:
            if piece.first >= 0:  # in place: a strided view of consecutive blocks
                n = -(-piece.tokens // self._block_size)
                k = k_pool[piece.first : piece.first + n].flatten(0, 1)[piece.skip : piece.tokens]  # [keys, Hkv, D]
                v = v_pool[piece.first : piece.first + n].flatten(0, 1)[piece.skip : piece.tokens]
            else:
                k = self._scratch.gather(0, k_pool, piece.blocks)[piece.skip : piece.tokens]
                v = self._scratch.gather(1, v_pool, piece.blocks)[piece.skip : piece.tokens]
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, keys, D]
            if len(pieces) == 1 and not needs_scores(variant):
                return F.scaled_dot_product_attention(q4, k, v, scale=scale)
            o, l = self._piece(q4, k, v, scale, variant.softcap)
            if acc is None:
                acc, lse = o.float(), l
                continue
            merged = torch.logaddexp(lse, l)  # [1, Hkv, G]
            acc = acc * torch.exp(lse - merged)[..., None] + o.float() * torch.exp(l - merged)[..., None]
            lse = merged
        if variant.sinks is not None:
            acc = acc * sink_weight(lse, variant.sinks.view(lse.shape))[..., None]
        return acc.to(q4.dtype)

    @staticmethod
    def _piece(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
               softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One piece's normalised output and log-sum-exp, ``([1, Hkv, G, D], [1, Hkv, G])``."""
        if softcap == 0:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k, v, 0.0, False, scale=scale)
        scale = q4.shape[-1] ** -0.5 if scale is None else scale
        scores = soft_cap(torch.matmul(q4.float(), k.float().transpose(-1, -2)) * scale, softcap)  # [1, Hkv, G, keys]
        lse = torch.logsumexp(scores, dim=-1)
        return torch.matmul(torch.exp(scores - lse[..., None]), v.float()), lse


class _Scratch:
    """Flat buffers reused call after call: a fresh multi-MiB tensor per chunk costs more in page faults
    than the copy. While autograd records, a gather allocates instead.
    """

    def __init__(self, device: torch.device | str) -> None:
        self._device = device
        self._buffers: dict[int, torch.Tensor] = {}

    def buffer(self, slot: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < count or buf.dtype != dtype:
            buf = torch.empty(count, dtype=dtype, device=self._device)
            self._buffers[slot] = buf
        return buf[:count]

    def gather(self, slot: int, pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``pool[blocks]`` as ``[..., n * block, Hkv, D]`` in the pool's dtype (a view of buffer ``slot``)."""
        shape = (*blocks.shape[:-1], blocks.shape[-1] * pool.shape[1], *pool.shape[2:])
        if torch.is_grad_enabled() and pool.requires_grad:
            return pool.index_select(0, blocks.reshape(-1)).view(shape)
        raw = self.buffer(slot, blocks.numel() * pool[0].numel(), pool.dtype)
        torch.index_select(pool, 0, blocks.reshape(-1), out=raw.view(blocks.numel(), *pool.shape[1:]))
        return raw.view(shape)


# ---- blockwise online softmax -----------------------------------------------------------------
@dataclass(frozen=True)
class _Chunk:
    """One chunk of keys for a group of rows: ``blocks`` (never -1), ``[rows, C]`` for decode, ``[C]`` for
    a prefill; ``valid``: the keys each query row may see (``None``: all).
    """

    blocks: torch.Tensor
    valid: torch.Tensor | None
    rows: int = 0
    skip: int = 0
    stop: int = 0
    keys: int = 0


@dataclass(frozen=True)
class _DecodeGroup:
    tokens: torch.Tensor  # int64 [Bd]: packed index of each decode query, most blocks read first
    chunks: tuple[_Chunk, ...]


@dataclass(frozen=True)
class _PrefillSeq:
    first: int  # packed index of the sequence's first new token
    count: int  # its new tokens
    chunks: tuple[_Chunk, ...]


@dataclass(frozen=True)
class _BlockwiseMeta:
    decode: _DecodeGroup | None
    prefill: tuple[_PrefillSeq, ...]


class BlockwiseOnlineSoftmax(PagedKernel):
    """Attention one chunk of blocks at a time, merged by an online softmax (flash-decoding style).

    No sequence's whole K/V is gathered. Decode rows of all sequences run together, sorted by the
    blocks they read; a prefill runs alone. Scores and accumulators are float32. Keys past a length
    are masked and their values zeroed, so stale pool data (even inf/NaN) never reaches an output.

    Args:
        block_size: tokens per pool block.
        kv_heads: KV heads of the pool.
        chunk_tokens: keys per chunk (rounded down to whole blocks, at least one); ``None``:
            :data:`BLOCKWISE_CHUNK_TOKENS`.
        device: where the pools live (scratch buffers; a cache calls its kernel from one thread).

    Raises:
        InvalidConfig: ``chunk_tokens`` is not a positive int.
    """

    name = "blockwise_online_softmax"
    features = ALL_FEATURES

    def __init__(
        self, block_size: int, kv_heads: int, chunk_tokens: int | None = None, device: torch.device | str = "cpu"
    ) -> None:
        chunk_tokens = _chunk_tokens(chunk_tokens, BLOCKWISE_CHUNK_TOKENS)
        self._block_size = block_size
        self._kv_heads = kv_heads
        self.chunk_tokens = chunk_tokens
        self._scratch = _Scratch(device)  # buffers 0/1: K/V as stored, 2/3: as float32

    # -- per step ---------------------------------------------------------------------------
    def plan(self, plan: StepPlan, q_heads: int, scale: float | None, variant: Variant = PLAIN) -> _BlockwiseMeta:
        table = plan.block_table
        per_chunk = max(1, self.chunk_tokens // self._block_size)  # blocks per chunk
        offsets = plan.offsets
        decode = [i for i, n in enumerate(plan.q_lens) if n == 1]
        decode_group = self._decode_group(plan, table, decode, offsets, per_chunk, variant.window) if decode else None
        group = q_heads // self._kv_heads
        prefill = tuple(
            self._prefill_seq(plan, table, i, offsets[i], per_chunk, group, variant.window)
            for i, n in enumerate(plan.q_lens) if n > 1
        )
        return _BlockwiseMeta(decode_group, prefill)

    def _decode_group(self, plan, table, decode, offsets, per_chunk, window) -> _DecodeGroup:
        device = table.device
        block = self._block_size
        firsts = {i: first_key(plan.kv_lens[i] - 1, window) for i in decode}  # each row's first key
        counts = {i: -(-plan.kv_lens[i] // block) - firsts[i] // block for i in decode}  # blocks each row reads
        order = sorted(decode, key=lambda i: (-counts[i], -plan.kv_lens[i]))  # most blocks first
        lens = [plan.kv_lens[i] for i in order]
        row_firsts = [firsts[i] for i in order]
        first_blocks = [f // block for f in row_firsts]
        rows_t = torch.tensor(order, device=device)
        lens_t = torch.tensor(lens, device=device)
        firsts_t = torch.tensor(row_firsts, device=device)
        starts_t = torch.tensor(first_blocks, device=device)
        width = table.shape[1]
        chunks = []
        for c in range(0, counts[order[0]], per_chunk):  # c: the chunk's first block, counted from each row's first
            rows = sum(1 for i in order if counts[i] > c)
            cols = min(per_chunk, width - min(first_blocks[:rows]) - c)
            index = (starts_t[:rows, None] + c + torch.arange(cols, device=device)).clamp_max(width - 1)
            blocks = table[rows_t[:rows, None], index].long().clamp_min(0)  # [rows, cols]
            valid = None
            if any(n < (b + c + cols) * block or f > (b + c) * block  # a row ends, or its window starts, inside
                   for n, f, b in zip(lens[:rows], row_firsts[:rows], first_blocks[:rows])):
                keys = (starts_t[:rows, None] + c) * block + torch.arange(cols * block, device=device)  # [rows, Tc]
                valid = (keys < lens_t[:rows, None]) & (keys >= firsts_t[:rows, None])
            chunks.append(_Chunk(blocks, valid, rows=rows))
        tokens = torch.tensor([offsets[i] for i in order], device=device)
        return _DecodeGroup(tokens, tuple(chunks))

    def _prefill_seq(self, plan, table, i, first_token, per_chunk, group, window) -> _PrefillSeq:
        device = table.device
        block = self._block_size
        start, n, kv_len = plan.starts[i], plan.q_lens[i], plan.kv_lens[i]
        chunks = []
        for first in range(first_key(start, window) // block, -(-kv_len // block), per_chunk):
            lo = first * block
            blocks = table[i : i + 1, first : first + per_chunk].long().clamp_min(0)
            hi = lo + blocks.shape[1] * block
            skip = max(0, lo - start)  # query rows (positions start+r) that see no key of the chunk: before it
            stop = min(n, hi + window - 1 - start) if window else n  # from here on: every key before their window
            valid = None
            if hi - 1 > start + skip or first_key(start + stop - 1, window) > lo:  # the causal or a window boundary crosses
                keys = torch.arange(lo, hi, device=device)
                queries = torch.arange(start + skip, start + stop, device=device)
                valid = (keys[None, :] <= queries[:, None]) & (keys[None, :] >= first_key(queries, window)[:, None])
                valid = valid.repeat_interleave(group, 0)  # [(stop - skip) * G, Tc]: one row per (query, group member)
            chunks.append(_Chunk(blocks[0], valid, skip=skip, stop=stop, keys=min(hi, kv_len) - lo))
        return _PrefillSeq(first_token, n, tuple(chunks))

    # -- per layer ----------------------------------------------------------------------------
    def run(self, q, k_pool, v_pool, plan, meta: _BlockwiseMeta, scale, variant=PLAIN):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = torch.empty_like(q)
        if meta.decode is not None:
            out[meta.decode.tokens] = self._decode(q[meta.decode.tokens], k_pool, v_pool, meta.decode, scale, variant)
        for seq in meta.prefill:
            span = slice(seq.first, seq.first + seq.count)
            out[span] = self._prefill(q[span], k_pool, v_pool, seq, scale, variant)
        return out

    def _gather(self, which: int, pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The chunk's keys (``which`` 0) or values (1): ``[..., C * block, Hkv, D]`` float32, in scratch buffers."""
        raw = self._scratch.gather(which, pool, blocks)
        if raw.dtype == torch.float32:
            return raw
        if torch.is_grad_enabled() and pool.requires_grad:
            return raw.float()
        return self._scratch.buffer(2 + which, raw.numel(), torch.float32).view(raw.shape).copy_(raw)

    def _decode(self, q, k_pool, v_pool, group: _DecodeGroup, scale: float, variant: Variant) -> torch.Tensor:
        batch, q_heads, dim = q.shape
        kv_heads = k_pool.shape[2]
        g = q_heads // kv_heads
        qf = (q.float() * scale).reshape(batch, kv_heads, g, dim).transpose(0, 1)  # [Hkv, B, G, D] (view)
        m = torch.full((kv_heads, batch, g), -math.inf, device=q.device)  # running max  [Hkv, B, G]
        l = torch.zeros((kv_heads, batch, g), device=q.device)  # running sum of exp     [Hkv, B, G]
        acc = torch.zeros((kv_heads, batch, g, dim), device=q.device)  # numerator   [Hkv, B, G, D]
        for chunk in group.chunks:
            r = chunk.rows
            k = self._gather(0, k_pool, chunk.blocks)  # [r, Tc, Hkv, D]
            v = self._gather(1, v_pool, chunk.blocks)
            if chunk.valid is not None:
                v.masked_fill_(~chunk.valid[:, :, None, None], 0.0)  # p is 0 there, but 0 * inf is NaN
            # per KV head, batched over sequences: k[:, :, h] is a strided matrix BLAS reads as is
            s = torch.stack([torch.bmm(qf[h, :r], k[:, :, h].transpose(1, 2)) for h in range(kv_heads)])
            s = soft_cap(s, variant.softcap)
            if chunk.valid is not None:  # s: [Hkv, r, G, Tc]
                s.masked_fill_(~chunk.valid[None, :, None, :], -math.inf)
            p = self._merge(s, m[:, :r], l[:, :r], acc[:, :r])
            for h in range(kv_heads):
                acc[h, :r].baddbmm_(p[h], v[:, :, h])
        out = acc / l[..., None]  # [Hkv, B, G, D]
        if variant.sinks is not None:
            out = out * sink_weight(m + torch.log(l), variant.sinks.view(kv_heads, 1, g))[..., None]
        return out.transpose(0, 1).reshape(batch, q_heads, dim).to(q.dtype)

    def _prefill(self, q, k_pool, v_pool, seq: _PrefillSeq, scale: float, variant: Variant) -> torch.Tensor:
        n, q_heads, dim = q.shape
        kv_heads = k_pool.shape[2]
        g = q_heads // kv_heads
        # rows = (query, group member): row r * G + j is query r, head h * G + j
        qf = (q.float() * scale).reshape(n, kv_heads, g * dim).transpose(0, 1).reshape(kv_heads, n * g, dim)
        m = torch.full((kv_heads, n * g), -math.inf, device=q.device)  # [Hkv, n*G]
        l = torch.zeros((kv_heads, n * g), device=q.device)
        acc = torch.zeros((kv_heads, n * g, dim), device=q.device)  # [Hkv, n*G, D]
        for chunk in seq.chunks:
            rows = slice(chunk.skip * g, chunk.stop * g)  # the queries that see a key of the chunk
            k = self._gather(0, k_pool, chunk.blocks)  # [Tc, Hkv, D]
            v = self._gather(1, v_pool, chunk.blocks)
            s = torch.stack([qf[h, rows] @ k[:, h].T for h in range(kv_heads)])  # [Hkv, (stop - skip)*G, Tc]
            s = soft_cap(s, variant.softcap)
            if chunk.valid is not None:
                s.masked_fill_(~chunk.valid, -math.inf)  # valid: [(stop - skip)*G, Tc]
                v[chunk.keys :] = 0.0  # keys past the sequence: p is 0 there, but 0 * inf is NaN
            p = self._merge(s, m[:, rows], l[:, rows], acc[:, rows])
            for h in range(kv_heads):
                acc[h, rows].addmm_(p[h], v[:, h])
        out = acc / l[..., None]  # [Hkv, n*G, D]
        if variant.sinks is not None:
            sinks = variant.sinks.view(kv_heads, 1, g).expand(kv_heads, n, g).reshape(kv_heads, n * g)
            out = out * sink_weight(m + torch.log(l), sinks)[..., None]
        return out.view(kv_heads, n, g, dim).transpose(0, 1).reshape(n, q_heads, dim).to(q.dtype)  # via [n, Hkv, G, D]

    @staticmethod
    def _merge(s: torch.Tensor, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """Fold one chunk's scores ``s [..., R, Tc]`` into the running max ``m``, sum ``l`` and numerator ``acc``
        (in place); returns the chunk's probabilities. Every row sees a key in its first chunk, so ``m``
        is finite from then on.
        """
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l.mul_(alpha).add_(p.sum(-1))
        acc.mul_(alpha[..., None])
        m.copy_(m_new)
        return p


# ---- CUDA kernels (need a GPU; checked against their sources, see docs/paged.md) --------------
class VarlenBlockTable(PagedKernel):
    """PyTorch's FlashAttention varlen op reading the pools through ``block_table`` (block_size % 256 == 0).
    Decode steps pass no mask (the grouped-query decode path); a window is ``window_size=(window - 1,
    0)``, so no entry before it is read (reasoned, GPU only). No soft-cap, no sinks.
    """

    name = "varlen_attn_block_table"
    features = frozenset({"window"})

    def plan(self, plan, q_heads, scale, variant=PLAIN):
        return torch.tensor([0, *accumulate(plan.kv_lens)], dtype=torch.int32, device=plan.kv_lens_t.device)

    def run(self, q, k_pool, v_pool, plan, meta, scale, variant=PLAIN):
        from torch.nn.attention.varlen import varlen_attn

        q = q.contiguous()  # FlashAttention wants a unit last stride (any strided q is accepted here)
        if variant.window:
            window_size = (flash_window_left(variant.window), 0)
        else:
            window_size = (-1, -1) if plan.is_decode else (-1, 0)
        return varlen_attn(
            q, k_pool, v_pool, plan.cu_q, meta, plan.max_q, plan.max_kv,
            scale=scale, window_size=window_size,
            enable_gqa=q.shape[1] != k_pool.shape[2], seqused_k=plan.kv_lens_t, block_table=plan.block_table,
        )


class FlashKVCacheBlockTable(PagedKernel):
    """flash-attn's ``flash_attn_with_kvcache`` with ``block_table=``: decode steps in one call, prefill
    steps per sequence; window and soft-cap passed to the kernel. No sinks.
    """

    name = "flash_attn_with_kvcache"
    features = frozenset({"window", "softcap"})

    def run(self, q, k_pool, v_pool, plan, meta, scale, variant=PLAIN):
        flash_attn_with_kvcache = optional_kernel("flash_attn")
        q = q.contiguous()  # FlashAttention wants a unit last stride (any strided q is accepted here)
        extra = flash_attn_variant(variant.window, variant.softcap)
        if plan.is_decode:
            return flash_attn_with_kvcache(
                q.unsqueeze(1), k_pool, v_pool, cache_seqlens=plan.kv_lens_t,
                block_table=plan.block_table, softmax_scale=scale, causal=True, **extra,
            ).squeeze(1)  # [B, 1, Hq, D] -> [B, Hq, D]
        out = torch.empty_like(q)
        offsets = plan.offsets
        for i in range(plan.batch_size):
            a, b = offsets[i], offsets[i + 1]
            out[a:b] = flash_attn_with_kvcache(
                q[a:b].unsqueeze(0), k_pool, v_pool, cache_seqlens=plan.kv_lens_t[i : i + 1],
                block_table=plan.block_table[i : i + 1], softmax_scale=scale, causal=True, **extra,
            ).squeeze(0)
        return out


class FlashInferDecode(PagedKernel):
    """FlashInfer's batch decode over the paged pools (NHD layout), planned once per step; decode steps
    only (paired with another kernel: :class:`vmkv.kernels.base.PhaseSplit`).

    The plan's CSR arrays start each sequence at its window's first block. Window and soft-cap are
    fixed at ``plan`` time, so each (window, soft-cap) has its own wrapper; the wrappers share one
    workspace (sequential on one stream). No sinks. Reasoned from FlashInfer's sources (GPU only).

    Args:
        device: the CUDA device (for the workspace).
        block_size, kv_heads, head_dim, dtype: the pool's geometry.

    Raises:
        BackendUnavailable: FlashInfer is missing or does not import.
    """

    name = "flashinfer_decode"
    features = frozenset({"window", "softcap"})

    def __init__(self, device: torch.device, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self._wrapper_class = optional_kernel("flashinfer")
        self._workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple[int, float], Any] = {}
        self._block_size, self._kv_heads, self._head_dim, self._dtype = block_size, kv_heads, head_dim, dtype

    def plan(self, plan, q_heads, scale, variant=PLAIN):
        """The wrapper of this window and soft-cap, planned for the step."""
        key = (variant.window, variant.softcap)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            wrapper = self._wrappers[key] = self._wrapper_class(self._workspace, "NHD")
        block = self._block_size
        table = plan.block_table
        lens = plan.kv_lens_t.long()
        ends = (lens + block - 1) // block  # one past each sequence's last block  [B]
        firsts = first_key(lens - 1, variant.window) // block  # each sequence's first block read  [B]
        columns = torch.arange(table.shape[1], device=table.device)[None, :]
        indices = table[(columns >= firsts[:, None]) & (columns < ends[:, None])]  # row-major: each sequence's blocks in order
        indptr = torch.cat([ends.new_zeros(1), (ends - firsts).cumsum(0)]).to(torch.int32)
        last = (plan.kv_lens_t - (ends.to(torch.int32) - 1) * block).to(torch.int32)
        extra: dict[str, Any] = {}
        if variant.window:
            extra["window_left"] = flash_window_left(variant.window)
        if variant.softcap:
            extra["logits_soft_cap"] = variant.softcap
        wrapper.plan(
            indptr, indices, last, q_heads, self._kv_heads, self._head_dim, block,
            pos_encoding_mode="NONE", q_data_type=self._dtype, kv_data_type=self._dtype, sm_scale=scale, **extra,
        )
        return wrapper

    def run(self, q, k_pool, v_pool, plan, meta, scale, variant=PLAIN):
        return meta.run(q.contiguous(), (k_pool, v_pool))  # [B, Hq, D]


BLOCK_KERNELS: dict[str, frozenset[str]] = {
    kernel.name: kernel.features
    for kernel in (GatherSDPA, BlockwiseOnlineSoftmax, ChunkedSDPA, VarlenBlockTable, FlashKVCacheBlockTable, FlashInferDecode)
}
"""Every blocks kernel of this module by name, with the variant features it supports."""


def block_kernel(name: str, device: torch.device, dtype: torch.dtype, kv_heads: int, head_dim: int, block_size: int,
                 chunk_tokens: int | None = None) -> PagedKernel:
    """A new kernel object of blocks kernel ``name`` for a pool of this geometry.

    Raises:
        KeyError: no such kernel.
        InvalidConfig: ``chunk_tokens`` is not a positive int.
        BackendUnavailable: an optional package the kernel calls is missing.
    """
    builders = {
        "gather_sdpa": lambda: GatherSDPA(),
        "blockwise_online_softmax": lambda: BlockwiseOnlineSoftmax(block_size, kv_heads, chunk_tokens, device),
        "sdpa_chunked": lambda: ChunkedSDPA(block_size, chunk_tokens, device),
        "varlen_attn_block_table": lambda: VarlenBlockTable(),
        "flash_attn_with_kvcache": lambda: FlashKVCacheBlockTable(),
        "flashinfer_decode": lambda: FlashInferDecode(device, block_size, kv_heads, head_dim, dtype),
    }
    return builders[name]()
