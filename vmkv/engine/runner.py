"""Loading a model (the embedded default, or a local Llama, Mistral or Qwen2 checkpoint read with
``local_files_only``) and running one step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import KVCacheConfig
from ..core.base import KVCacheBase
from ..core.step import StepPlan
from ..errors import InvalidConfig
from ..models import EMBEDDED, ByteTokenizer, default_hf_model
from ..validate import as_device
from .graphs import DecodeGraphs
from .llama import LlamaForCausalLM, LlamaShape

log = logging.getLogger("vmkv.engine")

DEFAULT_MODEL_NAME = "vmkv-default"


class ByteChatTokenizer:
    """The embedded model's byte tokenizer behind the engine's tokenizer interface."""

    def __init__(self) -> None:
        self._tok = ByteTokenizer()
        self.eos_token_ids: tuple[int, ...] = (self._tok.eos_token_id,)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self._tok.apply_chat_template(messages)


class HFTokenizer:
    """A transformers tokenizer loaded from a local directory (``local_files_only=True``).

    Raises:
        InvalidConfig: no tokenizer files in the directory.
    """

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...]) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise InvalidConfig(f"no usable tokenizer in {path}: {exc}") from None
        ids = set(eos_token_ids)
        if self._tok.eos_token_id is not None:
            ids.add(self._tok.eos_token_id)
        self.eos_token_ids = tuple(sorted(ids))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat through the tokenizer's chat template.

        Raises:
            InvalidConfig: the tokenizer has no chat template.
        """
        if not getattr(self._tok, "chat_template", None):
            raise InvalidConfig("this model's tokenizer has no chat template; use /v1/completions")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self._tok.encode(text, add_special_tokens=False))


@dataclass
class LoadedModel:
    """A model ready to run, its tokenizer, and the name the server reports."""

    model: LlamaForCausalLM
    tokenizer: ByteChatTokenizer | HFTokenizer
    name: str
    max_position_embeddings: int


