"""The host-wide KV ledger (vmkv/ledger/) and caches sharing one budget (the shared_budget setting).

Processes: tests/ledger_member.py owns one VMM cache per process; the resident bytes of every
member's page store are sampled from outside (``fstat`` of ``/proc/PID/fd/MEMFD``: the kernel's
count) all along, and must never add up past the budget.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import vmkv
import vmkv.share
from vmkv.errors import BackendError, InvalidConfig, LedgerCorrupt, LedgerMismatch, OutOfPages
from vmkv.ledger import Ledger, SharedBudget, ledger_path
from vmkv_bench.two_engines import ResidentSampler, read_answer

sys.path.insert(0, str(Path(__file__).parent))
import ledger_member  # noqa: E402
from fake_cuda.fixtures import fake, fake_cuda_backends, fake_lib  # noqa: E402, F401  (fixtures)

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 4 << 20  # 128 member pages of 32 KiB: less than two members' 4 MiB each
PAGE = 32 << 10
BURST = dict(seqs=6, tokens=256)  # 6 x 17 pages = 102 pages, more than half the budget


@pytest.fixture
def name(request):
    """A ledger name of this test alone; its file is gone afterwards."""
    label = f"test-{os.getpid()}-{zlib.crc32(request.node.nodeid.encode()):08x}"
    yield label
    if os.path.exists(ledger_path(label)):
        os.unlink(ledger_path(label))


class Member:
    """A tests/ledger_member.py process."""

    def __init__(self, shared_budget: str, prefix: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([*prefix, sys.executable, str(Path(__file__).with_name("ledger_member.py")),
                                      shared_budget],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.memfd = self.read(120)["memfd"]

    def read(self, timeout: float = 60) -> dict:
        return read_answer(self.proc, timeout)

    def send(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(30)


    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


@pytest.fixture
def reference():
    """Digests of bursts run alone (no ledger), by seed."""
    cache = ledger_member.open_member(None)
    yield lambda seed: ledger_member.run_burst(cache, BURST["seqs"], BURST["tokens"], seed)
    cache.close()


def test_idle_members_pages_move_to_the_one_that_bursts(name, reference):
    a, b = Member(f"{name}:4MiB,member=a"), Member(f"{name}:4MiB,member=b")
    sampler = ResidentSampler([f"/proc/{m.proc.pid}/fd/{m.memfd}" for m in (a, b)], interval=0.001)
    sampler.start()
    try:
        first = a.send(op="burst", seed=1, **BURST)
        assert first["held"] > BUDGET // PAGE // 2  # A alone got more than half
        second = b.send(op="burst", seed=2, **BURST)  # A idles: its watcher gives back
        after = a.send(op="stats")
    finally:
        peak = sampler.stop()
        a.close()
        b.close()
    assert first["digest"] == reference(1) and second["digest"] == reference(2)
    assert second["held"] >= 102 and after["held"] <= BUDGET // PAGE - 102
    assert after["resident"] <= after["held"] * PAGE
    assert sampler.samples >= 20 and 3 << 20 < peak <= BUDGET, (sampler.samples, peak)


def test_a_killed_members_pages_go_to_the_survivor(name, reference):
    a, b = Member(f"{name}:4MiB,member=a"), Member(f"{name}:4MiB,member=b,wait=10")
    try:
        assert a.send(op="hold", seed=1, **BURST)["held"] >= 102  # live sequences: nothing to reclaim
        assert a.send(op="spin") == {"spinning": True}
        time.sleep(0.2)
        os.kill(a.proc.pid, signal.SIGKILL)  # mid-step; left a zombie until waited for
        start = time.monotonic()
        answer = b.send(op="burst", seed=2, **BURST)
        took = time.monotonic() - start
        with Ledger(name, None) as ledger:
            members = ledger.members()
    finally:
        a.proc.wait(10)
        b.close()
    assert answer["digest"] == reference(2) and answer["held"] >= 102
    assert [m.name for m in members] == ["b"]
    assert took < 10, took


# ---- in one process ---------------------------------------------------------------------------
def small(name: str, extra: str = "") -> vmkv.VirtualKVCache:
    return ledger_member.open_member(f"{name}:4MiB{extra}")


def test_a_member_short_of_budget_waits_then_raises_and_changes_nothing(name):
    with small(name, ",member=a") as a, small(name, ",member=b,wait=0.2") as b:
        ledger_member.run_burst(a, 7, 256, seed=1, keep=True)  # 119 pages, live: nothing to give back
        b.add("x")
        before = b.state()
        start = time.monotonic()
        with pytest.raises(OutOfPages, match="ledger"):
            b.begin_step({"x": 256})
        assert time.monotonic() - start < 2  # bounded: 0.2 s, or at once when nobody offers idle pages
        assert b.state() == before
        b.check()
        held = {m.name: m.held for m in Ledger(name, None).members()}
        assert sum(held.values()) <= BUDGET and held["a"] >= 119 * PAGE


def test_trim_returns_grants_and_close_leaves(name):
    with small(name) as cache:
        ledger_member.run_burst(cache, 2, 128, seed=3)
        assert cache.stats()["ledger_pages_held"] >= 18
        cache.trim()
        assert cache.stats()["ledger_pages_held"] == 0 == cache.stats()["resident_bytes"]
        assert os.path.exists(ledger_path(name))
    assert not os.path.exists(ledger_path(name))


def test_map_ahead_stays_within_grants(name):
    config = vmkv.KVCacheConfig(**ledger_member.CONFIG, map_ahead=True, shared_budget=f"{name}:4MiB")
    with vmkv.VirtualKVCache(config) as cache:
        ledger_member.run_burst(cache, 6, 256, seed=4, keep=True)
        cache.check()
        assert cache.budget.memory.backed() <= cache.stats()["ledger_pages_held"]
        assert cache.stats()["map_ahead_errors"] == 0


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["nocolon", "x:0", "x:1MiB,min=2MiB", "x:1MiB,foo=1", "bad name!:1MiB",
                                  "x:1MiB,wait=-1", "x:1MiB,min=1,min=2"])
def test_bad_settings_are_refused(text):
    with pytest.raises(InvalidConfig):
        SharedBudget.parse(text)


def test_paged_mode_refuses_a_shared_budget(name):
    with pytest.raises(InvalidConfig, match="VMM"):
        vmkv.open_cache(vmkv.KVCacheConfig(**ledger_member.CONFIG, shared_budget=f"{name}:4MiB"), mode="paged")


def test_same_name_other_budget_is_refused(name):
    with Ledger(name, BUDGET):
        with pytest.raises(LedgerMismatch, match="budget"):
            Ledger(name, BUDGET * 2)


@pytest.mark.parametrize("damage", ["foreign", "short", "overdrawn", "empty slot holding"])
def test_corrupt_or_foreign_files_are_refused_untouched(name, damage):
    path = ledger_path(name)
    if damage in ("foreign", "short"):
        Path(path).write_bytes(os.urandom(64 + 32 * 128 if damage == "foreign" else 100))
    else:
        with Ledger(name, BUDGET) as ledger:
            member = ledger.join("m", PAGE)
            member.take(4)
            ledger.record.write(member.slot if damage == "overdrawn" else 5, held=2 * BUDGET if damage == "overdrawn" else PAGE)
    before = Path(path).read_bytes()
    with pytest.raises(LedgerCorrupt):
        Ledger(name, BUDGET)
    with pytest.raises(LedgerCorrupt):
        small(name)  # a cache refuses it too (and leaks nothing: its memory is closed)
    assert Path(path).read_bytes() == before


def test_dead_processes_are_reaped_once(name):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with Ledger(name, BUDGET) as ledger:
        theirs = ledger.join("child", PAGE, pid=child.pid)
        assert theirs.take(100) == 0
        mine = ledger.join("me", PAGE)
        assert mine.take(100) == 72  # the child lives: 28 granted, 72 short
        child.kill()  # a zombie until waited for: counted dead all the same
        time.sleep(0.1)
        assert mine.take(100) == 0
        assert ledger.reap() == 0  # its bytes came back once
        child.wait()
        assert [m.name for m in ledger.members()] == ["me"]


# ---- the state machine --------------------------------------------------------------------------
class LedgerMachine(RuleBasedStateMachine):
    """Members of different page sizes take, give, ask and die; the ledger must agree with a
    model of who holds what, and never hold more than its budget."""

    UNIT = 4096
    BUDGET = 64 * 4096

    def __init__(self) -> None:
        super().__init__()
        self.name = f"machine-{os.getpid()}-{id(self)}"
        self.dead: set[int] = set()
        self.ledger = Ledger(self.name, self.BUDGET, alive=lambda pid, start: pid not in self.dead)
        self.members: list = []  # live handles
        self.held: dict[int, int] = {}  # pid -> bytes, what the ledger should record (dead until reaped)
        self.next_pid = 10_000_000

    def teardown(self) -> None:
        self.ledger.close()
        os.unlink(ledger_path(self.name))

    def free(self) -> int:
        return self.BUDGET - sum(self.held.values())

    @precondition(lambda self: len(self.members) < 4)
    @rule(size=st.sampled_from([1, 2, 4]))
    def join(self, size):
        self.next_pid += 1
        self.members.append(self.ledger.join(f"m{self.next_pid}", size * self.UNIT, pid=self.next_pid))
        self.held[self.next_pid] = 0

    def model_take(self, member, pages: int, extra: int) -> int:
        need = max(0, pages - member.held)
        if not need:
            return 0
        got = min(min(self.free(), self.BUDGET - member.held * member.page_bytes) // member.page_bytes, need + extra)
        if need - got > 0 and any(pid in self.dead for pid in self.held):
            self.held = {pid: held for pid, held in self.held.items() if pid not in self.dead}
            got = min(min(self.free(), self.BUDGET - member.held * member.page_bytes) // member.page_bytes,
                      need + extra)
        self.held[member.pid] += got * member.page_bytes
        return max(0, need - got)

    @precondition(lambda self: self.members)
    @rule(data=st.data(), pages=st.integers(0, 64), extra=st.integers(0, 4))
    def take(self, data, pages, extra):
        member = data.draw(st.sampled_from(self.members))
        pages = min(pages, self.BUDGET // member.page_bytes)
        expected = self.model_take(member, pages, extra)
        assert member.take(pages, extra=extra) == expected

    @precondition(lambda self: self.members)
    @rule(data=st.data(), pages=st.integers(0, 64), on_request=st.booleans())
    def give(self, data, pages, on_request):
        member = data.draw(st.sampled_from(self.members))
        given = min(pages, member.held)
        member.give(pages, reclaim=on_request)
        self.held[member.pid] -= given * member.page_bytes
        if on_request:
            assert member.asked() == 0

    @precondition(lambda self: len(self.members) >= 2)
    @rule(data=st.data())
    def ask_and_serve(self, data):
        asker, giver = data.draw(st.permutations(self.members))[:2]
        for member in self.members:
            member.offer(member.held if member is giver else 0)
        if not giver.held:
            return
        with self.ledger.locked() as slots:
            asker._ask(slots, giver.held * giver.page_bytes)
        assert giver.asked() == giver.held and all(m.asked() == 0 for m in self.members if m is not giver)
        self.held[giver.pid] = 0
        giver.give(giver.asked(), reclaim=True)
        assert giver.held == 0 == giver.asked()

    @precondition(lambda self: self.members)
    @rule(data=st.data())
    def die(self, data):
        member = data.draw(st.sampled_from(self.members))
        self.members.remove(member)
        self.dead.add(member.pid)

    @rule()
    def reap(self):
        freed = sum(held for pid, held in self.held.items() if pid in self.dead)
        assert self.ledger.reap() == freed
        self.held = {pid: held for pid, held in self.held.items() if pid not in self.dead}

    @invariant()
    def agrees_with_the_model(self):
        recorded = {m.pid: m.held for m in self.ledger.members()}
        assert recorded == self.held
        assert sum(recorded.values()) <= self.BUDGET
        for member in self.members:
            assert member.held * member.page_bytes == recorded[member.pid]  # counted once, in one place


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_reference_outputs_do_not_depend_on_the_ledger(name, reference):
    """The digest is a real check: another seed, or a damaged page, changes it."""
    with small(name) as cache:
        assert ledger_member.run_burst(cache, BURST["seqs"], BURST["tokens"], 1) == reference(1) != reference(2)


# ---- seeing it: vmkv ledger, /metrics ------------------------------------------------------------
def test_vmkv_ledger_prints_members_and_a_verdict(name, capsys):
    from vmkv.cli import main

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with small(name, ",member=busy") as cache, Ledger(name, BUDGET) as ledger:
        ledger_member.run_burst(cache, 2, 128, seed=5)
        ghost = ledger.join("ghost", PAGE, pid=child.pid)
        ghost.take(3)
        assert main(["ledger", name]) == 0
        alive = capsys.readouterr().out.splitlines()
        child.kill()
        child.wait()
        assert main(["ledger", name, "--reap"]) == 0
        reaped = capsys.readouterr().out.splitlines()
    assert alive[1].split()[:5] == ["member", "pid", "state", "page", "held"]
    assert [row.split()[0] for row in alive[2:-1]] == ["busy", "ghost"]
    assert alive[-1].startswith("verdict: 2 member(s) hold") and "idle" in alive[-1]
    assert [row.split()[0] for row in reaped[2:-1]] == ["busy"] and "reaped 96.0 KiB" in reaped[-1]
    assert main(["ledger", name]) == 1 and "no ledger named" in capsys.readouterr().err


AT_EXIT = {  # what keeps a member's cache referenced until the interpreter exits, so it is never finalized
    "a daemon thread": """
