"""Property-based test: random add / step / fork / free / truncate / reserve / trim / cancelled
steps against a model, with backend failures injected into random calls.

After every step: every page's reference count equals its owners, no page is both free and in
use (``cache.check()``), and every sequence reads back exactly the K/V of the tokens it holds.
A call that fails (an injected backend failure at its k-th map/unmap/allocate) leaves the cache's
state exactly as before. At the end, freeing everything and trimming returns every page.

The quick settings run in every test session; ``test_*_state_machine_long`` (marked slow) runs
2,000 examples per mode.
"""

from __future__ import annotations

import pytest
import torch
from helpers import instrument
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import vmkv
from vmkv.errors import BackendError, InvalidInput, NoFreeSlot, OutOfPages, StalePlan

TPP = 8  # 2 heads x 64 floats = 512 B a token: 4 KiB pages / blocks of 8 hold 8 tokens
CONFIG = dict(
    num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", max_batch_size=5, max_seq_len=96,
    memory_budget=14 * 4 * 4096, page_size="4KiB", block_size=TPP,
)
PREFIXES = [[1] * 20, [2, 3] * 10, list(range(30))]  # shared prompt heads so prefix hits happen


def kv_of(tokens: list[int], start: int, layer: int) -> torch.Tensor:
    """K (= V) of ``tokens`` at positions ``start..``: a function of (token, position, layer) only."""
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32)[:, None, None]
    ids = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    lanes = torch.arange(2 * 64, dtype=torch.float32).view(1, 2, 64)
    return torch.sin(ids * 0.37 + pos * 0.011 + lanes * 0.05 + layer)


