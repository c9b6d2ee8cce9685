"""A vLLM 0.32 ``BlockPool`` that hands out blocks page by page (scheduler side).

vLLM's ``BlockPool`` (``vllm/v1/core/block_pool.py``) decides which free block to use only through
``self.free_block_queue``; :class:`PageAffineBlockPool` keeps the pool and replaces that queue
with :class:`~vmkv.vllm.scheduler.free_blocks.PageAwareFreeBlocks`. ``reset_prefix_cache`` counts
every free block for its "nothing in use" check, ``evict_blocks`` empties unhashed blocks,
``unpin_blocks`` retains what it releases (mapped until reused), and ``trim`` evicts the pages
only prefix-cached blocks keep mapped.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from vllm.logger import init_logger
from vllm.v1.core.block_pool import BlockPool

from ...errors import InvalidConfig
from ..layout import KVLayout
from .free_blocks import PageAwareFreeBlocks

logger = init_logger(__name__)


class PageAffineBlockPool(BlockPool):
    """vLLM's ``BlockPool`` with page-affine allocation over ``layout`` within ``budget_pages``
    (``max_idle_units``: units only prefix-cached blocks may keep mapped); other arguments as ``BlockPool``'s.

    Raises:
        InvalidConfig: the layout has another block count, or the budget is too small.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, *,
                 layout: KVLayout, budget_pages: int, max_idle_units: int,
                 enable_kv_cache_events: bool = False, metrics_collector: Any = None, **kwargs: Any) -> None:
        if layout.num_blocks != num_gpu_blocks:
            raise InvalidConfig(f"vmkv: the KV layout has {layout.num_blocks} blocks, the pool {num_gpu_blocks}")
        super().__init__(num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events=enable_kv_cache_events,
                         metrics_collector=metrics_collector, **kwargs)
        for block in self.blocks:  # the stock queue's links are not used any more
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue: PageAwareFreeBlocks = PageAwareFreeBlocks(
            self.blocks, layout, budget_pages, max_idle_units, enable_caching, self._maybe_evict_cached_block)
        self.free_block_queue.pin(self.null_block)  # block 0: its unit stays mapped for good
        self.track_handed_out = False  # contiguous mode: remember the blocks handed out (take_handed_out)
        self._handed_out: list[int] = []

    @classmethod
    def replacing(cls, pool: BlockPool, layout: KVLayout, budget_pages: int, max_idle_units: int) -> "PageAffineBlockPool":
        """A pool with ``pool``'s settings, to take its place before any block is allocated.

        Raises:
            InvalidConfig: ``pool`` has handed out blocks already.
        """
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
            raise InvalidConfig("vmkv: the block pool can only be replaced before vLLM allocates blocks")
        return cls(pool.num_gpu_blocks, pool.enable_caching, pool.hash_block_size, layout=layout,
                   budget_pages=budget_pages, max_idle_units=max_idle_units,
                   enable_kv_cache_events=pool.enable_kv_cache_events, metrics_collector=pool.metrics_collector,
                   medium=pool.medium)

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        """vLLM's ``get_new_blocks``; with ``track_handed_out`` the blocks are remembered."""
        blocks = super().get_new_blocks(num_blocks)
        if self.track_handed_out:
            self._handed_out.extend(block.block_id for block in blocks)
        return blocks

    def take_handed_out(self) -> list[int]:
        """Blocks handed out empty since the last call (contiguous mode's write guard)."""
        out, self._handed_out = self._handed_out, []
        return out

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset (only when no block is in use), then unmap the pages it emptied."""
        with self.free_block_queue.counting_all():
            reset = super().reset_prefix_cache()
        if reset:
            self.free_block_queue.forget_hashes()
        return reset

    def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Callable[[Any], None]) -> None:
        """vLLM's ``unpin_blocks``; the blocks it releases are retained (module docstring)."""
        with self.free_block_queue.retaining():
            super().unpin_blocks(blocks, on_reuse)

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        for block_id in block_ids:
            self.free_block_queue.hash_removed(self.blocks[block_id])

    def trim(self) -> int:
        """Evict the pages only prefix-cached blocks keep mapped; return how many get unmapped."""
        pages = self.free_block_queue.trim()
        logger.debug("vmkv trim: %d pages to unmap", pages)
        return pages

    def check(self) -> None:
        """The pool's consistency, for tests (vLLM's core tests run it on every pool): every block but the
        null block is free exactly when its ``ref_cnt`` is 0, and once; the null block is never free or
        hashed; with the whole buffer as budget the free count is stock's; one allocation of the free
        count succeeds.

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        queue = self.free_block_queue
        listed = [block.block_id for block in queue.get_all_free_blocks()]
        free = set(listed)
        if len(free) != len(listed):
            raise AssertionError(f"a block is free twice: {sorted(b for b in free if listed.count(b) > 1)}")
        null = self.null_block
        if null.block_id != 0 or not null.is_null or 0 in free or null.block_hash is not None \
                or 0 in self.cached_block_hashes_by_block:
            raise AssertionError(f"the null block was touched: {null!r}")
        for block in self.blocks[1:]:
            if block.is_null or block.ref_cnt < 0 or (block.ref_cnt == 0) != (block.block_id in free):
                state = "free" if block.block_id in free else "not free"
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt} and is {state}")
        for entry in self.cached_block_hash_to_block._cache.values():
            if null in (entry.values() if isinstance(entry, dict) else [entry]):
                raise AssertionError("a prefix-cache entry names the null block")
        if queue.budget_pages >= queue.layout.num_pages and self.get_num_free_blocks() != len(free):
            raise AssertionError(f"{self.get_num_free_blocks()} blocks counted free, {len(free)} are")
        queue.check()
