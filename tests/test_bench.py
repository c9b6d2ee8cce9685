"""The benchmark suite and the ``vmkv`` command: every benchmark of benchmarks/{memory,decode,
mapping,sharing}.py runs in smoke mode (tiny sizes) and its JSON must follow the module contract;
``vmkv info`` and ``vmkv bench --smoke <name>`` must work end to end."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common
from vmkv import cli

MINE = ["memory", "decode", "mapping", "sharing"]


def _args(module, tmp_path: Path, argv: list[str] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(list(argv))
    args.device, args.smoke, args.seed, args.out, args.progress = "cpu", True, 0, tmp_path, False
    return args


def _check_contract(result: dict, name: str) -> None:
    assert result["name"] == name
    json.dumps(result)  # JSON-serialisable as returned
    assert set(result) >= {"name", "schema", "rows", "summary"}
    assert result["rows"], "a benchmark must produce rows"
    for row in result["rows"]:
        assert set(row) == set(result["schema"]), f"row fields {sorted(row)} != schema {sorted(result['schema'])}"
        for value in row.values():
            assert not (isinstance(value, float) and math.isnan(value))


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory) -> dict[str, dict]:
    """Each of this suite's benchmarks run once in smoke mode (shared by the tests below)."""
    out = tmp_path_factory.mktemp("bench")
    results = {}
    for name in MINE:
        module = importlib.import_module(f"benchmarks.{name}")
        results[name] = module.run(_args(module, out))
    return results


@pytest.mark.parametrize("name", MINE)
def test_smoke_result_follows_the_contract(smoke_results, name, tmp_path):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.NAME == name and module.DESCRIPTION
    result = smoke_results[name]
    _check_contract(result, name)
    path = common.write_json(result, tmp_path)
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    if hasattr(module, "plot"):
        for png in module.plot(result, tmp_path):
            assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_orders_the_allocators(smoke_results):
    rows = {(r["trace"], r["allocator"]): r for r in smoke_results["memory"]["rows"]}
    for trace in ("sharegpt", "alpaca"):
        static, paged = rows[(trace, "static-max")], rows[(trace, "paged-b16")]
        one_token = rows[(trace, "vmm-all-64KiB")]  # Llama-3-8B, all layers: 64 KiB is one token a page
        assert one_token["tokens_per_page"] == 1 and one_token["steady_util"] > 0.99
        assert paged["tokens_per_page"] == 16
        assert static["steady_util"] < paged["steady_util"] <= 1.0
        assert static["max_running"] <= paged["max_running"]
        # the same page geometry gives the same answer whatever the layout
        assert rows[(trace, "vmm-layer-64KiB")]["steady_util"] == pytest.approx(rows[(trace, "vmm-all-2MiB")]["steady_util"])


def test_decode_outputs_agree_and_times_are_positive(smoke_results):
    result = smoke_results["decode"]
    assert result["summary"]["max_abs_diff"] < 1e-4
    assert result["summary"]["kernels"]["vmm"] == "sdpa_adaptive"
    assert result["summary"]["read_bandwidth_gbps"] > 0
    assert all(r["vmm_ms"] > 0 and r["paged_ms"] > 0 and r["dense_ms"] > 0 for r in result["rows"])
    assert {"gather_sdpa", result["summary"]["kernels"]["paged_selected"]} == {r["paged_kernel"] for r in result["rows"]}


def test_mapping_measures_every_part(smoke_results):
    rows = smoke_results["mapping"]["rows"]
    measures = {r["measure"] for r in rows}
    assert measures == {"map_us", "unmap_us", "reserve_64GiB_ms", "decode_share"}
    assert all(r["value"] > 0 for r in rows if r["measure"] != "decode_share")
    assert {r["map_ahead"] for r in rows if r["measure"] == "decode_share"} == {True, False}


def test_sharing_saves_memory_only_with_small_pages(smoke_results):
    rows = {(r["scenario"], r["allocator"]): r for r in smoke_results["sharing"]["rows"]}
    for scenario in ("parallel", "beam"):
        assert rows[(scenario, "paged-b16")]["saved"] > 0.05
        # 1024-token pages: a short request fits one page, and every write copies it
        assert rows[(scenario, "vmm-layer-2MiB")]["saved"] < rows[(scenario, "paged-b16")]["saved"]
    assert rows[("beam", "paged-b16")]["cow_copies"] > 0