class CacheMachine(RuleBasedStateMachine):
    mode = "vmm"

    def __init__(self) -> None:
        super().__init__()
        self.cache = vmkv.open_cache(vmkv.KVCacheConfig(**CONFIG), mode=self.mode)
        self.faults = instrument(self.cache)  # counts backend calls; fails one when armed
        self.tokens: dict[int, list[int]] = {}  # the model: tokens each sequence holds
        self.next_id = 0

    def _step(self, batch: dict[int, list[int]]) -> bool:
        """Run one step of ``batch``; on OutOfPages check nothing changed and return False."""
        before = self.cache.stats()
        try:
            plan = self.cache.begin_step(batch)
        except OutOfPages:
            assert self.cache.stats() == before
            return False
        for layer in range(CONFIG["num_layers"]):
            kv = torch.cat([kv_of(toks, len(self.tokens[s]), layer) for s, toks in batch.items()])
            self.cache.write(layer, kv, kv, plan)
        for seq_id, toks in batch.items():
            self.tokens[seq_id] = self.tokens[seq_id] + toks
        return True

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(1, 30), tail=st.lists(st.integers(0, 9), max_size=12))
    def add(self, prefix, cut, tail):
        prompt = prefix[:cut] + tail
        seq_id, self.next_id = self.next_id, self.next_id + 1
        try:
            self.cache.add(seq_id, token_ids=prompt)
        except NoFreeSlot:
            assert len(self.tokens) == CONFIG["max_batch_size"]
            return
        hit = self.cache.seq_len(seq_id)
        assert hit % TPP == 0 and hit < len(prompt)
        self.tokens[seq_id] = prompt[:hit]
        if not self._step({seq_id: prompt[hit:]}):
            self.cache.free(seq_id)
            del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def step(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=4, unique=True))
        batch = {}
        for seq_id in ids:
            room = CONFIG["max_seq_len"] - len(self.tokens[seq_id])
            if room > 0:
                batch[seq_id] = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=min(room, 20)))
        if batch:
            self._step(batch)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), steps=st.integers(1, 6))
    def decode(self, data, steps):
        """A few one-token steps of the same sequences in a row: begin_step's decode fast path
        (the last plan one token further) until a page boundary or copy-on-write needs the full one."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=4, unique=True))
        for _ in range(steps):
            batch = {s: [data.draw(st.integers(0, 9))] for s in ids if len(self.tokens[s]) < CONFIG["max_seq_len"]}
            if len(batch) < len(ids) or not self._step(batch):
                return

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), layers=st.integers(0, 2))
    def cancelled_step(self, data, layers):
        """An undoable step (a compiled step's eager point), some layers written, then cancelled:
        the cache is exactly as before it (lengths, token ids, pages, copies, mappings)."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=4, unique=True))
        batch = {s: data.draw(st.lists(st.integers(0, 9), min_size=1,
                                       max_size=min(6, CONFIG["max_seq_len"] - len(self.tokens[s]))))
                 for s in ids if len(self.tokens[s]) < CONFIG["max_seq_len"]}
        if not batch:
            return
        before = self.cache.state()
        try:
            plan = self.cache.begin_step(batch, undoable=True)
        except OutOfPages:
            assert self.cache.state() == before
            return
        for layer in range(layers):
            kv = torch.randn(plan.num_tokens, 2, 64)
            self.cache.write(layer, kv, kv, plan)
        self.cache.cancel_step(plan)
        assert self.cache.state() == before, "a cancelled step changed the cache"
        with pytest.raises(StalePlan):
            self.cache.cancel_step(plan)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        dst, self.next_id = self.next_id, self.next_id + 1
        try:
            self.cache.fork(src, dst)
        except NoFreeSlot:
            return
        self.tokens[dst] = list(self.tokens[src])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        length = data.draw(st.integers(0, len(self.tokens[seq_id])))
        self.cache.truncate(seq_id, length)
        del self.tokens[seq_id][length:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 40))
    def reserve(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        total = min(CONFIG["max_seq_len"], len(self.tokens[seq_id]) + extra)
        before = self.cache.stats()
        try:
            self.cache.reserve(seq_id, total)
        except OutOfPages:
            assert self.cache.stats() == before

    @rule(keep_cached=st.booleans())
    def trim(self, keep_cached):
        self.cache.trim(keep_cached=keep_cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 10), op=st.sampled_from(["step", "fork", "free", "trim", "reserve"]))
    def fail_one_call(self, data, k, op):
        """Arm a failure at the k-th failable call of one operation: if it fires, nothing changed."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.cache.state()
        self.faults.arm(k)
        try:
            if op == "step":
                room = CONFIG["max_seq_len"] - len(self.tokens[seq_id])
                if room > 0:
                    self._step({seq_id: data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=min(room, 20)))})
            elif op == "fork":
                self.fork_into(seq_id)
            elif op == "free":
                self.cache.free(seq_id)
                del self.tokens[seq_id]
            elif op == "trim":
                self.cache.trim()
            else:
                self.cache.reserve(seq_id, min(CONFIG["max_seq_len"], len(self.tokens[seq_id]) + 3 * TPP))
        except BackendError:
            # trim's unmaps roll back; its last phase, giving memory back (release_page), cannot:
            # those pages are free already (the one failure a call may leave behind, errors.py)
            if not (op == "trim" and self.faults.failed == "release_page"):
                assert self.cache.state() == before, f"a failed {op} changed the cache"
        except (OutOfPages, NoFreeSlot):
            assert self.cache.state() == before
        finally:
            self.faults.fail_at = None

    def fork_into(self, src: int) -> None:
        dst, self.next_id = self.next_id, self.next_id + 1
        self.cache.fork(src, dst)
        self.tokens[dst] = list(self.tokens[src])

    @invariant()
    def pages_and_contents_are_consistent(self):
        self.cache.check()
        assert self.cache.stats()["tokens"] == sum(len(t) for t in self.tokens.values())
        for seq_id, toks in self.tokens.items():
            assert self.cache.seq_len(seq_id) == len(toks)
            for layer in range(CONFIG["num_layers"]):
                k, v = self.cache.kv(seq_id, layer)
                want = kv_of(toks, 0, layer)
                assert torch.equal(k, want) and torch.equal(v, want), f"sequence {seq_id} layer {layer}"

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.free(seq_id)
        self.cache.trim()
        stats = self.cache.stats()
        assert stats["pages_free"] == stats["pages_total"], "pages leaked"
        self.cache.check()
        self.cache.close()


SETTINGS = settings(max_examples=20, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=1200, stateful_step_count=12, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


class WindowMachine(CacheMachine):
    """The same rules over a cache whose layers share a sliding window (issue 36): pages wholly
    behind it are released at each step's start; the window's tokens read back exactly, the
    released ones as zeros; a truncate past the slack is refused, changing nothing."""

    window = dict(layer_windows=(11, 11), window_slack=3)

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.cache = vmkv.open_cache(vmkv.KVCacheConfig(**CONFIG, **self.window), mode=self.mode)
        self.faults = instrument(self.cache)
        self.tokens, self.next_id = {}, 0

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        length = data.draw(st.integers(0, len(self.tokens[seq_id])))
        before = self.cache.state()
        try:
            self.cache.truncate(seq_id, length)
        except InvalidInput:
            assert self.cache.state() == before and length < len(self.tokens[seq_id])
            return
        del self.tokens[seq_id][length:]

    @invariant()
    def pages_and_contents_are_consistent(self):
        self.cache.check()
        assert self.cache.stats()["tokens"] == sum(len(t) for t in self.tokens.values())
        for seq_id, toks in self.tokens.items():
            assert self.cache.seq_len(seq_id) == len(toks)
            pages = self.cache.pages(seq_id)[: -(-len(toks) // TPP)]  # those of its tokens (reserve maps more)
            gone = pages.count(-1) * TPP  # positions of released pages
            assert len(toks) - gone <= 11 + 3 + 20 + TPP, "a row holds more than its window, slack, a step and a page"
            for layer in range(CONFIG["num_layers"]):
                k, _ = self.cache.kv(seq_id, layer)
                want = kv_of(toks, 0, layer)
                assert torch.equal(k[gone:], want[gone:]) and not k[:gone].any(), f"sequence {seq_id} layer {layer}"


class VmmMachine(CacheMachine):
    mode = "vmm"


class PagedMachine(CacheMachine):
    mode = "paged"


TestVmmStateMachine = SETTINGS(VmmMachine).TestCase
TestPagedStateMachine = SETTINGS(PagedMachine).TestCase
TestVmmWindowStateMachine = SETTINGS(type("VmmWindowMachine", (WindowMachine,), {"mode": "vmm"})).TestCase
TestPagedWindowStateMachine = SETTINGS(type("PagedWindowMachine", (WindowMachine,), {"mode": "paged"})).TestCase
TestWindowStateMachineLong = pytest.mark.slow(type("WindowMachineLong", (WindowMachine,), {"mode": "vmm"}).TestCase)
TestWindowStateMachineLong.settings = LONG
TestPagedWindowStateMachineLong = pytest.mark.slow(type("PagedWindowMachineLong", (WindowMachine,), {"mode": "paged"}).TestCase)
TestPagedWindowStateMachineLong.settings = LONG
TestVmmStateMachineLong = pytest.mark.slow(type("VmmMachineLong", (CacheMachine,), {"mode": "vmm"}).TestCase)
TestVmmStateMachineLong.settings = LONG
TestPagedStateMachineLong = pytest.mark.slow(type("PagedMachineLong", (CacheMachine,), {"mode": "paged"}).TestCase)
TestPagedStateMachineLong.settings = LONG
