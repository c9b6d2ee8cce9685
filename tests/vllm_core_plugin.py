"""A pytest plugin for vLLM 0.32's own ``tests/v1/core/`` (run by tests/vllm_core_suite.py).

With ``VMKV_CORE_POOL=1`` every vLLM ``KVCacheManager`` gets vmkv's block pool the way
``VmkvScheduler`` installs it (``PageAffineBlockPool.replacing`` + ``install_pool``, so the
allocation wrapper too), and a ``BlockPool`` a test module builds itself is a
``PageAffineBlockPool``. The layout is vLLM's CPU default shape: two layer runs of 1 KiB blocks
over 4 KiB pages (4 blocks a unit; runs not page-aligned unless the block count is a multiple of
4), the budget and the prefix-cache cap the whole buffer, so nothing but page affinity differs
from stock. Every such pool passes ``PageAffineBlockPool.check`` when its test ends (an error of
that test otherwise). Without the variable nothing changes: the stock run the outcomes are
compared with.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

ACTIVE = os.environ.get("VMKV_CORE_POOL") == "1"
_pools: list[Any] = []


def suite_layout(num_blocks: int) -> Any:
    from vmkv.vllm.layout import KVLayout, Segment

    return KVLayout([Segment(layer * num_blocks * 1024, 1024, 1024) for layer in range(2)], num_blocks,
                    2 * num_blocks * 1024, 4096)


def suite_budget(layout: Any) -> tuple[int, int]:
    """``(budget_pages, max_idle_units)``: the plugin's own rule with the whole buffer for both."""
    from vmkv.vllm.settings import PluginConfig, budget_settings

    return budget_settings(PluginConfig(page_size=layout.page_size, max_cached=layout.buffer_bytes), layout)


def _install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from vmkv.vllm.scheduler.block_pool import PageAffineBlockPool
    from vmkv.vllm.scheduler.scheduler import install_pool

    original_init = PageAffineBlockPool.__init__

    def tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _pools.append(self)

    PageAffineBlockPool.__init__ = tracked_init
    manager_init = KVCacheManager.__init__

    def manager_with_vmkv_pool(self: Any, *args: Any, **kwargs: Any) -> None:
        manager_init(self, *args, **kwargs)
        layout = suite_layout(self.block_pool.num_gpu_blocks)
        install_pool(self, PageAffineBlockPool.replacing(self.block_pool, layout, *suite_budget(layout)))

    KVCacheManager.__init__ = manager_with_vmkv_pool


class SuiteBlockPool:
    """Stands for ``BlockPool`` in a test module's namespace: builds a ``PageAffineBlockPool``."""

    def __new__(cls, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, **kwargs: Any) -> Any:
        from vmkv.vllm.scheduler.block_pool import PageAffineBlockPool

        layout = suite_layout(num_gpu_blocks)
        budget, idle = suite_budget(layout)
        return PageAffineBlockPool(num_gpu_blocks, enable_caching, hash_block_size, layout=layout,
                                   budget_pages=budget, max_idle_units=idle, **kwargs)


def pytest_configure(config: Any) -> None:
    if ACTIVE:
        _install()


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """Stock and plugin runs alike: no distributed/CUDA cleanup after each test (vLLM's own
    ``skip_global_cleanup`` marker; these scheduler-side tests start neither), ~1 s a test here."""
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


@pytest.fixture(autouse=True)
def _vmkv_pool_checked(request: Any, monkeypatch: Any) -> Any:
    if not ACTIVE:
        yield
        return
    from vllm.v1.core.block_pool import BlockPool

    module = getattr(request, "module", None)
    if module is not None and getattr(module, "BlockPool", None) is BlockPool:
        monkeypatch.setattr(module, "BlockPool", SuiteBlockPool)
    _pools.clear()
    yield
    pools, _pools[:] = list(_pools), []
    for pool in pools:
        pool.check()
