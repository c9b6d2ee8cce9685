"""Attention kernels of both modes: over slots (:mod:`.contiguous`), through block tables
(:mod:`.paged`), Triton for either; one interface (:mod:`.base`) and one selection rule
(:mod:`.registry`).
"""
