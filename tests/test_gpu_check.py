"""The GPU check, ``python benchmarks/gpu_check.py`` (``vmkv_bench/runner.py``, ``vmkv_bench/gpu/``), without a GPU.

* Its dry run as a user runs it (``--device cpu --smoke``): the sections added for issue 26
  (``shared_budget``, ``vllm_slots``, ``bench``) and ``zero_page`` (whose write probe must die),
  each in its own process, the JSON, the summary and the verdict line.
* The registry and the time budget: a section whose estimate does not fit in what is left is
  skipped with the reason; a section's process never outlives the budget, nor do the
  processes it started; the summary fits one screen.
* Each section's verdict logic, fed results that must fail.
* The CUDA paths of ``shared_budget`` and ``vllm_slots`` on the fake driver (tests/fake_cuda):
  the stores hold exactly what the driver created minus what it released, zero pages included;
  every driver call of mapping and freeing a slot fails once and is undone.

Every test name holds ``gpu_check``: the ``tests`` section deselects them on a GPU (they would
start the script inside itself; the fake-driver ones skip there anyway).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fake_cuda.fixtures import fake, fake_cuda_backends, fake_lib  # noqa: F401  (fixtures)
from helpers import register_kernel

import vmkv
from vmkv.kernels.contiguous import sdpa_per_sequence
from vmkv.vllm import PluginConfig
from vmkv_bench import runner
from vmkv_bench.decode import TOLERANCE
from vmkv_bench.gpu import core, kernels, memory, slots, vllm_engine, vllm_smoke
from vmkv_bench.gpu.memory import DeviceMemory, MemorySample, shared_budget_section
from vmkv_bench.registry import SECTIONS
from vmkv_bench.runner import Context, SectionSkipped, run_process

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")
MiB = 1 << 20
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the no-GPU path cannot be shown")


def smoke(device: str = "cpu", out: Path | None = None, **options) -> Context:
    """A section's context for the dry run's shapes, with the command's options given."""
    return Context(torch.device(device), True, out or Path("gpu-check-out"), argparse.Namespace(**options))


# ---- the dry run, as a user runs it -----------------------------------------------------------
def test_gpu_check_cpu_dry_run_runs_the_new_sections_each_in_its_own_process(tmp_path):
    """The write probe dies in a grandchild (SIGSEGV on the host); shared_budget, vllm_slots and
    the main job's suite (one quick benchmark) pass; the summary names each with its headline;
    the last line is the verdict."""
    sections = ["zero_page", "shared_budget", "vllm_slots", "bench"]
    run = run_process([sys.executable, SCRIPT, "--device", "cpu", "--smoke", "--out", str(tmp_path),
                       "--sections", *sections], 300)
    assert run.returncode == 0, run.output
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    entries = report["sections"]
    assert list(entries) == sections and all(entry["status"] == "passed" for entry in entries.values()), entries
    assert entries["zero_page"]["result"]["write_probe"]["exit"] == "killed by SIGSEGV"
    assert all(entries["zero_page"]["result"]["checks"].values()) and len(entries["zero_page"]["result"]["checks"]) == 7
    budget = entries["shared_budget"]["result"]
    assert all(budget["checks"].values()) and budget["resident_after_second"] <= budget["budget_bytes"]
    assert [row["stage"] for row in budget["rounds"]["measured"]] == list(memory.STAGES)
    slot = entries["vllm_slots"]["result"]
    assert all(slot["checks"].values()) and slot["rollback"]["map"]["calls"] > 0 and slot["vllm_layout"] == "LBHNC"
    suite = entries["bench"]["result"]
    assert suite["returncode"] == 0 and suite["benchmarks"][runner.SMOKE_BENCHMARK]["status"] == "ok", suite
    assert all(entry["estimate_s"] > 0 and entry["headline"] for entry in entries.values())
    lines = run.stdout.strip().splitlines()
    assert lines[-1] == "gpu_check on cpu: 4 passed, 0 skipped."
    table = lines[lines.index(next(line for line in lines if line.startswith("section "))):]
    assert all(any(line.startswith(name) and entries[name]["headline"][:40] in line for line in table) for name in sections)


