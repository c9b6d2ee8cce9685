"""The ``@triton.jit`` kernels behind :mod:`vmkv.kernels.triton_attention`, which validates inputs and
chooses launch shapes: call them through it. Imported lazily at a kernel's first launch, since
triton decides at definition whether a kernel runs compiled or in its interpreter.

Conventions of every kernel here:

* Storage ``K, V``: ``[N0, N1, Hkv, D]``, any strides but a unit last one (paged: blocks x block
  size; contiguous: slots x capacity).
* Scores are in base 2 (``qk_scale = scale * log2(e)``, ``exp2``), and so is every log-sum-exp.
* Storage offsets are int64 (a slot's offset passes 2**31 elements); per-tile indexes int32.
* A key at or past its sequence's length, or before its window, is never loaded (lengths are first
  clamped to ``max_keys``), the block-table lookup included.
* ``SOFTCAP`` and ``HAS_SINKS`` are constexpr: a plain layer compiles neither.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_offsets(
    tile_start, offs_n, valid, k_row, v_row, bt_row,
    stride_k0, stride_k1, stride_v0, stride_v1,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Element offsets (int64 ``[BLOCK_N]``) of keys ``tile_start + offs_n`` of one sequence in K and V:
    the one place the addressings differ (a slot row, or a block-table lookup per tile or per key).
    """
    pos = tile_start + offs_n
    if PAGED:
        if PAGE_SIZE % BLOCK_N == 0:
            block = tl.load(bt_row + tile_start // PAGE_SIZE).to(tl.int64)  # scalar: tile_start < length
            in_block = (tile_start % PAGE_SIZE + offs_n).to(tl.int64)
        else:
            block = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            in_block = (pos % PAGE_SIZE).to(tl.int64)
        k_off = block * stride_k0 + in_block * stride_k1
        v_off = block * stride_v0 + in_block * stride_v1
    else:
        k_off = k_row + pos.to(tl.int64) * stride_k1
        v_off = v_row + pos.to(tl.int64) * stride_v1
    return k_off, v_off


@triton.jit
def _sequence_rows(seq, SLOTS, BLOCK_TABLE, stride_bt, stride_k0, stride_v0, PAGED: tl.constexpr):
    """Where sequence ``seq``'s keys start: ``(k_row, v_row, bt_row)`` for :func:`_kv_offsets`."""
    if PAGED:
        k_row = 0
        v_row = 0
        bt_row = BLOCK_TABLE + seq.to(tl.int64) * stride_bt
    else:
        slot = tl.load(SLOTS + seq).to(tl.int64)
        k_row = slot * stride_k0
        v_row = slot * stride_v0
        bt_row = BLOCK_TABLE
    return k_row, v_row, bt_row


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # scores are kept in base 2


@triton.jit
def _window_first(position, window):
    """The first key a query at ``position`` sees (0 without a window)."""
    return tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)


