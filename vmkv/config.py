"""Cache configuration: what the user chooses, validated once (no device is read here: a
``None`` layout or page size is decided when a cache opens, by :mod:`vmkv.sizing`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from .errors import InvalidConfig
from .ledger import SharedBudget
from .sizes import parse_size
from .validate import as_device, is_int, positive_int

Layout = Literal["per_layer", "all_layers", "head_major"]
LAYOUTS = ("per_layer", "all_layers", "head_major")


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _as_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        dtype = _DTYPES[value.lower().removeprefix("torch.")]
    else:
        raise InvalidConfig(f"dtype: {value!r} is not supported; use float32, float16 or bfloat16")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidConfig(f"dtype: {dtype} is not supported; use float32, float16 or bfloat16")
    return dtype


@dataclass(frozen=True)
class KVShape:
    """The K/V geometry of a model (on one rank), which is all the bytes of one token depend on. A VMM
    piece is one reserved range (or, head-major, one head of one).

    Args:
        num_layers: attention layers.
        num_kv_heads: key/value heads per layer.
        head_dim: size of one head.
        element_size: bytes of one K/V element.

    Raises:
        InvalidConfig: a field is not a positive int.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "element_size"):
            positive_int(name, getattr(self, name))

    @property
    def layer_token_bytes(self) -> int:
        """Bytes one token takes in one layer's K (or V) tensor."""
        return self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in every layer, K and V."""
        return 2 * self.num_layers * self.layer_token_bytes

    def token_bytes(self, layout: str) -> int:
        """Bytes one token takes in one piece of ``layout``.

        Raises:
            InvalidConfig: ``layout`` is not one of :data:`LAYOUTS`.
        """
        check_layout(layout)
        if layout == "all_layers":
            return self.num_layers * self.layer_token_bytes
        if layout == "head_major":
            return self.head_dim * self.element_size
        return self.layer_token_bytes

    def pieces(self, layout: str) -> int:
        """Pieces one page of every layer's K and V takes in ``layout`` (a range each, and per head, head-major).

        Raises:
            InvalidConfig: ``layout`` is not one of :data:`LAYOUTS`.
        """
        check_layout(layout)
        if layout == "all_layers":
            return 2
        if layout == "head_major":
            return 2 * self.num_layers * self.num_kv_heads
        return 2 * self.num_layers


MODES = ("vmm", "paged")
"""The two addressings, by the names users pass (``open_cache(mode=)``, ``VirtualCache(mode=)``,
``EngineConfig(kv_mode=)``): VMM mode's virtually contiguous ranges, paged mode's block tables.
Other names for them, and why they stay: docs/where-things-live.md, "Vocabulary"."""


def check_mode(mode: object) -> None:
    """Raise :class:`InvalidConfig` unless ``mode`` is one of :data:`MODES`."""
    if mode not in MODES:
        raise InvalidConfig(f"mode must be 'vmm' or 'paged', got {mode!r}")


def check_layout(layout: object, *, optional: bool = False) -> None:
    """Raise :class:`InvalidConfig` unless ``layout`` is one of :data:`LAYOUTS` (or, ``optional``, ``None``: chosen)."""
    if layout not in LAYOUTS and not (optional and layout is None):
        raise InvalidConfig(f"layout must be one of {', '.join(map(repr, LAYOUTS))}{' (or None)' if optional else ''}, "
                            f"got {layout!r}")


MAX_SEQ_LEN = 2**31 - 1
"""The longest ``max_seq_len``: positions and lengths are int32 (FlashAttention's too)."""


@dataclass(frozen=True)
class KVCacheConfig:
    """What a KV cache holds and how much memory it may use. Shared by both modes.

    Args:
        num_layers: transformer layers.
        num_kv_heads: key/value heads per layer (fewer than query heads under GQA).
        head_dim: size of one head.
        dtype: element type of K and V (float32, float16, bfloat16; strings accepted).
        device: ``"cpu"`` (host virtual memory) or ``"cuda[:N]"`` (CUDA driver VMM).
        max_batch_size: number of slots, i.e. sequences that can be live at once.
        max_seq_len: longest sequence, in tokens (at most :data:`MAX_SEQ_LEN`).
        memory_budget: bytes of physical memory for pages (int or "2GiB").
        page_size: VMM mode: bytes of one mapping in one K or V piece, a multiple of the backend
            granularity (4 KiB on the host, usually 2 MiB on CUDA) and of a token's bytes there.
            ``None``: decided with the layout at open (:func:`vmkv.sizing.default_pages`). Paged
            mode ignores it but refuses a value VMM mode would refuse.
        layout: VMM mode: ``"per_layer"`` (a range per layer and K/V, ``[B, S, H, D]``),
            ``"all_layers"`` (one K and one V range for every layer) or ``"head_major"`` (per layer,
            ``[B, H, S, D]``, ``num_kv_heads`` times more mappings). ``None``: decided at open if
            ``page_size`` is ``None`` too, else ``"per_layer"``.
        block_size: paged mode: tokens per block (a positive int in either mode).
        prefix_caching: keep full pages indexed by a hash of their tokens for later prompts.
        deferred_reclaim: VMM mode: a freed slot keeps its private pages mapped for the next sequence.
        map_ahead: VMM mode: map each running sequence's next page on a background thread.
        shared_budget: VMM mode: join a host-wide KV budget (:mod:`vmkv.ledger`), ``"NAME:SIZE"``
            with optional ``,min=SIZE``, ``,max=SIZE``, ``,member=LABEL``, ``,wait=SECONDS``;
            ``memory_budget`` is then this cache's ceiling.
        layer_windows: per layer, its sliding window in tokens (0: full attention); ``None``: every
            layer full. Pages wholly behind a shared window are released; ``vmkv.open_cache``
            gives layers of different windows a cache each.
        window_slack: tokens kept behind the window for rollback (``crop``); ``None``: one page.
        attention_features: ``"softcap"`` (Gemma 2) and/or ``"sinks"`` (GPT-OSS), which the chosen
            kernels must have.
        max_step_tokens: the most tokens one step adds to a sequence, which sizes a windowed
            layer's share of ``memory_budget``; ``None``: ``max_seq_len``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | str = torch.float16
    device: torch.device | str = "cpu"
    max_batch_size: int = 8
    max_seq_len: int = 4096
    memory_budget: int | str = "1GiB"
    page_size: int | str | None = None
    layout: Layout | None = None
    block_size: int = 16
    prefix_caching: bool = True
    deferred_reclaim: bool = True
    map_ahead: bool = False
    shared_budget: SharedBudget | str | None = None
    layer_windows: tuple[int, ...] | None = None
    window_slack: int | None = None
    max_step_tokens: int | None = None
    attention_features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_batch_size", "max_seq_len", "block_size"):
            positive_int(name, getattr(self, name))
        if self.max_seq_len > MAX_SEQ_LEN:
            raise InvalidConfig(f"max_seq_len must be at most {MAX_SEQ_LEN} (positions are int32), "
                                f"got {self.max_seq_len}")
        check_layout(self.layout, optional=True)
        object.__setattr__(self, "dtype", _as_dtype(self.dtype))
        object.__setattr__(self, "device", as_device(self.device))
        object.__setattr__(self, "memory_budget", parse_size(self.memory_budget, name="memory_budget"))
        if self.shared_budget is not None and not isinstance(self.shared_budget, SharedBudget):
            object.__setattr__(self, "shared_budget", SharedBudget.parse(self.shared_budget))
        if self.page_size is not None:
            object.__setattr__(self, "page_size", parse_size(self.page_size, name="page_size"))
            if self.page_size <= 0:
                raise InvalidConfig("page_size must be > 0")
        for name in ("prefix_caching", "deferred_reclaim", "map_ahead"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfig(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.layer_windows is not None:
            windows = tuple(self.layer_windows) if isinstance(self.layer_windows, (list, tuple)) else None
            if windows is None or len(windows) != self.num_layers or not all(is_int(w, 0) for w in windows):
                raise InvalidConfig(f"layer_windows must give each of the {self.num_layers} layers a window >= 0 "
                                    f"(0: full attention), got {self.layer_windows!r}")
            object.__setattr__(self, "layer_windows", windows)
        if self.window_slack is not None and not is_int(self.window_slack, 0):
            raise InvalidConfig(f"window_slack must be an int >= 0 or None (one page), got {self.window_slack!r}")
        features = tuple(self.attention_features) if isinstance(self.attention_features, (list, tuple, frozenset, set)) else None
        if features is None or not set(features) <= {"softcap", "sinks"}:
            raise InvalidConfig(f"attention_features must name 'softcap' and/or 'sinks', got {self.attention_features!r}")
        object.__setattr__(self, "attention_features", tuple(sorted(set(features))))
        if self.max_step_tokens is not None and not is_int(self.max_step_tokens, 1):
            raise InvalidConfig(f"max_step_tokens must be a positive int or None (max_seq_len), got {self.max_step_tokens!r}")

    @property
    def features(self) -> frozenset[str]:
        """The attention features every kernel of this cache needs: a window (if any), and ``attention_features``."""
        return frozenset(self.attention_features) | ({"window"} if any(self.layer_windows or ()) else set())

    @property
    def window(self) -> int | None:
        """The sliding window every layer shares (0: full attention), or ``None`` if they differ."""
        windows = set(self.layer_windows or (0,))
        return windows.pop() if len(windows) == 1 else None

    @property
    def element_size(self) -> int:
        """Bytes of one element of K or V."""
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def kv_shape(self) -> "KVShape":
        """The model's K/V geometry (what the bytes of a token depend on)."""
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, self.element_size)

    @property
    def layer_token_bytes(self) -> int:
        """Bytes one token takes in one layer's K (or V) tensor."""
        return self.kv_shape.layer_token_bytes

    def tensor_token_bytes(self, layout: str | None = None) -> int:
        """Bytes one token takes in one VMM range piece of ``layout`` (default: this config's)."""
        return self.kv_shape.token_bytes(layout or self.layout)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in the whole cache: every layer, K and V."""
        return self.kv_shape.bytes_per_token

    def replace(self, **changes) -> "KVCacheConfig":
        """Return a copy with some fields changed (validated again)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return KVCacheConfig(**values)


