"""The one place that decides a VMM cache's layout and page size, from the device's facts.

A page must be a whole number of the backend's granule (4 KiB on the host, usually 2 MiB on
CUDA) and of the bytes one token takes in one piece of the layout; and on the host every page
mapped one by one costs up to two of the mappings Linux allows a process (``vm.max_map_count``).
Those are the device's facts (:class:`DeviceFacts`, read once per decision). One resolver
(:func:`choose_layout`) takes each user's candidate layouts and page sizes, best first, and
returns the first whose pool fits the mappings:

* the core cache's default (:func:`default_pages`): :func:`core_layouts` by device and dtype, at
  least :data:`DEFAULT_TOKENS_PER_PAGE` tokens a page, a pool of the memory budget;
* transformers' ``VirtualCache`` (:mod:`vmkv.hf.options`): the layout its attention reads
  fastest, pages grown until the first batch fits half the mappings left;
* vLLM's contiguous mode: one candidate per device (:data:`vmkv.vllm.contiguous.slots.SLOT_LAYOUTS`,
  the layout its slots map with vLLM's KV layout to match), its page one vLLM block in every
  piece (:mod:`vmkv.vllm.contiguous.pages`, by the same :func:`smallest_page`); one candidate
  leaves the resolver nothing to choose, so the plugin does not call it.

:class:`~vmkv.config.KVCacheConfig` only validates what the user gave: a ``None`` layout or page
size is resolved here when a cache opens (:func:`resolve`); ``cache.config`` holds the result.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import KVCacheConfig, KVShape, PageGeometry, check_mode
from .errors import InvalidConfig
from .sizes import format_size

log = logging.getLogger("vmkv")

DEFAULT_TOKENS_PER_PAGE = 16
"""The fewest tokens a default VMM page holds (vLLM's default block size). What utilization each
page size gives on the ShareGPT-like trace: docs/benchmarks.md (``vmkv bench memory``)."""

CUDA_GRANULARITY = 2 << 20
"""NVIDIA GPUs' usual ``cuMemGetAllocationGranularity`` (minimum): the granularity assumed where the
CUDA driver cannot be asked (a cache then says why it cannot open; vLLM's front end, which must not
touch the GPU, plans contiguous mode's block size with it)."""


@dataclass(frozen=True)
class DeviceFacts:
    """What a device allows a VMM cache's pages.

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"``.
        granularity: the backend's smallest mappable page, in bytes.
        mapping_room: host: mappings this process may still create (``None``: unbounded, or
            unknown); always ``None`` on CUDA.
    """

    device_type: str
    granularity: int
    mapping_room: int | None = None

    @classmethod
    def probe(cls, device: torch.device, *, mappings: bool = True) -> "DeviceFacts":
        """The facts of ``device`` now (the mapping room lists ``/proc/self/maps``: pass
        ``mappings=False`` where no decision needs it)."""
        from .vm import granularity, mapping_room  # the backends import the config, which this module imports

        try:
            gran = granularity(device)
        except Exception:  # noqa: BLE001 -- no CUDA driver: the cache will say so when it opens
            gran = CUDA_GRANULARITY
        room = mapping_room() if mappings and device.type == "cpu" else None
        return cls(device.type, gran, room)


def device_memory(device: torch.device) -> int | None:
    """Bytes of physical memory on ``device`` (host RAM for the CPU), or ``None`` if unknown."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return torch.cuda.mem_get_info(device)[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_budget_fits(config: KVCacheConfig) -> None:
    """Refuse a ``memory_budget`` larger than the device's whole memory: such a cache would be
    killed by the OS (or fail in the driver) long before it reported ``OutOfPages``.

    Raises:
        InvalidConfig: the budget exceeds the device's memory.
    """
    total = device_memory(config.device)
    if total is not None and config.memory_budget > total:
        raise InvalidConfig(
            f"memory_budget {format_size(config.memory_budget)} exceeds the memory of {config.device} "
            f"({format_size(total)} in all); lower it"
        )


def smallest_page(token_bytes: int, granularity: int, min_tokens: int = DEFAULT_TOKENS_PER_PAGE) -> int:
    """The smallest page that is a multiple of ``granularity`` and of ``token_bytes`` and holds at
    least ``min_tokens`` tokens.

    Args:
        token_bytes: bytes one token takes in one piece (:meth:`KVShape.token_bytes`).
        granularity: the backend's smallest mappable page.
        min_tokens: the fewest tokens the page must hold.
    """
    step = math.lcm(granularity, token_bytes)
    return step * max(1, -(-min_tokens * token_bytes // step))


def fragmented_mappings(pieces: int, pages: int) -> int:
    """The most host mappings ``pages`` pool pages of ``pieces`` pieces each can take: each range
    is one, and a page mapped apart from its neighbours splits its range once more."""
    return pieces * (2 * pages + 1)


Candidate = tuple[str, Sequence[int]]
"""A layout a caller would take, and the page sizes (bytes of one piece's page) it would take it
at, in its order of preference."""


def choose_layout(shape: KVShape, candidates: Iterable[Candidate], room: int | None,
                  pool_pages: Callable[[str, int], int]) -> tuple[str, int] | None:
    """The layout decision every user of a VMM cache goes through: the first of ``candidates``, at
    the first of its page sizes, whose pool of ``pool_pages(layout, page)`` pages fits ``room``
    host mappings even fragmented (:func:`fragmented_mappings`). Each caller passes its own
    candidates and pool (the core: :func:`core_layouts` and its budget; transformers: the layout
    its attention reads fastest and its first batch, :mod:`vmkv.hf.options`).

    Args:
        shape: the model's K/V geometry.
        candidates: ``(layout, page sizes)``, best first.
        room: host mappings the pool may take; ``None`` (CUDA, or no limit): any.
        pool_pages: pool pages a cache of ``layout`` with pages of ``page`` bytes holds.

    Returns:
        ``(layout, page_size)``, or ``None`` if no candidate fits (the caller's fallback then).
    """
    for layout, pages in candidates:
        pieces = shape.pieces(layout)
        for page in pages:
            if room is None or fragmented_mappings(pieces, pool_pages(layout, page)) <= room:
                return layout, page
    return None


def core_layouts(device_type: str, dtype: torch.dtype) -> tuple[str, ...]:
    """The core cache's candidate layouts, best first, each at its smallest page holding at least
    :data:`DEFAULT_TOKENS_PER_PAGE` tokens (:func:`default_pages`):

    * host, float16/bfloat16: ``head_major``, ``per_layer``, ``all_layers``;
    * host, float32: ``per_layer``, ``all_layers`` (head-major gains nothing in float32);
    * CUDA: ``all_layers`` (with 2 MiB granules the only layout near 16-32 tokens a page).

    Why this order (what CPU SDPA reads fastest, what utilization each page size gives):
    docs/how-it-works.md, "Layouts". The last is ``all_layers``: its pages cover ``num_layers``
    times fewer tokens for the same bytes, so it needs the fewest mappings.
    """
    if device_type != "cpu":
        return ("all_layers",)
    if dtype == torch.float32:
        return ("per_layer", "all_layers")
    return ("head_major", "per_layer", "all_layers")


def default_pages(shape: KVShape, dtype: torch.dtype, budget: int, facts: DeviceFacts,
                  layout: str | None = None) -> tuple[str, int]:
    """The core cache's default ``(layout, page_size)``: :func:`choose_layout` over
    :func:`core_layouts`, whose pool is ``budget``, within the host's mapping room. If no layout
    fits, the last (``all_layers``), its page enlarged until it fits.

    Args:
        shape: the model's K/V geometry.
        dtype: of K and V.
        budget: bytes of physical memory for pages.
        facts: the device's facts.
        layout: size pages for this layout; ``None``: choose it as above.
    """
    layouts = (layout,) if layout is not None else core_layouts(facts.device_type, dtype)
    smallest = {c: smallest_page(shape.token_bytes(c), facts.granularity) for c in layouts}
    room = facts.mapping_room
    chosen = choose_layout(shape, [(c, (smallest[c],)) for c in layouts], room,
                           lambda c, page: budget // (shape.pieces(c) * page))
    if chosen is not None:
        return chosen
    assert room is not None  # an unbounded room takes the first candidate
    layout = layouts[-1]
    pieces, step = shape.pieces(layout), math.lcm(facts.granularity, shape.token_bytes(layout))
    pages_that_fit = max(1, (room // pieces - 1) // 2)
    return layout, max(smallest[layout], -(-budget // (pieces * pages_that_fit * step)) * step)


def resolve(config: KVCacheConfig, facts: DeviceFacts | None = None) -> KVCacheConfig:
    """``config`` with its VMM layout and page size decided: what the user gave, else
    :func:`default_pages` (a page size given without a layout: ``per_layer``).

    Args:
        facts: the device's facts (default: probed now, the mapping room only if a default needs it).
    """
    if config.layout is not None and config.page_size is not None:
        return config
    if config.page_size is not None:
        return config.replace(layout="per_layer")
    facts = facts or DeviceFacts.probe(config.device)
    layout, page = default_pages(config.kv_shape, config.dtype, config.memory_budget, facts, config.layout)
    return config.replace(layout=layout, page_size=page)


def check_page_size(config: KVCacheConfig, granularity: int) -> None:
    """Refuse a ``page_size`` that no VMM cache of ``config`` (resolved) could map. Both modes
    call it: paged mode ignores a given page size but validates it all the same, so that a
    setting is never accepted silently in one mode and refused in the other.

    Raises:
        InvalidConfig: the page size is not a multiple of the backend granularity or of the
            bytes one token takes in one tensor of ``config.layout``.
    """
    token_bytes, page = config.tensor_token_bytes(), config.page_size
    if page % granularity or page % token_bytes:
        step = math.lcm(granularity, token_bytes)
        suggestion = max(step, page // step * step)
        raise InvalidConfig(
            f"page_size {page} must be a multiple of the backend granularity ({granularity} B) and of "
            f"the bytes one token takes in one {config.layout} tensor ({token_bytes} B); "
            f"try page_size={suggestion}"
        )


def vmm_geometry(config: KVCacheConfig, granularity: int) -> PageGeometry:
    """Page geometry of VMM mode for a resolved ``config``: a page is ``page_size`` bytes in each
    virtual K/V piece (head-major: each head of each range is a piece).

    Raises:
        InvalidConfig: the page size is not a multiple of the backend granularity or of the
            bytes one token takes in one tensor, or the budget holds no page.
    """
    check_page_size(config, granularity)
    num_tensors, token_bytes = config.kv_shape.pieces(config.layout), config.tensor_token_bytes()
    page = config.page_size
    num_pages = config.memory_budget // (num_tensors * page)
    if num_pages == 0:
        raise InvalidConfig(
            f"memory_budget {config.memory_budget} B holds no page of {num_tensors} x {page} B; "
            "raise the budget or lower page_size"
        )
    return PageGeometry(page // token_bytes, num_tensors, page, num_pages)


def check_cache_options(config: KVCacheConfig, mode: str) -> PageGeometry:
    """Refuse what opening a ``mode`` cache of ``config`` would refuse for its options, without
    allocating anything: the page size (both modes), the geometry, the budget against the
    device's memory. For callers with slow work between choosing and opening (``vmkv serve``
    loads weights: a bad option must not wait for them).

    Returns:
        The page geometry the cache will have.

    Raises:
        InvalidConfig: an unknown mode, or an option the cache would refuse.
        BackendUnavailable: the device's backend is not available.
    """
    from .vm import granularity  # the backends import the config, which this module imports

    check_mode(mode)
    gran = granularity(config.device)  # raises where the backend is unavailable
    if mode == "vmm":
        geometry = vmm_geometry(resolve(config, DeviceFacts.probe(config.device)), gran)
    else:
        if config.page_size is not None:
            check_page_size(resolve(config), gran)
        geometry = paged_geometry(config)
    check_budget_fits(config)
    return geometry


def paged_geometry(config: KVCacheConfig) -> PageGeometry:
    """Page geometry of paged mode: a page is one block of ``block_size`` tokens in every tensor.

    Raises:
        InvalidConfig: the budget holds no block, or the block table (int32, ``max_batch_size``
            rows of ``max_seq_len / block_size`` entries, in host memory) would not fit the host.
    """
    piece = config.block_size * config.layer_token_bytes
    num_tensors = 2 * config.num_layers
    num_pages = config.memory_budget // (num_tensors * piece)
    if num_pages == 0:
        raise InvalidConfig(
            f"memory_budget {config.memory_budget} B holds no block of {config.block_size} tokens "
            f"({num_tensors * piece} B across all layers); raise the budget"
        )
    table_bytes = config.max_batch_size * -(-config.max_seq_len // config.block_size) * 4
    host = device_memory(torch.device("cpu"))
    if host is not None and table_bytes > host:
        raise InvalidConfig(
            f"the block table of max_batch_size={config.max_batch_size} x max_seq_len={config.max_seq_len} "
            f"(blocks of {config.block_size} tokens) takes {format_size(table_bytes)}, more than this host's "
            f"{format_size(host)}; lower max_seq_len or max_batch_size, or raise block_size"
        )
    return PageGeometry(config.block_size, num_tensors, piece, num_pages)


def check_mappings(config: KVCacheConfig, geometry: PageGeometry, facts: DeviceFacts) -> int:
    """How many host mappings a cache of ``config`` needs, checked against the mapping room.

    Each range is one mapping; a run of mapped pages that are neighbours in the page store
    merges into one more, and splits the range once more. Pages mapped one by one (a
    fragmented pool) cost up to two each: if that worst case does not fit, a warning is
    logged and a map that hits the limit raises ``OutOfMappings`` (an ``OutOfPages``), rolled
    back. Returns the mappings promised (0 on CUDA: no such limit).

    Raises:
        InvalidConfig: not even one mapping per page fits; names a page size that does.
    """
    room = facts.mapping_room
    if facts.device_type != "cpu":
        return 0
    tensors = geometry.num_tensors
    typical, worst = tensors * (geometry.num_pages + 1), fragmented_mappings(tensors, geometry.num_pages)
    if room is None or worst <= room:
        return typical
    step = math.lcm(facts.granularity, geometry.piece_bytes // geometry.tokens_per_page)
    most_pages = max(1, (room // tensors - 1) // 2)
    fits = -(-config.memory_budget // (tensors * most_pages * step)) * step
    advice = (f"page_size={format_size(fits)} or larger fits even a fragmented pool (or use the all_layers "
              "layout, a smaller memory_budget, or raise the limit: sysctl -w vm.max_map_count=N)")
    if typical > room:
        raise InvalidConfig(
            f"page_size {format_size(config.page_size)} makes {geometry.num_pages} pages in each of {tensors} "
            f"ranges: {typical} mappings or more, but this process may create only {room} more "
            f"(Linux vm.max_map_count); {advice}"
        )
    log.warning("vmkv: %d pages in %d ranges may need up to %d mappings when fragmented, %d are left "
                "(Linux vm.max_map_count): a step may then raise OutOfMappings; %s",
                geometry.num_pages, tensors, worst, room, advice)
    return typical


def mappable_pages(pieces: int, room: int | None) -> int:
    """Pool pages of ``pieces`` pieces whose mappings (two per page and range when fragmented)
    fit in half of ``room`` (unbounded when ``None``)."""
    if room is None:
        return 1 << 62
    return max(1, (room // 2 // pieces - 1) // 2)


def layer_groups(config: KVCacheConfig, facts: DeviceFacts | None = None) -> list[tuple[list[int], KVCacheConfig]]:
    """How a model whose layers have different windows (``config.layer_windows``) shares a cache:
    a core cache per window (:mod:`vmkv.core.groups`), as ``(layers, config)`` pairs in the order
    of their first layer. ``memory_budget`` is split by what each group holds at most per row: a
    full layer ``max_seq_len`` tokens, a windowed one its window and slack, the longest step
    (``max_step_tokens``) and three pages, so each group's pages run out together.

    Raises:
        InvalidConfig: a shared budget (each group would be a member of its own: not supported).
    """
    if config.shared_budget is not None:
        raise InvalidConfig("shared_budget with layers of different windows is not supported: "
                            "give every layer the same window, or leave the shared budget out")
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(config.layer_windows):
        by_window.setdefault(window, []).append(layer)
    groups, needs = [], []
    for window, layers in by_window.items():
        sub = config.replace(num_layers=len(layers), layer_windows=(window,) * len(layers))
        tpp = _tokens_per_page(sub, facts)
        slack = tpp if config.window_slack is None else config.window_slack
        step = config.max_step_tokens or config.max_seq_len
        # a partly filled page at each end, and one more taken before any is let go (an undoable step)
        span = config.max_seq_len if not window else min(config.max_seq_len, window + slack + step + 3 * tpp)
        groups.append((layers, sub))
        needs.append(span * sub.bytes_per_token)
    return [(layers, sub.replace(memory_budget=config.memory_budget * need // sum(needs)))
            for (layers, sub), need in zip(groups, needs)]


def _tokens_per_page(config: KVCacheConfig, facts: DeviceFacts | None) -> int:
    """Tokens of the larger of ``config``'s VMM page (resolved) and its paged block: what a
    windowed group keeps at each end of a row, for the budget split of either mode."""
    resolved = resolve(config, facts)
    return max(resolved.page_size // resolved.tensor_token_bytes(), config.block_size)


def model_windows(config: Any) -> tuple[int, ...] | None:
    """Each layer's sliding window from a Hugging Face model config, as transformers' caches read
    it (``layer_types``, else every layer windowed when ``sliding_window`` is set); ``None``: no
    layer has one. Chunked attention (Llama 4) is no window: those layers keep every token."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * config.num_hidden_layers
    windows = tuple(window if kind == "sliding_attention" and window else 0 for kind in types)
    return windows if any(windows) else None

