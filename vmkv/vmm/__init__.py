"""VMM mode: virtually contiguous K/V tensors backed by pages on demand (:class:`VirtualKVCache`)."""

from .cache import VirtualKVCache

__all__ = ["VirtualKVCache"]
