"""A process that owns one VMM cache and runs bursts on command (tests/test_ledger.py drives it).

Run as ``python tests/ledger_member.py [SHARED_BUDGET]``; reads one JSON command a line on stdin,
answers one JSON line on stdout:

    {"op": "burst", "seqs": N, "tokens": L, "seed": S}   N sequences of L tokens, then freed
    {"op": "hold", "seqs": N, "tokens": L, "seed": S}    the same, kept live
    {"op": "spin"}                                       decode steps of the held sequences, forever
    {"op": "stats"}                                      ledger pages held, resident bytes
    {"op": "quit"}

Every answer carries ``held`` (pages granted), ``resident`` (the page store's resident bytes) and,
for bursts, ``digest``: a hash of every attention output, the same with or without a ledger if
the cache kept every live sequence's K/V intact.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

import vmkv

CONFIG = dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", page_size="8KiB", max_batch_size=8,
              max_seq_len=512, memory_budget="4MiB")
"""16 tokens a page of 4 x 8 KiB = 32 KiB; 128 pages in 4 MiB."""
CHUNK = 64


def open_member(shared_budget: str | None) -> vmkv.VirtualKVCache:
    """The member's cache: ``CONFIG``, joined to ``shared_budget`` if given."""
    return vmkv.VirtualKVCache(vmkv.KVCacheConfig(**CONFIG, shared_budget=shared_budget))


def run_burst(cache: vmkv.KVCacheBase, seqs: int, tokens: int, seed: int, *, keep: bool = False) -> str:
    """Prefill ``seqs`` sequences of ``tokens`` tokens in chunks, then 4 decode steps; return a
    digest of every attention output (seeded data: the same in every process)."""
    gen = torch.Generator().manual_seed(seed)
    digest = hashlib.sha256()
    ids = [(seed, i) for i in range(seqs)]
    for seq_id in ids:
        cache.add(seq_id)
    steps = [CHUNK] * (tokens // CHUNK) + [1] * 4
    for step, count in enumerate(steps):
        plan = cache.begin_step({seq_id: [seed * 100_000 + i * 1000 + step * CHUNK + t for t in range(count)]
                                 for i, seq_id in enumerate(ids)})
        for layer in range(CONFIG["num_layers"]):
            k, v, q = (torch.randn(seqs * count, 2, 64, generator=gen) for _ in range(3))
            cache.write(layer, k, v, plan)
            digest.update(cache.attention(layer, q, plan).numpy().tobytes())
    if not keep:
        for seq_id in ids:
            cache.free(seq_id)
    return digest.hexdigest()


def spin(cache: vmkv.KVCacheBase) -> None:
    """Decode steps of every live sequence until killed (each writes one token a sequence)."""
    while True:
        ids = cache.seq_ids
        plan = cache.begin_step({seq_id: 1 for seq_id in ids})
        for layer in range(CONFIG["num_layers"]):
            kv = torch.ones(len(ids), 2, 64)
            cache.write(layer, kv, kv, plan)
        for seq_id in ids:
            cache.truncate(seq_id, cache.seq_len(seq_id) - 1)


def main() -> None:
    torch.set_num_threads(1)
    cache = open_member(sys.argv[1] if len(sys.argv) > 1 else None)
    print(json.dumps({"ready": True, "memfd": cache.ranges.vm._fd}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if op in ("burst", "hold"):
            answer = {"digest": run_burst(cache, command["seqs"], command["tokens"], command["seed"],
                                          keep=op == "hold")}
        elif op == "spin":
            print(json.dumps({"spinning": True}), flush=True)
            spin(cache)
        else:
            answer = {}
        stats = cache.stats()
        answer.update(held=stats.get("ledger_pages_held"), resident=stats["resident_bytes"])
        print(json.dumps(answer), flush=True)
    cache.close()


if __name__ == "__main__":
    main()
