"""Attention kernels, one package for both cache modes (see :mod:`vmkv.kernels.triton_attention`
for the Triton kernels that read either addressing)."""
