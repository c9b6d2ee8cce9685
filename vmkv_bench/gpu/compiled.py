"""The ``hf_compiled`` section: ``generate()`` compiled over ``VirtualCache(compile=True)`` against
StaticCache on a 1B-shaped model: dense, teacher-forced logits, ragged rows, a profile (docs/gpu.md)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..common import synchronize
from ..runner import Context

LOGIT_FACTOR = 2.0  # compiled VirtualCache's logit error may be at most this many times StaticCache's
LOGIT_FLOOR = 1e-4  # ... or this (float32, where both are rounding: a few 1e-6)
RAGGED_NEEDS_S = 150  # the ragged part compiles StaticCache and both VirtualCaches again (a new shape)
PROFILE_NEEDS_S = 45
COMPILED = ("vmm+compile", "vmm+compile+vmkv")  # VirtualCache(compile=True) with the model's SDPA, with "vmkv"
TARGETS = {"dense_vs_static": 1.0, "ragged_vs_static": 1.2, "ragged_bytes_vs_tokens": 1.05, "paged_vs_vmm": 0.9}
ONE_B = {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "rope_theta": 500000.0}


@dataclass(frozen=True)
class Work:
    """One generate() workload: ``prompts`` (left-padded ids and mask), ``new`` tokens each."""

    ids: torch.Tensor
    mask: torch.Tensor
    new: int

    @property
    def longest(self) -> int:
        return self.ids.shape[1] + self.new

    def real_tokens(self) -> int:
        """Tokens the rows hold at the end, padding excluded."""
        return int(self.mask.sum()) + self.ids.shape[0] * (self.new - 1)


def _work(lengths: list[int], new: int, device: torch.device) -> Work:
    gen = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(1, 256, (length,), generator=gen)
        mask[row, width - length:] = 1
    return Work(ids.to(device), mask.to(device), new)


def _cache(name: str, model: torch.nn.Module, work: Work) -> Any:
    from transformers import StaticCache

    import vmkv.hf

    if name == "dynamic":
        return None
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=work.longest)
    return vmkv.hf.VirtualCache(name.split("+")[0], config=model.config, max_batch_size=work.ids.shape[0],
                                max_seq_len=work.longest, compile=name in COMPILED)


def _generate(model: torch.nn.Module, name: str, work: Work, compile_config: Any, **options: Any) -> tuple[Any, Any]:
    """One generate() of ``work`` with cache ``name``: ``(cache, output)``."""
    import vmkv.hf

    model.set_attn_implementation("vmkv" if name.endswith("+vmkv") else "sdpa")
    cache = _cache(name, model, work)
    extra = {vmkv.hf.cache_argument(): cache} if cache is not None else {}
    if compile_config is not None and name in ("static", *COMPILED):
        extra["compile_config"] = compile_config
    out = model.generate(work.ids, attention_mask=work.mask, max_new_tokens=work.new, min_new_tokens=work.new,
                         do_sample=False, pad_token_id=0, **extra, **options)
    return cache, out


def _kv_bytes(cache: Any, out: Any) -> int:
    cache = out.past_key_values if cache is None else cache
    if hasattr(cache, "peak_bytes"):
        return cache.peak_bytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _time(model: torch.nn.Module, part: str, names: list[str], work: Work, compile_config: Any, rounds: int,
          result: dict[str, Any], keep: Callable[[], None]) -> None:
    """``result[part]``, per cache, kept after each: a cache that raises gets ``{"error": ...}`` and a line in
    ``result["failures"]``, and the others still run."""
    found = result[part] = {}
    for name in names:
        try:
            found[name] = _time_one(model, name, work, compile_config, rounds)
        except Exception as exc:  # noqa: BLE001 - recorded; the section fails on it
            found[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        keep()
    result["failures"] += [f"{name} raised in the {part} part: {row['error']}" for name, row in found.items() if "error" in row]


def _time_one(model: torch.nn.Module, name: str, work: Work, compile_config: Any, rounds: int) -> dict[str, Any]:
    """One cache's row of :func:`_time`."""
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    _generate(model, name, work, compile_config)
    skips = counters["inductor"]["cudagraph_skips"] - skips
    seconds = []
    for _ in range(rounds):
        synchronize(work.ids.device.type)
        began = time.perf_counter()
        cache, out = _generate(model, name, work, compile_config, return_dict_in_generate=True)
        synchronize(work.ids.device.type)
        seconds.append(time.perf_counter() - began)
    median = statistics.median(seconds)
    row = {"seconds": median, "tokens_per_s": work.ids.shape[0] * work.new / median,
           "kv_bytes": _kv_bytes(cache, out), "cudagraph_skips": skips}
    if hasattr(cache, "close"):
        cache.close()
    return row


