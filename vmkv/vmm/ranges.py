"""The reserved virtual ranges of a VMM cache, and the pool pages mapped into them.

Each range holds ``max_batch`` slots of ``seq_capacity`` tokens, reserved once (its address never
changes). Logical page ``i`` of slot ``s`` in piece ``t`` lives at::

    base[t // heads_per_range] + s * slot_bytes + (t % heads_per_range) * run_bytes + i * page_bytes

Unmapped pages are the shared zero page. VMM mode's :class:`~vmkv.core.ownership.Addressing`:
every map and unmap journals its inverse.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch

from ..config import KVCacheConfig, PageGeometry
from ..sizing import DeviceFacts, check_mappings
from ..vm import VirtualMemory, open_backend
from .memory import MappedPages

if TYPE_CHECKING:
    from ..core.budget import CacheBudget
    from ..core.sequence import LiveSequence

class SlotRanges:
    """The ranges of one cache: the backend, its reservations, the zero-copy views over them.

    Attributes:
        vm: the backend; ``None`` once closed.
        memory: which pool pages hold memory.
        seq_capacity: tokens of one slot (``max_seq_len`` rounded up to whole pages).
        slot_bytes: bytes of one slot in one range.
        k, v: per layer, ``[max_batch, seq_capacity, kv_heads, head_dim]`` views.
        budget: the shared budget whose grants a new page needs.

    Raises:
        InvalidConfig: (host) more mappings than Linux's ``vm.max_map_count`` leaves.
        BackendUnavailable: CUDA was asked for but is not available.
    """

    def __init__(self, config: KVCacheConfig, geometry: PageGeometry, facts: DeviceFacts,
                 log: Callable[[Callable[[], None]], None]) -> None:
        self.config, self.geometry, self._log = config, geometry, log
        tpp = geometry.tokens_per_page
        self.seq_capacity = -(-config.max_seq_len // tpp) * tpp
        self._heads_per_range = config.num_kv_heads if config.layout == "head_major" else 1
        self._run_bytes = self.seq_capacity * geometry.piece_bytes // tpp  # one slot (one head's run, head-major)
        self.slot_bytes = self._heads_per_range * self._run_bytes
        self.budget: CacheBudget | None = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.vm: VirtualMemory | None = open_backend(
            config.device, geometry.piece_bytes, geometry.num_pages * geometry.num_tensors,
            max_mappings=check_mappings(config, geometry, facts), on_demand=config.shared_budget is not None)
        try:
            self._bases = [self.vm.reserve(config.max_batch_size * self.slot_bytes)
                           for _ in range(geometry.num_tensors // self._heads_per_range)]
            self.k, self.v = self._views()
            self.memory = MappedPages(self.vm, geometry)
        except BaseException:
            self.close()
            raise

    @property
    def reserved_bytes(self) -> int:
        """Virtual address space reserved (every range)."""
        return len(self._bases) * self.config.max_batch_size * self.slot_bytes

    def _views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zero-copy tensors over the ranges: ``[max_batch, seq_capacity, heads, dim]`` per layer."""
        config, vm = self.config, self.vm
        heads, dim, layers = config.num_kv_heads, config.head_dim, config.num_layers
        shape = (config.max_batch_size, self.seq_capacity)
        if config.layout == "per_layer":
            views = [vm.tensor(base, (*shape, heads, dim), config.dtype) for base in self._bases]
            return views[0::2], views[1::2]
        if config.layout == "head_major":  # [B, H, S, D] ranges, seen as [B, S, H, D] like the others
            batch, capacity = shape
            views = [vm.tensor(base, (batch, heads, capacity, dim), config.dtype).transpose(1, 2) for base in self._bases]
            return views[0::2], views[1::2]
        k_all, v_all = (vm.tensor(base, (*shape, layers, heads, dim), config.dtype) for base in self._bases)
        return [k_all[:, :, layer] for layer in range(layers)], [v_all[:, :, layer] for layer in range(layers)]

    def addr(self, tensor: int, slot: int, index: int) -> int:
        """Address of piece ``tensor``'s logical page ``index`` of ``slot``."""
        base, head = divmod(tensor, self._heads_per_range)
        return self._bases[base] + slot * self.slot_bytes + head * self._run_bytes + index * self.geometry.piece_bytes

    # ---- Addressing ------------------------------------------------------------------------
    def attach(self, slot: int, index: int, page: int, old: int | None, keep: int) -> None:
        """Map ``page`` in every range at ``slot``/``index`` (replacing ``old``, its first ``keep`` tokens
        copied first); each backend call journals its inverse.

        Raises:
            OutOfPages: a shared budget has no grant left for a page that holds no memory yet.
            BackendError, OutOfMappings: the backend refused (rolled back by the caller).
        """
        vm, pieces = self.vm, self.geometry.num_tensors
        nbytes = keep * self.geometry.piece_bytes // self.geometry.tokens_per_page  # the stored tokens only
        addrs = [self.addr(t, slot, index) for t in range(pieces)]
        saved = [vm.tensor(a, (nbytes,), torch.uint8).clone() for a in addrs] if keep else []
        if self.budget is not None and self.memory.fresh([page]):
            self.budget.check_granted()
        # No kernel may still read these addresses: ``old`` goes away, and on CUDA even the zero
        # page is unmapped for a moment (padded kernels read past a sequence's length).
        vm.synchronize()
        if old is None:  # a new page (the common case): one backend call maps every piece
            vm.map_pages([(addr, self.memory.piece(page, t)) for t, addr in enumerate(addrs)])
            self._log(functools.partial(self._unmap_all, addrs))
        else:
            for t, addr in enumerate(addrs):
                vm.unmap(addr)
                self._log(functools.partial(vm.map, addr, self.memory.piece(old, t)))
                vm.map(addr, self.memory.piece(page, t))
                self._log(functools.partial(vm.unmap, addr))
        for addr, data in zip(addrs, saved):
            vm.tensor(addr, (nbytes,), torch.uint8).copy_(data)
        self.memory.mapped(page)

    def _unmap_all(self, addrs: list[int]) -> None:
        """Unmap every address of ``addrs``, last first (the undo of ``map_pages``)."""
        for addr in reversed(addrs):
            self.vm.unmap(addr)

    def detach(self, slot: int, index: int, page: int) -> None:
        """Unmap ``page`` at ``slot``/``index`` in every range (journaled); it reads as zeros again."""
        self.vm.synchronize()  # no kernel may still read the page we take away
        for t in range(self.geometry.num_tensors):
            addr = self.addr(t, slot, index)
            self.vm.unmap(addr)
            self._log(functools.partial(self.vm.map, addr, self.memory.piece(page, t)))

    def release(self, pages: list[int]) -> None:
        """Give the memory of free pages back to the OS (only pages mapped since their last release)."""
        self.memory.release(pages)

    def token_rows(self, slot: int, pages: list[int], start: int, count: int) -> torch.Tensor:
        """Rows ``slot * seq_capacity + position`` of a layer's flattened token rows."""
        return torch.arange(start, start + count) + slot * self.seq_capacity

    def block_table(self, seqs: list["LiveSequence"], kv_lens: list[int]) -> None:
        """None: kernels read each slot's range directly."""
        return None

    def check(self, seqs: list["LiveSequence"]) -> None:
        """Nothing beyond the pool's checks: a range maps exactly the pages ownership attached."""

    def close(self) -> None:
        """Release the backend (views read zeros from now on). Idempotent."""
        self.k = self.v = []
        vm, self.vm = self.vm, None
        if vm is not None:
            vm.synchronize()
            vm.close()