cache = ledger_member.open_member(NAME + ":4MiB")
ledger_member.run_burst(cache, 2, 128, seed=3)
threading.Thread(target=lambda held=cache: time.sleep(600), daemon=True).start()
""",
    "an engine loop left open": """
from vmkv.engine import Engine, EngineConfig, EngineLoop, SamplingParams
engine = Engine.from_config(EngineConfig(memory_budget="1MiB", page_size="4KiB", max_num_seqs=2, max_seq_len=256,
                                         shared_budget=NAME + ":4MiB"))
engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9] * 4], SamplingParams(max_tokens=4, temperature=0))
loop = EngineLoop(engine)  # its daemon thread holds the engine
""",
    "an engine loop busy at exit": """
from vmkv.engine import Engine, EngineConfig, EngineLoop, SamplingParams
engine = Engine.from_config(EngineConfig(memory_budget="1MiB", page_size="4KiB", max_num_seqs=2, max_seq_len=256,
                                         shared_budget=NAME + ":4MiB"))
loop = EngineLoop(engine)
started = threading.Event()
loop.submit([1, 2, 3, 4, 5, 6, 7, 8, 9] * 4, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
            lambda output: started.set())
assert started.wait(60)  # it steps on: the interpreter exits in the middle of a request
""",
}


@pytest.mark.parametrize("holder", list(AT_EXIT))
def test_a_cache_open_at_interpreter_exit_closes_and_leaves_the_ledger(name, holder):
    """Issue 37 item 1: a member's cache still referenced when the interpreter exits (so its
    finalizer never runs) closes then and leaves the ledger: no dead member holding its bytes,
    and the last member's file goes."""
    script = "\n".join([
        "import sys, threading, time",
        "from vmkv.ledger import Ledger",
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})",
        "import ledger_member",
        f"NAME = {name!r}",
        AT_EXIT[holder],
        "with Ledger(NAME, None) as seen:",
        "    assert seen.members()[0].held > 0  # the member holds bytes as the interpreter exits",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(ledger_path(name)), "\n".join(vmkv.ledger.report(name))