@triton.jit
def _scores(dot, qk_scale, softcap_in, softcap_out, SOFTCAP: tl.constexpr):
    """Base-2 scores from ``q . k``: ``dot * qk_scale``, or soft-capped ``softcap_out * tanh(dot * softcap_in)``."""
    if SOFTCAP:
        return softcap_out * (1.0 - 2.0 / (tl.exp2(dot * (2.0 * LOG2E * softcap_in)) + 1.0))
    else:
        return dot * qk_scale


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``tl.dot(a, b)`` in float32; ``EMULATE_BF16`` (Triton's CPU interpreter only, whose bfloat16 dot is
    wrong) multiplies float32 copies, exactly what the GPU computes.
    """
    if EMULATE_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _decode_split_kernel(
    Q, K, V, KV_LENS, BLOCK_TABLE, SLOTS, OUT, PART_OUT, PART_LSE, SINKS,
    qk_scale, max_keys, num_splits, window, softcap_in, softcap_out,
    stride_qb, stride_qh,
    stride_k0, stride_k1, stride_kh,
    stride_v0, stride_v1, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Pass 1 of decode. Program ``(seq, kv_head, split)``: the ``GROUP`` query heads of ``kv_head``
    against split ``split`` of the sequence's keys, by online softmax.

    Splits are computed from the device length, so the grid never depends on it; an empty split stores
    lse = -inf. With one split it writes ``OUT`` directly, else a partial output and its lse.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    kv_len = tl.minimum(tl.load(KV_LENS + seq), max_keys)
    lo = _window_first(kv_len - 1, window)  # the query's first key
    first = lo // BLOCK_N * BLOCK_N  # the tile holding it: tiles stay aligned (a block holds whole tiles)
    keys_per_split = tl.cdiv(tl.cdiv(kv_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * keys_per_split
    end = tl.minimum(start + keys_per_split, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # query heads of this KV head
    g_mask = offs_g < GROUP
    seq64 = seq.to(tl.int64)

    # q: [BLOCK_G, D]
    q = tl.load(Q + seq64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    k_row, v_row, bt_row = _sequence_rows(seq, SLOTS, BLOCK_TABLE, stride_bt, stride_k0, stride_v0, PAGED)
    K_head = K + kv_head * stride_kh
    V_head = V + kv_head * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the scores, per query head
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m_i)
    if HAS_SINKS:
        if num_splits == 1:  # the sink is one more key of value 0 (with splits: the merge's)
            m_i = tl.load(SINKS + heads, mask=g_mask, other=0.0) * LOG2E
            l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)  # running sum of exp2(score - m_i) * v
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        valid = (pos >= lo) & (pos < end)
        k_off, v_off = _kv_offsets(
            tile_start, offs_n, valid, k_row, v_row, bt_row, stride_k0, stride_k1, stride_v0, stride_v1,
            PAGED, PAGE_SIZE, BLOCK_N,
        )
        k = tl.load(K_head + k_off[None, :] + offs_d[:, None], mask=valid[None, :], other=0.0)  # [D, BLOCK_N]
        s = _scores(_dot(q, k, DOT_PRECISION, EMULATE_BF16), qk_scale, softcap_in, softcap_out, SOFTCAP)  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile visited holds a valid key (lo, or its first)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_head + v_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, EMULATE_BF16)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no key: acc is 0, so o is 0
    if num_splits == 1:  # (triton compiles a 1 passed as an int as a constant: this branch is resolved then)
        out_ptrs = OUT + seq64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        part_ptrs = PART_OUT + seq64 * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        tl.store(part_ptrs, o, mask=g_mask[:, None])
        tl.store(PART_LSE + seq64 * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    PART_OUT, PART_LSE, OUT, SINKS, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Pass 2 of decode. Program ``(seq, kv_head)``: merges the splits by their lse (an empty split
    weighs 0; a sink is one more split of output 0).
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP

    lse_ptrs = PART_LSE + seq * stride_lb + heads * stride_lh  # [BLOCK_G], split 0 of each head
    part_ptrs = PART_OUT + seq * stride_pb + heads[:, None] * stride_ph + offs_d[None, :]  # [BLOCK_G, D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the splits' lse
    total = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(lse - m_i)
    if HAS_SINKS:
        m_i = tl.load(SINKS + heads, mask=g_mask, other=0.0) * LOG2E
        total = total + 1.0
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for s in range(num_splits):
        lse = tl.load(lse_ptrs + s, mask=g_mask, other=float("-inf"))
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key so far: every weight exp2(-inf) = 0
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        o = tl.load(part_ptrs + s * stride_ps, mask=g_mask[:, None], other=0.0)  # an empty split stored zeros, never NaN
        acc = acc * alpha[:, None] + w[:, None] * o
        total = total * alpha + w
        m_i = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_ptrs = OUT + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _find_sequence(CU_Q, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence that owns query tile ``tile`` (prefill grid): a binary search over ``cu_q``."""
    lo = tile * 0  # an int32 scalar (num_seqs may be specialised to a constant)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(CU_Q + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _prefill_kernel(
    Q, K, V, CU_Q, KV_LENS, BLOCK_TABLE, SLOTS, OUT, SINKS,
    qk_scale, max_keys, num_seqs, window, softcap_in, softcap_out,
    stride_qt, stride_qh,
    stride_k0, stride_k1, stride_kh,
    stride_v0, stride_v1, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Causal prefill over the cached prefix. Program ``(tile, kv_head)``: ``BLOCK_Q`` query tokens of one
    sequence times the ``GROUP`` query heads of ``kv_head``, so each K/V tile is read once per group.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(CU_Q, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_begin
    first = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # this tile's first token in the sequence
    if first >= q_len:  # a spare tile of the numbering
        return

    kv_len = tl.minimum(tl.load(KV_LENS + seq), max_keys)
    prefix = tl.maximum(kv_len - q_len, 0)  # keys cached before this step's tokens

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    token = first + offs_m // GROUP  # [BLOCK_M] token of each row, in the sequence
    heads = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (token < q_len)
    q_pos = prefix + token  # the last key each row sees
    q_first = _window_first(q_pos, window)  # the first key each row sees
    lo = _window_first(prefix + first, window)  # the first key the tile's earliest query sees
    rows = (q_begin + token).to(tl.int64)  # packed index of each row's token

    # q: [BLOCK_M, D]
    q = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_row, v_row, bt_row = _sequence_rows(seq, SLOTS, BLOCK_TABLE, stride_bt, stride_k0, stride_v0, PAGED)
    K_head = K + kv_head * stride_kh
    V_head = V + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink is one more key of value 0
        m_i = tl.load(SINKS + heads) * LOG2E
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = tl.minimum(kv_len, prefix + first + BLOCK_Q)  # past the tile's last query position
    for tile_start in range(lo // BLOCK_N * BLOCK_N, end, BLOCK_N):
        pos = tile_start + offs_n
        valid = (pos >= lo) & (pos < end)
        k_off, v_off = _kv_offsets(
            tile_start, offs_n, valid, k_row, v_row, bt_row, stride_k0, stride_k1, stride_v0, stride_v1,
            PAGED, PAGE_SIZE, BLOCK_N,
        )
        k = tl.load(K_head + k_off[None, :] + offs_d[:, None], mask=valid[None, :], other=0.0)  # [D, BLOCK_N]
        s = _scores(_dot(q, k, DOT_PRECISION, EMULATE_BF16), qk_scale, softcap_in, softcap_out, SOFTCAP)  # [BLOCK_M, BLOCK_N]
        in_window = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= q_first[:, None])
        s = tl.where(valid[None, :] & in_window, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet stays 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_head + v_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, EMULATE_BF16)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = OUT + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
