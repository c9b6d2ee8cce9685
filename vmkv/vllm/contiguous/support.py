"""What contiguous mode supports, and how many slots it has, read from vLLM's config at engine start.

Three places ask: the connector's scheduler half refuses an unsupported model before the first
step (:func:`check_model`) and sizes the slot table (:func:`slot_geometry`); each worker half
sizes its slot space the same way; vLLM's front end and the CPU platform hook ask whether an
engine runs contiguous mode at all (:func:`contiguous_requested`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...errors import InvalidConfig
from .. import settings as plugin


def contiguous_requested(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` runs vmkv's KV connector with ``kv_mode="contiguous"``."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or transfer.kv_connector != plugin.CONNECTOR_NAME:
        return False
    return (transfer.kv_connector_extra_config or {}).get("kv_mode") == "contiguous"


def check_model(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse, at engine start, models contiguous mode does not support, naming the setting.

    Raises:
        InvalidConfig: sliding-window attention, MLA, hybrid (Mamba/linear attention or several
            KV cache groups), encoder-decoder, or a quantized (fp8) KV cache.
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    check_attention_backend(vllm_config)
    why = []
    if model.get_sliding_window() is not None:
        why.append(f"sliding-window attention (the model's sliding_window={model.get_sliding_window()})")
    if model.use_mla:
        why.append("MLA (multi-head latent attention)")
    if model.is_encoder_decoder:
        why.append("encoder-decoder models")
    if str(cache.cache_dtype) != "auto":
        why.append(f"a quantized KV cache (kv_cache_dtype={cache.cache_dtype!r}; use 'auto')")
    groups = kv_cache_config.kv_cache_groups
    specs = [type(group.kv_cache_spec).__name__ for group in groups]
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        why.append(f"hybrid models or other KV than full attention (KV cache groups: {specs})")
    if why:
        raise InvalidConfig(f"vmkv kv_mode='contiguous' does not support {'; '.join(why)}: use kv_mode='paged'")


def check_attention_backend(vllm_config: Any) -> None:
    """On a GPU, contiguous mode needs vLLM to run vmkv's attention backend (the CPU platform's
    choice is made by :func:`vmkv.vllm.contiguous.backend.install_platform_hook`).

    Raises:
        InvalidConfig: the engine is not on CPU and its attention backend is not ``CUSTOM``.
    """
    device = vllm_config.device_config.device
    backend = vllm_config.attention_config.backend
    name = None if backend is None else backend.name
    if torch.device(device).type != "cpu" and name != plugin.ATTENTION_BACKEND:
        raise InvalidConfig(f"vmkv kv_mode='contiguous' on {device} needs vmkv's attention backend, but vLLM's is "
                            f"{name or 'chosen automatically'}: start vLLM with --attention-backend {plugin.ATTENTION_BACKEND} "
                            "(vmkv.vllm.engine_args(kv_mode='contiguous') and python -m vmkv.vllm --kv-mode contiguous add it)")


def slot_geometry(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int]:
    """``(slots, blocks per slot)`` of contiguous mode: ``max_num_seqs`` slots of ``max_model_len``
    tokens in whole blocks (the scheduler and every worker compute them the same way)."""
    block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    return vllm_config.scheduler_config.max_num_seqs, -(-vllm_config.model_config.max_model_len // block_size)
