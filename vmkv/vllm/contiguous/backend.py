"""vLLM's attention backend in contiguous mode (``kv_mode="contiguous"``): the stock kernel on slots.

Worker side (the builder and the kernel run in every worker), and vLLM's front end, which picks
the backend and its block size (:func:`install_platform_hook`,
:meth:`VmkvContiguousBackend.get_preferred_block_size`).

vLLM keeps scheduling, prefix caching, preemption and parallelism; its KV buffer stays the paged
buffer vmkv backs (:mod:`vmkv.vllm.worker`), and new K/V are written there through vLLM's own
slot mapping (:meth:`VmkvContiguousImpl.do_kv_cache_update`). Attention never reads it through a
block table: every request's K/V is one virtually contiguous slot per layer
(:mod:`vmkv.vllm.contiguous.slots`) and the kernel is the one :mod:`vmkv.kernels.contiguous` chooses for the VMM
cache (:func:`vmkv.kernels.registry.make_kernel`: on CPU torch SDPA, one batched call for
the decode rows or one call per sequence, as its rule decides), on the same
:class:`~vmkv.core.step.StepPlan` the VMM cache gives it.

Per step, once for all layers (:class:`VmkvContiguousBuilder`): the rows' slots come from the
worker's :class:`~vmkv.vllm.contiguous.slots.SlotSpace` (checked against vLLM's block table), and the plan
holds each row's cached length (``seq_len - query_len``, so prefix hits and chunked prefill
attend to the cached part), its new tokens and its slot.

How vLLM picks it: the CPU platform always answers ``CPU_ATTN`` for non-MLA models
(``CpuPlatform.get_attn_backend_cls``), so :func:`install_platform_hook` wraps that method to
answer this backend exactly when the engine's KV connector is vmkv's with
``kv_mode="contiguous"`` (:func:`~vmkv.vllm.contiguous.support.contiguous_requested`). On GPU the
backend is registered as vLLM's ``CUSTOM`` backend and selected by ``--attention-backend CUSTOM``
(which :func:`vmkv.vllm.engine_args` adds; :func:`~vmkv.vllm.contiguous.support.check_attention_backend`
refuses a GPU engine without it); it asks vLLM for block-outermost blocks (``BLHNC``) and, when no
block size is set, for the all-layers plan's (:meth:`VmkvContiguousBackend.get_preferred_block_size`), and its kernel is
FlashAttention's ``flash_attn_with_kvcache`` with ``cache_batch_idx`` where flash-attn imports
(the same rule names what runs otherwise). It declares no CUDA graph support.

The worker's slot space is found through the engine's KV connector (its worker half makes it);
what the mode supports is checked at engine start by :mod:`vmkv.vllm.contiguous.support`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from ...core.step import StepPlan, make_plan
from ...errors import InvalidConfig
from ...kernels.registry import KernelSpec, make_kernel
from ...sizing import CUDA_GRANULARITY
from ..connector import VmkvConnector
from .pages import plan_for_vllm
from .slots import SlotSpace, slot_layout
from .support import contiguous_requested

BACKEND_PATH = "vmkv.vllm.contiguous.backend.VmkvContiguousBackend"


def install_platform_hook() -> bool:
    """Make the CPU platform answer this backend in contiguous mode (and only then).

    Returns:
        True if the hook was installed now (False: it was already).
    """
    # vLLM's CPU platform module, imported when the hook is installed (register(), VMKV_VLLM=1)
    from vllm.platforms.cpu import CpuPlatform

    stock = CpuPlatform.get_attn_backend_cls
    if getattr(stock, "vmkv_stock", None) is not None:
        return False
    stock_function = stock.__func__

    def get_attn_backend_cls(cls: Any, selected_backend: Any, attn_selector_config: Any, *args: Any, **kwargs: Any) -> str:
        if contiguous_requested(get_current_vllm_config_or_none()):
            if attn_selector_config.use_mla or attn_selector_config.use_sparse:
                raise InvalidConfig("vmkv kv_mode='contiguous' does not support MLA or sparse attention: use kv_mode='paged'")
            return BACKEND_PATH
        return stock_function(cls, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls.vmkv_stock = stock  # type: ignore[attr-defined]
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    return True


def register_custom_backend() -> None:
    """Register the backend as vLLM's ``CUSTOM`` attention backend (``--attention-backend CUSTOM``)."""
    # vLLM's backend registry, imported when the backend is registered (register(), VMKV_VLLM=1)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def _slot_space() -> SlotSpace:
    """The worker's :class:`~vmkv.vllm.contiguous.slots.SlotSpace` (its KV connector's worker half holds it).

    Raises:
        InvalidConfig: the engine runs without vmkv's connector in contiguous mode.
    """
    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    half = connector.connector_worker if isinstance(connector, VmkvConnector) else None
    space = half.slot_space if half is not None else None
    if space is None:
        raise InvalidConfig("vmkv's contiguous attention backend runs only with vmkv's KV connector in "
                            "kv_mode='contiguous' (vmkv.vllm.engine_args(kv_mode='contiguous'))")
    return space