def as_config(value: "KVCacheConfig | Mapping[str, Any]") -> KVCacheConfig:
    """``value`` as a :class:`KVCacheConfig`: a config as is, a mapping of its fields built into one.

    Raises:
        InvalidConfig: ``value`` is neither, or the mapping names a field the config does not have.
    """
    if isinstance(value, KVCacheConfig):
        return value
    if not isinstance(value, Mapping):
        raise InvalidConfig(f"config must be a KVCacheConfig or a mapping of its fields, got {type(value).__name__}")
    names = [field.name for field in fields(KVCacheConfig)]
    unknown = [key for key in value if key not in names]
    if unknown:
        raise InvalidConfig(f"config: unknown field(s) {', '.join(map(repr, unknown))}; the fields are {', '.join(names)}")
    missing = [name for name in ("num_layers", "num_kv_heads", "head_dim") if name not in value]
    if missing:
        raise InvalidConfig(f"config: missing field(s) {', '.join(missing)}")
    return KVCacheConfig(**value)


@dataclass(frozen=True)
class PageGeometry:
    """How one pool page maps onto tokens and bytes, for one mode: the K and V of ``tokens_per_page``
    tokens in every layer, backed by ``num_tensors`` pieces of ``piece_bytes``.
    """

    tokens_per_page: int
    num_tensors: int
    piece_bytes: int
    num_pages: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one pool page (all its pieces)."""
        return self.num_tensors * self.piece_bytes