def test_trace_means_match_the_papers():
    for kind, spec in common.TRACES.items():
        stats = common.trace_stats(common.make_trace(kind, 4000, seed=1, max_len=2048))
        assert stats["mean_input"] == pytest.approx(spec["input_mean"], rel=0.1)
        assert stats["mean_output"] == pytest.approx(spec["output_mean"], rel=0.1)
    assert common.make_trace("alpaca", 5, 3, 64) == common.make_trace("alpaca", 5, 3, 64)


def test_format_table_markdown():
    text = common.format_table([{"a": 1, "b": 0.5}, {"a": 22, "b": 1234567.0}], markdown=True)
    assert text.splitlines()[:2] == ["| a | b |", "|---|---|"]
    assert "1.23e+06" in text


# ---- the CLI ---------------------------------------------------------------------------------
def test_cli_info_names_backends_and_kernels(capsys):
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "host  available; granularity" in text
    assert "cuda  " in text  # available, or unavailable with the reason
    assert "sdpa_adaptive" in text and "blockwise_online_softmax" in text


def test_cli_bench_one_smoke_writes_json_report_and_plot(tmp_path, capsys):
    status = cli.main(["bench", "--smoke", "--no-progress", "sharing", "--allocators", "paged-b16", "--out", str(tmp_path)])
    assert status == 0
    result = json.loads((tmp_path / "sharing.json").read_text())
    _check_contract(result, "sharing")
    assert (tmp_path / "sharing_saved.png").exists()
    assert "## sharing" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "suite.json").read_text())["records"][0]["status"] == "ok"
    assert "saved" in capsys.readouterr().out


def test_cli_registry_lists_colleagues_and_reports_a_missing_module(tmp_path, monkeypatch, capsys):
    assert {"generate", "serve", *MINE} <= set(cli.REGISTRY)
    broken = cli.Entry("broken", "benchmarks.does_not_exist")
    monkeypatch.setattr(cli, "REGISTRY", {"broken": broken, "mapping": cli.REGISTRY["mapping"]})
    status = cli.main(["bench", "--smoke", "--no-plots", "--no-progress", "--out", str(tmp_path)])
    assert status == 1  # one benchmark did not run ...
    records = json.loads((tmp_path / "suite.json").read_text())["records"]
    assert [r["status"] for r in records] == ["unavailable", "ok"]  # ... and the others did
    assert "benchmarks.does_not_exist could not be imported" in capsys.readouterr().err


def test_cli_unknown_benchmark_and_unavailable_device(tmp_path, capsys):
    assert cli.main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        status = cli.main(["bench", "--device", "cuda", "--no-plots", "--out", str(tmp_path), "mapping"])
        assert status == 1
        assert "torch sees no CUDA GPU" in capsys.readouterr().err


def test_vmkv_command_runs_as_a_process_and_lists_module_options():
    done = subprocess.run([sys.executable, "-m", "vmkv.cli", "bench", "decode", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--batches" in done.stdout and "--smoke" in done.stdout


def test_cli_list_names_every_benchmark(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("generate", "serve", *MINE))


def test_cli_serve_delegates_to_the_server_cli(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vmkv serve") and "--kv-mode" in out


def _cuda_unavailable() -> str:
    """Why the CUDA backend cannot run here ('' when it can)."""
    try:
        cli._cuda_granularity()
    except Exception as exc:  # noqa: BLE001 - the reason becomes the skip message
        return f"{type(exc).__name__}: {exc}"
    return ""


@pytest.mark.gpu
@pytest.mark.parametrize("name", MINE)
def test_smoke_on_cuda(name, tmp_path):
    why = _cuda_unavailable()
    if why:
        pytest.skip(f"needs the CUDA backend: {why}")
    module = importlib.import_module(f"benchmarks.{name}")
    args = _args(module, tmp_path)
    args.device = "cuda"
    _check_contract(module.run(args), name)