def test_gpu_check_cpu_dry_run_of_the_cuda_graph_sections(tmp_path):
    """engine_graphs (the engine's captured decode steps, replayed eagerly on a CPU, both modes:
    the masked SDPA reference reads slots or block tables) and hf_compiled
    (generate() compiled over StaticCache and VirtualCache(compile=True), tiny) pass their dry run."""
    sections = ["engine_graphs", "hf_compiled"]
    run = run_process([sys.executable, SCRIPT, "--device", "cpu", "--smoke", "--out", str(tmp_path),
                       "--sections", *sections], 400)
    assert run.returncode == 0, run.output
    entries = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert all(entries[name]["status"] == "passed" for name in sections), entries
    graphs = entries["engine_graphs"]["result"]
    assert graphs["outputs"]["vmm"]["max_rel_diff"] < 1e-4 and graphs["outputs"]["vmm"]["pages_mapped_while_decoding"] > 0
    assert graphs["outputs"]["paged"]["max_rel_diff"] < 1e-4 and not graphs["skipped"]
    assert graphs["speed"]["vmm"]["captured"] == graphs["speed"]["paged"]["captured"] == [3]
    compiled = entries["hf_compiled"]["result"]
    assert set(compiled["dense"]) == {"dynamic", "static", "vmm", "vmm+vmkv", "paged+vmkv", "vmm+compile", "vmm+compile+vmkv"}
    assert set(compiled["ratios"]) >= set(compiled["targets"])
    assert all(row["cudagraph_skips"] == 0 for row in compiled["dense"].values())  # reported (a CPU asks for no CUDA graphs)
    partial = json.loads((tmp_path / "hf_compiled.partial.json").read_text())  # what a run killed at its limit keeps
    assert partial["ratios"] == compiled["ratios"] and "ragged" in partial
    assert compiled["logit_errors"]["vmm+compile"] < 1e-4 and compiled["logit_errors"]["vmm+compile+vmkv"] < 1e-4
    # the ragged rows of the "vmkv" attention hold their real tokens only (a page each, at most, beyond)
    assert compiled["ragged"]["vmm+compile+vmkv"]["kv_bytes"] < compiled["ragged"]["vmm+compile"]["kv_bytes"]
    assert set(compiled["profile"]) == {"static", "vmm+compile", "vmm+compile+vmkv"}
    assert compiled["profile"]["vmm+compile+vmkv"]["self_cpu_ms"]
    assert "alone" not in entries["hf_compiled"] and "StaticCache" in entries["hf_compiled"]["headline"]


def test_hf_compiled_keeps_measuring_when_one_cache_raises(monkeypatch, tmp_path):
    """One device run measures every cache: a compiled cache that raises (here, made to) gets its
    error in each part and the section's failures, the others' numbers and ratios stay."""
    from types import SimpleNamespace

    from vmkv_bench.gpu import compiled

    config = SimpleNamespace(head_dim=8, hidden_size=16, num_attention_heads=2, num_hidden_layers=1, num_key_value_heads=1)
    work = compiled._work([4, 2], 3, torch.device("cpu"))
    monkeypatch.setattr(compiled, "_setup", lambda device, smoke: (SimpleNamespace(config=config, dtype=torch.float32),
                                                                    None, work, work, 1))
    speeds = {"static": 100.0, "vmm+compile": 80.0, "paged+vmkv": 45.0, "vmm+vmkv": 50.0}

    def time_one(model, name, work, compile_config, rounds):
        if name == "vmm+compile+vmkv":
            raise RuntimeError("capture failed")
        return {"seconds": 1.0, "tokens_per_s": speeds.get(name, 10.0), "kv_bytes": 64, "cudagraph_skips": 0}

    monkeypatch.setattr(compiled, "_time_one", time_one)
    monkeypatch.setattr(compiled, "logit_errors", lambda *args: {"static": 1e-3, "vmm+compile": 1e-3,
                                                                 "vmm+compile+vmkv": "RuntimeError: capture failed"})
    monkeypatch.setattr(compiled, "profile", lambda model, name, work, config: {"cpu_ms_total": 1.0})
    result = compiled.hf_compiled_section(smoke(out=tmp_path))
    assert [f.split(":")[0] for f in result["failures"]] == [
        "vmm+compile+vmkv raised in the dense part", "vmm+compile+vmkv raised in the logits part",
        "vmm+compile+vmkv raised in the ragged part"]
    ratios = result["ratios"]
    assert ratios["dense_vs_static"] == ratios["dense_vmm+compile_vs_static"] == 0.8 and ratios["paged_vs_vmm"] == 0.9
    assert ratios["dense_vmm+compile+vmkv_vs_static"] is None and ratios["ragged_bytes_vs_tokens"] is None
    assert set(result["profile"]) == {"static", "vmm+compile"}
    headline = compiled.hf_compiled_headline(result)
    assert "0.80x StaticCache" in headline and "vmkv n/a" in headline and "ragged n/a" in headline


