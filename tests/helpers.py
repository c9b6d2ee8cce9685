"""Helpers several test modules share (test modules never import each other; conftest.py holds
fixtures only)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import vmkv
from vmkv.errors import BackendError

MODES = ["vmm", "paged"]
"""The two cache modes every mode-generic test runs over."""


VLLM_RUN_TIMEOUT_S = 1800
"""Wall-clock limit for a subprocess that starts a vLLM engine (its processes, model load and
warm-up): a safety net against hangs, not a speed check. A busy 2-core machine takes minutes
(``docs/vllm.md``'s page overran 180 s at a load average of 10-14)."""


# A small geometry: 2 layers, 2 KV heads of 16 floats = 128 B per token per tensor.
# VMM with 4 KiB pages -> 32 tokens a page; paged with block_size 32 -> the same tokens a page.
SMALL = dict(
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    dtype="float32",
    max_batch_size=6,
    max_seq_len=512,
    memory_budget=64 * 4096 * 4,  # 64 pool pages of 4 tensors x 4 KiB
    page_size="4KiB",
    block_size=32,
)


def small_config(**overrides) -> vmkv.KVCacheConfig:
    return vmkv.KVCacheConfig(**{**SMALL, **overrides})


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Reference attention in float64 with plain torch ops, in ``q``'s dtype.

    q: [n, Hq, D] queries at positions start..start+n-1; k, v: [start+n, Hkv, D]. Returns [n, Hq, D].
    """
    return variant_attention(q, k, v, start).to(q.dtype)


def variant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, *, scale: float | None = None,
                      window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Reference attention in float64, applying a variant as transformers does: scores scaled, then
    soft-capped (Gemma 2's ``eager_attention_forward``: ``/ softcap``, ``tanh``, ``* softcap``),
    then masked causal and sliding (``masking_utils``: ``kv_idx <= q_idx`` and
    ``kv_idx > q_idx - sliding_window``), then, with sinks, GPT-OSS's ``eager_attention_forward``:
    each head's sink logit concatenated as one more column, the row max subtracted, a softmax, the
    sink column dropped.

    q: [n, Hq, D] queries at positions start..start+n-1; k, v: [start+n, Hkv, D]; sinks: [Hq].
    Returns [n, Hq, D] float64.
    """
    n, hq, d = q.shape
    group = hq // k.shape[1]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64 = k64.repeat_interleave(group, dim=1)  # [S, Hq, D]
    v64 = v64.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q64, k64)  # [Hq, n, S]
    scores = scores / math.sqrt(d) if scale is None else scores * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    kv_idx, q_idx = torch.arange(k.shape[0])[None, :], (start + torch.arange(n))[:, None]
    allowed = kv_idx <= q_idx  # [n, S]
    if window:
        allowed &= kv_idx > q_idx - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        combined = torch.cat([scores, sinks.double().view(hq, 1, 1).expand(hq, n, 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(-1)[..., :-1]
    return torch.einsum("hns,shd->nhd", probs, v64)


@dataclass
class VariantStep:
    """One step of several sequences whose K/V are held both ways, for kernels under a variant.

    ``plan`` has both addressings: slot ``plan.slots[i]`` of ``k_slots``/``v_slots``
    (``[B + 2, capacity, Hkv, D]``) and row ``i`` of ``plan.block_table`` into ``k_pool``/``v_pool``
    (``[blocks, block_size, Hkv, D]``). What the window released (see :func:`variant_step`) holds
    ``before_window`` in the slots, and NaN in pool blocks no table names, their entries -1.
    ``keys``/``values``: each sequence's true K/V (float64, every position).
    """

    plan: object
    k_slots: torch.Tensor
    v_slots: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    keys: list
    values: list

    def reference(self, q: torch.Tensor, i: int, **variant) -> torch.Tensor:
        """:func:`variant_attention` of sequence ``i``'s rows of the packed ``q``."""
        plan = self.plan
        rows = q[plan.offsets[i] : plan.offsets[i + 1]]
        return variant_attention(rows, self.keys[i], self.values[i], plan.starts[i], **variant)

    def assert_matches(self, q: torch.Tensor, out: torch.Tensor, label: str, **variant) -> None:
        """Every sequence's rows of ``out`` (a kernel's output for ``q``) against :meth:`reference`;
        float32 to 1e-5, other dtypes to 2e-2."""
        tol = 1e-5 if out.dtype == torch.float32 else 2e-2
        for i in range(self.plan.batch_size):
            got = out[self.plan.offsets[i] : self.plan.offsets[i + 1]].double()
            torch.testing.assert_close(got, self.reference(q, i, **variant), atol=tol, rtol=tol,
                                       msg=lambda m: f"{label}: {m}")


def variant_step(starts: list[int], q_lens: list[int], *, window: int, kv_heads: int = 2, head_dim: int = 16,
                 block_size: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0,
                 before_window: float = float("nan"), head_major: bool = False) -> VariantStep:
    """Random K/V of sequences that held ``starts`` tokens and add ``q_lens`` this step, as a
    sliding-window cache would hold them: memory before the window of a sequence's earliest query
    of the step (position ``starts[i]``, first key ``starts[i] - window + 1``) is released.

    Slots (VMM mode): shuffled slots of ``[B + 2, capacity, Hkv, D]`` (``head_major``: a
    ``[B + 2, Hkv, capacity, D]`` range transposed); positions before the window hold
    ``before_window`` (zeros: an unmapped page; NaN: garbage that must not leak), positions past a
    length stale random numbers. Block pools (paged mode): the first sequence's blocks in one run
    from block 0 (read in place), the others scattered; blocks wholly before the window are
    released (table entry -1, the block NaN); the pool's last block is NaN and unaddressed (a
    ``-1`` used as an index would read it); entries past a sequence's blocks are -1.
    """
    from vmkv.core.step import make_plan

    gen = torch.Generator().manual_seed(seed)
    lens = [s + n for s, n in zip(starts, q_lens)]
    capacity = max(lens) + 3
    batch = len(lens)
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    firsts = [max(0, s - window + 1) if window else 0 for s in starts]  # first key of each earliest query

    slots = torch.randperm(batch + 2, generator=gen)[:batch].tolist()
    shape = (batch + 2, kv_heads, capacity, head_dim) if head_major else (batch + 2, capacity, kv_heads, head_dim)
    k_slots, v_slots = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))  # stale data
    if head_major:
        k_slots, v_slots = k_slots.transpose(1, 2), v_slots.transpose(1, 2)
    for slot, k, v, first in zip(slots, keys, values, firsts):
        k_slots[slot, : k.shape[0]], v_slots[slot, : v.shape[0]] = k, v
        k_slots[slot, :first], v_slots[slot, :first] = before_window, before_window

    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 1
    free = [b for b in torch.randperm(num_blocks - 1, generator=gen).tolist() if b >= need[0]]
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_pool[-1], v_pool[-1] = float("nan"), float("nan")
    table = torch.full((batch, max(need) + 1), -1, dtype=torch.int32)
    for i, (k, v, first) in enumerate(zip(keys, values, firsts)):
        own = list(range(need[0])) if i == 0 else [free.pop() for _ in range(need[i])]
        for j, block in enumerate(own):
            rows = slice(j * block_size, (j + 1) * block_size)
            taken = k[rows].shape[0]
            if (j + 1) * block_size <= first:  # wholly before the window: released
                k_pool[block], v_pool[block] = float("nan"), float("nan")
                continue
            table[i, j] = block
            k_pool[block, :taken], v_pool[block, :taken] = k[rows], v[rows]
    plan = make_plan(tuple(range(batch)), slots, starts, q_lens, device=torch.device("cpu"),
                     write_rows=torch.zeros(sum(q_lens), dtype=torch.long), block_table=table)
    return VariantStep(plan, k_slots, v_slots, k_pool, v_pool, [k.double() for k in keys], [v.double() for v in values])


class KVMirror:
    """Drives a cache and keeps a dense copy of every sequence's K/V to compare against."""

    def __init__(self, cache: vmkv.KVCacheBase, q_heads: int, seed: int = 0) -> None:
        self.cache = cache
        self.q_heads = q_heads
        self.gen = torch.Generator().manual_seed(seed)
        self.k: dict = {}  # seq_id -> list over layers of [len, H, D]
        self.v: dict = {}

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        """Random values on the CPU, in the cache's dtype."""
        return (torch.randn(*shape, generator=self.gen) * scale).to(self.cache.config.dtype)

    def record(self, seq_id, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Append ``seq_id``'s new K/V rows of ``layer`` to the dense copy; return how many
        tokens it held before them (the step's start)."""
        layers = self.cache.config.num_layers
        ks = self.k.setdefault(seq_id, [k[:0]] * layers)
        vs = self.v.setdefault(seq_id, [v[:0]] * layers)
        start = ks[layer].shape[0]
        ks[layer] = torch.cat([ks[layer], k])
        vs[layer] = torch.cat([vs[layer], v])
        return start

    def step(self, batch: dict, check: bool = True) -> list[torch.Tensor]:
        """One step: write random K/V for ``batch`` {seq_id: n}, attend, compare with the reference."""
        cfg = self.cache.config
        plan = self.cache.begin_step(batch)
        total = sum(batch.values())
        outs = []
        for layer in range(cfg.num_layers):
            k = self.randn(total, cfg.num_kv_heads, cfg.head_dim)
            v = self.randn(total, cfg.num_kv_heads, cfg.head_dim)
            q = self.randn(total, self.q_heads, cfg.head_dim)
            self.cache.write(layer, k, v, plan)
            out = self.cache.attention(layer, q, plan)
            offset = 0
            for seq_id, n in batch.items():
                start = self.record(seq_id, layer, k[offset : offset + n], v[offset : offset + n])
                if check:
                    want = dense_attention(q[offset : offset + n], self.k[seq_id][layer], self.v[seq_id][layer], start)
                    tol = 1e-5 if cfg.dtype == torch.float32 else 2e-2
                    torch.testing.assert_close(out[offset : offset + n], want, atol=tol, rtol=tol)
                offset += n
            outs.append(out)
        return outs

    def fork(self, src, dst) -> None:
        self.cache.fork(src, dst)
        self.k[dst] = list(self.k.get(src, []))
        self.v[dst] = list(self.v.get(src, []))

    def free(self, seq_id) -> None:
        self.cache.free(seq_id)
        self.k.pop(seq_id, None)
        self.v.pop(seq_id, None)

    def assert_stored(self, seq_id) -> None:
        """The cache reads back exactly the K/V written to ``seq_id``, in every layer."""
        for layer in range(self.cache.config.num_layers):
            k, v = self.cache.kv(seq_id, layer)
            want_k = self.k.get(seq_id, [None] * (layer + 1))[layer]
            if want_k is None:
                assert k.shape[0] == 0
                continue
            assert torch.equal(k, want_k), f"{seq_id!r} layer {layer}: K differs"
            assert torch.equal(v, self.v[seq_id][layer]), f"{seq_id!r} layer {layer}: V differs"


# ---- fault injection and memory ----------------------------------------------------------------
class Faults:
    """Counts calls of the wrapped functions; raises at the ``fail_at``-th (1-based) when armed."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail_at: int | None = None
        self.error: type[Exception] = BackendError
        self.failed = ""  # the name of the call that failed

    def wrap(self, owner: object, name: str) -> None:
        real = getattr(owner, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                self.failed = name
                raise self.error(f"injected failure of {name} (call {self.calls})")
            return real(*args, **kwargs)

        setattr(owner, name, call)

    def arm(self, k: int) -> None:
        self.fail_at = self.calls + k


def instrument(cache: vmkv.KVCacheBase) -> Faults:
    """Wrap every call that can fail half-way: the backend's (VMM) or the block copy (paged),
    and the pool's allocation."""
    faults = Faults()
    if cache.mode == "vmm":
        for name in ("map", "map_pages", "unmap", "release_page"):
            faults.wrap(cache.ranges.vm, name)
    else:
        for name in ("attach", "detach"):
            faults.wrap(cache.blocks, name)
    faults.wrap(cache.pool, "allocate")
    return faults


def rss_bytes() -> int:
    """Resident memory of this process (anonymous + file + shared), from /proc."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def register_kernel(monkeypatch, name: str, function, addressing: str = "slots") -> None:
    """Make ``function(q, k, v, plan, scale)`` the kernel ``name`` of ``addressing`` for this test
    (a new name is added to the registry, runnable everywhere; an existing one is replaced)."""
    from vmkv.kernels import registry
    from vmkv.kernels.contiguous import Stateless

    if name not in registry.KERNELS:
        monkeypatch.setitem(registry.KERNELS, name, registry.KernelEntry(name, frozenset({addressing}), lambda spec, facts: []))
    real = registry.build

    def build(kernel: str, spec):
        if kernel != name:
            return real(kernel, spec)
        built = Stateless(name, function)
        built.addressing = spec.addressing
        return built

    monkeypatch.setattr(registry, "build", build)
