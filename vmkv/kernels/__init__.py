"""Attention kernels of both modes: contiguous (VMM mode, :mod:`.contiguous`) and through block
tables (paged mode, :mod:`.paged`)."""
