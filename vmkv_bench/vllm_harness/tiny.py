"""A tiny Llama checkpoint vLLM can load, built offline: vmkv's embedded model with 2 layers and its
byte tokenizer saved as a Hugging Face tokenizer (needs transformers, safetensors, tokenizers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vmkv.models import DEFAULT_MODEL, default_hf_model, save_byte_tokenizer

TINY_LAYERS = 2
TOKENIZER_VERSION = 2  # 1: ids in code-point order of the byte alphabet, no BOS (directories made so are rewritten)


def token_bytes(num_layers: int = TINY_LAYERS, head_dim: int | None = None) -> int:
    """KV bytes one token of the tiny model takes over all layers (K and V, float32)."""
    return 2 * num_layers * DEFAULT_MODEL["num_key_value_heads"] * (head_dim or DEFAULT_MODEL["head_dim"]) * 4


def save_tiny_model(path: str | Path, num_layers: int = TINY_LAYERS, head_dim: int | None = None) -> Path:
    """Write the tiny Llama (``config.json``, safetensors weights, tokenizer) to ``path``."""
    path = Path(path)
    made = {"num_layers": num_layers, "tokenizer": TOKENIZER_VERSION}
    overrides = {"num_hidden_layers": num_layers}
    if head_dim is not None and head_dim != DEFAULT_MODEL["head_dim"]:
        made["head_dim"] = overrides["head_dim"] = head_dim
    marker = path / "vmkv-tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == made:
        return path
    path.mkdir(parents=True, exist_ok=True)
    default_hf_model(torch.float32, **overrides).save_pretrained(path)
    save_byte_tokenizer(path)
    marker.write_text(json.dumps(made))
    return path
