"""Virtual-memory backends: ``host`` (Linux mmap + memfd) and ``cuda`` (CUDA driver VMM)."""

from __future__ import annotations

import torch

from .base import VirtualMemory
from .host import HostVirtualMemory, free_map_count, mapping_room


def open_backend(device: torch.device, page_size: int, num_pages: int, *, max_mappings: int = 0,
                 on_demand: bool = False) -> VirtualMemory:
    """Return the backend for ``device`` with a store of ``num_pages`` pages of ``page_size`` bytes.

    Args:
        max_mappings: host only: the most mappings the caller will need (checked against
            ``vm.max_map_count``; 0 skips the check).
        on_demand: CUDA only: create pages when provisioned, give them back when released.

    Raises:
        BackendUnavailable: CUDA was asked for but the driver, a GPU or cuda-bindings is missing.
        InvalidConfig: the host process cannot create ``max_mappings`` more mappings.
    """
    if device.type == "cuda":
        from .cuda import CudaVirtualMemory  # imported lazily: cuda-bindings is an optional extra

        return CudaVirtualMemory(page_size, num_pages, device=device, on_demand=on_demand)
    return HostVirtualMemory(page_size, num_pages, max_mappings=max_mappings)


def granularity(device: torch.device) -> int:
    """The smallest page size the backend for ``device`` can map, in bytes."""
    if device.type == "cuda":
        from .cuda import cuda_granularity

        return cuda_granularity(device)
    import mmap

    return mmap.PAGESIZE


__all__ = ["VirtualMemory", "HostVirtualMemory", "open_backend", "granularity", "free_map_count", "mapping_room"]
