"""Every attention kernel of both modes, and the one rule that picks one.

A kernel has a name, the addressings it reads (``"slots"``: VMM mode's contiguous slots,
``"blocks"``: paged mode's block tables), the phases it runs (decode steps, or every step) and
what it needs (:func:`unavailable`). The rule (:func:`choose`): for the cache's device type and
addressing, walk the measured order (``vmkv/kernels/measured.json``: which kernel is fastest,
measured where, by what command, when) and take, for decode steps and for the other steps, the
first kernel that can run (an order may rank decode steps apart: on an H200, Triton's split-KV
decode over slots beats torch's FlashAttention, whose prefill is kept). When the two differ
(FlashInfer decodes only), the cache gets both (:class:`~vmkv.kernels.base.PhaseSplit`, named
``decode+other``). A kernel the order places without a measurement on that device
(``provisional``) says so in the choice's reason.

A kernel also declares the variant features it supports (a sliding window, soft-capping,
attention sinks: :class:`~vmkv.kernels.base.Variant`); a cache whose layers use one
(``KernelSpec.features``) passes over the kernels that lack it, and the last kernel of every
order, like ``sdpa_masked`` for captured steps, has them all.

Which kernel a cache runs is logged once and shown in ``stats()["kernel"]``; ``vmkv info`` shows
the choice for this machine and for a GPU it lacks (:func:`describe`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import BackendUnavailable, InvalidConfig
from .base import ADDRESSINGS, FEATURES, AttentionKernel, PhaseSplit, describe_features
from .capturable import MaskedDecode
from .contiguous import SLOT_KERNELS, slot_kernel
from .facts import MachineFacts, flash_attention_blockers
from .measured import order
from .paged import BLOCK_KERNELS, block_kernel
from .triton import TritonAttention
from .triton_attention import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

log = logging.getLogger("vmkv")


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel is asked to read: the cache's addressing, device and K/V geometry.

    ``block_size`` is paged mode's (``None`` for slots); ``chunk_tokens`` tunes the chunked CPU
    paged kernels (``None``: their measured default); ``features``: the variant features the
    cache's layers use (keys of :data:`~vmkv.kernels.base.FEATURES`), which the kernel must have.

    Raises:
        InvalidConfig: ``features`` names an unknown feature.
    """

    addressing: str
    device: torch.device
    dtype: torch.dtype
    kv_heads: int
    head_dim: int
    block_size: int | None = None
    chunk_tokens: int | None = None
    features: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise InvalidConfig(f"unknown attention features {sorted(unknown)}; known: {', '.join(FEATURES)}")
        object.__setattr__(self, "features", frozenset(self.features))


def _cpu_only(name: str) -> Callable[[KernelSpec, MachineFacts], list[str]]:
    def needs(spec: KernelSpec, facts: MachineFacts) -> list[str]:
        return [] if spec.device.type == "cpu" else [f"the CPU ({name} was measured on CPU only), not {spec.device.type}"]
    return needs


def _float32_cpu(spec: KernelSpec, facts: MachineFacts) -> list[str]:
    why = _cpu_only("this GEMM kernel")(spec, facts)
    if spec.dtype != torch.float32:
        why.append(f"float32 (the cache holds {spec.dtype}: half-precision scores would be rounded)")
    return why


def _flash(package: str | None, paged_feature: str | None = None) -> Callable[[KernelSpec, MachineFacts], list[str]]:
    """FlashAttention's needs (:func:`flash_attention_blockers`), 256-token blocks when paged, and
    flash-attn importable (``package``) or torch's varlen op with the features it takes (a
    window, for a cache whose layers have one)."""

    def needs(spec: KernelSpec, facts: MachineFacts) -> list[str]:
        why = flash_attention_blockers(spec.device.type == "cuda" and facts.capability is not None, facts.capability,
                                       spec.dtype, spec.head_dim)
        if spec.addressing == "blocks" and spec.block_size is not None and spec.block_size % 256:
            why.append(f"block_size to be a multiple of 256, got {spec.block_size}")
        if why:
            return why
        if package is not None and facts.package_missing(package):
            return [f"{package} installed and importable ({facts.package_missing(package)})"]
        if spec.addressing == "slots" and package is None and not facts.varlen_seqused:
            return [f"torch's FlashAttention varlen op with seqused_k (torch {torch.__version__} has none)"]
        if spec.addressing == "slots" and package is None and "window" in spec.features and not facts.varlen_window:
            return [f"torch's FlashAttention varlen op with window_size_left (torch {torch.__version__} has none)"]
        if paged_feature and not {"block_table", "seqused_k", "window_size", "enable_gqa"} <= facts.varlen_features:
            return [f"torch's varlen_attn with block_table and seqused_k (torch {torch.__version__} has no such)"]
        return []

    return needs


