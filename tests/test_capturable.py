"""The kernels graph paths call (``vmkv.kernels.capturable``), on their own, on the CPU: the
masked SDPA reference over slots and over block tables against a dense one, under variants
(windows, soft-caps, sinks; eager and through the ``decode_store`` operator compiled), the paged
write through a pool's token rows, and the misuse errors. (The Triton kernel behind the same calls:
tests/test_triton_kernels.py; through compiled steps and CUDA graphs: tests/test_hf_compile.py,
tests/test_engine_graphs.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import variant_step

from vmkv.errors import InvalidDtype, InvalidInput, InvalidShape
from vmkv.kernels.capturable import decode_attention, decode_store, stores_of, write_columns

B, HQ, HKV, D, BLOCK = 3, 4, 2, 8, 4
LENS = [5, 11, 1]


def dense_decode(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Row by row: ``q[b]`` ``[Hq, D]`` over ``keys[b]`` ``[L, Hkv, D]`` (GQA: heads share K/V)."""
    out = []
    for row, (k, v) in enumerate(zip(keys, values)):
        k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)  # [L, Hq, D]
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[row], k) * D**-0.5, -1)
        out.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(out)


def test_masked_reference_reads_slots_and_block_tables_alike():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, D, generator=gen)
    keys = [torch.randn(n, HKV, D, generator=gen) for n in LENS]
    values = [torch.randn(n, HKV, D, generator=gen) for n in LENS]
    kv_lens = torch.tensor(LENS, dtype=torch.int32)
    want = dense_decode(q, keys, values)
    # slots: row b's tokens at the start of slot 2 - b, the rest of every slot is noise
    k_slots, v_slots = torch.randn(B, 16, HKV, D, generator=gen), torch.randn(B, 16, HKV, D, generator=gen)
    slots = torch.tensor([2, 1, 0], dtype=torch.int32)
    for row, n in enumerate(LENS):
        k_slots[2 - row, :n], v_slots[2 - row, :n] = keys[row], values[row]
    got = decode_attention(q, k_slots, v_slots, kv_lens, kernel="sdpa_masked", slots=slots, max_kv_len=16,
                           out=torch.empty_like(q))
    torch.testing.assert_close(got, want)
    # blocks: each row's tokens in blocks scattered over a pool of noise; -1 past a row's blocks
    k_pool, v_pool = torch.randn(12, BLOCK, HKV, D, generator=gen), torch.randn(12, BLOCK, HKV, D, generator=gen)
    table = torch.full((B, 4), -1, dtype=torch.int32)
    free = iter([7, 2, 9, 0, 11, 4, 5])
    for row, n in enumerate(LENS):
        for page in range(-(-n // BLOCK)):
            block = next(free)
            table[row, page] = block
            taken = min(BLOCK, n - page * BLOCK)
            k_pool[block, :taken] = keys[row][page * BLOCK : page * BLOCK + taken]
            v_pool[block, :taken] = values[row][page * BLOCK : page * BLOCK + taken]
    got = decode_attention(q, k_pool, v_pool, kv_lens, kernel="sdpa_masked", block_table=table, max_kv_len=16,
                           out=torch.empty_like(q))
    torch.testing.assert_close(got, want)


def test_decode_needs_exactly_one_addressing():
    q, k = torch.zeros(1, HQ, D), torch.zeros(1, 4, HKV, D)
    lens, index = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for addressing in ({}, {"slots": index, "block_table": index[:, None]}):
        with pytest.raises(InvalidInput, match="exactly one"):
            decode_attention(q, k, k, lens, kernel="sdpa_masked", max_kv_len=4, out=torch.empty_like(q), **addressing)


def test_a_pools_token_rows_take_a_paged_write_and_nothing_else():
    pool_k, pool_v = torch.zeros(6, BLOCK, HKV, D), torch.zeros(6, BLOCK, HKV, D)
    (k_store, v_store), = stores_of([(pool_k, pool_v)])
    k_rows, v_rows = k_store.token_rows(), v_store.token_rows()
    assert k_rows.size == (1, 6 * BLOCK, HKV, D)
    new_k, new_v = torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D)  # [B, Hkv, 1, D]
    rows = torch.tensor([9, 22])  # block 2 offset 1, block 5 offset 2
    write_columns(k_rows, v_rows, new_k, new_v, torch.zeros(2, dtype=torch.int64), rows)
    assert torch.equal(pool_k[2, 1], new_k[0, :, 0]) and torch.equal(pool_v[5, 2], new_v[1, :, 0])
    assert int(torch.count_nonzero(pool_k.flatten(0, 1).abs().sum((1, 2)))) == 2  # two rows written, no other
    (strided, _), = stores_of([(torch.zeros(6, 2 * BLOCK, HKV, D)[:, :BLOCK], pool_v)])
    with pytest.raises(ValueError, match="not back to back"):
        strided.token_rows()


# ---- variants: window, soft-cap, sinks ---------------------------------------------------------
WINDOWED = variant_step([20, 9, 33, 0], [1, 1, 1, 1], window=6, kv_heads=HKV, head_dim=D, block_size=BLOCK)
SINKS = torch.randn(HQ, generator=torch.Generator().manual_seed(3))


def _addressings(step) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    return [(step.k_slots, step.v_slots, {"slots": step.plan.slots_t}),
            (step.k_pool, step.v_pool, {"block_table": step.plan.block_table})]


@pytest.mark.parametrize("window, softcap, sinks", [(6, 0.0, False), (6, 3.0, True), (1, 0.0, True), (0, 2.0, False)])
def test_masked_decode_applies_a_variant_over_both_addressings(window, softcap, sinks):
    """``decode_attention(kernel="sdpa_masked")`` under a variant, slots and block tables, the
    memory before each window released (NaN slots positions, -1 entries over NaN blocks), against
    the float64 reference; a ``max_kv_len`` above every length changes nothing."""
    step = variant_step([20, 9, 33, 0], [1, 1, 1, 1], window=window, kv_heads=HKV, head_dim=D, block_size=BLOCK)
    q = torch.randn(4, HQ, D, generator=torch.Generator().manual_seed(1))
    variant = dict(window=window, softcap=softcap, sinks=SINKS if sinks else None)
    for k, v, where in _addressings(step):
        for max_kv_len in (34, 64):
            got = decode_attention(q, k, v, step.plan.kv_lens_t, kernel="sdpa_masked", max_kv_len=max_kv_len,
                                   out=torch.full_like(q, float("nan")), **variant, **where)
            for i in range(4):
                torch.testing.assert_close(got[i : i + 1].double(), step.reference(q, i, **variant), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap, sinks", [(0.0, False), (3.0, True)])
def test_decode_store_with_a_window_compiles_to_the_eager_result(softcap, sinks):
    """A tiny compiled function calling ``torch.ops.vmkv.decode_store`` with a window (the op's
    schema carries window, softcap and sinks) gives the eager result, over both addressings."""
    q = torch.randn(4, HQ, D, generator=torch.Generator().manual_seed(2))
    for k, v, where in _addressings(WINDOWED):
        (k_store, v_store), = stores_of([(k, v)])
        sink_logits = SINKS if sinks else None

        def step(q, kv_lens, sink_logits, k_store=k_store, v_store=v_store, where=where):
            return decode_store(q, k_store, v_store, kv_lens, D**-0.5, 64, "sdpa_masked", window=6, softcap=softcap,
                                sinks=sink_logits, **where)

        eager = step(q, WINDOWED.plan.kv_lens_t, sink_logits)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(q, WINDOWED.plan.kv_lens_t, sink_logits)
        torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
        for i in range(4):
            want = WINDOWED.reference(q, i, window=6, softcap=softcap, sinks=sink_logits)
            torch.testing.assert_close(eager[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)
    schema = str(torch.ops.vmkv.decode_store.default._schema)
    assert "int window=0, float softcap=0., Tensor? sinks=None" in schema


def test_a_bad_variant_is_refused_before_anything_is_written():
    q = torch.randn(4, HQ, D)
    k, v, where = _addressings(WINDOWED)[1]
    out = torch.full_like(q, 7.0)
    for error, variant in [(InvalidInput, {"window": -1}), (InvalidInput, {"softcap": float("nan")}),
                           (InvalidShape, {"sinks": torch.zeros(HQ + 1)}),
                           (InvalidDtype, {"sinks": torch.zeros(HQ, dtype=torch.float64)})]:
        with pytest.raises(error):
            decode_attention(q, k, v, WINDOWED.plan.kv_lens_t, kernel="sdpa_masked", max_kv_len=64, out=out, **variant, **where)
        assert bool((out == 7.0).all())
