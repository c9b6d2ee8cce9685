"""The embedded default model: a small Llama with seeded random weights and a byte-level tokenizer,
so benchmarks, the server and the tests run with no download. :data:`EMBEDDED` names its variants
(``"mistral"``: the same weights with a sliding window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .extras import install_hint

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
EMBEDDED_WINDOW = 64
EMBEDDED: dict[str, dict[str, Any]] = {
    "llama": DEFAULT_MODEL,
    "mistral": {**DEFAULT_MODEL, "model_type": "mistral", "sliding_window": EMBEDDED_WINDOW},
}
"""The embedded models by name (``vmkv serve --model embedded:NAME``): their config dictionaries."""


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
        """Token ids of a chat as BOS, ``<role>: content`` lines, then ``assistant:``."""
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return self.encode("\n".join(lines) + "\nassistant:")


def default_hf_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *, name: str = "llama",
                     **overrides: Any):
    """An embedded model as a ``transformers`` model (needs the ``hf`` extra): ``LlamaForCausalLM``, or
    ``MistralForCausalLM`` for ``name="mistral"``; ``overrides``: config fields to change.

    Raises:
        ModuleNotFoundError: transformers is not installed (the message names the extra).
        KeyError: no embedded model of that name.
    """
    try:
        import transformers
    except ModuleNotFoundError as exc:  # say which extra brings the missing package
        if exc.name != "transformers":
            raise
        raise ModuleNotFoundError(f"default_hf_model needs transformers: {install_hint('hf')} ({exc})",
                                  name=exc.name) from exc

    values = {**EMBEDDED[name], **overrides}
    family = {"llama": "Llama", "mistral": "Mistral"}[values["model_type"]]
    config = getattr(transformers, f"{family}Config")(**values)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DEFAULT_SEED)
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    return model.to(dtype=dtype, device=device).eval()


def save_byte_tokenizer(path: str | Path) -> None:
    """Save :class:`ByteTokenizer` as a Hugging Face tokenizer directory (for transformers, vLLM) whose
    ids, decoded text and chat prompts equal ``ByteTokenizer``'s. Needs ``transformers`` and ``tokenizers``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = {"<s>": BOS, "</s>": EOS, "<pad>": PAD}
    vocab = {char: byte for byte, char in bytes_to_unicode().items()} | specials
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(path)
