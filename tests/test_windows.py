"""Sliding windows in the core (issue 36): memory that follows the window, in both modes, with
the cache's own kernels against a float64 reference that applies the window as transformers
does; a cache of layer groups for models whose layers differ (vmkv.core.groups)."""

from __future__ import annotations

import pytest
import torch
from helpers import variant_attention

import vmkv
from vmkv.errors import InvalidConfig, InvalidInput, OutOfPages

MODES = ["vmm", "paged"]
HKV, HQ, D = 2, 4, 64


def config(windows: tuple[int, ...], **overrides) -> vmkv.KVCacheConfig:
    values = dict(num_layers=len(windows), num_kv_heads=HKV, head_dim=D, dtype="float32", max_batch_size=4,
                  max_seq_len=256, memory_budget="4MiB", page_size="4KiB", layout="per_layer", block_size=8,
                  layer_windows=windows, window_slack=4)
    return vmkv.KVCacheConfig(**{**values, **overrides})


class Mirror:
    """A cache and every token's K/V, to check each step's attention against the reference."""

    def __init__(self, cache, windows: tuple[int, ...]) -> None:
        self.cache, self.windows = cache, windows
        self.k: dict[str, list[torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(0)

    def step(self, batch: dict[str, int]) -> None:
        cache = self.cache
        for seq_id in batch:
            self.k.setdefault(seq_id, [torch.zeros(0, HKV, D) for _ in self.windows])
        plan = cache.begin_step(batch)
        for layer, window in enumerate(self.windows):
            k = torch.randn(plan.num_tokens, HKV, D, generator=self.gen)
            q = torch.randn(plan.num_tokens, HQ, D, generator=self.gen)
            cache.write(layer, k, -k, plan)
            out = cache.attention(layer, q, plan)
            offset = 0
            for seq_id, n in batch.items():
                past = self.k[seq_id][layer]
                self.k[seq_id][layer] = keys = torch.cat([past, k[offset : offset + n]])
                want = variant_attention(q[offset : offset + n], keys, -keys, past.shape[0], window=window)
                torch.testing.assert_close(out[offset : offset + n].double(), want, atol=1e-5, rtol=1e-5)
                offset += n

    def fork(self, src: str, dst: str) -> None:
        self.cache.fork(src, dst)
        self.k[dst] = list(self.k[src])


@pytest.mark.parametrize("mode", MODES)
def test_a_windowed_cache_attends_over_its_window_and_holds_only_it(mode):
    cache = vmkv.open_cache(config((12, 12)), mode=mode)
    mirror = Mirror(cache, (12, 12))
    cache.add("a"), cache.add("b")
    mirror.step({"a": 40, "b": 3})  # a prompt longer than the window: every key is needed this step
    for _ in range(40):
        mirror.step({"a": 1, "b": 1})
    mirror.fork("a", "c")  # the fork shares the kept pages; the released ones are nobody's
    for _ in range(10):
        mirror.step({"a": 1, "c": 1})
    cache.check()
    tpp = cache.tokens_per_page
    for seq_id in ("a", "b", "c"):
        pages = cache.pages(seq_id)
        held = [page for page in pages if page != -1]
        assert len(held) * tpp <= 12 + 4 + 2 * tpp, f"{seq_id} holds {len(held)} pages of {tpp} tokens"
        k, _ = cache.kv(seq_id, 0)
        gone = (len(pages) - len(held)) * tpp
        assert gone > 0 and not k[:gone].any()  # released: zeros (VMM: the zero page)
        torch.testing.assert_close(k[gone:], mirror.k[seq_id][0][gone:])
    stats = cache.stats()
    assert stats["window"] == 12 and stats["window_releases"] > 0
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_rollback_within_the_slack_stays_exact_and_beyond_it_is_refused(mode):
    cache = vmkv.open_cache(config((12, 12)), mode=mode)
    mirror = Mirror(cache, (12, 12))
    cache.add("a")
    mirror.step({"a": 30})
    for _ in range(30):
        mirror.step({"a": 1})
    before = cache.state()
    with pytest.raises(InvalidInput, match="sliding window let go"):
        cache.truncate("a", 20)
    assert cache.state() == before
    cache.truncate("a", 56)  # 4 tokens back, as a rejected speculation would
    mirror.k["a"] = [k[:56] for k in mirror.k["a"]]
    for _ in range(5):
        mirror.step({"a": 1})  # the same attention as if the 4 tokens had never been
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_layers_of_different_windows_get_a_cache_each(mode):
    windows = (8, 0, 8, 0, 8)  # GPT-OSS's alternation
    cache = vmkv.open_cache(config(windows, max_step_tokens=40), mode=mode)
    assert isinstance(cache, vmkv.LayerGroups) and [g.config.window for g in cache.groups] == [8, 0]
    assert cache.layers == [[0, 2, 4], [1, 3]]
    mirror = Mirror(cache, windows)
    cache.add("a"), cache.add("b")
    mirror.step({"a": 40, "b": 5})
    for _ in range(30):
        mirror.step({"a": 1, "b": 1})
    mirror.fork("b", "c")
    mirror.step({"a": 1, "b": 1, "c": 1})
    assert cache.slot("c") == cache.groups[0].slot("c") == cache.groups[1].slot("c")
    cache.check()
    stats = cache.stats()
    windowed, full = stats["groups"]
    assert windowed["layers"] == [0, 2, 4]
    assert windowed["bytes_in_use"] / 3 < full["bytes_in_use"] / 2 / 2  # a windowed layer holds under half a full one
    assert stats["bytes_in_use"] == windowed["bytes_in_use"] + full["bytes_in_use"]
    assert stats["tokens"] == cache.seq_len("a") + cache.seq_len("b") + cache.seq_len("c")
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_group_that_refuses_a_step_leaves_every_group_as_it_was(mode):
    """The full group runs out of pages while the windowed one keeps releasing its own: the
    windowed group's step, begun first, is cancelled, and every group is as it was."""
    cache = vmkv.open_cache(config((8, 0), memory_budget=256 * 1024, max_step_tokens=8), mode=mode)
    cache.add("a")
    before = None
    with pytest.raises(OutOfPages):
        for _ in range(256):
            before = cache.state()
            plan = cache.begin_step({"a": 1})
            for layer in range(2):
                cache.write(layer, torch.ones(1, HKV, D), torch.ones(1, HKV, D), plan)
    assert cache.state() == before and cache.seq_len("a") > 100
    cache.check()
    cache.close()


@pytest.mark.parametrize("mode", ["vmm", "paged"])
def test_a_group_that_refuses_a_reservation_leaves_every_group_as_it_was(mode):
    """The full group (first) has room for 33 tokens, the windowed one's smaller share has not: the
    reservation is refused before the full group maps anything."""
    cache = vmkv.open_cache(config((0, 8), memory_budget=256 * 1024, max_step_tokens=8), mode=mode)
    cache.add("a")
    cache.groups[0].check_reserve("a", 33)  # the full group alone would take it
    before = cache.state()
    with pytest.raises(OutOfPages):
        cache.reserve("a", 33)
    assert cache.state() == before
    cache.check()
    cache.close()


def test_layer_windows_are_validated_and_a_shared_budget_needs_one_window():
    with pytest.raises(InvalidConfig, match="layer_windows"):
        config((8,), num_layers=2)
    with pytest.raises(InvalidConfig, match="layer_windows"):
        config((8, -1))
    with pytest.raises(InvalidConfig, match="window_slack"):
        config((8, 8), window_slack=-1)
    with pytest.raises(InvalidConfig, match="shared_budget"):
        vmkv.open_cache(config((8, 0), shared_budget="vmkv-test-windows:1MiB"))
    assert config((8, 8)).window == 8 and config((8, 0)).window is None and config((0, 0)).window == 0
    assert config((8, 0)).features == {"window"} and config((0, 0), attention_features=("sinks",)).features == {"sinks"}