def _flashinfer(spec: KernelSpec, facts: MachineFacts) -> list[str]:
    why = [] if spec.device.type == "cuda" else ["CUDA"]
    if spec.dtype not in (torch.float16, torch.bfloat16):
        why.append(f"float16 or bfloat16 (the cache holds {spec.dtype})")
    missing = facts.package_missing("flashinfer")
    return why + ([f"flashinfer installed and importable ({missing})"] if missing and not why else [])


def _triton(spec: KernelSpec, facts: MachineFacts) -> list[str]:
    why = [f"head_dim in {SUPPORTED_HEAD_DIMS} (got {spec.head_dim})"] if spec.head_dim not in SUPPORTED_HEAD_DIMS else []
    if spec.dtype not in SUPPORTED_DTYPES:
        why.append(f"float16, bfloat16 or float32 (the cache holds {spec.dtype})")
    if facts.triton_missing:
        why.append(f"triton usable here ({facts.triton_missing})")
    return why


def _anywhere(spec: KernelSpec, facts: MachineFacts) -> list[str]:
    return []


@dataclass(frozen=True)
class KernelEntry:
    """One kernel of the registry.

    Attributes:
        name: its name (the same name may read both addressings: flash-attn, Triton).
        addressings: the addressings it reads.
        decode_only: it runs decode steps only (the rule pairs it with another kernel).
        capturable: a compiled step or a captured CUDA graph may run it: its launches depend on
            host values fixed up front and it reads lengths from the device
            (:func:`vmkv.kernels.capturable.decode_attention`; :func:`choose_capturable`).
        needs: why it cannot run for a spec on a machine (``[]``: it can), each as the object
            of "needs".
        features: the variant features it supports (keys of :data:`~vmkv.kernels.base.FEATURES`),
            as its module declares them (:data:`~vmkv.kernels.contiguous.SLOT_KERNELS`,
            :data:`~vmkv.kernels.paged.BLOCK_KERNELS`, the kernel classes).
    """

    name: str
    addressings: frozenset[str]
    needs: Callable[[KernelSpec, MachineFacts], list[str]]
    decode_only: bool = False
    capturable: bool = False
    features: frozenset[str] = frozenset()


_DECLARED = {**BLOCK_KERNELS, **SLOT_KERNELS, TritonAttention.name: TritonAttention.features,
             MaskedDecode.name: MaskedDecode.features}
"""The variant features of every kernel, as the modules that implement them declare them."""
assert SLOT_KERNELS["flash_attn_with_kvcache"] == BLOCK_KERNELS["flash_attn_with_kvcache"]


def _entry(name: str, addressings: frozenset[str], needs: Callable[[KernelSpec, MachineFacts], list[str]],
           decode_only: bool = False, capturable: bool = False) -> KernelEntry:
    return KernelEntry(name, addressings, needs, decode_only, capturable, _DECLARED[name])