class VmkvContiguousBackend(AttentionBackend):
    """vLLM attention backend over request slots (see the module docstring)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The block size vLLM takes when the user set none (vLLM asks with its config current):
        on CUDA the contiguous plan's (``all_layers``, one block one page of whole
        :data:`~vmkv.sizing.CUDA_GRANULARITY` granules in every piece, valid in every pipeline stage: 32 tokens
        for Llama-3-8B in fp16); elsewhere ``default_block_size``. The front end must not touch
        the GPU, so the granularity is the one NVIDIA GPUs report; each worker's slot space
        checks its driver's and refuses, naming the size that works, if it differs."""
        config = get_current_vllm_config_or_none()
        if config is None or not contiguous_requested(config) or torch.device(config.device_config.device).type != "cuda":
            return default_block_size
        return plan_for_vllm(config, layout=slot_layout("cuda").slots, granularity=CUDA_GRANULARITY).block_size  # type: ignore[arg-type]

    @staticmethod
    def get_impl_cls() -> type["VmkvContiguousImpl"]:
        return VmkvContiguousImpl

    @staticmethod
    def get_builder_cls() -> type["VmkvContiguousBuilder"]:
        return VmkvContiguousBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """The one layout whose blocks map into this device's slots (:data:`~vmkv.vllm.contiguous.slots.SLOT_LAYOUTS`:
        head-major ``LBHNC`` on CPU, block-outermost ``BLHNC`` on CUDA)."""
        # vLLM resolves its platform on first access to current_platform: not at this module's import
        from vllm.platforms import current_platform

        return (KVCacheLayout[slot_layout(current_platform.device_type).vllm_layout],)


@dataclass
class ContiguousMetadata:
    """One step's attention metadata, shared by every layer.

    Attributes:
        plan: rows' slots, cached lengths and new tokens (``None``: a dummy batch, nothing runs).
        num_actual_tokens: packed query tokens of real rows.
    """

    plan: StepPlan | None
    num_actual_tokens: int


