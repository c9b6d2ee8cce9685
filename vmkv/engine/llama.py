"""A Llama-family decoder (Llama, Mistral, Qwen2 shapes) that runs one packed, mixed batch per step::

    input_ids, positions : [T]                T = sum(plan.q_lens)
    hidden               : [T, hidden]
    q                    : [T, q_heads, head_dim]     -> cache.attention(layer, q, plan)
    k, v                 : [T, kv_heads, head_dim]    -> cache.write(layer, k, v, plan)

Parameter names and arithmetic match transformers' ``*ForCausalLM`` (RMSNorm in float32,
rotate-half RoPE, SwiGLU), so checkpoints load unchanged and greedy outputs match ``generate``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.base import KVCacheBase
from ..core.step import StepPlan
from ..errors import InvalidConfig
from ..sizing import model_windows

FAMILIES = ("llama", "mistral", "qwen2")

log = logging.getLogger("vmkv.engine")


@dataclass(frozen=True)
class LlamaShape:
    """The architecture numbers the runner needs, read from a Hugging Face config.

    Attributes:
        family: ``llama``, ``mistral`` or ``qwen2``.
        qkv_bias, o_bias, mlp_bias: which projections carry a bias.
        layer_windows: each layer's sliding window (0: full), as transformers reads them;
            ``None``: every layer full.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_windows: tuple[int, ...] | None = None

    @classmethod
    def from_hf_config(cls, config: Any) -> "LlamaShape":
        """Read a transformers ``PretrainedConfig`` of a supported family.

        Raises:
            InvalidConfig: another ``model_type``, or head counts that do not divide.
        """
        family = getattr(config, "model_type", None)
        if family not in FAMILIES:
            raise InvalidConfig(f"model_type {family!r} is not supported; the runner handles {', '.join(FAMILIES)}")
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if heads % kv_heads:
            raise InvalidConfig(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            family=family,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            layer_windows=model_windows(config),
        )


