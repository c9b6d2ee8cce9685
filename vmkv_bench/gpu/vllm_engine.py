"""The sections that need vLLM on the GPU: ``vllm`` (the plugin's smoke test) and ``vllm_addressing``
(block tables vs virtual memory inside one vLLM); both skip, with the reason, off CUDA or without vLLM."""

from __future__ import annotations

import importlib.util
import statistics
from typing import Any

import torch

import vmkv

from ..runner import Context, SectionSkipped
from .vllm_smoke import gpu_smoke

MiB = 1 << 20


def vllm_unavailable(device: torch.device, smoke: bool) -> str | None:
    """Why a section that starts vLLM cannot run here (checked before its process starts)."""
    if device.type != "cuda":
        return "vLLM on the GPU needs a CUDA device"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    return None


def vllm_section(ctx: Context) -> dict[str, Any]:
    """:func:`~vmkv_bench.gpu.vllm_smoke.gpu_smoke` ``(DIR/vllm)``: stock vLLM and vLLM + vmkv on the tiny model."""
    device, out_dir = ctx.device, ctx.out
    if device.type != "cuda":
        raise SectionSkipped("the vLLM smoke test needs a CUDA device")
    if importlib.util.find_spec("vllm") is None:
        raise SectionSkipped("vLLM is not installed")
    (out_dir / "vllm").mkdir(parents=True, exist_ok=True)
    try:
        result = gpu_smoke(out_dir / "vllm")
    except vmkv.BackendUnavailable as exc:  # e.g. a vLLM other than the one the plugin supports
        raise SectionSkipped(f"the vLLM smoke test: {exc}") from None
    result = dict(result) if isinstance(result, dict) else {"returned": result}
    result["failures"] = vllm_failures(result)
    return result


def vllm_failures(result: dict[str, Any]) -> list[str]:
    """Why ``gpu_smoke``'s result fails (``[]`` when it reports ``"passed": True``)."""
    if result.get("passed") is True:
        return []
    if "passed" not in result:
        return [f"gpu_smoke reported no 'passed' (keys: {', '.join(sorted(result))})"]
    why = []
    if result.get("tokens_identical") is not True:
        why.append("vLLM + vmkv generated other tokens than stock vLLM")
    peak, buffer = result.get("kv_peak_mapped_bytes"), result.get("kv_buffer_bytes")
    if isinstance(peak, int) and isinstance(buffer, int) and peak >= buffer:
        why.append(f"vmkv mapped {peak / MiB:.0f} MiB at peak, not less than the {buffer / MiB:.0f} MiB KV buffer")
    return why or ["gpu_smoke reported passed=False"]


def vllm_addressing_section(ctx: Context) -> dict[str, Any]:
    """``vmkv bench vllm --parts addressing`` on the GPU (:data:`~vmkv_bench.vllm_addressing.GPU_SETTINGS`)."""
    device, out_dir, smoke = ctx.device, ctx.out, ctx.smoke
    if device.type != "cuda":
        raise SectionSkipped("the addressing comparison inside vLLM on CUDA needs a CUDA device "
                             "(the CPU run: vmkv bench vllm --parts addressing)")
    if importlib.util.find_spec("vllm") is None:
        raise SectionSkipped("vLLM is not installed")
    from vmkv.vllm import check_vllm

    try:
        check_vllm()
    except vmkv.BackendUnavailable as exc:  # missing, or another release than the plugin's (UnsupportedVllm)
        raise SectionSkipped(str(exc)) from None
    from .. import vllm_addressing

    settings = dict(vllm_addressing.GPU_SETTINGS)
    if smoke:
        settings.update(requests=2, prompt=(256, 384), output=8, rounds=1)
    (out_dir / "vllm_addressing").mkdir(parents=True, exist_ok=True)
    result = vllm_addressing.run(settings, out_dir / "vllm_addressing", 0, vllm_addressing.GPU_ENGINE)
    result["failures"] = addressing_failures(result["rows"])
    return result


def addressing_failures(rows: list[dict[str, Any]]) -> list[str]:
    """Why the addressing run fails: the paged backing must give stock's tokens exactly, contiguous mode
    every first token (later bfloat16 differences are summation order, reported)."""
    why = []
    for row in rows:
        if row["engine"] == "paged" and not row["tokens_identical"]:
            why.append(f"round {row['round']}: the paged backing's tokens differ from stock's at position {row['first_divergence']}")
        if row["engine"] == "contiguous" and row["first_divergence"] == 0:
            why.append(f"round {row['round']}: contiguous mode's first token differs from stock's")
    return why


def vllm_headline(result: dict[str, Any]) -> str:
    """Whether vLLM + vmkv gave stock vLLM's tokens, and its peak KV mapping."""
    peak, buffer = result.get("kv_peak_mapped_bytes"), result.get("kv_buffer_bytes")
    mapped = f", KV mapped at peak {peak / MiB:.0f} of {buffer / MiB:.0f} MiB" if isinstance(peak, int) and isinstance(buffer, int) else ""
    return f"tokens identical to stock: {result.get('tokens_identical')}{mapped}"


def vllm_addressing_headline(result: dict[str, Any]) -> str:
    """Contiguous mode's output tokens/s over stock vLLM's, median and range of the rounds."""
    over = result["summary"]["contiguous_over_stock"]
    return f"contiguous {statistics.median(over):.2f}x stock tokens/s (rounds {min(over):.2f}-{max(over):.2f})"
