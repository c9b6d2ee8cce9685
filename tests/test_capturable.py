"""The kernels graph paths call (``vmkv.kernels.capturable``), on their own, on the CPU: the
masked SDPA reference over slots and over block tables against a dense one, the paged write
through a pool's token rows, and the misuse errors. (The Triton kernel behind the same calls:
tests/test_triton_kernels.py; through compiled steps and CUDA graphs: tests/test_hf_compile.py,
tests/test_engine_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

from vmkv.errors import InvalidInput
from vmkv.kernels.capturable import decode_attention, stores_of, write_columns

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
    got = decode_attention(q, k_slots, v_slots, kv_lens, kernel="sdpa_masked", slots=slots, max_kv_len=16, out=torch.empty_like(q))
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
    got = decode_attention(q, k_pool, v_pool, kv_lens, kernel="sdpa_masked", block_table=table, max_kv_len=16, out=torch.empty_like(q))
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
