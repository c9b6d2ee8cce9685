"""The kernels graph paths call: what a compiled step (``torch.compile``) or a captured CUDA graph
may run over a cache's fixed virtual addresses.

Two rules make a kernel usable there:

* **It touches only the positions it names.** A compiled write into a VMM tensor must not be
  widened into a copy of the whole tensor: inductor functionalizes an in-place write into a view
  (``narrow(...).copy_``) as a full clone of the base and a copy back, and the copy back writes
  every page of the range, the empty ones too, which are the read-only zero page (SIGSEGV on the
  host, a fault on the GPU). :func:`write_columns` is an operator of its own
  (``torch.ops.vmkv.write_columns``) whose schema declares what it mutates: the tensor over the
  layer's whole storage (:class:`Store`), a graph input of its own that no other input aliases,
  so inductor calls it in place (it re-inplaces the functional form of an op whose mutated input
  is a graph input), cannot look inside it, and CUDA graphs accept the mutation.
* **Its launches depend on host ints known up front** and its lengths live on the device, so one
  capture serves every step: :func:`decode_attention` takes the cache's lengths as a device
  tensor and an upper bound on them as a host int; :func:`decode_store` is the same kernel as an
  operator (``torch.ops.vmkv.decode_store``) a compiled region calls without tracing into it.

This module is the one place the graph paths (``vmkv.hf.compiled``, ``vmkv.engine.graphs``) get
their kernels from. Eager steps take their kernel from :mod:`vmkv.kernels.registry`; a graph
needs one that is capturable as well, which today only the Triton kernels are (elsewhere:
SDPA over whole slots, masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidInput
from .triton_attention import DecodeWorkspace, triton_available
from .triton_attention import decode_attention as _triton_decode

__all__ = ["DecodeWorkspace", "Store", "decode_attention", "decode_kernel_name", "decode_store", "stores_of",
           "write_columns"]


_LIBRARY = torch.library.Library("vmkv", "FRAGMENT")  # noqa: TOR901 - the schema says what is mutated
_LIBRARY.define("write_columns(Tensor(a!) k_base, Tensor(b!) v_base, Tensor k, Tensor v, Tensor slots, Tensor starts, "
                "SymInt[] size, SymInt[] k_stride, SymInt k_offset, SymInt[] v_stride, SymInt v_offset) -> ()")
_LIBRARY.define("decode_store(Tensor q, Tensor k_base, Tensor v_base, Tensor kv_lens, Tensor? slots, "
                "Tensor? block_table, SymInt[] size, SymInt[] k_stride, SymInt k_offset, SymInt[] v_stride, "
                "SymInt v_offset, float scale, int max_kv_len) -> Tensor")


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
                  k_offset: int, v_stride: list[int], v_offset: int, scale: float, max_kv_len: int) -> torch.Tensor:
    k_store = k_base.as_strided(size, k_stride, k_offset)  # slots: [max_batch, capacity, Hkv, D]; blocks: [N, size, Hkv, D]
    v_store = v_base.as_strided(size, v_stride, v_offset)
    return decode_attention(q, k_store, v_store, kv_lens, slots=slots, block_table=block_table, scale=scale,
                            max_kv_len=max_kv_len, out=torch.empty_like(q))


_LIBRARY.impl("decode_store", _decode_store, "CompositeExplicitAutograd")


@torch.library.register_fake("vmkv::decode_store")
def _decode_store_fake(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor, kv_lens: torch.Tensor,
                       slots: torch.Tensor | None, block_table: torch.Tensor | None, size: list[int], k_stride: list[int],
                       k_offset: int, v_stride: list[int], v_offset: int, scale: float, max_kv_len: int) -> torch.Tensor:
    return torch.empty_like(q)


@dataclass(frozen=True)
class Store:
    """One layer's K or V as a graph path sees it: ``base``, a 1-D tensor over the whole storage
    the layer lives in, and the layer's ``[max_batch, capacity, kv_heads, head_dim]`` view of it.

    A compiled region takes ``base`` as its input and mutates it, not the layer's view: the views
    of an all-layers range share one storage, and a compiled region whose mutated inputs alias
    each other gets them merged into a synthetic base, which CUDA graphs refuse to capture
    (inductor: "skipping cudagraphs due to mutated inputs"). Made by :func:`stores_of`.
    """

    base: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def view(self) -> torch.Tensor:
        """The layer's view (inside a compiled region: a view of the input ``base``)."""
        return self.base.as_strided(self.size, self.stride, self.offset)

    def token_rows(self) -> "Store":
        """A block pool ``[blocks, block_size, H, D]`` as ``[1, blocks * block_size, H, D]``: one
        slot whose positions are the pool's token rows (what :func:`write_columns` writes paged
        mode through).

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
    (``torch.ops.vmkv.write_columns``: its schema names the two storages it mutates).

    Args:
        k_store, v_store: a layer's K and V (:func:`stores_of` of ``cache.kv_cache(layer)``, any
            strides). Every position written must be in a mapped page: the caller's eager point
            mapped it.
        k, v: ``[B, kv_heads, S, head_dim]``, the new states in transformers' layout.
        slots: int64 ``[B]``, the slot of each row.
        starts: int64 ``[B]`` (or ``[]``: the same for every row), the first position each row writes.
    """
    if k_store.size != v_store.size:
        raise ValueError(f"K and V views differ in shape: {k_store.size} vs {v_store.size}")
    torch.ops.vmkv.write_columns(k_store.base, v_store.base, k, v, slots, starts, list(k_store.size),
                                 list(k_store.stride), k_store.offset, list(v_store.stride), v_store.offset)