def rope_frequencies(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim / 2]`` and the cos/sin scale of a HF config (static scaled
    types from transformers' ``ROPE_INIT_FUNCTIONS``).

    Raises:
        InvalidConfig: ``dynamic`` or ``longrope`` RoPE (frequencies that change with the length),
            or a type this transformers version does not know.
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise InvalidConfig(f"rope_type {rope_type!r} depends on the sequence length and is not implemented")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise InvalidConfig(f"rope_type {rope_type!r} is unknown to this transformers version")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as transformers does. ``x: [T, hidden]``."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def linear_backend(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """How the runner multiplies by its weights: ``(name, why)``. ``"onednn"``: weights packed once into
    oneDNN's layout, as inductor's freezing does on CPU (why: docs/serving.md, "Models");
    ``"torch"``: ``F.linear``.
    """
    if device.type != "cpu":
        return "torch", f"{device.type}: F.linear (cuBLAS)"
    if not torch.backends.mkldnn.is_available():
        return "torch", "this torch has no oneDNN (mkldnn)"
    if dtype == torch.float32:
        return "onednn", "CPU float32: oneDNN with pre-packed weights"
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "onednn", "CPU bfloat16: oneDNN with pre-packed weights"
    return "torch", f"CPU {dtype}: oneDNN pre-packing not used for this dtype (or this CPU lacks bf16 support)"


class PackedLinear:
    """Several ``nn.Linear`` of the same input as one GEMM, ``x @ cat(W)^T + cat(b)``: (q, k, v) and
    (gate, up) fused as vLLM does. The fused weights are a snapshot and a copy: a packed model holds
    its linear weights twice (:meth:`LlamaForCausalLM.pack` rebuilds them).

    Args:
        linears: layers with the same ``in_features`` (biases: all, some or none).
        backend: ``"onednn"`` or ``"torch"`` (see :func:`linear_backend`).
    """

    def __init__(self, linears: Sequence[nn.Linear], backend: str) -> None:
        weight = torch.cat([layer.weight.detach() for layer in linears])  # [sum(out), in]
        if any(layer.bias is not None for layer in linears):
            self.bias: torch.Tensor | None = torch.cat([
                layer.bias.detach() if layer.bias is not None else weight.new_zeros(layer.out_features) for layer in linears
            ])
        else:
            self.bias = None
        self.sizes = [layer.out_features for layer in linears]
        self.backend = backend
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if backend == "onednn" else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, in]`` -> ``[T, sum(out)]``."""
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``self(x)`` split back into the fused layers' outputs (views)."""
        return self(x).split(self.sizes, dim=-1)


@dataclass(frozen=True)
class _PackedLayer:
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Projections of one attention block (the attention itself is the cache's)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        d = shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, shape.num_heads * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.num_heads * d, shape.hidden_size, bias=shape.o_bias)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=shape.mlp_bias)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=shape.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


# how one layer stores its new K/V and attends: (layer, q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D]
LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cache_attention(cache: KVCacheBase, plan: StepPlan) -> LayerAttention:
    """The usual layer attention: ``cache.write`` then ``cache.attention`` with ``plan``."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.write(layer, k, v, plan)
        return cache.attention(layer, q, plan)

    return attend


class LlamaForCausalLM(nn.Module):
    """Llama/Mistral/Qwen2 decoder whose attention goes through a vmkv cache.

    Args:
        shape: the architecture (see :meth:`LlamaShape.from_hf_config`).
        inv_freq: RoPE inverse frequencies ``[head_dim / 2]`` (float32).
        rope_scale: factor on cos/sin (1.0 except for some scaled RoPE types).
    """

    def __init__(self, shape: LlamaShape, inv_freq: torch.Tensor, rope_scale: float = 1.0) -> None:
        super().__init__()
        self.shape = shape
        self.model = Backbone(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = rope_scale
        self.linear_backend = "modules"  # what forward() multiplies with; pack() changes it
        self._packed: tuple[list[_PackedLayer], PackedLinear] | None = None

    @classmethod
    def from_hf_config(cls, config: Any) -> "LlamaForCausalLM":
        """An uninitialised model of a transformers config's shape (load weights next)."""
        shape = LlamaShape.from_hf_config(config)
        inv_freq, scale = rope_frequencies(config, shape.head_dim)
        with torch.device("meta"):
            model = cls(shape, torch.empty(shape.head_dim // 2), scale)
        model = model.to_empty(device="cpu")  # to_empty unties shared parameters: tie again
        if shape.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = inv_freq
        return model

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict in (names as in ``*ForCausalLM``).

        Raises:
            InvalidConfig: a weight is missing, or one with an unknown name or shape is present.
        """
        ignored = ("rotary_emb.inv_freq",)
        state = {k: v for k, v in state_dict.items() if not k.endswith(ignored)}
        if self.shape.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        own = self.state_dict()
        missing = sorted(set(own) - set(state) - ({"lm_head.weight"} if self.shape.tie_word_embeddings else set()))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise InvalidConfig(f"weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise InvalidConfig(f"weight {name} has shape {list(tensor.shape)}, expected {list(own[name].shape)}")
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name in state:
                    param.copy_(state[name])
        if self._packed is not None:
            self.pack(self.linear_backend)

    def pack(self, backend: str | None = None) -> str:
        """Fuse and pack the linear layers for :meth:`forward` (after the weights are final and on their
        device and dtype); returns the backend used.

        Args:
            backend: ``"onednn"``, ``"torch"`` or ``"modules"`` (the unpacked reference path);
                ``None``: :func:`linear_backend`'s choice.

        Raises:
            InvalidConfig: an unknown backend.
        """
        weight = self.lm_head.weight
        if backend is None:
            backend, why = linear_backend(weight.device, weight.dtype)
            log.info("vmkv engine linears: %s (%s)", backend, why)
        if backend not in ("onednn", "torch", "modules"):
            raise InvalidConfig(f"linear backend must be onednn, torch or modules, got {backend!r}")
        if backend == "modules":
            self._packed = None
        else:
            layers = [
                _PackedLayer(
                    PackedLinear([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], backend),
                    PackedLinear([l.self_attn.o_proj], backend),
                    PackedLinear([l.mlp.gate_proj, l.mlp.up_proj], backend),
                    PackedLinear([l.mlp.down_proj], backend),
                )
                for l in self.model.layers
            ]
            self._packed = (layers, PackedLinear([self.lm_head], backend))
        self.linear_backend = backend
        return backend

    # ---- forward -------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for ``positions: [T]``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def _qkv(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed projections with RoPE applied: q ``[T, Hq, D]``, k, v ``[T, Hkv, D]``."""
        s = self.shape
        h = layer.input_layernorm(x)
        q = layer.self_attn.q_proj(h).view(-1, s.num_heads, s.head_dim)
        k = layer.self_attn.k_proj(h).view(-1, s.num_kv_heads, s.head_dim)
        v = layer.self_attn.v_proj(h).view(-1, s.num_kv_heads, s.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    @torch.inference_mode()
    def forward(
        self, cache: KVCacheBase, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor,
        logit_rows: torch.Tensor, attention: LayerAttention | None = None,
    ) -> torch.Tensor:
        """One step over the packed batch of ``plan``.

        Args:
            cache: the KV cache ``plan`` came from.
            plan: this step's plan (``cache.begin_step``).
            input_ids, positions: int64 ``[T]`` new tokens and their positions, packed in plan order.
            logit_rows: int64 ``[R]`` packed rows whose next-token logits are wanted.
            attention: how each layer stores and attends (default :func:`cache_attention`).

        Returns:
            float32 logits ``[R, vocab]``.
        """
        attend = attention or cache_attention(cache, plan)
        if self._packed is None:
            return self._forward_modules(attend, input_ids, positions, logit_rows)
        s = self.shape
        layers, lm_head = self._packed
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self._rope(positions, x.dtype)
        for index, (layer, ops) in enumerate(zip(self.model.layers, layers)):
            h = layer.input_layernorm(x)
            q, k, v = ops.qkv.split(h)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
            q = q.view(-1, s.num_heads, s.head_dim)
            k = k.view(-1, s.num_kv_heads, s.head_dim)
            q = q * cos + rotate_half(q) * sin  # fresh contiguous tensors
            k = k * cos + rotate_half(k) * sin
            out = attend(index, q, k, v.reshape(-1, s.num_kv_heads, s.head_dim))  # [T, Hq, D]
            x = x + ops.o(out.reshape(x.shape[0], -1))
            gate, up = ops.gate_up.split(layer.post_attention_layernorm(x))
            x = x + ops.down(F.silu(gate) * up)
        x = self.model.norm(x[logit_rows])
        return lm_head(x).float()

    def _forward_modules(
        self, attend: LayerAttention, input_ids: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward` through the ``nn.Linear`` modules one by one (the reference path)."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self._rope(positions, x.dtype)
        for index, layer in enumerate(self.model.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            out = attend(index, q.contiguous(), k.contiguous(), v.contiguous())  # [T, Hq, D]
            x = x + layer.self_attn.o_proj(out.reshape(x.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x[logit_rows])
        return self.lm_head(x).float()

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference path with no cache: causal SDPA over one sequence, ``input_ids: [S]`` -> float32 ``[S, vocab]``."""
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        cos, sin = self._rope(positions, x.dtype)
        gqa = self.shape.num_heads != self.shape.num_kv_heads
        windows = self.shape.layer_windows or (0,) * self.shape.num_layers
        for layer, window in zip(self.model.layers, windows):
            q, k, v = self._qkv(layer, x, cos, sin)
            seen = positions[None, :] <= positions[:, None]  # [S, S]: causal, within the window
            if window:
                seen &= positions[None, :] > positions[:, None] - window
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=seen, enable_gqa=gqa
            )  # [Hq, S, D]
            x = x + layer.self_attn.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x)).float()