class VmkvContiguousBuilder(AttentionMetadataBuilder[ContiguousMetadata]):
    """Builds :class:`ContiguousMetadata` once per step from vLLM's common metadata."""

    reorder_batch_threshold: ClassVar[int | None] = None
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    """No CUDA graphs: a step's slots, lengths and kernel choice are read on the host (``build``,
    ``rows_to_slots``) and per-sequence prefill calls vary in number; vLLM runs attention eagerly
    between its piecewise graphs."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.device = device

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ContiguousMetadata:
        start = time.perf_counter()
        metadata = self._build(common_attn_metadata)
        if metadata.plan is not None:  # a real step (the slot space exists)
            _slot_space().record_mode_work(time.perf_counter() - start)
        return metadata

    def _build(self, meta: CommonAttentionMetadata) -> ContiguousMetadata:
        num_reqs = meta.num_reqs
        starts_q = meta.query_start_loc_cpu[: num_reqs + 1].tolist()
        q_lens = [b - a for a, b in zip(starts_q, starts_q[1:])]
        seq_lens = meta.seq_lens[:num_reqs].cpu().tolist()
        if num_reqs == 0 or min(seq_lens) <= 0:
            return ContiguousMetadata(None, meta.num_actual_tokens)
        slots = _slot_space().rows_to_slots(meta.block_table_tensor[:num_reqs], seq_lens)
        if slots is None:
            return ContiguousMetadata(None, meta.num_actual_tokens)
        starts = [length - n for length, n in zip(seq_lens, q_lens)]
        plan = make_plan(tuple(range(num_reqs)), slots, starts, q_lens, device=self.device,
                         write_rows=torch.empty(0, dtype=torch.long))
        return ContiguousMetadata(plan, starts_q[-1])


class VmkvContiguousImpl(AttentionImpl):
    """Writes new K/V into vLLM's buffer and attends over the slots with vmkv's kernel.

    Raises:
        InvalidConfig: an attention feature the mode does not support (alibi, sliding window,
            logits soft-cap, sinks, KV sharing between layers, non-decoder attention).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        unsupported = {"alibi_slopes": alibi_slopes is not None, "sliding_window": sliding_window is not None,
                       "logits_soft_cap": bool(logits_soft_cap), "sinks": sinks is not None,
                       "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
                       f"attn_type={attn_type}": attn_type != AttentionType.DECODER,
                       f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype != "auto"}
        refused = [name for name, bad in unsupported.items() if bad]
        if refused:
            raise InvalidConfig(f"vmkv kv_mode='contiguous' does not support {', '.join(refused)}: use kv_mode='paged'")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kernel_name: str | None = None
        self._kernel: Any = None
        self._layer: int | None = None
        self._rows: tuple[Any, tuple[torch.Tensor, tuple[int, int], torch.Tensor, int]] | None = None  # _write_rows

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Write the step's new K/V where vLLM's slot mapping says (token ``s`` of the step goes
        to block ``s // block_size``, row ``s % block_size``), into the block interior the slots
        read (:attr:`~vmkv.vllm.contiguous.slots.SlotSpace.write_views`); the slots see it through the shared
        pages. Padding entries (vLLM's ``-1``) write into its null block 0, which no slot maps.
        One ``index_copy_`` of head_dim-wide rows (:meth:`_write_rows`): an advanced-index write
        into the 5-D strided view was several times slower."""
        start = time.perf_counter()
        count = slot_mapping.shape[0]
        if count == 0:
            return
        space = _slot_space()
        flat, first, offsets, tokens = self._write_rows(layer, space)
        where = slot_mapping.long().clamp_min(0)
        block, row = where // tokens, where % tokens
        rows = (block * first[0] + row * first[1])[:, None, None] + offsets  # [T, K|V, Hkv]: row in flat
        source = torch.stack([key[:count], value[:count]], dim=1)  # [T, K|V, Hkv, D]
        flat.index_copy_(0, rows.flatten(), source.reshape(-1, flat.shape[1]))
        space.record_mode_work(time.perf_counter() - start)

    def _write_rows(self, layer: Any, space: Any) -> tuple[torch.Tensor, tuple[int, int], torch.Tensor, int]:
        """This layer's write view (``[blocks, tokens, K|V, Hkv, D]``) as rows of head_dim:
        ``(flat [rows, D], (rows per block, rows per token), [1, K|V, Hkv] row offsets, tokens per
        block)``, computed once per slot space.

        Raises:
            InvalidConfig: a stride of the write view is not a whole number of head_dim rows.
        """
        if self._rows is not None and self._rows[0] is space:
            return self._rows[1]
        view = space.write_views[self._bind(layer, space)]
        dim = view.shape[-1]
        strides = view.stride()[:4]
        if view.stride(4) != 1 or any(stride % dim for stride in strides):
            raise InvalidConfig(f"contiguous mode: KV block strides {view.stride()} are not whole rows of head_dim {dim}")
        rows_of = [stride // dim for stride in strides]
        extent = 1 + sum((size - 1) * step for size, step in zip(view.shape[:4], rows_of))
        flat = view.as_strided((extent, dim), (dim, 1), view.storage_offset())
        half = torch.arange(2, device=view.device)[:, None] * rows_of[2]
        offsets = (half + torch.arange(view.shape[3], device=view.device)[None, :] * rows_of[3])[None]
        self._rows = (space, (flat, (rows_of[0], rows_of[1]), offsets, view.shape[1]))
        return self._rows[1]

    def _bind(self, layer: Any, space: Any) -> int:
        """This layer's index in the slot space (looked up once)."""
        if self._layer is None:
            self._layer = space.layer_index[layer.layer_name]
        return self._layer

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: ContiguousMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise InvalidConfig("vmkv kv_mode='contiguous' does not support fused output quantization")
        if attn_metadata is None or attn_metadata.plan is None:
            return output  # vLLM's warm-up / profiling runs
        space = _slot_space()
        if self._kernel is None:
            self._kernel = make_kernel(KernelSpec("slots", query.device, space.dtype, self.num_kv_heads, self.head_size))
            self.kernel_name = self._kernel.name
        index = self._bind(layer, space)
        plan = attn_metadata.plan
        count = attn_metadata.num_actual_tokens
        k, v = space.k[index], space.v[index]
        start = time.perf_counter()
        out = self._kernel(query[:count], k, v, plan, self.scale)  # plan.block_table is None: slots only
        space.record_call(self.kernel_name, k, plan, time.perf_counter() - start)
        output[:count].view(count, self.num_heads, self.head_size).copy_(out)
        return output
