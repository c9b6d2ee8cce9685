"""Attention kernels of both modes, one package: contiguous (VMM mode's slots, :mod:`.contiguous`),
through block tables (paged mode, :mod:`.paged`), and the Triton kernels that read either
addressing (:mod:`.triton_attention`, :mod:`.triton`); one interface (plan, then run per layer:
:mod:`.base`) and one selection rule over the measured orders (:mod:`.registry`,
:mod:`.measured`, :mod:`.facts`)."""
