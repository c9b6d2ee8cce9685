"""The embedded default model: a small Llama-shaped transformer with seeded random weights and a
byte-level tokenizer, so benchmarks, the server and the tests run with no download.

``DEFAULT_MODEL`` is a Hugging Face ``LlamaConfig`` dictionary (grouped-query attention: 8 query
heads share 4 KV heads). Weights are drawn from ``torch.manual_seed(DEFAULT_SEED)`` with a
standard deviation large enough that greedy decoding is not a tie-break lottery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BOS, EOS, PAD = 256, 257, 258

DEFAULT_MODEL: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
}
DEFAULT_SEED = 0


class ByteTokenizer:
    """Byte-level tokenizer of the embedded model: token ``i < 256`` is byte ``i``; then BOS, EOS, PAD."""

    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD
    vocab_size = DEFAULT_MODEL["vocab_size"]

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """UTF-8 bytes of ``text``, after BOS if ``add_bos``."""
        return ([BOS] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        """Text of the byte tokens (special and out-of-range tokens are skipped)."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat as ``<role>: content`` lines followed by ``assistant:``."""
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return self.encode("\n".join(lines) + "\nassistant:")


def default_hf_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **overrides: Any):
    """The embedded default model as a ``transformers`` ``LlamaForCausalLM`` (needs the ``hf`` extra).

    Args:
        dtype: parameter dtype.
        device: where the parameters live.
        overrides: ``LlamaConfig`` fields to change (e.g. ``num_hidden_layers=2``).

    Raises:
        ModuleNotFoundError: transformers is not installed (the message names the extra).
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ModuleNotFoundError as exc:  # say which extra brings the missing package
        if exc.name != "transformers":
            raise
        raise ModuleNotFoundError(f"default_hf_model needs transformers: pip install 'vmkv[hf]' ({exc})",
                                  name=exc.name) from exc

    config = LlamaConfig(**{**DEFAULT_MODEL, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DEFAULT_SEED)
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype, device=device).eval()


def save_byte_tokenizer(path: str | Path) -> None:
    """Save a Hugging Face byte-level tokenizer sized to the default model's 259-token vocabulary
    (256 byte tokens, then BOS, EOS, PAD) to ``path``, for loaders that want a tokenizer
    directory (``transformers``, vLLM). Needs ``transformers`` and ``tokenizers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(path)