def test_engines_share_a_budget_with_unchanged_outputs_and_export_gauges(name):
    from vmkv.engine import Engine, EngineConfig, SamplingParams
    from vmkv.server import metrics

    def engine(shared: str | None) -> Engine:
        return Engine.from_config(EngineConfig(memory_budget="1MiB", page_size="4KiB", max_num_seqs=4, max_seq_len=256,
                                               shared_budget=shared))

    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8, 9] * 8 for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0)
    alone = engine(None)
    want = [out.outputs[0].token_ids for out in alone.generate(prompts, params)]
    alone.close()
    a, b = engine(f"{name}:1MiB,member=a"), engine(f"{name}:1MiB,member=b")
    try:
        got_a = [out.outputs[0].token_ids for out in a.generate(prompts, params)]
        got_b = [out.outputs[0].token_ids for out in b.generate(prompts, params)]
        text = metrics.render(a.stats())
    finally:
        a.close()
        b.close()
    assert got_a == want == got_b
    held = {line.split('member="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("vmkv_ledger_member_held_bytes{")}
    assert set(held) == {"a", "b"} and held["b"] > 0 and sum(held.values()) <= 1 << 20
    assert f'vmkv_ledger_budget_bytes{{ledger="{name}"}} {1 << 20}' in text


def test_grants_come_in_batches_not_a_lock_per_page(name):
    with small(name) as cache:
        ledger, calls = cache.budget.share.ledger, []
        locked = ledger.locked
        ledger.locked = lambda: calls.append(1) or locked()
        ledger_member.run_burst(cache, 6, 256, seed=6, keep=True)
        assert cache.stats()["ledger_pages_held"] >= 102
    assert 0 < len(calls) <= 12, len(calls)  # 102 pages in 8 steps, a lock at most per step that grows


@pytest.mark.slow
def test_two_engines_benchmark_follows_the_contract(tmp_path):
    """`vmkv bench two_engines --smoke`, smaller still: rows of both setups, the shared one within
    its budget, both completing every request, and the two TTFT verdicts."""
    import argparse

    from vmkv_bench import two_engines

    parser = argparse.ArgumentParser()
    two_engines.add_arguments(parser)
    args = parser.parse_args(["--bursts", "2", "--burst-requests", "4", "--output-len", "4", "--period", "0.5"])
    args.device, args.smoke, args.seed, args.out, args.progress = "cpu", True, 0, tmp_path, False
    result = two_engines.run(args)
    assert [row["setup"] for row in result["rows"]] == ["static", "shared"]
    for row in result["rows"]:
        assert set(row) == set(result["schema"]) and row["completed"] == 8
        assert 0 < row["peak_resident_mib"] <= row["budget_mib"]
    assert [v.key for v in two_engines.verdicts(result)] == ["two_engines.p99_ttft", "two_engines.p50_ttft"]


# ---- CUDA (the fake driver): pages given back really go back to the device ----------------------
def test_cuda_members_create_pages_in_batches_and_release_them(name, reference, fake_cuda_backends, fake):  # noqa: F811
    zero_pages = 2 * 8192  # one zero page per backend
    a, b = small(name, ",member=a"), small(name, ",member=b")
    try:
        assert [backend.on_demand for backend in fake_cuda_backends] == [True, True]
        assert fake.state()["memory_used"] == zero_pages  # nothing created up front
        fake.calls(clear=True)
        first = ledger_member.run_burst(a, BURST["seqs"], BURST["tokens"], 1)
        calls = [call.name for call in fake.calls()]
        after_a = fake.state()["memory_used"]
        second = ledger_member.run_burst(b, BURST["seqs"], BURST["tokens"], 2)  # a idles: its watcher gives back
        after_b = fake.state()["memory_used"]
        released = [call.name for call in fake.calls()].count("cuMemRelease")
        a.check()
        b.check()
    finally:
        a.close()
        b.close()
    assert first == reference(1) and second == reference(2)  # the same outputs as host caches alone
    assert 102 * PAGE <= after_a - zero_pages <= BUDGET and after_b - zero_pages <= BUDGET
    assert calls.count("cuMemCreate") >= 102 * 4 and calls.count("cuMemsetD8") <= 12  # a batch, not a page, a memset
    assert released >= 4 * (102 - (BUDGET // PAGE - 102))  # a gave back at least what b lacked


def test_cuda_trim_gives_memory_back_to_the_device(name, fake_cuda_backends, fake):  # noqa: F811
    with small(name) as cache:
        ledger_member.run_burst(cache, 2, 128, seed=3)
        assert fake.state()["memory_used"] > 8192
        cache.trim()
        assert fake.state()["memory_used"] == 8192 and cache.stats()["ledger_pages_held"] == 0
        cache.add("x")
        cache.begin_step({"x": 4})
        page = cache.pages("x")[0]
        with pytest.raises(BackendError, match="still mapped"):
            fake_cuda_backends[0].release_page(cache._piece(page, 0))


def test_a_members_min_is_never_asked_back(name):
    with small(name, ",member=a,min=3MiB") as a, small(name, ",member=b,wait=0.5") as b:
        ledger_member.run_burst(a, *BURST.values(), seed=1)  # 102 pages, then idle (cached)
        with pytest.raises(OutOfPages):
            ledger_member.run_burst(b, *BURST.values(), seed=2)
        assert a.stats()["ledger_pages_held"] >= 96  # 3 MiB of 32 KiB pages
        b.check()


def test_a_call_waits_for_the_watcher_instead_of_raising(name):
    from vmkv.errors import ConcurrentUse

    with small(name) as cache:
        guard, inside = cache.guard, threading.Event()

        def hold(seconds: float, serving: bool) -> None:
            guard.serving = serving
            with guard.lock:
                inside.set()
                time.sleep(seconds)
            guard.serving = False

        watcher = threading.Thread(target=hold, args=(0.2, True))
        watcher.start()
        inside.wait()
        cache.add("x")  # the watcher is giving pages back: wait for it
        watcher.join()
        inside.clear()
        other = threading.Thread(target=hold, args=(0.2, False))
        other.start()
        inside.wait()
        with pytest.raises(ConcurrentUse):  # any other thread is still refused
            cache.add("y")
        other.join()


def test_gpu_check_shared_budget_section_dry_runs_on_the_cpu():
    import torch

    from vmkv_bench.gpu.memory import shared_budget_section
    from vmkv_bench.runner import Context

    result = shared_budget_section(Context(torch.device("cpu"), smoke=True))
    assert result["failures"] == [] and all(result["checks"].values())
    assert result["resident_after_second"] <= result["budget_bytes"] and result["pages_held"][1] >= 40


class SharedCachesMachine(RuleBasedStateMachine):
    """Two VMM caches in one ledger smaller than their sum: sequences come, grow and go, caches
    trim and serve requests (the watcher's work, called here so runs replay). A call either
    succeeds or raises OutOfPages having changed nothing; every stored token reads back as
    written; no cache backs a page it was not granted, and the ledger never holds more than its
    budget."""

    def __init__(self) -> None:
        super().__init__()
        self.name = f"caches-{os.getpid()}-{id(self)}"
        self._poll, vmkv.share.POLL_S = vmkv.share.POLL_S, 3600.0  # no watcher wakes: the rules serve
        config = dict(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32", page_size="4KiB", max_batch_size=4,
                      max_seq_len=1024, memory_budget=24 * 2 * 4096)  # 24 pages of 2 x 4 KiB each, 256 tokens a page
        self.caches = [vmkv.VirtualKVCache(vmkv.KVCacheConfig(**config, shared_budget=f"{self.name}:{32 * 8192},wait=0.05"))
                       for _ in range(2)]
        self.tokens: list[dict[str, list[float]]] = [{}, {}]  # per cache: seq -> the value of each token
        self.next_id = 0
        self.last_error = ""

    def teardown(self) -> None:
        for cache in self.caches:
            cache.close()
        vmkv.share.POLL_S = self._poll

    def attempt(self, which: int, call) -> bool:
        cache = self.caches[which]
        before = cache.state()
        try:
            call(cache)
        except OutOfPages as exc:
            self.last_error = "ledger full" if "ledger" in str(exc) else "cache full"
            event(self.last_error)
            assert cache.state() == before
            return False
        return True

    @precondition(lambda self: any(len(t) < 4 for t in self.tokens))
    @rule(which=st.integers(0, 1), length=st.integers(1, 1500))
    def add_and_prefill(self, which, length):
        if len(self.tokens[which]) == 4:
            return
        seq, self.next_id = f"s{self.next_id}", self.next_id + 1
        length = min(length, 1024)
        cache = self.caches[which]
        cache.add(seq)

        def prefill(cache):
            plan = cache.begin_step({seq: length})
            values = torch.arange(length, dtype=torch.float32) + 10_000 * self.next_id
            cache.write(0, values[:, None, None].expand(length, 1, 16), values[:, None, None].expand(length, 1, 16), plan)

        done = self.attempt(which, prefill)
        if not done and self.last_error == "ledger full":  # the other's watcher would serve the request now
            self.serve(1 - which)
            done = self.attempt(which, prefill)
        if done:
            self.tokens[which][seq] = [float(v) for v in range(length)]
        else:
            cache.free(seq)

    @precondition(lambda self: any(self.tokens))
    @rule(data=st.data())
    def free_one(self, data):
        which = data.draw(st.sampled_from([i for i in (0, 1) if self.tokens[i]]))
        seq = data.draw(st.sampled_from(sorted(self.tokens[which])))
        self.caches[which].free(seq)
        del self.tokens[which][seq]

    @rule(which=st.integers(0, 1))
    def trim(self, which):
        self.caches[which].trim(keep_cached=True)

    @rule(which=st.integers(0, 1))
    def serve(self, which):
        held = self.caches[which].budget.member.held
        self.caches[which].budget.serve()
        event("gave back" if self.caches[which].budget.member.held < held else "nothing to give")

    @invariant()
    def within_grants_and_intact(self):
        held = 0
        for cache, tokens in zip(self.caches, self.tokens):
            member = cache.budget.member
            assert cache.budget.memory.backed() <= member.held
            assert cache.stats()["resident_bytes"] <= member.held * cache.geometry.page_bytes
            held += member.held * cache.geometry.page_bytes
            for seq, values in tokens.items():
                k, _ = cache.kv(seq, 0)
                assert k.shape[0] == len(values) and torch.equal(k[:, 0, 0] % 10_000, torch.tensor(values))
        assert held <= 32 * 8192


TestSharedCachesMachine = SharedCachesMachine.TestCase
TestSharedCachesMachine.settings = settings(max_examples=60, stateful_step_count=20, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_another_version_and_a_missing_directory_say_so(name, tmp_path):
    import vmkv.ledger as ledger_module
    from vmkv.errors import LedgerError

    path = ledger_path(name)
    other = ledger_module.VERSION + 1
    Path(path).write_bytes(struct.pack("<8sIIQ", ledger_module.MAGIC, other, 64, BUDGET).ljust(64 + 64 * 128, b"\0"))
    with pytest.raises(LedgerMismatch, match=f"version {other}"):
        Ledger(name, BUDGET)
    with pytest.raises(LedgerError, match="directory does not exist"):
        Ledger(str(tmp_path / "missing" / "ledger"), BUDGET)


# ---- faults and misuse (issue 30) ---------------------------------------------------------------
CHURN = str(Path(__file__).with_name("ledger_churn.py"))


def isolated(tmp_path: Path, mount_options: str, script: str) -> subprocess.CompletedProcess:
    """Run Python ``script`` in a private mount namespace where ``DIR`` (in the script) names a
    fresh tmpfs mounted with ``mount_options`` (a full or a read-only filesystem; the host's are
    not touched). Skips where no such namespace can be made (neither root nor user namespaces)."""
    directory = tmp_path / "fs"
    directory.mkdir()
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        if subprocess.run([*prefix, "mount", "-t", "tmpfs", "tmpfs", str(directory)], capture_output=True).returncode == 0:
            break
    else:
        pytest.skip("cannot mount a tmpfs in a private mount namespace here")
    shell = f'mount -t tmpfs -o {mount_options} vmkv-test {directory} && exec {sys.executable} -c "$0"'
    return subprocess.run([*prefix, "sh", "-c", shell, f"DIR = {str(directory)!r}\n{script}"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


FULL_TMPFS = """
import json, os
from vmkv.errors import LedgerError
from vmkv.ledger import Ledger
fill = os.open(DIR + "/fill", os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(fill, bytes(4096))
except OSError:
    os.close(fill)
try:
    Ledger(DIR + "/kv", 1 << 20)
    error = None
except LedgerError as exc:
    error = str(exc)
left = sorted(os.listdir(DIR))
os.unlink(DIR + "/fill")
with Ledger(DIR + "/kv", 1 << 20) as ledger:
    member = ledger.join("m", 4096)
    short = member.take(3)
    member.leave()
print(json.dumps({"error": error, "left": left, "short": short}))
"""


def test_a_full_filesystem_is_a_typed_error_that_leaves_no_file(tmp_path):
    """Item 1: a ledger created on a full tmpfs (a container's 64 MiB /dev/shm) killed its process
    with SIGBUS and left a file that blocked the name for good."""
    done = isolated(tmp_path, "size=8k", FULL_TMPFS)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 was SIGBUS
    result = json.loads(done.stdout)
    assert "no space left" in result["error"] and result["left"] == ["fill"]
    assert result["short"] == 0  # once there is room, the same name works


READ_ONLY = """
import os
from vmkv.errors import LedgerError
from vmkv.ledger import Ledger
try:
    Ledger(DIR + "/kv", 1 << 20)
except LedgerError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_read_only_filesystem_is_a_typed_error(tmp_path):
    """Item 13: a ledger path on a read-only filesystem."""
    done = isolated(tmp_path, "ro", READ_ONLY)
    assert done.returncode == 0 and done.stdout.startswith("LedgerError") and "read-only" in done.stdout, \
        (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize("kind", ["directory", "/dev/null", "/proc file", "foreign file"])
def test_paths_that_are_not_ledgers_get_one_typed_error_and_stay_untouched(kind, tmp_path, capsys):
    """Item 13: a directory, a device, a /proc file or another program's file as a ledger path."""
    from vmkv.cli import main
    from vmkv.errors import LedgerError

    path = {"directory": str(tmp_path), "/dev/null": "/dev/null", "/proc file": "/proc/self/status",
            "foreign file": str(tmp_path / "passwd")}[kind]
    if kind == "foreign file":
        Path(path).write_text("root:x:0:0:root:/root:/bin/bash\n")
    before = sorted(os.listdir(tmp_path)), Path(path).read_bytes() if kind == "foreign file" else None
    for budget in (BUDGET, None):
        with pytest.raises(LedgerError) as error:
            Ledger(path, budget)
        assert "remove" not in str(error.value)  # never advise removing a file vmkv did not make
    with pytest.raises(LedgerError):
        small(path)
    assert main(["ledger", path]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vmkv ledger: ") and "Traceback" not in err and "remove" not in err
    assert (sorted(os.listdir(tmp_path)), Path(path).read_bytes() if kind == "foreign file" else None) == before


def test_random_kills_inside_join_leave_and_reap_leave_a_working_ledger(name, reference):
    """Item 3: members SIGKILLed at random moments (inside join, take, give, ask, reap, leave)
    left a half-written slot that made every locked read raise LedgerCorrupt, for every member.
    Live members keep working all along, and ``vmkv ledger NAME --reap`` leaves a clean ledger."""
    from vmkv.cli import main

    kills = 500
    cache = small(name, ",member=cache")
    ledger = Ledger(name, BUDGET)
    live = [ledger.join(f"live{i}", PAGE) for i in range(2)]
    errors, stop = [], threading.Event()

    def work() -> None:  # the live members take, offer, serve requests and give, all along
        rounds = 0
        while not stop.is_set():
            rounds += 1
            for member in live:
                try:
                    if member.asked():
                        member.give(member.asked(), reclaim=True)
                    member.take(2 + rounds % 6)
                    member.offer(member.held // 2)
                    member.give(member.held // 2)
                except Exception as exc:  # noqa: BLE001 -- the test reports it
                    errors.append(repr(exc))
                    return
            time.sleep(0.002)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        killer = subprocess.run([sys.executable, CHURN, "kill", name, str(kills), "30"],
                                capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        stop.set()
        worker.join()
    assert killer.returncode == 0, killer.stderr[-3000:]
    assert json.loads(killer.stdout) == {"kills": kills, "failures": []}, killer.stderr[-3000:]
    assert errors == []
    for member in live:  # every live member still works
        held = member.held
        assert member.take(held + 2) == 0 and member.held >= held + 2
        member.give(2)
    assert ledger_member.run_burst(cache, *BURST.values(), seed=1) == reference(1)
    assert main(["ledger", name, "--reap"]) == 0
    members = ledger.members()
    assert sorted(m.name for m in members) == ["cache", "live0", "live1"] and all(m.alive for m in members)
    held = {m.name: m.held for m in members}
    assert held["live0"] == live[0].held * PAGE and held["live1"] == live[1].held * PAGE
    assert held["cache"] == cache.stats()["ledger_pages_held"] * PAGE
    for member in live:
        member.leave()
    ledger.close()
    cache.close()
    assert not os.path.exists(ledger_path(name))  # the last member took the file with it


def can_unshare_pids() -> bool:
    return subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not can_unshare_pids(), reason="cannot create a PID namespace here")
def test_a_member_in_another_pid_namespace_is_not_reaped(name, reference):
    """Item 5: a live member in another PID namespace (a second container sharing /dev/shm) was
    reaped as dead; the other member took its budget. It is alive while it lives, and reaped
    once it is killed."""
    other = Member(f"{name}:4MiB,member=other", prefix=("unshare", "-p", "--kill-child", "--mount-proc"))
    try:
        assert other.send(op="hold", seqs=5, tokens=256, seed=1)["held"] >= 85  # 5 x 17 pages, live
        with small(name, ",member=b,wait=0.3") as b:
            with pytest.raises(OutOfPages):
                ledger_member.run_burst(b, *BURST.values(), seed=2)  # needs 102: only a reap would free them
            b.check()
            for seq_id in b.seq_ids:
                b.free(seq_id)
            members = {m.name: m for m in Ledger(name, None).members()}
            assert members["other"].alive and members["other"].held >= 85 * PAGE
            assert other.send(op="hold", seqs=1, tokens=64, seed=3)["held"] >= 90  # it still works
            other.proc.kill()  # unshare dies; --kill-child kills the member
            other.proc.wait(10)
            deadline = time.monotonic() + 10
            while any(m.alive for m in Ledger(name, None).members() if m.name == "other"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert ledger_member.run_burst(b, *BURST.values(), seed=2) == reference(2)  # its budget came back
    finally:
        other.proc.kill()
        other.proc.wait(10)


def test_liveness_rests_on_the_members_lock_not_on_its_pid(name):
    """Item 5 where no PID namespace can be made: a member whose slot names another namespace and
    a pid that is dead here stays alive while its process (its lock) lives, and is reaped once it
    is gone; in this namespace a dead pid is dead although its lock is held (a forked child of
    a dead member may keep it)."""
    from vmkv.ledger import pid_namespace

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holders = [subprocess.Popen([sys.executable, CHURN, "hold", name, str(pages)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for pages in (40, 10)]
    try:
        slots = [read_answer(holder, 60)["slot"] for holder in holders]
        gone = subprocess.Popen(["true"])
        gone.wait()  # a pid that is dead here
        with Ledger(name, None) as ledger:
            with ledger.locked():
                for slot in slots:
                    ledger.record.write(slot, pid=gone.pid, ns=pid_namespace() + 1)
            assert ledger.reap() == 0 and all(m.alive for m in ledger.members())
            holders[1].kill()
            holders[1].wait()
            assert ledger.reap() == 10 * PAGE  # its lock went with it
            with ledger.locked():
                ledger.record.write(slots[0], ns=pid_namespace())
            assert ledger.reap() == 40 * PAGE and ledger.members() == []  # here its pid decides
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def test_an_idle_member_whose_last_call_was_a_step_gives_back(name):
    """Item 6: a member whose last call was a finished ``begin_step`` never served requests (its
    watcher took the step for one in flight); the other waited and got OutOfPages."""
    with small(name, ",member=a") as a, small(name, ",member=b") as b:
        ledger_member.run_burst(a, *BURST.values(), seed=1)  # 102 pages, then freed: idle
        a.add("last")
        plan = a.begin_step({"last": 16})
        values = torch.arange(16 * 2 * 64, dtype=torch.float32).view(16, 2, 64)
        for layer in range(ledger_member.CONFIG["num_layers"]):
            a.write(layer, values, values, plan)
        ledger_member.run_burst(b, *BURST.values(), seed=2)  # a idles: its watcher gives back
        assert b.stats()["ledger_pages_held"] >= 102
        assert a.stats()["ledger_pages_held"] <= BUDGET // PAGE - 102
        k, v = a.kv("last", 1)
        assert torch.equal(k, values) and torch.equal(v, values)
        a.check()


def test_max_zero_is_refused(name):
    """Item 8: ``max=0`` meant no limit."""
    with pytest.raises(InvalidConfig, match="max"):
        SharedBudget.parse(f"{name}:4MiB,max=0")
    with pytest.raises(InvalidConfig, match="max"):
        small(name, ",max=0")
    assert not os.path.exists(ledger_path(name))


@pytest.mark.parametrize("setting", [":16KiB", ":4MiB,max=16KiB", ":4MiB,min=1MiB,max=512KiB"])
def test_a_join_that_fails_leaves_no_file(name, setting):
    """Item 9: a join refused for a budget that holds no page left a member-less file behind, and
    later opens with another budget got LedgerMismatch."""
    with pytest.raises(InvalidConfig):
        ledger_member.open_member(name + setting)
    assert not os.path.exists(ledger_path(name))
    with Ledger(name, 3 * BUDGET) as ledger:
        assert ledger.budget == 3 * BUDGET


@pytest.mark.parametrize("budget", [1 << 64, 1 << 80])
def test_a_budget_past_the_file_format_is_refused_before_any_file(name, budget):
    """Item 10: a budget of 2**64 or more raised a bare struct.error after creating the file,
    which then blocked the name for good."""
    with pytest.raises(InvalidConfig, match="budget"):
        SharedBudget.parse(f"{name}:{budget}")
    with pytest.raises(InvalidConfig, match="budget"):
        Ledger(name, budget)
    with pytest.raises(InvalidConfig, match="budget"):
        vmkv.VirtualKVCache(vmkv.KVCacheConfig(**ledger_member.CONFIG, shared_budget=SharedBudget(name, budget)))
    assert not os.path.exists(ledger_path(name))
    with Ledger(name, BUDGET) as ledger:
        assert ledger.budget == BUDGET


def test_a_request_goes_with_the_member_that_made_it(name):
    """Item 11: a reclaim request outlived its asker (timed out, closed or killed); the asked
    member later gave pages back for nobody."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with Ledger(name, BUDGET) as ledger:
        giver = ledger.join("giver", PAGE)
        assert giver.take(120) == 0
        giver.offer(120)
        asker = ledger.join("asker", PAGE)
        with pytest.raises(OutOfPages):
            asker.take(100, wait_s=0.05)  # the giver never serves it
        assert giver.asked() == 0  # the asker gave up
        asker.leave()
        for leaves in ("leave", "dies"):
            asker = ledger.join("asker", PAGE, pid=None if leaves == "leave" else child.pid)
            with ledger.locked() as slots:
                asker._ask(slots, 50 * PAGE)
            assert giver.asked() == 50
            if leaves == "leave":
                asker.leave()
            else:
                child.kill()
                child.wait()
            assert giver.asked() == 0 and giver.held == 120
        assert ledger.reap() == 0 and [m.name for m in ledger.members()] == ["giver"]


def test_reading_a_ledger_while_members_create_and_remove_it(name):
    """Item 12: ``vmkv ledger`` and ``/metrics`` read a file a member was just creating and said
    LedgerCorrupt, advising its removal (which splits the budget in two)."""
    from vmkv.errors import LedgerError
    from vmkv.ledger import prometheus_lines, report

    cycler = subprocess.Popen([sys.executable, CHURN, "cycle", name, "2.5"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert read_answer(cycler, 60) == {"ready": True}
    outcomes: dict[str, int] = {"read": 0, "absent": 0}
    errors = []
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        try:
            report(name)
            prometheus_lines(name)
            outcomes["read"] += 1
        except FileNotFoundError:
            outcomes["absent"] += 1
        except LedgerError as exc:
            errors.append(str(exc))
    cycles = read_answer(cycler, 60)["cycles"]
    cycler.wait(10)
    assert errors == [] and outcomes["read"] >= 20 and outcomes["absent"] >= 20 and cycles >= 200, \
        (errors[:3], len(errors), outcomes, cycles)


def test_threads_sharing_one_handle_take_turns(name):
    """A member's watcher thread reads its requests under the lock (item 11) while the owner's
    thread takes and gives: flock alone does not exclude threads that share an open file."""
    with Ledger(name, BUDGET) as ledger:
        owner = ledger.join("owner", PAGE)
        asker = ledger.join("asker", PAGE, pid=os.getppid())  # a live process that asks and gives up
        errors, stop = [], threading.Event()

        def run(job) -> None:
            try:
                while not stop.is_set():
                    job()
            except Exception as exc:  # noqa: BLE001 -- the test reports it
                errors.append(repr(exc))

        def own() -> None:  # the owner's thread: its slot's held changes all along
            owner.take(2 + owner.held % 7)
            owner.offer(owner.held)
            owner.give(owner.held // 2)

        def watch() -> None:  # its watcher: a request comes and goes, then it reads (and clears) it
            with ledger.locked() as slots:
                asker._ask(slots, PAGE)
                ledger.record.write(asker.slot, want=0)
            owner.asked()

        threads = [threading.Thread(target=run, args=(job,)) for job in (own, watch)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch inside the lock's hold, if anything lets them
        try:
            for thread in threads:
                thread.start()
            time.sleep(1.0)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            sys.setswitchinterval(interval)
        assert errors == []
        assert {m.name: m.held for m in ledger.members()} == {"owner": owner.held * PAGE, "asker": 0}


def test_the_watcher_outlives_a_ledger_it_cannot_read(name, caplog):
    """Reading a request takes the ledger's lock (item 11), which refuses a damaged record: the
    idle member's watcher logs it and keeps watching instead of dying with a traceback."""
    with small(name, ",member=a") as cache, Ledger(name, None) as ledger:
        ledger_member.run_burst(cache, 2, 128, seed=7)
        slot = cache.budget.member.slot
        with ledger.locked():
            ledger.record.write(slot, request=PAGE)
            ledger.record.write(slot, held=2 * BUDGET)  # damaged: more than the budget
        deadline = time.monotonic() + 5
        while "giving pages back" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "LedgerCorrupt" in caplog.text and cache.budget.share._watcher.is_alive()
        ledger.record.write(slot, held=cache.budget.member.held * PAGE, request=0)  # repaired: the cache closes
