"""``--scheduler-cls vmkv.vllm.scheduler.VmkvScheduler``: installs the page-affine block pool.

vLLM 0.32 builds one ``BlockPool`` in the ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``)
through its coordinator (``vllm/v1/core/kv_cache_coordinator.py``) and hands it, with its null
block, to every ``SingleTypeKVCacheManager``. :class:`VmkvScheduler` puts a
:class:`~vmkv.vllm.scheduler.block_pool.PageAffineBlockPool` in all those places before any block
is allocated (:func:`install_pool`), and wraps each manager's ``allocate_new_blocks`` to tell the
pool the request's last block (page affinity). Constructing it returns a
:class:`VmkvAsyncScheduler` when the config asks for async scheduling.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

from ...errors import InvalidConfig
from .. import settings as plugin
from ..connector import VmkvConnector
from .block_pool import PageAffineBlockPool
from .share import engine_wake

logger = init_logger(__name__)


class VmkvScheduler(Scheduler):
    """vLLM's scheduler with the page-affine block pool.

    Raises:
        InvalidConfig: the engine was not given vmkv's KV connector, or the model's KV cache is
            not supported (:func:`vmkv.vllm.layout.check_supported`).
        UnsupportedVllm: not vLLM 0.32.
    """

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> "VmkvScheduler":
        if cls is VmkvScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = VmkvAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        plugin.check_vllm()
        super().__init__(vllm_config, *args, **kwargs)
        if not isinstance(self.connector, VmkvConnector):
            raise InvalidConfig(
                f"{plugin.SCHEDULER_CLS} needs vmkv's KV connector: start vLLM with "
                f"--kv-transfer-config '{{\"kv_connector\":\"{plugin.CONNECTOR_NAME}\",\"kv_connector_module_path\":"
                f"\"{plugin.CONNECTOR_MODULE}\",\"kv_role\":\"kv_producer\"}}' (or vmkv.vllm.engine_args())")
        half = self.connector.connector_scheduler
        manager = self.kv_cache_manager
        pool = PageAffineBlockPool.replacing(manager.block_pool, *half.pool_settings(vllm_config))
        install_pool(manager, pool)
        self.connector.bind_kv_cache_manager(manager)
        logger.info("vmkv: page-affine block pool installed (%s)", pool.free_block_queue.layout)
        share = half.join_ledger(vllm_config.parallel_config.world_size, engine_wake())
        if share is not None:
            manager.coordinator.get_num_blocks_to_allocate = _with_room(manager.coordinator, pool)
            logger.info("vmkv: joined ledger %r (%d B): pages are mapped as it grants them", share.ledger.name,
                        share.ledger.budget)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``schedule``, after serving other ledger members' requests (a step boundary)."""
        self.connector.connector_scheduler.step_boundary()
        return super().schedule(*args, **kwargs)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's ``update_from_output``; then the step is done on every worker (its unmaps too)."""
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.connector.connector_scheduler.step_finished(scheduler_output.kv_connector_metadata)
        return outputs


def install_pool(manager: Any, pool: PageAffineBlockPool) -> None:
    """Put ``pool`` in every place of ``manager`` that holds its block pool or that pool's null block
    (``_null_block`` is compared with ``==``, which includes ``ref_cnt``), before any allocation.

    Raises:
        InvalidConfig: a KV cache group has a pool of its own, or a group manager lacks the null
            block attribute this code knows (not vLLM 0.32's layout).
    """
    old = manager.block_pool
    coordinator = manager.coordinator
    for index, single in enumerate(coordinator.single_type_managers):
        if single.block_pool is not old:
            raise InvalidConfig(f"vmkv: KV cache group {index} has its own block pool (unsupported layout)")
        if getattr(single, "_null_block", None) is not old.null_block:
            raise InvalidConfig(f"vmkv: KV cache group {index}'s manager does not keep the pool's null block "
                                "as _null_block (not vLLM 0.32's layout)")
    for single in coordinator.single_type_managers:
        single.block_pool = pool
        single._null_block = pool.null_block
        single.allocate_new_blocks = _with_affinity(single, pool)
    coordinator.block_pool = pool
    manager.block_pool = pool


def _with_affinity(manager: Any, pool: PageAffineBlockPool) -> Any:
    """``manager.allocate_new_blocks`` that tells ``pool`` the request's last block (if only that request
    holds it) while it runs; calls that allocate nothing go straight through.
    """
    allocate = manager.allocate_new_blocks
    stock = type(manager).allocate_new_blocks is SingleTypeKVCacheManager.allocate_new_blocks

    def allocate_new_blocks(request_id: str, num_tokens: int, num_tokens_main_model: int) -> Any:
        blocks = manager.req_to_blocks.get(request_id) or ()
        if stock and not _allocates(manager, request_id, num_tokens, len(blocks)):
            return allocate(request_id, num_tokens, num_tokens_main_model)
        last = blocks[-1] if blocks else None
        own = last is not None and not last.is_null and last.ref_cnt == 1
        with pool.free_block_queue.affinity(last.block_id if own else None):
            return allocate(request_id, num_tokens, num_tokens_main_model)

    return allocate_new_blocks


def _with_room(coordinator: Any, pool: PageAffineBlockPool) -> Any:
    """``coordinator.get_num_blocks_to_allocate`` that first takes the grants the blocks need (shared budget)."""
    count = coordinator.get_num_blocks_to_allocate

    def get_num_blocks_to_allocate(*args: Any, **kwargs: Any) -> int:
        blocks = count(*args, **kwargs)
        pool.free_block_queue.make_room(blocks)
        return blocks

    return get_num_blocks_to_allocate


def _allocates(manager: Any, request_id: str, num_tokens: int, num_blocks: int) -> bool:
    """Whether vLLM 0.32's ``allocate_new_blocks`` takes blocks from the pool for this call."""
    return request_id in manager._partial_hit_reqs or -(-num_tokens // manager.block_size) > num_blocks


class VmkvAsyncScheduler(VmkvScheduler, AsyncScheduler):
    """:class:`VmkvScheduler` over vLLM's ``AsyncScheduler`` (chosen automatically)."""