def _teacher_forced_logits(model: torch.nn.Module, name: str, work: Work, compile_config: Any,
                           forced: torch.Tensor) -> torch.Tensor:
    """The model's logits ``[steps, B, vocab]`` along ``forced`` (``[B, new]``) with cache ``name``."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Force(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            step = input_ids.shape[1] - work.ids.shape[1]
            chosen = torch.full_like(scores, float("-inf"))
            return chosen.scatter_(1, forced[:, step : step + 1], 0.0)

    cache, out = _generate(model, name, work, compile_config, logits_processor=LogitsProcessorList([Force()]),
                           output_logits=True, return_dict_in_generate=True)
    if hasattr(cache, "close"):
        cache.close()
    return torch.stack(out.logits).float()


def logit_errors(model: torch.nn.Module, work: Work, compile_config: Any) -> dict[str, float]:
    """Each compiled cache's (and StaticCache's) logit error against DynamicCache's, teacher-forced."""
    _, static_out = _generate(model, "static", work, compile_config)
    forced = static_out[:, work.ids.shape[1]:]
    reference = _teacher_forced_logits(model, "dynamic", work, compile_config, forced)
    scale = float(reference.abs().max())
    errors: dict[str, Any] = {}
    for name in ("static", *COMPILED):
        try:
            logits = _teacher_forced_logits(model, name, work, compile_config, forced)
            errors[name] = float((logits - reference).abs().max()) / scale
        except Exception as exc:  # noqa: BLE001 - recorded; the section fails on it
            if name == "static":
                raise
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
    return errors


def _setup(device: torch.device, smoke: bool) -> tuple[torch.nn.Module, Any, Work, Work, int]:
    """The model, generate()'s compile_config (None: generate() compiles by itself), workloads, rounds."""
    from vmkv.models import default_hf_model

    if smoke:
        model = default_hf_model(num_hidden_layers=2, device=device).eval()
        from transformers import CompileConfig

        config = CompileConfig(mode="default")
        config._compile_all_devices = True
        return model, config, _work([16, 16], 8, device), _work([5, 80], 8, device), 1
    model = default_hf_model(torch.bfloat16, device, **ONE_B).eval()
    ragged = [128 + (2048 - 128) * i // 15 for i in range(16)]
    return model, None, _work([512] * 16, 128, device), _work(ragged, 128, device), 2


def hf_compiled_section(ctx: Context) -> dict[str, Any]:
    """Dense and logits, then ragged and profile while time is left; kept in ``hf_compiled.partial.json``
    after each part. Fails when a cache raises or a compiled cache's logits drift past StaticCache's."""
    out, smoke, seconds_left = ctx.out, ctx.smoke, ctx.seconds_left
    model, compile_config, dense, ragged, rounds = _setup(ctx.device, smoke)
    result: dict[str, Any] = {"model": "embedded, 2 layers, float32" if smoke else "Llama-3.2-1B shape, bfloat16",
                              "targets": TARGETS, "failures": []}

    def keep() -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "hf_compiled.partial.json").write_text(json.dumps(result, indent=2, default=str))

    def enough(part: str, need_s: float) -> bool:
        if seconds_left() >= need_s:
            return True
        result[part] = {"skipped": f"{seconds_left():.0f} s left of the section's limit, {part} needs ~{need_s} s"}
        return False

    _time(model, "dense", ["dynamic", "static", "vmm", "vmm+vmkv", "paged+vmkv", *COMPILED], dense, compile_config, rounds,
          result, keep)
    compiled = {f"dense_{name}_vs_static": _speed_ratio(result["dense"], name, "static") for name in COMPILED}
    ratios = result["ratios"] = {
        "dense_vs_static": max((r for r in compiled.values() if r is not None), default=None), **compiled,
        "dense_vs_dynamic": _speed_ratio(result["dense"], "vmm+compile", "dynamic"),
        "paged_vs_vmm": _speed_ratio(result["dense"], "paged+vmkv", "vmm+vmkv"),
    }
    keep()
    errors = result["logit_errors"] = logit_errors(model, dense, compile_config)
    for name in COMPILED:
        if isinstance(errors[name], str):
            result["failures"].append(f"{name} raised in the logits part: {errors[name]}")
        elif errors[name] > max(LOGIT_FACTOR * errors["static"], LOGIT_FLOOR):
            result["failures"].append(f"{name}'s logits differ from DynamicCache's by {errors[name]:.2e} of the "
                                      f"largest, StaticCache's by {errors['static']:.2e}")
    keep()
    if enough("ragged", RAGGED_NEEDS_S):
        _time(model, "ragged", ["static", *COMPILED], ragged, compile_config, rounds, result, keep)
        result["ragged_real_token_bytes"] = ragged.real_tokens() * _token_bytes(model)
        ratios["ragged_vs_static"] = _speed_ratio(result["ragged"], "vmm+compile+vmkv", "static")
        ratios["ragged_vmm+compile_vs_static"] = _speed_ratio(result["ragged"], "vmm+compile", "static")
        held = result["ragged"]["vmm+compile+vmkv"].get("kv_bytes")
        ratios["ragged_bytes_vs_tokens"] = None if held is None else held / result["ragged_real_token_bytes"]
        keep()
    if enough("profile", PROFILE_NEEDS_S):
        result["profile"] = {name: profile(model, name, dense, compile_config) for name in ("static", *COMPILED)
                             if "error" not in result["dense"][name]}
        keep()
    return result


