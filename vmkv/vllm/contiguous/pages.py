"""Page size of contiguous mode: how vLLM's blocks become VMM pages of per-request slots.

Used on the worker side (each worker's slot space plans its slots) and by vLLM's front end
(the attention backend's preferred block size, :func:`plan_for_vllm`).

In contiguous mode every request owns a *slot*: a token-contiguous virtual range in each K/V
piece of the VMM layout (the layouts of :class:`~vmkv.vmm.cache.VirtualKVCache`: ``per_layer``
``[slots, tokens, kv_heads, head_dim]`` per layer and K/V, ``all_layers`` one K and one V range
``[slots, tokens, layers, kv_heads, head_dim]``, ``head_major`` per layer and head). Logical page
``j`` of a slot maps the physical page of vLLM block ``block_table[j]``, so vLLM's block table
*is* the page table and vLLM's prefix sharing is one physical page mapped into several slots.

**The rule** (:func:`plan_contiguous_pages`): *one vLLM block is one page in every piece.* A
piece's page must be a whole number of backend granules (``cuMemGetAllocationGranularity``:
2 MiB on NVIDIA GPUs; the OS page, 4 KiB, on the host) and of tokens, so the block size is a
multiple of ``granularity / gcd(granularity, token_bytes)`` tokens. Without a requested size
the plan takes the smallest such multiple that holds at least
:data:`~vmkv.sizing.DEFAULT_TOKENS_PER_PAGE` (16, vLLM's default) tokens. The layout is the
caller's (the device's slot layout, :data:`vmkv.vllm.contiguous.slots.SLOT_LAYOUTS`): on CUDA
``all_layers``, whose block is the smaller for every model measured in docs/vllm.md
("Contiguous mode: page size on CUDA"): 32 tokens for Llama-3-8B in fp16, where ``per_layer``
needs 1,024.

Several blocks in one page are refused, not planned: the page is then mapped at one place of one
slot, so its blocks must be consecutive logical blocks of one request in page order (page-affine
allocation that vLLM's prefix hits, preemption and the page-affine pool's fallback steps under
budget pressure cannot guarantee), and a prefix shares only whole pages anyway (another request
can map the page only if every block in it is shared). Smaller blocks would then buy nothing in
memory (the page is the unit of physical memory either way) and break "the block table is the
page table".

What follows from the rule, per request (fields and properties of :class:`ContiguousPagePlan`):

* waste bound: its last block, partly filled: ``block_size - 1`` tokens, i.e.
  ``(block_size - 1) * token_bytes`` in each piece and ``(block_size - 1)`` tokens of every
  layer's K and V in all; the same for every layout at one block size;
* prefix sharing: in whole blocks of ``block_size`` tokens (vLLM's own granularity);
* mappings: one page per piece per block (``pieces`` driver maps, each a ``cuMemUnmap`` of the
  zero page, ``cuMemMap`` and ``cuMemSetAccess``), ``pages_per_slot * pieces`` at
  ``max_model_len``; the count is the bytes mapped over the page size whatever the layout, but a
  layout with fewer pieces maps in smaller bursts (``pieces`` at once, once every
  ``block_size`` tokens of a decoding request).

Tensor and pipeline parallelism: a rank's token holds its own KV heads and its stage's layers
(Llama-3-70B at TP=8 keeps one KV head a rank: 512-token all-layers blocks), and vLLM has one
``block_size`` for every stage, so it must make whole granules in each (``stages``).

This module is pure: no device access (the caller passes the granularity: the worker's slot
space its backend's, the front end NVIDIA's), vLLM imported only by the functions that read a
``VllmConfig``, when called (the rest runs without vLLM). :func:`plan_for_vllm` is what vLLM's
front end calls to choose the block size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...config import KVShape, Layout, check_layout
from ...errors import InvalidConfig, InvalidInput
from ...sizes import format_size
from ...sizing import DEFAULT_TOKENS_PER_PAGE, smallest_page
from ...validate import is_int, positive_int


@dataclass(frozen=True)
class ContiguousPagePlan:
    """How vLLM's blocks map onto the pages of per-request slots (see the module docstring).

    Invariants: ``page_bytes == block_size * token_bytes`` is a multiple of ``granularity``;
    ``block_size`` is a multiple of ``min_block_size``; ``slot_tokens`` is the smallest multiple of
    ``block_size`` that holds ``max_model_len``.

    Attributes:
        layout: the VMM layout of the slots (``per_layer``, ``all_layers`` or ``head_major``).
        granularity: the backend's smallest mappable page, in bytes.
        token_bytes: bytes one token takes in one piece.
        pieces: pieces one block takes (one page each): ranges, times heads head-major.
        heads_per_range: pieces per range (``kv_heads`` head-major, else 1).
        block_size: tokens of one vLLM block, which is one page in every piece.
        min_block_size: the smallest block size whose page is whole granules (in every pipeline
            stage planned together); every valid block size is a multiple of it.
        page_bytes: bytes of one page (one piece of one block): the backend's ``page_size``.
        max_model_len: the longest request, in tokens.
        slot_tokens: tokens one slot holds: ``max_model_len`` rounded up to whole blocks.
        max_num_seqs: slots (requests running at once).
        reason: why this block size, in one sentence with the numbers.
    """

    layout: Layout
    granularity: int
    token_bytes: int
    pieces: int
    heads_per_range: int
    block_size: int
    min_block_size: int
    page_bytes: int
    max_model_len: int
    slot_tokens: int
    max_num_seqs: int
    reason: str

    @property
    def granules_per_page(self) -> int:
        """Backend granules in one page (one ``cuMemCreate`` handle of that many granules)."""
        return self.page_bytes // self.granularity

    @property
    def pages_per_slot(self) -> int:
        """Pages of one slot in one piece: the most blocks one request can hold."""
        return self.slot_tokens // self.block_size

    @property
    def ranges(self) -> int:
        """Virtual ranges to reserve (each holds every slot; ``pieces // heads_per_range``)."""
        return self.pieces // self.heads_per_range

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot in one range (all its heads, head-major)."""
        return self.heads_per_range * self.slot_tokens * self.token_bytes

    @property
    def reservation_bytes(self) -> int:
        """Bytes of one range: every slot (virtual address space only)."""
        return self.max_num_seqs * self.slot_bytes

    @property
    def block_bytes(self) -> int:
        """Physical bytes of one block in every piece: the unit memory is mapped and freed in."""
        return self.pieces * self.page_bytes

    @property
    def waste_tokens(self) -> int:
        """The most mapped but empty token positions of one request: its last block, partly filled."""
        return self.block_size - 1

    @property
    def waste_bytes_per_piece(self) -> int:
        """:attr:`waste_tokens` in one piece, in bytes."""
        return self.waste_tokens * self.token_bytes

    @property
    def waste_bytes(self) -> int:
        """:attr:`waste_tokens` in every piece (every layer's K and V), in bytes: the per-request
        waste bound of the model."""
        return self.waste_bytes_per_piece * self.pieces

    @property
    def sharing_tokens(self) -> int:
        """Prefix sharing granularity: requests share pages of whole blocks only."""
        return self.block_size

    @property
    def maps_per_block(self) -> int:
        """Pages mapped (``cuMemMap`` calls on CUDA) when a slot gets one more block."""
        return self.pieces

    @property
    def mappings_per_request(self) -> int:
        """Pages mapped for one request at ``max_model_len`` (``pages_per_slot * pieces``)."""
        return self.pages_per_slot * self.pieces

    @property
    def maps_per_decode_token(self) -> float:
        """Pages mapped per request per decoded token, on average (``pieces / block_size``)."""
        return self.pieces / self.block_size

    def page_offset(self, slot: int, logical_page: int, head: int = 0) -> int:
        """Where logical page ``logical_page`` of ``slot`` starts, in bytes from its range's start
        (the layout of :class:`~vmkv.vmm.cache.VirtualKVCache`: slot-major, head-major within a slot).

        Args:
            slot: the request's slot, ``0 <= slot < max_num_seqs``.
            logical_page: the block's index in the request's block table, ``< pages_per_slot``.
            head: head-major only: the KV head (``< heads_per_range``).

        Raises:
            InvalidInput: an index is out of range.
        """
        for name, value, bound in (("slot", slot, self.max_num_seqs), ("logical_page", logical_page, self.pages_per_slot),
                                   ("head", head, self.heads_per_range)):
            if not is_int(value, 0) or value >= bound:
                raise InvalidInput(f"page_offset: {name} must be an int in [0, {bound}), got {value!r}")
        return slot * self.slot_bytes + head * self.slot_tokens * self.token_bytes + logical_page * self.page_bytes

    def describe(self) -> str:
        """One line for logs and ``python -m vmkv.vllm``."""
        return (f"contiguous pages: {self.layout}, block_size {self.block_size} tokens = one "
                f"{format_size(self.page_bytes)} page ({self.granules_per_page} x {format_size(self.granularity)}) "
                f"in each of {self.pieces} pieces; waste <= {self.waste_tokens} tokens "
                f"({format_size(self.waste_bytes)}) a request; {self.reason}")


def min_block_size(shape: KVShape, granularity: int, layout: Layout) -> int:
    """The smallest block, in tokens, whose page in one piece of ``layout`` is whole granules.

    Raises:
        InvalidConfig: ``granularity`` is not a positive int, or ``layout`` is unknown.
    """
    positive_int("granularity", granularity)
    token_bytes = shape.token_bytes(layout)
    return granularity // math.gcd(granularity, token_bytes)


def _step(shapes: Sequence[KVShape], granularity: int, layout: Layout) -> int:
    """The smallest block valid for every shape: the lcm of their :func:`min_block_size`."""
    return math.lcm(*(min_block_size(shape, granularity, layout) for shape in shapes))


def _block_for(shapes: Sequence[KVShape], granularity: int, layout: Layout, requested: int | None) -> int:
    """The block size of ``layout`` for ``shapes`` (the first is this rank's): ``requested`` if its
    pages are whole granules in every shape, else raise; ``None``: the smallest such holding 16 tokens."""
    token_bytes, step = shapes[0].token_bytes(layout), _step(shapes, granularity, layout)
    if requested is None:  # the smallest page that is whole steps and holds DEFAULT_TOKENS_PER_PAGE tokens
        return smallest_page(token_bytes, step * token_bytes) // token_bytes
    if requested % step:
        stages = " on this pipeline stage, and the block must suit the other stages too" if len(shapes) > 1 else ""
        raise InvalidConfig(
            f"block_size {requested}: in the {layout} layout a token takes {token_bytes} B of a piece{stages} and pages are "
            f"whole {format_size(granularity)} granules, so one vLLM block (one page in every piece) must be a multiple "
            f"of {step} tokens (several blocks in one page are not supported: docs/vllm.md, \"Contiguous mode: page "
            f"size on CUDA\"); use block_size={-(-requested // step) * step} or leave it unset")
    return requested


def plan_contiguous_pages(shape: KVShape, granularity: int, *, max_model_len: int, max_num_seqs: int,
                          layout: Layout, block_size: int | None = None,
                          stages: Sequence[KVShape] = ()) -> ContiguousPagePlan:
    """Plan the pages of contiguous mode: one vLLM block is one page in every piece.

    Args:
        shape: the model's K/V geometry on this rank (KV heads per tensor-parallel rank, layers
            per pipeline stage).
        granularity: the backend's smallest mappable page in bytes (:func:`vmkv.vm.granularity`:
            2 MiB on CUDA, 4 KiB on the host).
        max_model_len: the longest request, in tokens.
        max_num_seqs: slots (requests running at once).
        layout: the slots' VMM layout (the device's: :data:`vmkv.vllm.contiguous.slots.SLOT_LAYOUTS`).
        block_size: the block size the user asked vLLM for; ``None``: the smallest valid one
            holding at least 16 tokens.
        stages: every pipeline stage's shape (this rank's among them) where stages hold different
            layer counts: vLLM has one ``block_size``, so it must make whole granules in each
            (``all_layers`` tokens take bytes in proportion to the stage's layers).

    Returns:
        The plan (its numbers are documented on :class:`ContiguousPagePlan`).

    Raises:
        InvalidConfig: a size is not a positive int, the layout is unknown, or ``block_size``
            makes pages that are not whole granules (the message names the sizes that work).
    """
    positive_int("granularity", granularity)
    positive_int("max_model_len", max_model_len)
    positive_int("max_num_seqs", max_num_seqs)
    if block_size is not None:
        positive_int("block_size", block_size)
    for other in (shape, *stages):
        if not isinstance(other, KVShape):
            raise InvalidConfig(f"shape and stages must be KVShape, got {type(other).__name__}")
    shapes = list(dict.fromkeys([shape, *stages]))  # this rank's first; equal stages once
    check_layout(layout)
    block = _block_for(shapes, granularity, layout, block_size)
    token_bytes = shape.token_bytes(layout)
    return ContiguousPagePlan(
        layout=layout, granularity=granularity, token_bytes=token_bytes, pieces=shape.pieces(layout),
        heads_per_range=shape.num_kv_heads if layout == "head_major" else 1, block_size=block,
        min_block_size=_step(shapes, granularity, layout), page_bytes=block * token_bytes,
        max_model_len=max_model_len, slot_tokens=-(-max_model_len // block) * block, max_num_seqs=max_num_seqs,
        reason=_reason(shapes, granularity, layout, block_size))


def _reason(shapes: Sequence[KVShape], granularity: int, layout: Layout, requested: int | None) -> str:
    """Why the plan has this block size, with the numbers."""
    why = (f"block_size {requested} as asked (a multiple of {_step(shapes, granularity, layout)})"
           if requested is not None else
           f"the smallest page of whole {format_size(granularity)} granules holding >= "
           f"{DEFAULT_TOKENS_PER_PAGE} tokens of {shapes[0].token_bytes(layout)} B")
    return why + (", valid in every pipeline stage" if len(shapes) > 1 else "")


def vllm_stage_shapes(vllm_config: Any) -> list[KVShape]:
    """The K/V geometry of every pipeline stage of a vLLM engine, on one tensor-parallel rank: KV
    heads per rank (``ModelConfig.get_num_kv_heads``), each stage's layers (vLLM's own split,
    ``get_pp_indices``), the KV cache dtype. For attention-only models (what contiguous mode runs).

    Raises:
        InvalidConfig: the KV cache dtype is not float16, bfloat16 or float32 (``cache_dtype``).
    """
    from vllm.distributed.utils import get_pp_indices
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise InvalidConfig(f"cache_dtype={cache.cache_dtype!r}: contiguous mode keeps K/V in float16, bfloat16 or float32")
    heads, head_dim = model.get_num_kv_heads(parallel), model.get_head_size()
    total, count = model.get_total_num_hidden_layers(), parallel.pipeline_parallel_size
    spans = [get_pp_indices(total, stage, count) for stage in range(count)]
    return [KVShape(end - start, heads, head_dim, dtype.itemsize) for start, end in spans]


def plan_for_vllm(vllm_config: Any, *, layout: Layout, granularity: int) -> ContiguousPagePlan:
    """The plan of this rank's pipeline stage of a vLLM engine (a block size valid in every stage).

    Args:
        vllm_config: vLLM's ``VllmConfig``: ``max_model_len``, ``max_num_seqs``, the parallel
            layout, and ``block_size`` if the user set it (``user_specified_block_size``; else
            the plan chooses it and the caller sets ``cache_config.block_size`` to it).
        layout: the slots' layout (the device's).
        granularity: the backend's smallest mappable page (vLLM's front end, which must not touch
            the GPU, passes the one NVIDIA GPUs report).

    Raises:
        InvalidConfig: as :func:`plan_contiguous_pages` and :func:`vllm_stage_shapes`.
    """
    shapes = vllm_stage_shapes(vllm_config)
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    stage = (parallel.rank // parallel.tensor_parallel_size) % parallel.pipeline_parallel_size  # vLLM's order: DP x PP x TP
    return plan_contiguous_pages(shapes[stage], granularity, max_model_len=vllm_config.model_config.max_model_len,
                                 max_num_seqs=vllm_config.scheduler_config.max_num_seqs, layout=layout,
                                 block_size=cache.block_size if cache.user_specified_block_size else None,
                                 stages=shapes)


__all__ = ["ContiguousPagePlan", "min_block_size", "plan_contiguous_pages", "plan_for_vllm", "vllm_stage_shapes"]
