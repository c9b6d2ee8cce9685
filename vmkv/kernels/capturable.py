"""The kernels graph paths call: what a compiled step or a captured CUDA graph may run over a cache's
fixed virtual addresses.

Two rules make a kernel usable there. It touches only the positions it names: :func:`write_columns`
is an operator whose schema declares what it mutates, so inductor calls it in place instead of
copying the whole range back over the read-only zero page (docs/hf.md, "Compiled generation").
Its launches depend only on host ints known up front, lengths living on the device, so one capture
serves every step (:func:`decode_attention`, the decode entry point of every path). Which decode
kernel runs is :func:`vmkv.kernels.registry.choose_capturable`'s choice, made once per cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.step import StepPlan
from ..errors import InvalidInput
from .base import ALL_FEATURES, PLAIN, AttentionKernel, Variant, first_key
from .triton_attention import DecodeWorkspace
from .triton_attention import decode_attention as _triton_decode
from .variants import explicit_attention, needs_scores

__all__ = ["DecodeWorkspace", "MaskedDecode", "Store", "decode_attention", "decode_store", "stores_of", "write_columns"]

DECODE_KERNELS = ("triton", "sdpa_masked")
"""The kernels :func:`decode_attention` runs (the registry's capturable ones)."""


_LIBRARY = torch.library.Library("vmkv", "FRAGMENT")  # noqa: TOR901 - the schema says what is mutated
_LIBRARY.define("write_columns(Tensor(a!) k_base, Tensor(b!) v_base, Tensor k, Tensor v, Tensor slots, Tensor starts, "
                "SymInt[] size, SymInt[] k_stride, SymInt k_offset, SymInt[] v_stride, SymInt v_offset) -> ()")
_LIBRARY.define("decode_store(Tensor q, Tensor k_base, Tensor v_base, Tensor kv_lens, Tensor? slots, "
                "Tensor? block_table, SymInt[] size, SymInt[] k_stride, SymInt k_offset, SymInt[] v_stride, "
                "SymInt v_offset, float scale, int max_kv_len, str kernel, int window=0, float softcap=0.0, "
                "Tensor? sinks=None) -> Tensor")


def _write_columns(k_base: torch.Tensor, v_base: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   starts: torch.Tensor, size: list[int], k_stride: list[int], k_offset: int, v_stride: list[int],
                   v_offset: int) -> None:
    k_store = k_base.as_strided(size, k_stride, k_offset)  # [max_batch, capacity, kv_heads, head_dim]
    v_store = v_base.as_strided(size, v_stride, v_offset)
    # rows: [B, 1] slots, cols: [B or 1, S] positions; the pair selects [B, S] tokens of [H, D] each
    rows, cols = slots.reshape(-1, 1), starts.reshape(-1, 1)
    if k.shape[2] > 1:
        cols = cols + torch.arange(k.shape[2], device=k.device)
    torch.ops.aten.index_put_.default(k_store, [rows, cols], k.transpose(1, 2))  # [B, S, H, D]
    torch.ops.aten.index_put_.default(v_store, [rows, cols], v.transpose(1, 2))


# one Python kernel for every device (the dispatcher's own registration: a torch.library.custom_op
# adds an autograd wrapper that doubles the cost of a call, and the op is never differentiated)
_LIBRARY.impl("write_columns", _write_columns, "CompositeExplicitAutograd")


@torch.library.register_fake("vmkv::write_columns")
def _write_columns_fake(k_base: torch.Tensor, v_base: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                        starts: torch.Tensor, size: list[int], k_stride: list[int], k_offset: int, v_stride: list[int],
                        v_offset: int) -> None:
    return None


def _decode_store(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor, kv_lens: torch.Tensor,
                  slots: torch.Tensor | None, block_table: torch.Tensor | None, size: list[int], k_stride: list[int],
                  k_offset: int, v_stride: list[int], v_offset: int, scale: float, max_kv_len: int,
                  kernel: str, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    k_store = k_base.as_strided(size, k_stride, k_offset)  # slots: [max_batch, capacity, Hkv, D]; blocks: [N, size, Hkv, D]
    v_store = v_base.as_strided(size, v_stride, v_offset)
    return decode_attention(q, k_store, v_store, kv_lens, kernel=kernel, slots=slots, block_table=block_table,
                            scale=scale, max_kv_len=max_kv_len, window=window, softcap=softcap, sinks=sinks)


_LIBRARY.impl("decode_store", _decode_store, "CompositeExplicitAutograd")


@torch.library.register_fake("vmkv::decode_store")
def _decode_store_fake(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor, kv_lens: torch.Tensor,
                       slots: torch.Tensor | None, block_table: torch.Tensor | None, size: list[int], k_stride: list[int],
                       k_offset: int, v_stride: list[int], v_offset: int, scale: float, max_kv_len: int,
                       kernel: str, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(q)


@dataclass(frozen=True)
class Store:
    """One layer's K or V as a graph path sees it: ``base``, a 1-D tensor over the layer's whole storage,
    and the layer's ``[max_batch, capacity, kv_heads, head_dim]`` view of it.

    A compiled region mutates ``base``, not the view: views of one all-layers range alias, and aliased
    mutated inputs make inductor skip CUDA graphs.
    """

    base: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def view(self) -> torch.Tensor:
        """The layer's view (inside a compiled region: a view of the input ``base``)."""
        return self.base.as_strided(self.size, self.stride, self.offset)

    def token_rows(self) -> "Store":
        """A block pool ``[blocks, block_size, H, D]`` as one slot ``[1, blocks * block_size, H, D]``.

        Raises:
            ValueError: the pool's blocks are not back to back (no one stride spans them).
        """
        blocks, size, *rest = self.size
        block_stride, row_stride, *rest_strides = self.stride
        if block_stride != size * row_stride:
            raise ValueError(f"blocks of {size} rows of stride {row_stride} are {block_stride} apart, not back to back")
        return Store(self.base, (1, blocks * size, *rest), (blocks * block_stride, row_stride, *rest_strides), self.offset)


def stores_of(views: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[Store, Store]]:
    """Per layer, its K and V views (plain tensors) as :class:`Store` s, one ``base`` per storage."""
    bases: dict[int, torch.Tensor] = {}

    def store(view: torch.Tensor) -> Store:
        storage = view.untyped_storage()
        base = bases.get(storage.data_ptr())
        if base is None:
            base = bases[storage.data_ptr()] = torch.empty(0, dtype=view.dtype, device=view.device).set_(storage)
        return Store(base, tuple(view.shape), tuple(view.stride()), view.storage_offset())

    return [(store(k), store(v)) for k, v in views]


def write_columns(k_store: Store, v_store: Store, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                  starts: torch.Tensor) -> None:
    """Write each row's new K/V at its own positions of its slot, and nothing else
    (``torch.ops.vmkv.write_columns``).

    Args:
        k_store, v_store: a layer's K and V (:func:`stores_of`); every position written must be mapped.
        k, v: ``[B, kv_heads, S, head_dim]``, the new states in transformers' layout.
        slots: int64 ``[B]``, the slot of each row.
        starts: int64 ``[B]`` (or ``[]``: the same for every row), the first position each row writes.
    """
    if k_store.size != v_store.size:
        raise ValueError(f"K and V views differ in shape: {k_store.size} vs {v_store.size}")
    torch.ops.vmkv.write_columns(k_store.base, v_store.base, k, v, slots, starts, list(k_store.size),
                                 list(k_store.stride), k_store.offset, list(v_store.stride), v_store.offset)


def decode_store(q: torch.Tensor, k_store: Store, v_store: Store, kv_lens: torch.Tensor, scale: float,
                 max_kv_len: int, kernel: str, *, slots: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_attention` over one layer's stores as an operator a compiled region calls whole
    (``torch.ops.vmkv.decode_store``); arguments as :func:`decode_attention`'s. Returns ``[B, Hq, D]``.
    """
    return torch.ops.vmkv.decode_store(q, k_store.base, v_store.base, kv_lens, slots, block_table, list(k_store.size),
                                       list(k_store.stride), k_store.offset, list(v_store.stride), v_store.offset,
                                       float(scale), int(max_kv_len), kernel, int(window), float(softcap), sinks)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor, *, kernel: str,
                     slots: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     scale: float | None = None, max_kv_len: int, num_splits: int | None = None,
                     out: torch.Tensor | None = None, workspace: DecodeWorkspace | None = None,
                     window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention, one query token per row, over either addressing: the one entry point of every
    decode path, and capturable by a CUDA graph.

    ``kernel`` ``"triton"``: the split-KV Triton kernel; ``"sdpa_masked"``: SDPA over a fixed number
    of keys per row with the unseen ones masked (any device).

    Args:
        q: ``[B, Hq, D]``; k, v: the storage (slots: ``[max_batch, capacity, Hkv, D]``, blocks:
            ``[blocks, block_size, Hkv, D]``); kv_lens: int32 ``[B]``, keys per row.
        kernel: one of :data:`DECODE_KERNELS` (the caller's choice, made once).
        slots, block_table: exactly one (int32): contiguous or paged addressing.
        scale: softmax scale (default ``D ** -0.5``).
        max_kv_len: host upper bound on ``kv_lens`` (``max_seq_len``): fixes the launch shape.
        num_splits, workspace: the Triton kernel's split count and split scratch.
        out: ``[B, Hq, D]``, written in place and returned (default: a new tensor).
        window, softcap, sinks: the layer's :class:`~vmkv.kernels.base.Variant` (sinks: float32
            ``[Hq]`` on ``q``'s device); defaults: plain attention.

    Raises:
        InvalidInput: both or neither of ``slots`` and ``block_table``, or an unknown ``kernel``.
        InvalidInput, InvalidDtype, InvalidShape, InvalidDevice: a bad window, soft-cap or sinks.
        As the Triton kernel otherwise.
    """
    if (slots is None) == (block_table is None):
        raise InvalidInput("give exactly one of slots (contiguous addressing) and block_table (paged)")
    if kernel == "triton":
        return _triton_decode(q, k, v, kv_lens, slots=slots, block_table=block_table, scale=scale,
                              max_kv_len=max_kv_len, num_splits=num_splits, out=out, workspace=workspace,
                              window=window, softcap=softcap, sinks=sinks)
    if kernel != "sdpa_masked":
        raise InvalidInput(f"kernel must be one of {', '.join(DECODE_KERNELS)}, got {kernel!r}")
    variant = Variant(window, softcap, sinks)
    variant.check(q.shape[1], q.device)
    result = _masked_sdpa_decode(q, k, v, kv_lens, slots, block_table, scale, max_kv_len, variant)
    return result if out is None else out.copy_(result)


def _masked_sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor,
                        slots: torch.Tensor | None, block_table: torch.Tensor | None, scale: float | None,
                        max_kv_len: int, variant: Variant = PLAIN) -> torch.Tensor:
    """SDPA over a fixed number of keys per row, those a row does not see masked; ``[B, Hq, D]``. On a CPU
    (no graph) it reads no more than the longest row holds; with a window only what it can reach.
    """
    if q.device.type != "cuda":  # no graph captures a CPU run: read no more keys than the longest row holds
        max_kv_len = max(1, min(max_kv_len, int(kv_lens.max())))
    if variant.window:
        keys, values, valid = _window_keys(k, v, kv_lens, slots, block_table, max_kv_len, variant.window)
    else:
        if block_table is None:  # [B, L, Hkv, D]: each row's first L keys, copied once
            keys, values = k[:, :max_kv_len].index_select(0, slots.long()), v[:, :max_kv_len].index_select(0, slots.long())
        else:  # entries past a row's blocks may be -1 (no block): any block does, those keys are masked
            blocks = block_table[:, : -(-max_kv_len // k.shape[1])].long().clamp(min=0)
            keys, values = k[blocks].flatten(1, 2), v[blocks].flatten(1, 2)  # [B, blocks * block_size, Hkv, D]
        keys, values = keys[:, :max_kv_len], values[:, :max_kv_len]  # [B, L, Hkv, D]
        valid = torch.arange(keys.shape[1], device=q.device)[None, :] < kv_lens.long()[:, None]  # [B, L]
    if variant.features:  # keys a row does not see: zeros, so nothing non-finite there reaches it
        keys = keys.masked_fill(~valid[:, :, None, None], 0.0)
        values = values.masked_fill(~valid[:, :, None, None], 0.0)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, L, D]
    if needs_scores(variant):
        batch, q_heads, dim = q.shape
        q5 = q.reshape(batch, keys.shape[1], q_heads // keys.shape[1], 1, dim)  # [B, Hkv, G, 1, D]
        out = explicit_attention(q5, keys, values, dim ** -0.5 if scale is None else scale, variant,
                                 valid[:, None, None, None, :])
        return out.reshape(batch, q_heads, dim)
    result = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], keys, values, attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1])  # [B, Hq, 1, D]
    return result[:, :, 0]


def _window_keys(k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor, slots: torch.Tensor | None,
                 block_table: torch.Tensor | None, max_kv_len: int,
                 window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys a decode row's window can reach, a fixed number per row: ``(keys, values, valid)``,
    ``[B, L, Hkv, D]`` twice and bool ``[B, L]``. No entry of a block wholly before the window is read.
    """
    lens = kv_lens.long()
    first = first_key(lens - 1, window)  # [B]: each row's first key (its query is at kv_len - 1)
    if block_table is None:
        positions = first[:, None] + torch.arange(min(window, max_kv_len), device=lens.device)  # [B, L]
        rows, columns = slots.long()[:, None], positions.clamp_max(k.shape[1] - 1)
        keys, values = k[rows, columns], v[rows, columns]
    else:
        block, width = k.shape[1], block_table.shape[1]
        count = min(width, -(-(window - 1) // block) + 1)  # blocks `window` keys can touch
        cols = first[:, None] // block + torch.arange(count, device=lens.device)  # [B, count]
        blocks = block_table.gather(1, cols.clamp_max(width - 1)).long().clamp_min(0)
        keys, values = k[blocks].flatten(1, 2), v[blocks].flatten(1, 2)  # [B, count * block, Hkv, D]
        positions = (cols[:, :, None] * block + torch.arange(block, device=lens.device)).flatten(1)
    valid = (positions >= first[:, None]) & (positions < lens[:, None])
    return keys, values, valid


class MaskedDecode(AttentionKernel):
    """``"sdpa_masked"`` as a registry kernel (decode steps only), forced by name to compare it."""

    name = "sdpa_masked"
    features = ALL_FEATURES

    def __init__(self, addressing: str) -> None:
        self.addressing = addressing

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, meta: object,
            scale: float | None, variant: Variant = PLAIN) -> torch.Tensor:
        where = {"block_table": plan.block_table} if self.addressing == "blocks" else {"slots": plan.slots_t}
        return decode_attention(q, k, v, plan.kv_lens_t, kernel=self.name, scale=scale, max_kv_len=plan.max_kv,
                                window=variant.window, softcap=variant.softcap, sinks=variant.sinks, **where)
