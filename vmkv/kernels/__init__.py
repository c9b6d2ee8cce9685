"""Attention kernels of both modes, one package: contiguous (VMM mode, :mod:`.contiguous`),
through block tables (paged mode, :mod:`.paged`), and the Triton kernels that read either
addressing (:mod:`.triton_attention`)."""