# ---- the registry and the budget --------------------------------------------------------------
def test_gpu_check_registry_fits_the_budget_with_room_for_more():
    """Unique names, a stated estimate and a line of text each; what a default run does without
    vLLM (the GPU machine has none) fits in the default 8 minutes with half a minute to spare
    (estimates are estimates); a section that runs alone is left out of the default run; the
    quick checks come before the main job."""
    names = list(SECTIONS)
    assert all(section.estimate_s > 0 and section.about and section.name == name for name, section in SECTIONS.items())
    assert all(callable(section.load()) and callable(section.load(section.headline)) for section in SECTIONS.values())
    default = [s for s in SECTIONS.values() if not s.alone]
    without_vllm = sum(s.estimate_s for s in default if s.skip != "vmkv_bench.gpu.vllm_engine:vllm_unavailable")
    assert without_vllm + 30 <= runner.DEFAULT_BUDGET_S == 480
    assert runner.parse_args([]).sections == [s.name for s in default] and "hf_compiled" not in runner.parse_args([]).sections
    assert names.index("bench") > max(names.index(n)
                                      for n in ("environment", "tests", "zero_page", "shared_budget", "vllm_slots"))


def _passing_worker(tmp_path: Path, seen: list) -> object:
    """A ``worker_command`` whose processes write a passed entry at once (no torch, no CUDA)."""
    def command(name, args, seconds):
        seen.append((name, seconds))
        entry = json.dumps({"status": "passed", "result": {"section": name}})
        path = runner.section_file(tmp_path, name)
        return [sys.executable, "-c",
                f"import pathlib; p = pathlib.Path({str(path)!r}); p.parent.mkdir(exist_ok=True); p.write_text({entry!r})"]
    return command


def test_gpu_check_skips_with_the_reason_what_does_not_fit_the_budget(tmp_path, monkeypatch, capsys):
    """--budget-s 100: bench (~215 s) is skipped over budget with the numbers, the others run
    with a time limit inside what is left; a run that starts late skips what no longer fits;
    skipped is not failed (exit 0); the summary fits one screen."""
    seen: list = []
    monkeypatch.setattr(runner, "worker_command", _passing_worker(tmp_path, seen))
    monkeypatch.setitem(runner.SECTIONS, "environment", dataclasses.replace(
        runner.SECTIONS["environment"], headline=lambda result: f"ran {result['section']}"))
    code = runner.check_main(["--device", "cpu", "--out", str(tmp_path), "--sections", "environment", "bench", "zero_page",
                              "--budget-s", "100"])
    assert code == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    skipped = report["sections"]["bench"]
    assert skipped["status"] == "skipped" and skipped["over_budget"] is True
    assert (skipped["reason"].startswith("over budget: needs ~215 s (estimate on an H200), ")
            and "of --budget-s 100" in skipped["reason"])
    assert [name for name, _ in seen] == ["environment", "zero_page"] and all(seconds <= 100 for _, seconds in seen)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "gpu_check on cpu: 2 passed, 1 skipped (1 over budget)."
    summary = out[out.index(next(line for line in out if line.startswith("section "))):]
    assert len(summary) <= 20 and all(len(line) <= 180 for line in summary)
    assert any(line.startswith("environment") and "ran environment" in line for line in summary)
    assert any(line.startswith("bench") and "over budget" in line for line in summary)

    seen.clear()  # started 95 s ago: 5 s left, nothing fits
    code = runner.check_main(["--device", "cpu", "--out", str(tmp_path), "--sections", "environment", "--budget-s", "100"],
                       started=time.monotonic() - 95)
    assert (code == 0 and seen == []
            and "over budget" in json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["environment"]["reason"])
    with pytest.raises(SystemExit):
        runner.parse_args(["--budget-s", "0"])


