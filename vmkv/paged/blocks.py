"""The block pools and block table of a paged cache: paged mode's addressing.

    K pool  [num_layers, num_blocks, block_size, kv_heads, head_dim]     (V alike)
    block table  int32 [max_batch_size, max_pages_per_seq]   (host memory; -1 = no block)

Token ``t`` of a sequence is row ``table[slot, t // B] * B + t % B`` of a layer's flattened pool.

Invariant: ``table[slot, i] == seq.pages[i]`` for every live sequence and ``i < len(seq.pages)``,
and ``-1`` everywhere else (:meth:`BlockPools.check`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config import KVCacheConfig, PageGeometry
from ..core.sequence import LiveSequence
from ..errors import InvalidConfig
from ..sizes import format_size

NO_BLOCK = -1


class BlockPools:
    """A paged cache's pools and table (:class:`~vmkv.core.ownership.Addressing`).

    Attributes:
        k, v: ``[num_layers, num_blocks, block_size, kv_heads, head_dim]``, zeroed at open (no read
            sees uninitialised memory).
        table: int32 ``[max_batch_size, max_pages_per_seq]`` on the host.

    Raises:
        InvalidConfig: the pools could not be allocated on the device.
    """

    def __init__(self, config: KVCacheConfig, geometry: PageGeometry, max_pages_per_seq: int,
                 log: Callable[[Callable[[], None]], None]) -> None:
        self.block_size = config.block_size
        self._device = config.device
        self._log = log
        shape = (config.num_layers, geometry.num_pages, config.block_size, config.num_kv_heads, config.head_dim)
        try:
            self.k = torch.zeros(shape, dtype=config.dtype, device=config.device)
            self.v = torch.zeros(shape, dtype=config.dtype, device=config.device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise InvalidConfig(
                f"memory_budget {format_size(config.memory_budget)}: the block pools could not be allocated "
                f"on {config.device} ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            ) from None
        self.table = torch.full((config.max_batch_size, max_pages_per_seq), NO_BLOCK, dtype=torch.int32)

    def attach(self, slot: int, index: int, page: int, old: int | None, keep: int) -> None:
        """Point entry ``slot``/``index`` at block ``page`` (journaled), copying ``old``'s first ``keep`` tokens first."""
        if keep:  # copy-on-write: the stored tokens of the block in every layer, K and V (one op each)
            self.k[:, page, :keep].copy_(self.k[:, old, :keep])
            self.v[:, page, :keep].copy_(self.v[:, old, :keep])
        self._set_entry(slot, index, page)

    def detach(self, slot: int, index: int, page: int) -> None:
        """Clear entry ``slot``/``index`` (journaled)."""
        self._set_entry(slot, index, NO_BLOCK)

    def _set_entry(self, slot: int, index: int, block: int) -> None:
        before = int(self.table[slot, index])
        self.table[slot, index] = block
        self._log(lambda: self.table.__setitem__((slot, index), before))

    def release(self, pages: list[int]) -> None:
        """Nothing to give back: the pools are allocated up front; ``close()`` frees them."""

    def token_rows(self, slot: int, pages: list[int], start: int, count: int) -> torch.Tensor:
        """Rows ``block * block_size + offset`` of the tokens (the slot mapping)."""
        block = self.block_size
        first = start // block
        positions = torch.arange(start, start + count)
        blocks = torch.tensor(pages[first : (start + count - 1) // block + 1], dtype=torch.long)
        return blocks[positions // block - first] * block + positions % block

    def block_table(self, seqs: list[LiveSequence], kv_lens: list[int]) -> torch.Tensor:
        """int32 ``[B, max_blocks]`` rows of the step's sequences on the cache's device; entries past a
        sequence's length may be anything (kernels read ``kv_lens`` tokens).
        """
        width = max(-(-n // self.block_size) for n in kv_lens)
        slots = torch.tensor([seq.slot for seq in seqs], dtype=torch.long)
        return self.table[slots, :width].to(self._device)

    def check(self, seqs: list[LiveSequence]) -> None:
        """Each live sequence's row lists exactly its pages, then -1; a free slot's row is all -1."""
        expected = torch.full_like(self.table, NO_BLOCK)
        for seq in seqs:
            expected[seq.slot, : len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
        bad = (self.table != expected).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"block table rows {bad} disagree with the sequences' pages"
