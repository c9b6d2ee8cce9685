"""The engine's captured decode steps (``vmkv.engine.graphs``, issue 28 item 2) without a GPU.

``torch.cuda.CUDAGraph`` does not exist here, so the graphs are replayed by ``EagerReplay``: the
step function recorded at capture (its closure, its capture-time plan and host values) is called
again over the persistent buffers. A step that read anything but its buffers would then give
other tokens than the eager engine: tokens must be identical. What is checked: the bucket logic,
the persistent buffers and padding rows, prefix caching and forks across replays, no page mapped
or unmapped during a replay (through the fake CUDA driver), typed refusals, and both addressings
through the Triton kernels (in Triton's interpreter, in a child process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fake_cuda.fixtures import fake, fake_cuda_backends, fake_lib  # noqa: F401  (fixtures)

import vmkv
from vmkv.engine import Engine, EngineConfig, SamplingParams
from vmkv.engine import graphs as graphs_module
from vmkv.engine.graphs import PAD_SEQUENCE, bucket_for, graph_buckets
from vmkv.engine.runner import cache_config_for, load_model
from vmkv.errors import InvalidConfig, Unsupported

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "a", "Once upon a time, there", "xyz"]


def test_buckets_cover_every_batch_up_to_the_slots():
    assert graph_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert graph_buckets(5) == (1, 2, 4, 5)
    assert graph_buckets(1) == (1,)
    with pytest.raises(InvalidConfig):
        graph_buckets(0)
    buckets = graph_buckets(40)
    assert [bucket_for(b, buckets) for b in (1, 3, 5, 17, 33, 40, 41)] == [1, 4, 8, 24, 40, 40, None]


def engine(mode: str, graphs: bool | None, **overrides) -> Engine:
    options = dict(kv_mode=mode, memory_budget="8MiB", page_size="4KiB", block_size=8, max_num_seqs=8, max_seq_len=256,
                   cuda_graphs=graphs)
    return Engine.from_config(EngineConfig(**{**options, **overrides}))


def outputs(e: Engine, params: list[SamplingParams]) -> list[list[list[int]]]:
    """Every completion's tokens of PROMPTS run together, one params each (so the batch shrinks)."""
    ids = [e.add_request(prompt, p) for prompt, p in zip(PROMPTS, params)]
    done = {}
    while len(done) < len(ids):
        for out in e.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return [done[i] for i in ids]


@pytest.mark.parametrize("mode", ["vmm", "paged"])
def test_graph_engine_gives_the_eager_engines_tokens(mode):
    """Greedy and sampled requests of different lengths (the batch shrinks through the buckets),
    a request with n=2 (a fork), and a repeated prompt (a prefix-cache hit); paged mode's step
    reads its blocks through the persistent block table."""
    params = [SamplingParams(max_tokens=n, temperature=t, seed=5, n=k, ignore_eos=True)
              for n, t, k in ((20, 0.0, 1), (14, 0.8, 1), (9, 0.0, 2), (5, 0.0, 1), (2, 1.0, 1))]
    eager, graphed = engine(mode, False), engine(mode, True)
    want, got = outputs(eager, params), outputs(graphed, params)
    assert got == want
    stats = graphed.stats()["engine"]["cuda_graphs"]
    assert stats["captured"] == [8, 4, 2, 1] and stats["replays"] > 0 and stats["padded_rows"] > 0
    assert outputs(graphed, params) == want  # again, with prefix-cache hits, over the same graphs
    assert graphed.stats()["cache"]["prefix_hits"] > 0 and graphed.stats()["engine"]["cuda_graphs"]["captured"] == [8, 4, 2, 1]
    cache = graphed.cache
    cache.check()
    assert list(cache.seq_ids) == [PAD_SEQUENCE] and graphed.max_slots == cache.config.max_batch_size - 1 == 8
    assert eager.stats()["engine"]["cuda_graphs"] is None
    eager.close()
    graphed.close()