def test_gpu_check_a_timed_out_section_takes_the_processes_it_started_with_it(tmp_path):
    """At its time limit a section's process is killed with its children (a benchmark's server,
    pytest's workers), so nothing is left holding the GPU for the next section."""
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(60)")
    done = run_process([sys.executable, "-c", script], timeout=3)
    assert done.returncode is None and done.ended == "timed out after 3 s" and "started" in done.stdout
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # the kill is immediate; its reaping by init may take a moment
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {grandchild} outlived its section")


def test_gpu_check_isolates_a_crashing_section_and_fails_the_run(tmp_path, monkeypatch, capsys):
    """A section whose process dies is recorded with the exit and its last output, the JSON is
    rewritten after every section, the next sections still run, and the exit status is 1."""
    seen = []
    passing = _passing_worker(tmp_path, [])

    def command(name, args, seconds):
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text())["sections"] if seen else {})
        if name == "decode":
            return [sys.executable, "-c", "import os; print('RuntimeError: the cause'); "
                    "print('frame\\n' * 1000 + 'about to crash', flush=True); os.abort()"]
        return passing(name, args, seconds)

    monkeypatch.setattr(runner, "worker_command", command)
    code = runner.check_main(["--device", "cpu", "--out", str(tmp_path), "--sections", "environment", "decode", "map_unmap"])
    assert code == runner.EXIT_FAILED
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [report["sections"][s]["status"] for s in ("environment", "decode", "map_unmap")] == ["passed", "failed", "passed"]
    crash = report["sections"]["decode"]
    assert "killed by SIGABRT" in crash["error"] and "about to crash" in crash["output_tail"]
    assert (crash["first_errors"] == ["RuntimeError: the cause"]
            and "the cause" not in crash["output_tail"])  # frames pushed it out
    assert list(seen[2]) == ["environment", "decode"]  # written before the third section started
    assert "1 FAILED: decode (the section's process killed by SIGABRT" in capsys.readouterr().out.strip().splitlines()[-1]
    timed_out = runner.collect([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "never.json", timeout=0.5)
    assert timed_out["status"] == "failed" and "timed out after" in timed_out["error"]


@needs_no_cuda
def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        runner.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert done.value.code == 0 and "Exit status" in help_text and "vllm_slots" in help_text and "--budget-s" in help_text
    code = runner.check_main(["--out", str(tmp_path / "out")])  # no arguments but the output folder
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == runner.EXIT_NO_GPU == 3 and len(lines) == 1
    assert lines[0].startswith("gpu_check: no CUDA GPU here (torch ") and not (tmp_path / "out").exists()


# ---- each section's verdicts ------------------------------------------------------------------
def test_gpu_check_sections_that_need_no_process_of_their_own(tmp_path):
    cpu = torch.device("cpu")
    env = core.environment_section(smoke())
    assert env["selected_contiguous_kernel"] == "sdpa_adaptive" and "cuda-bindings" in env["packages"]
    assert set(env["optional_packages"]) == {"flash-attn", "FlashInfer", "vLLM", "triton"}
    row = core.decode_section(smoke(kernels=["sdpa_per_sequence"]))["kernels"]["sdpa_per_sequence"]
    assert row["max_abs_diff"] == 0.0 and row["vmm_over_dense"] > 0  # same kernel, same bytes
    mapping = core.map_unmap_section(smoke())
    assert mapping["backend"] == "host" and mapping["map_us"]["median"] > 0
    assert core.map_unmap_headline(mapping).startswith("map ")
    paged = kernels.paged_vs_vmm_section(smoke())
    assert paged["candidates"]["blocks16:gather_sdpa"]["max_abs_err_vs_fp32_reference"] < 1e-5 and not paged["failures"]
    with pytest.raises(SectionSkipped, match="needs a CUDA device"):
        vllm_engine.vllm_section(smoke(out=tmp_path))
    with pytest.raises(SectionSkipped, match="addressing comparison inside vLLM on CUDA needs a CUDA device"):
        vllm_engine.vllm_addressing_section(smoke(out=tmp_path))
    assert vllm_engine.vllm_unavailable(cpu, True) == "vLLM on the GPU needs a CUDA device"


def test_gpu_check_decode_fails_a_kernel_off_the_reference(monkeypatch):
    """A kernel 0.01 off the fp32 reference (fp32 data: 100x the tolerance) fails the section;
    the right kernels do not."""
    def off(q, k_cache, v_cache, plan, scale):
        return sdpa_per_sequence(q, k_cache, v_cache, plan, scale) + 0.01

    register_kernel(monkeypatch, "test_off", off)
    result = core.decode_section(smoke(kernels=["sdpa_per_sequence", "test_off"]))
    assert result["tolerance"] == TOLERANCE["float32"]
    assert result["kernels"]["test_off"]["max_abs_err_vs_fp32_reference"] == pytest.approx(0.01, rel=1e-3)
    assert (len(result["failures"]) == 1
            and result["failures"][0].startswith("test_off: max |output - fp32 reference| 0.01 > 0.0001"))
    assert not core.decode_section(smoke(kernels=["sdpa_per_sequence"]))["failures"]


def test_gpu_check_paged_vs_vmm_fails_a_kernel_that_disagrees(monkeypatch):
    from vmkv.kernels.paged import GatherSDPA

    class Off(GatherSDPA):  # gather_sdpa, 0.01 off
        def run(self, *args):
            return super().run(*args) + 0.01

    register_kernel(monkeypatch, "gather_sdpa", lambda q, k, v, plan, scale: Off().run(q, k, v, plan, None, scale), "blocks")
    result = kernels.paged_vs_vmm_section(smoke())
    assert result["candidates"]["blocks16:gather_sdpa"]["max_abs_err_vs_fp32_reference"] == pytest.approx(0.01, rel=1e-3)
    assert [f.rpartition(": max")[0] for f in result["failures"]] == ["blocks16:gather_sdpa"]
    assert "> 0.0001 (float32)" in result["failures"][0]


def test_gpu_check_paged_vs_vmm_measures_the_triton_kernel_on_both_addressings(tmp_path):
    """The dry run in Triton's interpreter: the Triton kernel over slots and over block tables,
    right against the fp32 reference, the translation ratio and the verdicts stated."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, SCRIPT, "--device", "cpu", "--smoke", "--out", str(tmp_path), "--sections", "paged_vs_vmm"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    entry = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["paged_vs_vmm"]
    result = entry["result"]
    assert entry["status"] == "passed" and {"slots:triton", "blocks16:triton"} <= set(result["candidates"])
    assert set(result["ratios"]) >= {"slots_share_of_bandwidth", "blocks16_over_slots", "best_paged_over_vmm"}
    assert any("block" in line for line in result["verdicts"]) and result["splits"]["chosen"] >= 1


def test_gpu_check_vllm_section_fails_a_failed_smoke(monkeypatch, tmp_path):
    """gpu_smoke reports "passed" (vmkv_bench/gpu/vllm_smoke.py): passed=False fails the section
    with the reasons, through the worker as gpu_check runs it; passed=True passes; no "passed" fails."""
    import importlib.util

    answer: dict = {}
    monkeypatch.setattr(vllm_engine, "gpu_smoke", lambda out_dir: dict(answer))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))

    def worker() -> dict:
        runner.run_worker(runner.parse_args(["--worker", "vllm", "--device", "cuda", "--out", str(tmp_path)]))
        return json.loads(runner.section_file(tmp_path, "vllm").read_text())

    answer.update(passed=False, tokens_identical=False, kv_peak_mapped_bytes=512 * MiB, kv_buffer_bytes=512 * MiB)
    entry = worker()
    assert entry["status"] == "failed", entry
    assert "other tokens than stock vLLM" in entry["error"] and "mapped 512 MiB at peak" in entry["error"]
    answer.update(passed=True, tokens_identical=True, kv_peak_mapped_bytes=8 * MiB)
    assert worker()["status"] == "passed"
    assert vllm_engine.vllm_headline(dict(answer)) == "tokens identical to stock: True, KV mapped at peak 8 of 512 MiB"
    answer.clear()
    answer["ok"] = True  # not gpu_smoke's contract
    assert "no 'passed'" in worker()["error"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM 0.32 not installed")
@needs_no_cuda
def test_gpu_check_vllm_smoke_says_why_it_cannot_run_here(tmp_path):
    with pytest.raises(vmkv.BackendUnavailable, match="needs a CUDA GPU"):
        vllm_smoke.gpu_smoke(tmp_path)
    assert not any(tmp_path.iterdir())  # refused before writing anything


def test_gpu_check_vllm_smoke_passes_only_when_tokens_and_prefix_hits_match_stock():
    # the smoke keeps vmkv's default max_cached: prefix-cached pages stay mapped for the second pass
    assert PluginConfig.from_extra_config(vllm_smoke.VMKV_OPTIONS).max_cached is None
    tokens = {"0": [5, 6], "1": [7]}
    stock = {"tokens": tokens, "again": tokens, "cached": {"0": 288, "1": 288}}
    ours = {**stock, "peak_mapped": 2**20}
    assert vllm_smoke.verdict(stock, ours, 2**29)["passed"]
    for change, failed in [({"cached": {"0": 288, "1": 0}}, "prefix_hits_identical"),
                           ({"again": {"0": [5, 6], "1": [8]}}, "tokens_identical"),
                           ({"peak_mapped": 2**29}, "passed")]:
        result = vllm_smoke.verdict(stock, {**ours, **change}, 2**29)
        assert not result[failed] and not result["passed"], change
    nothing = {**stock, "cached": {"0": 0, "1": 0}}  # no hit anywhere: prefix caching went untested
    assert not vllm_smoke.verdict(nothing, {**nothing, "peak_mapped": 1}, 2**29)["passed"]


def test_gpu_check_addressing_fails_on_a_wrong_cache_and_headlines_the_ratio():
    """The CUDA addressing run (section vllm_addressing) fails when the paged backing's tokens
    differ at all or contiguous mode's first token does; later contiguous differences (bf16
    near-ties) pass; the verdict line carries contiguous over stock with its rounds."""
    def row(engine, identical, first, round_=0):
        return {"round": round_, "engine": engine, "tokens_identical": identical, "first_divergence": first}

    assert vllm_engine.addressing_failures([row("stock", True, -1), row("paged", True, -1), row("contiguous", False, 17)]) == []
    failures = vllm_engine.addressing_failures([row("paged", False, 3), row("contiguous", False, 0, 1)])
    assert failures == ["round 0: the paged backing's tokens differ from stock's at position 3",
                        "round 1: contiguous mode's first token differs from stock's"]
    summary = {"contiguous_over_stock": [0.9, 1.1, 1.2], "contiguous_kernels": ["flash_attn_with_kvcache"]}
    report = {"device": "cuda:0", "sections": {"vllm_addressing": {"status": "passed", "result": {"summary": summary}}}}
    assert runner.verdict(report).endswith("inside vLLM contiguous mode (flash_attn_with_kvcache) runs at 1.10x stock "
                                           "output tokens/s (rounds 0.90-1.20).")
    assert vllm_engine.vllm_addressing_headline({"summary": summary}) == "contiguous 1.10x stock tokens/s (rounds 0.90-1.20)"


def test_gpu_check_verdict_headlines_the_caches_own_kernel():
    kernels = {"sdpa_per_sequence": {"vmm_over_dense": 1.30}, "varlen_attn_seqused": {"vmm_over_dense": 1.02},
               "flash_attn_varlen": {"vmm_over_dense": 0.97}}
    report = {"device": "cuda:0", "sections": {"decode": {"status": "passed", "result": {
        "cache_kernel": "varlen_attn_seqused", "kernels": kernels}}}}
    line = runner.verdict(report)
    assert line.endswith("costs 1.02x dense with varlen_attn_seqused, the cache's kernel (1.00 = free).")
    kernels["varlen_attn_seqused"] = {"skipped": "needs flash"}
    assert "the cache's kernel varlen_attn_seqused was not timed (needs flash)" in runner.verdict(report)
    assert core.decode_headline(report["sections"]["decode"]["result"]).startswith(
        "the cache's kernel varlen_attn_seqused was not timed")


def test_gpu_check_bench_records_the_suites_exit_and_verdicts(tmp_path, monkeypatch):
    """The main job's exit status decides; each benchmark's status and verdicts are recorded from
    its suite.json (a stale one from an earlier run is not read); a suite past its time is
    killed and says so."""
    assert runner.bench_command(torch.device("cuda", 0), tmp_path / "bench", smoke=False)[1:] == [
        "-m", "vmkv.cli", "bench", "--device", "cuda", "--out", str(tmp_path / "bench")]
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "suite.json").write_text(json.dumps({"records": [{"name": "stale", "status": "ok"}]}))
    records = [{"name": "memory", "status": "ok", "seconds": 3.0, "verdicts": [{"question": "q", "result": "r", "winner": "vmm",
                                                                                 "reliable": True, "note": "dropped"}]},
               {"name": "mapping", "status": "failed", "reason": "InvalidConfig: page_size 4096 ..."}]
    writes = (f"import json, pathlib; pathlib.Path({str(tmp_path / 'bench' / 'suite.json')!r}).write_text("
              f"json.dumps({{'records': {records!r}}})); raise SystemExit(1)")
    monkeypatch.setattr(runner, "bench_command", lambda device, out, smoke: [sys.executable, "-c", writes])
    result = runner.bench_section(Context(torch.device("cuda"), False, tmp_path, deadline=time.monotonic() + 70))
    assert list(result["benchmarks"]) == ["memory", "mapping"]
    assert result["benchmarks"]["memory"]["verdicts"] == [{"question": "q", "result": "r", "winner": "vmm", "reliable": True}]
    assert result["failures"] == ["vmkv bench exit status 1; not ok: mapping"]
    assert runner.bench_headline(result).startswith("exit status 1: 1 of 2 benchmarks ok, 1 verdicts")
    monkeypatch.setattr(runner, "bench_command", lambda device, out, smoke: [sys.executable, "-c", "import time; time.sleep(30)"])
    slow = runner.bench_section(Context(torch.device("cuda"), False, tmp_path, deadline=time.monotonic() + 10.5))
    assert (slow["returncode"] is None and slow["failures"][0].startswith("vmkv bench timed out after")
            and slow["benchmarks"] == {})


# ---- shared_budget: where the device memory goes ---------------------------------------------
class _Scripted(DeviceMemory):
    """Device memory that reads what a test scripted: one value per sample, torch's count 0."""

    def __init__(self, values: list[int]) -> None:
        super().__init__("cpu")
        self.values = list(values)

    def sample(self) -> MemorySample:
        return MemorySample(self.values.pop(0), 0)

    def settle(self) -> None:
        pass


