"""Shared fixtures: small caches of either mode, one torch thread. Shared helpers (the small
geometry, the dense reference, the K/V mirror) live in helpers.py."""

from __future__ import annotations

import pytest
import torch
from helpers import MODES, small_config

import vmkv


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny matmuls on a shared 2-core machine: one thread is far faster than oversubscribed ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture
def make_cache(mode):
    """Build caches of the parametrised mode; closes them after the test."""
    caches = []

    def make(**overrides) -> vmkv.KVCacheBase:
        cache = vmkv.open_cache(small_config(**overrides), mode=mode)
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()
