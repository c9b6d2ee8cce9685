"""Which VMM layout makes ``generate()`` fastest, per attention path and dtype: the measurements
behind ``VirtualCache()``'s default layout (``vmkv.hf.sizing``, docs/hf.md "Defaults").

Run: ``python -m vmkv_bench.hf_layouts [--model small|mid] [--dtypes float32 bfloat16]
[--batch 8] [--prompt-len 512] [--new-tokens 256] [--layouts per_layer head_major all_layers]
[--vmkv-attention] [--repeats 3]``

Greedy generation of the embedded random Llama (``vmkv.models``; ``mid``: 12 layers, hidden
768, 12 query / 4 KV heads of 64) on the CPU with one torch thread, timed with the thread's CPU
time (other processes of a shared machine do not inflate it), in interleaved rounds
(``common.time_interleaved``). Candidates::

    dynamic                 DynamicCache, the model's SDPA
    default                 VirtualCache() with no layout: what vmkv.hf picks
    vmm:<layout>            VirtualCache(layout=...), the model's SDPA over the cache's views
    vmm:<layout>+vmkv       the same with attn_implementation="vmkv" (the cache's own kernel)

Each line gives every candidate's speed relative to DynamicCache (median of the per-round ratios,
min-max over the rounds; > 1: faster than DynamicCache) and whether its tokens equal
DynamicCache's; the last line names the fastest VMM layout per dtype.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from . import common

MID = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
           num_key_value_heads=4, head_dim=64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _candidates(args: argparse.Namespace) -> list[str]:
    styles = ("", "+vmkv") if args.vmkv_attention else ("",)
    return ["dynamic", "default"] + [f"vmm:{layout}{style}" for layout in args.layouts for style in styles]


def _cache(name: str, model: torch.nn.Module, batch: int, total: int) -> Any:
    from transformers import DynamicCache

    from vmkv.hf import VirtualCache

    if name == "dynamic":
        return DynamicCache(config=model.config)
    layout = None if name == "default" else name.split(":")[1].removesuffix("+vmkv")
    return VirtualCache("vmm", config=model.config, max_batch_size=batch, max_seq_len=total, layout=layout)


def measure(model: torch.nn.Module, args: argparse.Namespace, batch: int, new: int) -> tuple[common.Timings, dict[str, bool], str]:
    """Time every candidate on one workload; per-round seconds, token equality, the default's layout."""
    import vmkv.hf

    cache_kw = vmkv.hf.cache_argument()
    ids = torch.randint(0, 256, (batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=model.config.pad_token_id)
    outs: dict[str, torch.Tensor] = {}
    chosen: list[str] = []

    def run(name: str) -> None:
        model.set_attn_implementation("vmkv" if name.endswith("+vmkv") else "sdpa")
        cache = _cache(name, model, batch, args.prompt_len + new + 1)
        outs[name] = model.generate(ids, **{cache_kw: cache}, **kwargs)
        if name == "default":
            chosen[:] = [cache.stats()["layout"]]
        if hasattr(cache, "close"):
            cache.close()

    fns = {name: (lambda name=name: run(name)) for name in _candidates(args)}
    timings = common.time_interleaved(fns, "cpu", repeat=args.repeats, warmup=0, clock="cpu")
    same = {name: bool(torch.equal(out, outs["dynamic"])) for name, out in outs.items()}
    return timings, same, chosen[0] if chosen else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=["small", "mid"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--layouts", nargs="+", default=["per_layer", "head_major", "all_layers"])
    parser.add_argument("--vmkv-attention", action="store_true", help="also time attn_implementation='vmkv' candidates")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import vmkv.hf  # noqa: F401 -- registers attn_implementation="vmkv"
    from vmkv.models import default_hf_model

    best: dict[str, str] = {}
    with common.torch_threads(1):
        for dtype in args.dtypes:
            model = default_hf_model(**(MID if args.model == "mid" else {})).to(DTYPES[dtype])
            timings, same, chosen = measure(model, args, args.batch, args.new_tokens)
            cells = []
            for name in timings.samples:
                if name == "dynamic":
                    continue
                ratio = timings.ratio("dynamic", name)
                cells.append(f"{name} {common.number_text(ratio.value)} ({common.spread_text(ratio)})"
                             f"{'' if same[name] else ' OTHER TOKENS'}")
            print(f"{args.model} {dtype} B={args.batch} prompt={args.prompt_len} new={args.new_tokens} "
                  f"(speed vs DynamicCache, {args.repeats} rounds; default chose {chosen}): " + " | ".join(cells), flush=True)
            vmm = [name for name in timings.samples if name.startswith("vmm:") and same[name]]
            if vmm:
                best[dtype] = min(vmm, key=timings.median)
    print("verdict: fastest VMM layout " + ", ".join(f"{dtype}: {name}" for dtype, name in best.items())
          + "; > 1x means faster than DynamicCache.")


if __name__ == "__main__":
    main()
