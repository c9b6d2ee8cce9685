"""Which pages of vLLM's KV buffer each KV block occupies: both sides compute it and must agree.

vLLM 0.32 places all layers' KV in one buffer (``vllm/v1/kv_cache_interface.py``,
``KVCacheTensor``) and views it per layer (``create_kv_cache_views`` in
``vllm/v1/worker/utils.py``); the layout (LBHNC, BLHNC, ...) decides how a block splits into runs.
The geometry is read off vLLM's own views, as ``KVBlockZeroer`` does: the scheduler builds them
on the ``meta`` device, the worker checks its real ones give the same :attr:`KVLayout.fingerprint`.

    segment   one run of a block: bytes [start + b * stride, + span) of the buffer, for every b
    page      one backend page of the buffer (page_size bytes; what vmkv maps and unmaps)
    unit      the fewest consecutive blocks whose runs cover whole pages (the page-affine pool's granule)

A page is mapped while any block whose runs touch it holds data.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from ..errors import InvalidConfig


@dataclass(frozen=True, order=True)
class Segment:
    """One run of bytes of every block: block ``b`` covers ``[start + b * stride, + span)``."""

    start: int
    stride: int
    span: int


def view_segments(view: torch.Tensor, num_blocks: int) -> list[Segment]:
    """The runs one KV view gives every block, in bytes from the start of its storage (dimension 0
    walks blocks, or ``ratio`` kernel blocks per block).

    Raises:
        InvalidConfig: dimension 0 is not a whole number of kernel blocks per block.
    """
    if view.dim() == 0 or view.shape[0] % num_blocks:
        raise InvalidConfig(f"a KV view of shape {tuple(view.shape)} does not walk {num_blocks} blocks in dimension 0")
    element = view.element_size()
    base = view.storage_offset() * element
    ratio = view.shape[0] // num_blocks
    block_stride = view.stride(0) * element
    outer = [d for d in range(1, view.dim()) if view.stride(d) * element > block_stride and view.shape[d] > 1]
    inner = [d for d in range(1, view.dim()) if d not in outer]
    span = element + sum((view.shape[d] - 1) * view.stride(d) * element for d in inner)
    segments = []
    for index in itertools.product(*(range(view.shape[d]) for d in outer)):
        offset = base + sum(i * view.stride(d) * element for i, d in zip(index, outer))
        segments += [Segment(offset + j * block_stride, block_stride * ratio, span) for j in range(ratio)]
    return segments


def normalize(segments: Iterable[Segment]) -> tuple[Segment, ...]:
    """Merge runs that continue each other and overlays of the same bytes, so equal geometry compares equal."""
    widest: dict[tuple[int, int], int] = {}
    for seg in segments:
        widest[(seg.start, seg.stride)] = max(widest.get((seg.start, seg.stride), 0), seg.span)
    merged: list[Segment] = []
    ends: dict[tuple[int, int], int] = {}  # (stride, end) -> index in merged
    for (start, stride), span in sorted(widest.items()):
        index = ends.pop((stride, start), None)
        if index is None:
            merged.append(Segment(start, stride, span))
            index = len(merged) - 1
        else:
            prev = merged[index]
            merged[index] = Segment(prev.start, stride, prev.span + span)
        last = merged[index]
        ends[(stride, last.start + last.span)] = index
    return tuple(sorted(merged))


class KVLayout:
    """Blocks -> units -> pages of one KV buffer (``num_blocks``: vLLM's count, block 0 its null block).

    Raises:
        InvalidConfig: a size is not positive, or a run reaches past the buffer.
    """

    def __init__(self, segments: Iterable[Segment], num_blocks: int, buffer_bytes: int, page_size: int) -> None:
        if num_blocks <= 0 or buffer_bytes <= 0 or page_size <= 0:
            raise InvalidConfig(f"KV layout: blocks {num_blocks}, buffer {buffer_bytes} B and page {page_size} B "
                                "must be positive")
        self.segments = normalize(segments)
        if not self.segments:
            raise InvalidConfig("KV layout: no KV views to place")
        for seg in self.segments:
            if seg.start < 0 or seg.span <= 0 or seg.start + (num_blocks - 1) * seg.stride + seg.span > buffer_bytes:
                raise InvalidConfig(f"KV layout: run {seg} of {num_blocks} blocks does not fit the {buffer_bytes} B buffer")
        self.num_blocks = num_blocks
        self.buffer_bytes = buffer_bytes
        self.page_size = page_size
        self.num_pages = -(-buffer_bytes // page_size)
        per_unit = 1
        for seg in self.segments:
            per_unit = math.lcm(per_unit, page_size // math.gcd(page_size, seg.stride)) if seg.stride else per_unit
        self.blocks_per_unit = min(per_unit, num_blocks)
        self.num_units = -(-num_blocks // self.blocks_per_unit)
        self._pages: dict[int, tuple[int, ...]] = {}
        self.max_pages_per_unit = self._max_pages_bound()
        digest = hashlib.sha256(repr((self.segments, num_blocks, buffer_bytes, page_size)).encode())
        self.fingerprint = digest.hexdigest()[:16]

    def __repr__(self) -> str:
        return (f"KVLayout({self.num_blocks} blocks, {len(self.segments)} runs each, {self.num_pages} pages of "
                f"{self.page_size} B, {self.blocks_per_unit} blocks a unit, <= {self.max_pages_per_unit} pages a unit)")

    def unit_of(self, block_id: int) -> int:
        """The unit holding block ``block_id``."""
        return block_id // self.blocks_per_unit

    def unit_blocks(self, unit: int) -> range:
        """The block ids of ``unit``."""
        first = unit * self.blocks_per_unit
        return range(first, min(first + self.blocks_per_unit, self.num_blocks))

    def unit_pages(self, unit: int) -> tuple[int, ...]:
        """The sorted pages any block of ``unit`` touches (exact; cached)."""
        pages = self._pages.get(unit)
        if pages is None:
            blocks = self.unit_blocks(unit)
            touched: set[int] = set()
            for seg in self.segments:
                if seg.stride - seg.span < self.page_size:  # no whole page between runs: one range
                    first = (seg.start + blocks[0] * seg.stride) // self.page_size
                    last = (seg.start + blocks[-1] * seg.stride + seg.span - 1) // self.page_size
                    touched.update(range(first, last + 1))
                    continue
                for block in blocks:
                    begin = seg.start + block * seg.stride
                    touched.update(range(begin // self.page_size, (begin + seg.span - 1) // self.page_size + 1))
            pages = self._pages[unit] = tuple(sorted(touched))
        return pages

    def _max_pages_bound(self) -> int:
        """An upper bound of ``len(unit_pages(u))`` over all units (a run's offset in its page is the same in every unit)."""
        page, k = self.page_size, self.blocks_per_unit
        total = 0
        for seg in self.segments:
            if seg.stride - seg.span < page:
                length = (k - 1) * seg.stride + seg.span
                total += (seg.start % page + length - 1) // page + 1
            else:
                total += sum(((seg.start + j * seg.stride) % page + seg.span - 1) // page + 1 for j in range(k))
        return max(1, min(total, self.num_pages))


def layout_from_views(views: Mapping[str, torch.Tensor], num_blocks: int, buffer_bytes: int, page_size: int) -> KVLayout:
    """The :class:`KVLayout` of vLLM's per-layer KV views (layers sharing one view count once)."""
    seen: set[tuple[Any, ...]] = set()
    segments: list[Segment] = []
    for view in views.values():
        key = (view.storage_offset(), tuple(view.shape), tuple(view.stride()), view.dtype)
        if key not in seen:
            seen.add(key)
            segments += view_segments(view, num_blocks)
    return KVLayout(segments, num_blocks, buffer_bytes, page_size)


def buffer_bytes(kv_cache_config: Any) -> int:
    """Bytes of the backing allocation vLLM sizes for ``kv_cache_config``.

    Raises:
        InvalidConfig: the config has no KV tensors, or they disagree on the size.
    """
    sizes = {tensor.size for tensor in kv_cache_config.kv_cache_tensors}
    if len(sizes) != 1:
        raise InvalidConfig(f"vmkv: expected one shared KV allocation, vLLM's config has sizes {sorted(sizes)}")
    return sizes.pop()


def check_supported(kv_cache_config: Any) -> None:
    """Refuse KV cache configurations the plugin does not handle, naming why: Mamba/linear-attention
    state and mixed KV precisions (vLLM zeroes their new blocks before any connector hook, possibly
    into an unmapped page) and host-resident groups.

    Raises:
        InvalidConfig: the configuration is not supported.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs  # when called: see the module docstring

    if kv_cache_config.needs_kv_cache_zeroing:
        raise InvalidConfig("vmkv's vLLM plugin does not support models whose new KV blocks vLLM must zero "
                            "(Mamba/linear-attention layers or mixed KV precisions)")
    for group in kv_cache_config.kv_cache_groups:
        specs = (group.kv_cache_spec.kv_cache_specs.values() if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
                 else [group.kv_cache_spec])
        for spec in specs:
            if group.host_resident or not isinstance(spec, AttentionSpec) or not spec.has_layer_views:
                raise InvalidConfig(f"vmkv's vLLM plugin supports device-resident attention KV only, not {type(spec).__name__}"
                                    f"{' (host-resident)' if group.host_resident else ''}")
    buffer_bytes(kv_cache_config)


def vllm_allocate_kv_cache() -> Callable[..., dict[str, torch.Tensor]]:
    """vLLM's own ``allocate_kv_cache``, never the plugin's replacement (kept as ``__wrapped__``)."""
    from vllm.v1.worker import utils  # when called: see the module docstring

    allocate = utils.allocate_kv_cache
    return getattr(allocate, "__wrapped__", allocate)


def meta_layout(kv_cache_config: Any, layout: Any, page_size: int) -> KVLayout:
    """The layout vLLM's view builder gives ``kv_cache_config`` (with the resolved ``layout`` and
    ``page_size``), computed without memory.
    """
    views = vllm_allocate_kv_cache()(kv_cache_config, torch.device("meta"), layout, None)
    return layout_from_views(views, kv_cache_config.num_blocks, buffer_bytes(kv_cache_config), page_size)