SLOTS, BLOCKS, BOTH = frozenset({"slots"}), frozenset({"blocks"}), frozenset(ADDRESSINGS)
KERNELS: dict[str, KernelEntry] = {entry.name: entry for entry in (
    _entry("flash_attn_with_kvcache", BOTH, _flash("flash_attn")),
    _entry("varlen_attn_seqused", SLOTS, _flash(None)),
    _entry("varlen_attn_block_table", BLOCKS, _flash(None, paged_feature="block_table")),
    _entry("flashinfer_decode", BLOCKS, _flashinfer, decode_only=True),
    _entry("triton", BOTH, _triton, capturable=True),
    _entry("sdpa_adaptive", SLOTS, _cpu_only("sdpa_adaptive")),
    _entry("gemm_adaptive", SLOTS, _float32_cpu),
    _entry("sdpa_batched", SLOTS, _cpu_only("sdpa_batched")),
    _entry("gemm_batched", SLOTS, _float32_cpu),
    _entry("sdpa_per_sequence", SLOTS, _anywhere),
    _entry("sdpa_chunked", BLOCKS, _cpu_only("sdpa_chunked")),
    _entry("blockwise_online_softmax", BLOCKS, _anywhere),
    _entry("gather_sdpa", BLOCKS, _anywhere),
    _entry("sdpa_masked", BOTH, _anywhere, decode_only=True, capturable=True),
)}
"""Every kernel, by name. Which of them a cache runs is :func:`choose`'s answer."""
assert {name for name, e in KERNELS.items() if "slots" in e.addressings} - {"triton", "sdpa_masked"} == set(SLOT_KERNELS)
assert {name for name, e in KERNELS.items() if "blocks" in e.addressings} - {"triton", "sdpa_masked"} == set(BLOCK_KERNELS)

CAPTURE_ORDER = ("triton", "sdpa_masked")
"""The capturable decode kernels, fastest first: Triton's split-KV decode (its measurement:
``measured.json``), then masked SDPA over whole slots or blocks (runs anywhere, reads
``max_seq_len`` keys a row)."""


def names(addressing: str) -> list[str]:
    """The kernels that read ``addressing``, in registry order."""
    return [name for name, entry in KERNELS.items() if addressing in entry.addressings]


def unavailable(name: str, spec: KernelSpec, facts: MachineFacts | None = None) -> str | None:
    """Why kernel ``name`` cannot run for ``spec`` (``None``: it can).

    Args:
        facts: the machine's facts (default: probed for ``spec.device``); given, the answer is for
            that machine (``vmkv info`` describes a GPU it lacks).
    """
    entry = KERNELS.get(name)
    if entry is None:
        return f"unknown kernel {name!r}; known: {', '.join(names(spec.addressing))}"
    if spec.addressing not in entry.addressings:
        return f"{name} does not read {spec.addressing} (it reads {', '.join(sorted(entry.addressings))})"
    lacking = spec.features - entry.features
    why = [f"{describe_features(lacking)}, which it lacks"] if lacking else []
    why += entry.needs(spec, facts if facts is not None else MachineFacts.probe(spec.device))
    return f"{name} needs {'; '.join(why)}" if why else None


@dataclass(frozen=True)
class KernelChoice:
    """The rule's answer for one cache.

    Attributes:
        name: what the cache runs (``decode+other`` when the phases differ).
        decode, other: the kernel of decode steps and of every other step.
        skipped: why each kernel preferred to the chosen ones cannot run.
        source: the measurement behind the order (machine; command; date: result).
        provisional: the chosen kernels the order places without a measurement on this device.
    """

    name: str
    decode: str
    other: str
    skipped: tuple[str, ...]
    source: str
    provisional: tuple[str, ...]

    @property
    def reason(self) -> str:
        """One line for logs and ``vmkv info``."""
        parts = [f"not faster ones: {'; '.join(self.skipped)}" if self.skipped else "the first of the measured order"]
        if self.provisional:
            parts.append(f"{', '.join(self.provisional)} placed by reasoning, not yet measured on this device")
        return "; ".join(parts)


def choose(spec: KernelSpec, facts: MachineFacts | None = None) -> KernelChoice:
    """The rule: for decode steps, the first kernel of the measured decode order of ``spec``'s
    device type and addressing that can run (:func:`unavailable`); for every other step, the first
    of its order that can run and is not decode-only.

    Raises:
        BackendUnavailable: no kernel of the order can run (the message says why each cannot).
    """
    facts = facts if facts is not None else MachineFacts.probe(spec.device)
    measured = order(spec.device.type, spec.addressing)
    skipped: dict[str, str] = {}  # kernels preferred to a chosen one: why each cannot run

    def first(names: tuple[str, ...], decode_steps: bool) -> str | None:
        for name in names:
            if not decode_steps and KERNELS[name].decode_only:
                continue
            reason = unavailable(name, spec, facts)
            if reason is None:
                return name
            skipped.setdefault(name, reason)
        return None

    decode, other = first(measured.decode, True), first(measured.kernels, False)
    if decode is None or other is None:
        raise BackendUnavailable(f"no attention kernel for {spec.addressing} on {spec.device}: {'; '.join(skipped.values())}")
    chosen = (decode,) if decode == other else (decode, other)
    return KernelChoice("+".join(chosen), decode, other, tuple(skipped.values()), measured.source,
                  tuple(name for name in chosen if name in measured.provisional))