PROFILE_TOP = 8  # rows of each profile table


def profile(model: torch.nn.Module, name: str, work: Work, compile_config: Any) -> dict[str, Any]:
    """The ops with the most device and host time in one (compiled) generate() with cache ``name``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if work.ids.device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        _generate(model, name, work, compile_config)
        synchronize(work.ids.device.type)
    events = prof.key_averages()

    def top(key: str) -> dict[str, float]:
        rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:PROFILE_TOP]
        return {e.key[:80]: round(getattr(e, key) / 1e3, 3) for e in rows if getattr(e, key) > 0}

    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    return {"self_cpu_ms": top("self_cpu_time_total"), "self_device_ms": top(device_key) if len(activities) > 1 else {},
            "cpu_ms_total": round(sum(e.self_cpu_time_total for e in events) / 1e3, 3)}


def _speed_ratio(timed: dict[str, Any], ours: str, theirs: str) -> float | None:
    if "error" in timed[ours] or "error" in timed[theirs]:
        return None
    return timed[ours]["tokens_per_s"] / timed[theirs]["tokens_per_s"]


def _token_bytes(model: torch.nn.Module) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model.dtype.itemsize


def hf_compiled_headline(result: dict[str, Any]) -> str:
    """Compiled VirtualCache against StaticCache (dense, ragged, bytes) and paged vs vmm."""
    ratios = {name: "n/a" if value is None else f"{value:.2f}x" for name, value in result["ratios"].items()}
    ragged = (f"ragged {ratios['ragged_vs_static']} (>= 1.2) at {ratios['ragged_bytes_vs_tokens']} the tokens' "
              "bytes (<= 1.05)") if "ragged_vs_static" in ratios else "ragged not run"
    skipped = [name for name, row in result["dense"].items() if row.get("cudagraph_skips")]
    graphs = f"; ran without CUDA graphs: {', '.join(skipped)}" if skipped else ""
    return (f"compiled VirtualCache {ratios['dense_vs_static']} StaticCache (target >= 1.0; SDPA "
            f"{ratios['dense_vmm+compile_vs_static']}, vmkv {ratios['dense_vmm+compile+vmkv_vs_static']}), "
            f"{ragged}; paged {ratios['paged_vs_vmm']} vmm (>= 0.9){graphs}")