def decode_store(q: torch.Tensor, k_store: Store, v_store: Store, kv_lens: torch.Tensor, scale: float,
                 max_kv_len: int, *, slots: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over one layer's stores, as an operator a compiled region calls as a
    whole (``torch.ops.vmkv.decode_store``: dynamo does not trace into the kernel's launch logic,
    and inductor cannot widen its reads): :func:`decode_attention` over either addressing.

    Args:
        q: ``[B, Hq, D]``, one query token per row.
        k_store, v_store: the layer's K and V (:func:`stores_of`): ``[max_batch, capacity, Hkv, D]``
            with ``slots``, block pools ``[blocks, block_size, Hkv, D]`` with ``block_table``.
        kv_lens: int32 ``[B]`` on the device, keys per row (the new token's included).
        scale: softmax scale.
        max_kv_len: host upper bound on ``kv_lens`` (fixes the launch).
        slots, block_table: exactly one, int32 on the device: each row's slot, or its blocks.

    Returns:
        ``[B, Hq, D]``, a new tensor.
    """
    return torch.ops.vmkv.decode_store(q, k_store.base, v_store.base, kv_lens, slots, block_table, list(k_store.size),
                                       list(k_store.stride), k_store.offset, list(v_store.stride), v_store.offset,
                                       float(scale), int(max_kv_len))


def decode_kernel_name(device: torch.device) -> str:
    """The kernel :func:`decode_attention` runs on ``device``: ``"triton"`` (CUDA, or CPU tensors
    in Triton's interpreter) or ``"sdpa-masked"`` (CPU: SDPA over each row's whole slot or blocks,
    keys past its length masked)."""
    return "triton" if triton_available(device)[0] else "sdpa-masked"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor, *,
                     slots: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     scale: float | None = None, max_kv_len: int, out: torch.Tensor,
                     workspace: DecodeWorkspace | None = None) -> torch.Tensor:
    """Decode attention a CUDA graph can capture: one query token per row, over either addressing.

    On CUDA (and CPU tensors in Triton's interpreter) the split-KV Triton kernel
    (:func:`vmkv.kernels.triton_attention.decode_attention`) with the split count fixed by
    ``max_kv_len``, writing into ``out``. Elsewhere (CPU without the interpreter) a masked SDPA
    reference over each row's storage (its slot, or its blocks gathered); it reads every position
    up to ``max_kv_len`` (past a row's length: the zero page, or whatever blocks hold), so it is
    for tests and CPU runs.

    Args:
        q: ``[B, Hq, D]``; k, v: the storage (see the Triton kernel); kv_lens: int32 ``[B]``.
        slots, block_table: exactly one (int32): contiguous or paged addressing.
        scale: softmax scale (default ``D ** -0.5``).
        max_kv_len: host upper bound on ``kv_lens`` (``max_seq_len``): fixes the launch shape.
        out: ``[B, Hq, D]``, written in place and returned.
        workspace: split-KV scratch for the Triton kernel.

    Raises:
        InvalidInput: both or neither of ``slots`` and ``block_table``.
        As the Triton kernel otherwise (on CUDA or in the interpreter).
    """
    if (slots is None) == (block_table is None):
        raise InvalidInput("give exactly one of slots (contiguous addressing) and block_table (paged)")
    if triton_available(q.device)[0]:
        return _triton_decode(q, k, v, kv_lens, slots=slots, block_table=block_table, scale=scale,
                              max_kv_len=max_kv_len, out=out, workspace=workspace)
    return _masked_sdpa_decode(q, k, v, kv_lens, slots, block_table, scale, max_kv_len, out)


def _masked_sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor,
                        slots: torch.Tensor | None, block_table: torch.Tensor | None, scale: float | None,
                        max_kv_len: int, out: torch.Tensor) -> torch.Tensor:
    """SDPA over each row's first ``max_kv_len`` keys (its slot, or its blocks in table order)
    with the keys at or past its length masked."""
    if block_table is None:
        keys, values = k.index_select(0, slots.long()), v.index_select(0, slots.long())  # [B, capacity, Hkv, D]
    else:  # entries past a row's blocks may be -1 (no block): any block does, those keys are masked
        blocks = block_table.long().clamp(min=0)
        keys, values = k[blocks].flatten(1, 2), v[blocks].flatten(1, 2)  # [B, blocks * block_size, Hkv, D]
    keys = keys[:, :max_kv_len].transpose(1, 2)  # [B, Hkv, L, D]
    values = values[:, :max_kv_len].transpose(1, 2)
    mask = torch.arange(keys.shape[2], device=q.device)[None, :] < kv_lens.long()[:, None]  # [B, L]
    result = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], keys, values, attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1])  # [B, Hq, 1, D]
    return out.copy_(result[:, :, 0])