def test_gpu_check_shared_budget_fails_when_the_device_holds_more_than_budget_and_overhead():
    """Samples per round: start, the four stages, closed. Growth that stays after the warm-up
    closed everything is the context's (reported, not held against vmkv); growth in the
    measured round beyond the budget fails, and so does memory not given back at close."""
    big = 10**9  # far beyond the smoke budget (a few hundred KiB)
    warm = [0, 0, 0, 0, 0, big]  # the context grew during the warm-up and kept it
    result = shared_budget_section(smoke(), _Scripted(warm + [big] * 6))
    assert result["failures"] == [] and result["overhead"]["context_growth_bytes"] == big
    assert result["device_bytes_used"] == 0
    result = shared_budget_section(smoke(), _Scripted(warm + [big, big, big, big, 2 * big, big]))
    assert result["failures"] == ["device_memory_within_the_budget"] and result["device_bytes_used"] == big
    assert memory.shared_budget_headline(result).startswith("device +954 MiB for a 0 MiB budget")
    result = shared_budget_section(smoke(), _Scripted(warm + [big] * 5 + [big + 1]))
    assert result["failures"] == ["device_memory_given_back_at_close"]


def test_gpu_check_shared_budget_on_the_fake_driver_counts_every_byte(fake_cuda_backends, fake):  # noqa: F811
    """Both rounds on the CUDA backend over the fake driver: after every stage the stores'
    ``resident_bytes`` equals what the driver created minus what it released (its call log) and
    the device memory it reports in use, zero pages included (one a store); nothing is left once
    the caches are closed, and the section's device checks hold with nothing beyond the stores."""
    counted: list[int] = []

    class Counting(DeviceMemory):
        def sample(self) -> MemorySample:
            counted.append(fake.created_minus_released())
            return super().sample()

    result = shared_budget_section(smoke(), Counting("cuda:0", runtime=fake_cuda_backends.runtime))
    assert result["failures"] == [] and len(fake_cuda_backends) == 4  # two caches, two rounds
    page = fake_cuda_backends[0].page_size
    for stages in result["rounds"].values():
        for row in stages:
            assert row["driver"] == row["vmkv_resident"] and row["beyond"] == 0 and row["torch"] == 0, row
        assert stages[0]["vmkv_resident"] == 2 * page  # opened on demand: the zero pages only
        assert stages[-1]["vmkv_resident"] == 0
    assert counted == [0, *(row["vmkv_resident"] for row in result["rounds"]["warmup"]),
                       0, *(row["vmkv_resident"] for row in result["rounds"]["measured"])]
    assert result["overhead"]["zero_pages_bytes"] == 2 * page and result["overhead"]["driver_beyond_stores_bytes"] == 0
    assert fake.state()["memory_used"] == 0


