"""``python -m vmkv.vllm [--kv-mode M] [--page-size S] [--budget B] [--max-cached C]
[--shared-budget NAME:SIZE] [MODEL]``: print the
``vllm serve`` command line that runs MODEL with vmkv under its KV cache (no vLLM import)."""

from __future__ import annotations

import argparse
import shlex
import sys

from .settings import ENV_FLAG, KV_MODES, serve_flags


def main(argv: list[str] | None = None) -> int:
    """Print the command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m vmkv.vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="MODEL", help="model name or directory (default: MODEL)")
    parser.add_argument("--page-size", default="2MiB", help="backend page (default 2MiB, the CUDA granularity)")
    parser.add_argument("--budget", default=None, help="physical KV bytes per worker (default: vLLM's KV buffer)")
    parser.add_argument("--max-cached", default=None, help="KV only the prefix cache may keep mapped (default: budget / 8)")
    parser.add_argument("--shared-budget", default=None,
                        help="join a host-wide KV ledger, NAME:SIZE[,min=..][,max=..] (default: none)")
    parser.add_argument("--kv-mode", default="paged", choices=KV_MODES,
                        help="paged: vLLM's kernels over block tables (default); contiguous: one virtually "
                             "contiguous range per request, the stock kernel")
    args = parser.parse_args(argv)
    flags = serve_flags(page_size=args.page_size, budget=args.budget, max_cached=args.max_cached,
                        shared_budget=args.shared_budget, kv_mode=args.kv_mode)
    print(f"{ENV_FLAG}=1 " + shlex.join(["vllm", "serve", args.model, *flags]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
