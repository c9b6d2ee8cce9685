"""Stock vLLM vs vLLM + vmkv under vLLM's own benchmark client against both OpenAI servers, rounds
interleaved: output tokens/s and TTFT ratios per request rate (``vmkv bench vllm --parts client``)."""

from __future__ import annotations

import contextlib
import io
import math
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from . import common

SETTLE_S = 1.5  # vLLM's workers busy-poll their queue for 1 s after a step: let the idle engine go quiet
WARMUP_PROMPTS = 8  # a first short run per engine, not measured (lazy initialisation in both)
THROUGHPUT_TARGET = 0.97
TTFT_TARGET = 1.10  # vmkv's mean TTFT at most 10 % above stock's
CONFIDENCE = 0.9  # of the bootstrap interval of the engines' medians

SCHEMA = {
    "rate": "request rate of the open-loop client (requests/s, as text; inf: all at once)",
    "round": "interleaving round (engines take turns within a round, order alternating)",
    "engine": "stock (vLLM's KV buffer) or vmkv (pages mapped on demand)",
    "requests": "requests sent",
    "completed": "requests served",
    "output_tokens": "tokens generated",
    "duration_s": "seconds from the first request to the last response",
    "output_tok_per_s": "output tokens per second",
    "mean_ttft_ms": "mean time to first token (ms)",
    "median_ttft_ms": "median time to first token (ms)",
    "mean_tpot_ms": "mean time per output token after the first (ms)",
    "texts_identical": "generated text equal to the other engine's, every prompt of the round",
}


def parse_rates(text: str) -> list[float]:
    """``"inf,16"`` -> ``[inf, 16.0]``."""
    import vmkv

    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise vmkv.InvalidInput(f"request rate {part.strip()!r}: expected a positive number or 'inf'")
        rates.append(rate)
    return rates


