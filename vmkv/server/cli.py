"""``vmkv serve``: the OpenAI-compatible server from the command line.

``vmkv/cli.py`` (the ``vmkv`` command) calls :func:`add_arguments` to build the ``serve``
subcommand and :func:`run` to execute it; ``python -m vmkv.server.cli`` runs it alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger("vmkv.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser``."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="local Hugging Face model directory (Llama, Mistral, Qwen2); "
                       "default: the embedded seeded model")
    model.add_argument("--served-model-name", default=None, help="model id clients use (default: directory name "
                       "or 'vmkv-default')")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    model.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--kv-mode", default="vmm", choices=["vmm", "paged"])
    cache.add_argument("--memory-budget", default="256MiB", help="bytes for KV pages, e.g. 2GiB")
    cache.add_argument("--page-size", default=None, help="VMM page bytes per K/V tensor (default: the cache's per-device "
                       "default, all-layers layout with >= 16 tokens a page)")
    cache.add_argument("--block-size", type=int, default=16, help="paged mode: tokens per block")
    cache.add_argument("--max-num-seqs", type=int, default=32, help="sequences running at once (cache slots)")
    cache.add_argument("--max-seq-len", type=int, default=None, help="longest prompt + completion")
    cache.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens one step feeds at most")
    cache.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=os.environ.get("VMKV_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on /v1/* (default: $VMKV_API_KEY)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (torch.set_num_threads)")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without one")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    """Load the model, open the cache, serve until interrupted.

    Returns:
        0 after a clean shutdown, 2 on a configuration error.
    """
    import torch
    import uvicorn

    from ..engine import Engine, EngineConfig, EngineLoop
    from ..errors import VMKVError
    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model, kv_mode=args.kv_mode, memory_budget=args.memory_budget, page_size=args.page_size,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_chunk=args.max_num_batched_tokens,
        prefix_caching=not args.no_prefix_caching, dtype=args.dtype, device=args.device, seed=args.seed,
    )
    try:
        engine = Engine.from_config(config)
    except (VMKVError, OSError, ImportError) as exc:
        print(f"vmkv serve: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or engine.model_name
    stats = engine.stats()["cache"]
    log.info("serving %s on http://%s:%d (kv mode %s, kernel %s, %d pages of %d tokens)", name, args.host, args.port,
             stats["mode"], stats["kernel"], stats["pages_total"], stats["tokens_per_page"])
    loop = EngineLoop(engine)
    try:
        uvicorn.run(create_app(loop, name, args.api_key), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m vmkv.server.cli [options]``."""
    parser = argparse.ArgumentParser(prog="vmkv serve", description="OpenAI-compatible server over a vmkv KV cache")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