def _dtype(name: str | torch.dtype, config_dtype: Any, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU, the checkpoint's dtype (else bfloat16) on CUDA."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        if isinstance(config_dtype, torch.dtype):
            return config_dtype
        return getattr(torch, str(config_dtype), torch.bfloat16) if config_dtype else torch.bfloat16
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise InvalidConfig(f"dtype must be auto, float32, float16 or bfloat16, got {name!r}")
    return table[name]


@dataclass(frozen=True)
class ModelSpec:
    """What a model directory's ``config.json`` says, read before any weight: enough to size and open a
    KV cache, so a bad cache option fails fast.
    """

    hf_config: Any
    shape: LlamaShape
    dtype: torch.dtype
    device: torch.device
    max_position_embeddings: int

    def max_seq_len(self) -> int:
        """The longest sequence the runner handles: the model's positions."""
        return self.max_position_embeddings

    def cache_config(self, **options: Any) -> KVCacheConfig:
        """A KV cache configuration shaped for this model (its layers' windows too); ``options``
        are the other fields."""
        return KVCacheConfig(
            num_layers=self.shape.num_layers, num_kv_heads=self.shape.num_kv_heads, head_dim=self.shape.head_dim,
            dtype=self.dtype, device=self.device, layer_windows=self.shape.layer_windows, **options,
        )


def embedded_name(path: str | Path | None) -> str | None:
    """The embedded model ``path`` names (``None`` or ``"embedded:NAME"``), else ``None`` (a directory).

    Raises:
        InvalidConfig: ``embedded:`` with a name no embedded model has.
    """
    if path is None:
        return "llama"
    if isinstance(path, str) and path.startswith("embedded:"):
        name = path.removeprefix("embedded:")
        if name not in EMBEDDED:
            raise InvalidConfig(f"no embedded model {name!r}; there are {', '.join(EMBEDDED)}")
        return name
    return None


def read_model_spec(path: str | Path | None = None, *, dtype: str | torch.dtype = "auto", device: str = "cpu") -> ModelSpec:
    """Read the shape, dtype and positions of an embedded model or a local checkpoint.

    Raises:
        InvalidConfig: no ``config.json``, an unsupported architecture, dtype or device.
    """
    target = as_device(device)
    name = embedded_name(path)
    if name is not None:
        from transformers import AutoConfig

        values = dict(EMBEDDED[name])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        from transformers import AutoConfig

        root = Path(path)
        if not (root / "config.json").is_file():
            raise InvalidConfig(f"{root} has no config.json (a local Hugging Face model directory is expected)")
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    return ModelSpec(config, LlamaShape.from_hf_config(config), _dtype(dtype, getattr(config, "dtype", None), target),
                     target, config.max_position_embeddings)


def load_model(path: str | Path | None = None, *, dtype: str | torch.dtype = "auto", device: str = "cpu") -> LoadedModel:
    """Load an embedded model (``path=None``: the default; ``"embedded:mistral"``) or a local checkpoint.

    Args:
        path: a directory with ``config.json``, ``*.safetensors`` and tokenizer files.
        dtype: ``auto``, ``float32``, ``float16`` or ``bfloat16``.
        device: ``cpu`` or ``cuda[:N]``.

    Raises:
        InvalidConfig: unsupported architecture, missing files, weights that do not fit.
    """
    spec = read_model_spec(path, dtype=dtype, device=device)
    config = spec.hf_config
    model = LlamaForCausalLM.from_hf_config(config)
    embedded = embedded_name(path)
    if embedded is not None:
        model.load_weights(default_hf_model(name=embedded).state_dict())
        tokenizer: ByteChatTokenizer | HFTokenizer = ByteChatTokenizer()
        name = DEFAULT_MODEL_NAME if embedded == "llama" else f"{DEFAULT_MODEL_NAME}-{embedded}"
    else:
        root = Path(path)
        model.load_weights(_read_safetensors(root))
        eos = config.eos_token_id
        tokenizer = HFTokenizer(root, tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)))
        name = root.name
    model = model.to(device=spec.device, dtype=spec.dtype).eval()
    model.inv_freq = model.inv_freq.float()  # RoPE frequencies stay float32, as in transformers
    model.pack()  # fused, pre-packed linears (oneDNN on CPU): the weights are final now
    log.info("vmkv engine: model %s (%s, %d layers) on %s in %s", name, model.shape.family,
             model.shape.num_layers, spec.device, model.lm_head.weight.dtype)
    return LoadedModel(model, tokenizer, name, spec.max_position_embeddings)


def _read_safetensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint."""
    from safetensors.torch import load_file

    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise InvalidConfig(f"{root} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(root / name)))
    return state


def cache_config_for(model: LlamaForCausalLM, **options: Any) -> KVCacheConfig:
    """A KV cache configuration shaped for ``model``; ``options``: other :class:`KVCacheConfig` fields."""
    weight = model.lm_head.weight
    return KVCacheConfig(
        num_layers=model.shape.num_layers,
        num_kv_heads=model.shape.num_kv_heads,
        head_dim=model.shape.head_dim,
        dtype=weight.dtype,
        device=weight.device,
        layer_windows=model.shape.layer_windows,
        **options,
    )


class ModelRunner:
    """Packs a step's token chunks, runs the model, returns the logits asked for (``graphs``: captured
    decode steps replay where they apply).
    """

    def __init__(self, model: LlamaForCausalLM, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.graphs = graphs
        self.device = model.lm_head.weight.device

    def execute(
        self, cache: KVCacheBase, plan: StepPlan, chunks: list[list[int]], logits_for: list[bool]
    ) -> torch.Tensor:
        """Run one step: ``chunks[i]`` are the new token ids of ``plan.seq_ids[i]``; ``logits_for[i]``
        whether its next-token logits are wanted. Returns float32 ``[sum(logits_for), vocab]``.
        """
        if self.graphs is not None and self.graphs.applies(plan) and all(logits_for):
            return self.graphs.run(plan, [chunk[0] for chunk in chunks])
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for chunk, start, want in zip(chunks, plan.starts, logits_for):
            ids.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
            if want:
                rows.append(len(ids) - 1)
        ids_t, positions_t, rows_t = (torch.tensor(v, dtype=torch.long, device=self.device) for v in (ids, positions, rows))
        return self.model(cache, plan, ids_t, positions_t, rows_t)