def choose_capturable(spec: KernelSpec, facts: MachineFacts | None = None) -> KernelChoice:
    """The rule for compiled and captured decode steps: the first kernel of :data:`CAPTURE_ORDER`
    that can run for ``spec`` (the same needs as for eager steps: head dim, dtype, device, variant
    features). Made when a step's buffers are, so a step never meets a kernel that refuses it
    mid-generation."""
    facts = facts if facts is not None else MachineFacts.probe(spec.device)
    skipped = []
    for name in CAPTURE_ORDER:
        reason = unavailable(name, spec, facts)
        if reason is None:
            return KernelChoice(name, name, name, tuple(skipped), "vmkv.kernels.registry.CAPTURE_ORDER", ())
        skipped.append(reason)
    raise BackendUnavailable(f"no capturable decode kernel for {spec.addressing} on {spec.device}: {'; '.join(skipped)}")


def build(name: str, spec: KernelSpec) -> AttentionKernel:
    """A new kernel object of ``name`` for ``spec`` (no availability check: see :func:`unavailable`)."""
    if name == "triton":
        return TritonAttention(spec.addressing, spec.device, spec.kv_heads, spec.head_dim)
    if name == "sdpa_masked":
        return MaskedDecode(spec.addressing)
    if spec.addressing == "slots":
        return slot_kernel(name)
    return block_kernel(name, spec.device, spec.dtype, spec.kv_heads, spec.head_dim, spec.block_size, spec.chunk_tokens)


_LOGGED: set[str] = set()


def make_kernel(spec: KernelSpec, forced: str | None = None) -> AttentionKernel:
    """The kernel a cache runs: ``forced`` by name (a decode-only one is paired with the rule's
    choice for other steps), else :func:`choose`'s. Logs the choice once.

    Raises:
        InvalidConfig: ``forced`` names no kernel of this addressing.
        BackendUnavailable: ``forced`` cannot run here, or nothing can (the message says why).
    """
    if forced is not None and forced not in names(spec.addressing):
        raise InvalidConfig(f"kernel must be one of {', '.join(names(spec.addressing))}; got {forced!r}")
    if forced is None:
        choice = choose(spec)
        decode, other, why = choice.decode, choice.other, choice.reason
    else:
        reason = unavailable(forced, spec)
        if reason is not None:
            raise BackendUnavailable(f"kernel {forced} cannot run here: {reason}")
        decode, other, why = forced, forced, "chosen by the caller"
        if KERNELS[forced].decode_only:
            other = choose(spec).other
    kernel = build(decode, spec) if decode == other else PhaseSplit(build(decode, spec), build(other, spec))
    key = f"{spec.addressing} {spec.device.type} {kernel.name}: {why}"
    if key not in _LOGGED:
        _LOGGED.add(key)
        broken = "is installed but" in why  # a broken wheel deserves a warning
        log.log(logging.WARNING if broken else logging.INFO, "vmkv %s attention kernel: %s (%s)",
                spec.addressing, kernel.name, why)
    return kernel


def describe(spec: KernelSpec, facts: MachineFacts | None = None) -> list[str]:
    """Lines for ``vmkv info``: each kernel of ``spec``'s addressing, whether it can run and why
    not, then the rule's choice and the measurement behind the order."""
    facts = facts if facts is not None else MachineFacts.probe(spec.device)
    lines = [f"    {name:26s} {unavailable(name, spec, facts) or 'available'}" for name in names(spec.addressing)]
    try:
        choice = choose(spec, facts)
        lines.append(f"    chosen: {choice.name}" + (f" ({choice.reason})" if choice.provisional else ""))
    except BackendUnavailable as exc:
        lines.append(f"    chosen: none ({exc})")
    lines.append(f"    order measured on: {order(spec.device.type, spec.addressing).source}")
    return lines