def client_args(base_url: str, model: Path, *, prompts: int, rate: float, input_len: int, output_len: int,
                seed: int) -> list[str]:
    """vLLM's client arguments for one run (the issue's command, greedy, texts kept for comparison)."""
    return ["--base-url", base_url, "--model", str(model), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(prompts), "--request-rate", str(rate), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--save-detailed", "--disable-tqdm"]


def run_client(argv: Sequence[str]) -> dict[str, Any]:
    """Run vLLM's benchmark client with ``argv`` in this process; its printout is dropped."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(list(argv))
    with contextlib.redirect_stdout(io.StringIO()):
        return serve.main(args)


def measure(settings: dict[str, Any], model: Path, kv_bytes: int, options: dict[str, Any], seed: int,
            log_dir: Path | None = None) -> dict[str, Any]:
    """Start both servers, run the client at every rate for every round (interleaved)."""
    from vmkv_bench.vllm_harness import drive

    specs = {"stock": drive.ServerSpec(vmkv=False), "vmkv": drive.ServerSpec(vmkv=True, options=options)}
    rows, texts = [], {}
    with drive.servers(model, specs, kv_cache_bytes=kv_bytes, max_model_len=settings["max_model_len"],
                       log_dir=log_dir) as urls:
        for url in urls.values():
            run_client(client_args(url, model, prompts=WARMUP_PROMPTS, rate=math.inf, input_len=settings["input_len"],
                                   output_len=settings["output_len"], seed=seed))
        for round_ in range(settings["rounds"]):
            for rate in settings["rates"]:
                for name in (["stock", "vmkv"] if round_ % 2 == 0 else ["vmkv", "stock"]):
                    time.sleep(SETTLE_S)
                    out = run_client(client_args(urls[name], model, prompts=settings["prompts"], rate=rate,
                                                 input_len=settings["input_len"], output_len=settings["output_len"],
                                                 seed=seed + round_))
                    texts[(rate_key(rate), round_, name)] = out.get("generated_texts")
                    rows.append(_row(rate_key(rate), round_, name, settings["prompts"], out))
    for row in rows:
        other = "vmkv" if row["engine"] == "stock" else "stock"
        mine, theirs = texts[(row["rate"], row["round"], row["engine"])], texts[(row["rate"], row["round"], other)]
        row["texts_identical"] = mine is not None and mine == theirs
    config = {**settings, "rates": [rate_key(r) for r in settings["rates"]], "kv_bytes": kv_bytes, **options, "client": "vllm.benchmarks.serve (vllm bench serve)"}
    return {"schema": SCHEMA, "rows": rows, "summary": summary(rows), "config": config}


def _row(rate: str, round_: int, engine: str, prompts: int, out: dict[str, Any]) -> dict[str, Any]:
    # the client computes with numpy: plain numbers here, so the JSON and the verdicts see floats
    return {
        "rate": rate, "round": round_, "engine": engine, "requests": prompts, "completed": int(out["completed"]),
        "output_tokens": int(out["total_output_tokens"]), "duration_s": float(out["duration"]),
        "output_tok_per_s": float(out["output_throughput"]), "mean_ttft_ms": float(out["mean_ttft_ms"]),
        "median_ttft_ms": float(out["median_ttft_ms"]), "mean_tpot_ms": float(out["mean_tpot_ms"]), "texts_identical": False,
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rate: the per-round and pooled ratios, the engines' medians, same tokens and texts, each
    target's status, and a verdict line saying all of it."""
    out: dict[str, Any] = {}
    for rate in dict.fromkeys(r["rate"] for r in rows):
        by = {(r["round"], r["engine"]): r for r in rows if r["rate"] == rate}
        rounds = sorted({r for r, _ in by})
        throughput = [by[(i, "vmkv")]["output_tok_per_s"] / by[(i, "stock")]["output_tok_per_s"] for i in rounds]
        ttft = [by[(i, "stock")]["mean_ttft_ms"] / by[(i, "vmkv")]["mean_ttft_ms"] for i in rounds]
        mine = [r for r in by.values()]
        same_tokens = all(r["completed"] == r["requests"] and r["output_tokens"] == mine[0]["output_tokens"] for r in mine)
        identical = all(r["texts_identical"] for r in mine)
        t, f = common.Spread.of(throughput), common.Spread.of(ttft)
        pooled_throughput, pooled_ttft = pooled([r for r in rows if r["rate"] == rate])
        throughput_target = common.target_status(t, THROUGHPUT_TARGET)
        ttft_target = common.target_status(f, 1 / TTFT_TARGET)
        mt, mf = medians(by, rounds)
        medians_throughput_target = common.target_status(mt, THROUGHPUT_TARGET, "interval")
        medians_ttft_target = common.target_status(mf, 1 / TTFT_TARGET, "interval")
        out[rate] = {
            "throughput_ratios_vmkv_over_stock": throughput, "ttft_ratios_stock_over_vmkv": ttft,
            "pooled_throughput_vmkv_over_stock": pooled_throughput, "pooled_ttft_vmkv_over_stock": pooled_ttft,
            "throughput_target": throughput_target, "ttft_target": ttft_target,
            "medians_throughput_vmkv_over_stock": mt.as_dict(), "medians_ttft_stock_over_vmkv": mf.as_dict(),
            "medians_throughput_target": medians_throughput_target, "medians_ttft_target": medians_ttft_target,
            "same_tokens": same_tokens, "texts_identical": identical,
            "verdict": (f"at rate {rate}: vmkv {t.value:.2f}x stock output tokens/s (median of {t.runs} "
                        f"interleaved rounds, {_range_words(t)} {t.low:.2f}-{t.high:.2f}, vmkv faster in "
                        f"{sum(x > 1 for x in throughput)} of {t.runs}; pooled {pooled_throughput:.2f}x): target >= "
                        f"{THROUGHPUT_TARGET} {throughput_target}; mean TTFT {1 / f.value:.2f}x stock's ({_range_words(f)} "
                        f"{1 / f.high:.2f}-{1 / f.low:.2f}; pooled {pooled_ttft:.2f}x): target <= {TTFT_TARGET} "
                        f"{ttft_target}; the engines' medians over the rounds: vmkv {mt.value:.2f}x stock's output "
                        f"tokens/s ({CONFIDENCE:.0%} interval {mt.low:.2f}-{mt.high:.2f}): target {medians_throughput_target}, "
                        f"mean TTFT {1 / mf.value:.2f}x stock's ({1 / mf.high:.2f}-{1 / mf.low:.2f}): target "
                        f"{medians_ttft_target}; {'same tokens' if same_tokens else 'TOKEN COUNTS DIFFER'}, "
                        f"texts {'identical' if identical else 'DIFFER'}"),
        }
    return out


def pooled(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Over every round of ``rows`` (one rate): ``(vmkv / stock output tokens per second of all rounds
    together -- all tokens over all durations --, vmkv / stock mean TTFT averaged over the rounds)``."""
    def engine(name: str) -> tuple[float, float]:
        mine = [r for r in rows if r["engine"] == name]
        return (sum(r["output_tokens"] for r in mine) / sum(r["duration_s"] for r in mine),
                statistics.fmean(r["mean_ttft_ms"] for r in mine))

    (stock_tok_s, stock_ttft), (vmkv_tok_s, vmkv_ttft) = engine("stock"), engine("vmkv")
    return vmkv_tok_s / stock_tok_s, vmkv_ttft / stock_ttft


def medians(by: dict[tuple[int, str], dict[str, Any]], rounds: list[int]) -> tuple[common.Spread, common.Spread]:
    """The engines' medians over the rounds, compared with bootstrap intervals: robust to the rounds that
    stall in either engine, which set per-round ratios."""
    def values(engine: str, key: str) -> list[float]:
        return [by[(i, engine)][key] for i in rounds]

    return (common.ratio_of_medians(values("vmkv", "output_tok_per_s"), values("stock", "output_tok_per_s"),
                                    confidence=CONFIDENCE),
            common.ratio_of_medians(values("stock", "mean_ttft_ms"), values("vmkv", "mean_ttft_ms"), confidence=CONFIDENCE))


def _range_words(spread: common.Spread) -> str:
    return "range" if spread.kept == spread.runs else f"range of the middle {spread.kept}"


def rate_key(rate: float) -> str:
    """A rate as rows and verdict keys name it: ``"inf"``, ``"16"``."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def verdicts(client: dict[str, Any]) -> list[common.Verdict]:
    """Two answers per rate: what the plugin costs in output tokens/s and in time to first token."""
    out = []
    for key, s in client["summary"].items():
        note = ("same tokens" if s["same_tokens"] else "TOKEN COUNTS DIFFER") + (
            ", texts identical" if s["texts_identical"] else ", TEXTS DIFFER")
        throughput = common.Spread.of(s["throughput_ratios_vmkv_over_stock"])
        ttft = common.Spread.of(s["ttft_ratios_stock_over_vmkv"])
        out.append(common.ratio_verdict(
            f"vllm.client_{key}.throughput", f"vLLM's client at rate {key}: output tokens/s, vmkv over stock",
            throughput, "vmkv", "stock", target=THROUGHPUT_TARGET, note=note))
        out.append(common.ratio_verdict(
            f"vllm.client_{key}.ttft", f"vLLM's client at rate {key}: mean TTFT, stock over vmkv (> 1: vmkv faster)",
            ttft, "vmkv", "stock", reference=f"target >= {1 / TTFT_TARGET:.2f} (vmkv within 10 %)",
            target=1 / TTFT_TARGET, note=note))
    return out


def table(client: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    rows = client["rows"]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        for engine in ("stock", "vmkv"):
            mine = [r for r in rows if r["rate"] == rate and r["engine"] == engine]
            out.append({"workload": f"vLLM client, rate {rate}", "engine": engine, "rounds": len(mine),
                        "output tok/s": statistics.median(r["output_tok_per_s"] for r in mine),
                        "mean TTFT ms": statistics.median(r["mean_ttft_ms"] for r in mine),
                        "same text": all(r["texts_identical"] for r in mine)})
    return out