# ---- vllm_slots: contiguous mode's parts without vLLM -----------------------------------------
def test_gpu_check_vllm_slots_on_the_fake_cuda_driver(fake_cuda_backends, fake, monkeypatch):  # noqa: F811
    """On the CUDA backend (all-layers slots, vLLM's block-outermost buffer): every check holds,
    the driver's access flags match the slots, every driver call of a map and a free fails once
    and is undone; nothing is left behind (the fixture checks)."""
    from vmkv.vm.cuda import CudaVirtualMemory, cuda_granularity

    runtime = fake_cuda_backends.runtime
    monkeypatch.setattr(slots, "open_backend",
                        lambda device, page, pages: CudaVirtualMemory(page, pages, device="cuda:0", runtime=runtime))
    monkeypatch.setattr(slots, "granularity", lambda device: cuda_granularity("cuda:0", runtime=runtime))
    result = slots.vllm_slots_section(smoke())
    assert result["failures"] == [] and result["backend"] == "cuda", result["checks"]
    assert (result["vllm_layout"], result["slot_layout"]) == ("BLHNC", "all_layers")
    assert result["checks"]["driver_access_matches_the_slots"] is True
    for outcome in result["rollback"].values():
        assert outcome["unit"] == "driver call" and outcome["calls"] >= 20
    assert [c for c in fake.calls() if not c.ok and "OUT_OF_MEMORY" in c.result] == []  # injected failures never reach the driver
    assert slots.vllm_slots_headline(result).startswith(f"{len(result['checks'])}/{len(result['checks'])} checks hold; ")


def test_gpu_check_vllm_slots_catches_a_rollback_that_does_not_undo(monkeypatch):
    """A slot space whose undo does nothing fails the rollback check: a failed map leaves blocks
    mapped in a slot that says it holds none."""
    from vmkv.vllm.contiguous.slots import SlotSpace

    monkeypatch.setattr(SlotSpace, "_undo", lambda self, exc, done, call, args: exc)
    result = slots.vllm_slots_section(smoke())
    assert "every_failing_map_is_undone" in result["failures"] and result["rollback"]["map"]["not_undone"]
