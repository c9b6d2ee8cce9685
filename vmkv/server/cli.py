"""``vmkv serve``: the OpenAI-compatible server from the command line (``vmkv/cli.py`` calls
:func:`add_arguments` and :func:`run`; ``python -m vmkv.server.cli`` runs it alone).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from ..config import MODES


def _port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port), refused by argparse before anything binds."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: use 0..65535 (0 picks a free one)")
    return port


def _positive(text: str) -> int:
    """A positive int (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _device(text: str) -> str:
    """``cpu`` or ``cuda[:N]`` (argparse type): a typo is refused before the model loads."""
    from ..errors import InvalidConfig
    from ..validate import as_device

    try:
        as_device(text)
    except InvalidConfig as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("device: ")) from None
    return text


GRAPHS = {"auto": None, "on": True, "off": False}  # --cuda-graphs -> EngineConfig.cuda_graphs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser`` (every help line shows its default)."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="local Hugging Face model directory (Llama, Mistral, Qwen2), or "
                       "embedded:mistral (the embedded model with a 64-token sliding window) "
                       "(default: the embedded seeded model)")
    model.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory "
                       "name, or 'vmkv-default')")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                       help="model and KV dtype; auto = float32 on CPU, the checkpoint's on CUDA "
                       "(default: %(default)s)")
    model.add_argument("--device", type=_device, default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--kv-mode", default="vmm", choices=list(MODES),
                       help="virtually contiguous tensors or block tables (default: %(default)s)")
    cache.add_argument("--memory-budget", default="256MiB", help="bytes for KV pages, e.g. 2GiB (default: %(default)s)")
    cache.add_argument("--page-size", default=None, help="VMM page bytes per K/V tensor (default: the cache's "
                       "per-device default, >= 16 tokens a page; see docs/how-it-works.md; paged mode ignores it but "
                       "refuses a value VMM mode would refuse)")
    cache.add_argument("--block-size", type=_positive, default=16, help="paged mode: tokens per block; "
                       "VMM mode ignores it (default: %(default)s)")
    cache.add_argument("--max-num-seqs", type=_positive, default=32, help="sequences running at once (cache slots) "
                       "(default: %(default)s)")
    cache.add_argument("--max-seq-len", type=_positive, default=None, help="longest prompt + completion "
                       "(default: min(model positions, 4096))")
    cache.add_argument("--max-num-batched-tokens", type=_positive, default=512, help="tokens one step feeds at most "
                       "(default: %(default)s)")
    cache.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off (default: on)")
    cache.add_argument("--cuda-graphs", default="auto", choices=list(GRAPHS),
                       help="capture decode steps as CUDA graphs, one per batch-size bucket (auto: on a CUDA device; "
                       "on: refused without one; takes one more cache slot and page, for padding rows) "
                       "(default: %(default)s)")
    cache.add_argument("--map-ahead", action="store_true", help="VMM: map the next step's pages on a background "
                       "thread while the step runs (default: off)")
    cache.add_argument("--shared-budget", default=None, help="VMM: share one host-wide KV budget with other "
                       "engines, e.g. kv-host:16GiB[,min=1GiB,max=8GiB,member=NAME]; --memory-budget is then "
                       "this engine's ceiling (vmkv ledger NAME shows the members)")
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    http.add_argument("--port", type=_port, default=8000, help="TCP port, 0..65535 (default: %(default)s)")
    http.add_argument("--api-key", default=os.environ.get("VMKV_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on /v1/* (default: $VMKV_API_KEY, else none)")
    http.add_argument("--protect-metrics", action="store_true",
                      help="require the API key on /metrics too (default: /metrics is open; it shows counts, "
                      "never prompts or outputs)")
    parser.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (torch.set_num_threads) "
                        "(default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without one (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="(default: %(default)s)")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM outside uvicorn's handling: unwind, so ``run`` closes the engine (and leaves a
    shared budget's ledger) before the process ends.
    """
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM, then close the engine and say so on stderr, without a traceback.

    Returns:
        0 after a clean shutdown (a signal included), 2 on a configuration error.
    """
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return _serve(args)
    previous = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS}
    try:
        return _serve(args)
    except KeyboardInterrupt as exc:
        print(f"vmkv serve: stopped by {exc.args[0] if exc.args else 'SIGINT'}", file=sys.stderr)
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _serve(args: argparse.Namespace) -> int:
    """Open the cache (a bad option fails before the weights load), load the model, bind (stderr names
    the real port), serve; the engine closes whatever ends it.
    """
    import torch
    import uvicorn

    from ..engine import Engine, EngineConfig, EngineLoop
    from ..errors import VMKVError
    from .app import KEEP_ALIVE_S, create_app

    if args.protect_metrics and not args.api_key:
        print("vmkv serve: --protect-metrics needs --api-key (or $VMKV_API_KEY)", file=sys.stderr)
        return 2
    if args.cuda_graphs == "on" and torch.device(args.device).type != "cuda":
        print(f"vmkv serve: --cuda-graphs on needs a CUDA device (--device cuda): on {args.device} no graph can be "
              "captured (auto captures them where they can be)", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model, kv_mode=args.kv_mode, memory_budget=args.memory_budget, page_size=args.page_size,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_chunk=args.max_num_batched_tokens,
        prefix_caching=not args.no_prefix_caching, dtype=args.dtype, device=args.device, seed=args.seed,
        shared_budget=args.shared_budget, cuda_graphs=GRAPHS[args.cuda_graphs], map_ahead=args.map_ahead,
    )
    try:
        engine = Engine.from_config(config)
    except (VMKVError, OSError, ImportError) as exc:
        print(f"vmkv serve: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or engine.model_name
    stats = engine.stats()["cache"]
    loop = EngineLoop(engine)
    try:
        server = uvicorn.Server(uvicorn.Config(create_app(loop, name, args.api_key, args.protect_metrics),
                                               host=args.host, port=args.port, log_level=args.log_level,
                                               timeout_keep_alive=KEEP_ALIVE_S))
        sock = server.config.bind_socket()  # bound now, so the line names the port --port 0 got
        sock.listen(server.config.backlog)  # and listening: a client that reads the line waits in the backlog
        host, port = sock.getsockname()[:2]
        # printed, not logged: a client of --port 0 needs the port whatever --log-level hides
        print(f"vmkv serve: serving {name} on http://{f'[{host}]' if ':' in host else host}:{port} (kv mode "
              f"{stats['mode']}, kernel {stats['kernel']}, {stats['pages_total']} pages of {stats['tokens_per_page']} "
              "tokens)", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
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