def test_graphs_with_pages_mapped_ahead_on_a_thread_give_the_same_tokens():
    """map_ahead maps the next step's pages on a worker while the step replays (the Triton and the
    masked kernel never read past a length); a capture waits for the worker first."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 9, 6, 3, 2)]
    eager, graphed = engine("vmm", False), engine("vmm", True, map_ahead=True)
    assert outputs(graphed, params) == outputs(eager, params)
    assert graphed.stats()["cache"]["pages_mapped_ahead"] > 0
    eager.close()
    graphed.close()


def test_graphs_are_off_on_a_cpu_unless_asked_and_refused_where_they_cannot_run():
    e = engine("vmm", None)
    assert e.graphs is None and e.cache.config.max_batch_size == 8
    e.close()
    assert EngineConfig(cuda_graphs=True, max_num_seqs=8).cache_config().max_batch_size == 9  # the padding slot
    loaded = load_model(None)
    cache = vmkv.open_cache(cache_config_for(loaded.model, max_batch_size=1, memory_budget="4MiB", page_size="4KiB",
                                             max_seq_len=64))
    with pytest.raises(Unsupported, match="at least 2 slots"):
        Engine(loaded, cache, cuda_graphs=True)
    cache.close()


def test_no_page_is_mapped_during_a_replay_on_the_fake_cuda_driver(fake_cuda_backends, fake, monkeypatch):  # noqa: F811
    """VMM mode over the real CUDA backend and the fake driver: pages are mapped between replays
    (sequences cross page boundaries while decoding), never during one."""
    loaded = load_model(None)
    cache = vmkv.open_cache(cache_config_for(loaded.model, max_batch_size=5, memory_budget="4MiB", page_size="4KiB",
                                             max_seq_len=256, layout="all_layers"))
    assert cache.stats()["backend"] == "cuda"
    during: list[str] = []
    between: list[str] = []
    replay = graphs_module.EagerReplay.replay

    def watched(self):
        between.extend(c.name for c in fake.calls(clear=True))
        out = replay(self)
        during.extend(c.name for c in fake.calls(clear=True))
        return out

    monkeypatch.setattr(graphs_module.EagerReplay, "replay", watched)
    e = Engine(loaded, cache, cuda_graphs=True)
    fake.calls(clear=True)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    try:
        got = [o.outputs[0].token_ids for o in e.generate(PROMPTS[:4], greedy)]
        assert e.stats()["engine"]["cuda_graphs"]["replays"] >= 23
        assert not {"cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuCtxSynchronize"} & set(during), sorted(set(during))
        assert "cuMemMap" in between[1:]  # pages were mapped between replays (sequences crossed pages)
        assert [c for c in fake.calls() if not c.ok] == []
    finally:
        e.close()
    eager = engine("vmm", False, max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:4], greedy)] == got
    eager.close()


TRITON_CHILD = textwrap.dedent("""
    import sys, torch
    from vmkv.engine import Engine, EngineConfig, SamplingParams
    torch.set_num_threads(1)
    prompts = ["Hello world", "The quick brown fox", "a"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 3, 2)]
    for mode in ("vmm", "paged"):
        got = {}
        for graphs in (False, True):
            e = Engine.from_config(EngineConfig(kv_mode=mode, memory_budget="8MiB", page_size="4KiB", block_size=8,
                                                max_num_seqs=4, max_seq_len=128, cuda_graphs=graphs))
            assert not graphs or e.graphs.step.kernel == "triton", "not in Triton's interpreter"
            ids = [e.add_request(p, s) for p, s in zip(prompts, params)]
            done = {}
            while len(done) < len(ids):
                done.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
            got[graphs] = [done[i] for i in ids]
            if graphs:
                print(mode, e.stats()["engine"]["cuda_graphs"]["captured"])
            e.close()
        print(mode, "SAME" if got[False] == got[True] else f"DIFFERENT {got}")
""")


def test_both_addressings_through_the_triton_kernels_in_the_interpreter():
    """The captured step's kernels as on a GPU (Triton, slots or a block table), in Triton's
    interpreter, which must be switched on before triton's first import: a child process."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_CHILD], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert "vmm SAME" in lines and "paged SAME" in lines, done.stdout
    assert "vmm [4, 2, 1]" in lines and "paged [4, 2, 1]" in lines, done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with the CUDA driver")
@pytest.mark.parametrize("mode", ["vmm", "paged"])
def test_real_cuda_graphs_give_the_eager_engines_tokens_across_page_boundaries(mode):
    """On a GPU: real CUDA graphs (capture, replay), float32, prompts of about 1,000 tokens that
    cross a 2 MiB VMM page (1,024 tokens of the embedded model) while decoding, so pages are
    mapped between replays; the tokens must be the eager engine's."""
    prompts = [[(11 * i + j) % 256 for j in range(1000 + 5 * i)] for i in range(4)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = {}
    for graphs in (False, True):
        e = engine(mode, graphs, device="cuda", dtype="float32", memory_budget="256MiB", page_size=None, max_seq_len=2048,
                   max_num_batched_tokens=4096, max_prefill_chunk=4096)
        try:
            got[graphs] = [o.outputs[0].token_ids for o in e.generate(prompts, greedy)]
            if graphs:
                assert e.stats()["engine"]["cuda_graphs"]["replays"] >= 39
            e.cache.check()
        finally:
            e.close()
    assert got[True] == got[False]
