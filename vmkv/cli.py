"""The ``vmkv`` command: ``info``, ``serve``, ``ledger``, and subcommands other packages contribute.

::

    vmkv info                          backends, page granularity, kernels per mode and why
    vmkv bench [options]               the benchmark suite, contributed by the clone's ``vmkv_bench``
    vmkv serve [options]               the OpenAI-compatible server (vmkv.server.cli)
    vmkv ledger NAME [--reap]          a host-wide KV budget's members, holdings and verdict

A contributed subcommand is a ``vmkv.commands`` entry point loading an object with ``HELP`` and
``main(argv) -> int``; the library imports none by name.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import mmap
import platform
import sys
from pathlib import Path
from typing import Any

from .extras import attempt, install_hint, installed

COMMANDS_GROUP = "vmkv.commands"
KNOWN_COMMANDS = {  # contributed commands the docs name: what to install when one is missing
    "bench": "the benchmark suite, which ships with a clone of vmkv: " + install_hint("bench"),
}


# ---- vmkv info ---------------------------------------------------------------------------------
def info_lines() -> list[str]:
    """What ``vmkv info`` prints: versions, backends, granularity, kernels per mode with reasons."""
    import torch

    import vmkv

    from .vm import HostVirtualMemory

    lines = [f"vmkv {vmkv.__version__}  python {platform.python_version()}  torch {torch.__version__}  "
             f"({platform.platform()})", ""]
    lines.append("Virtual-memory backends")
    _, why = attempt(lambda: HostVirtualMemory(mmap.PAGESIZE, 1).close())
    lines.append(f"  host  {'available' if why == '' else 'unavailable: ' + why}; "
                 f"granularity {mmap.PAGESIZE} B (Linux mmap + memfd)")
    cuda_gran, cuda_why = attempt(_cuda_granularity)
    if cuda_why:
        lines.append(f"  cuda  unavailable: {cuda_why}")
    else:
        lines.append(f"  cuda  available on {torch.cuda.get_device_name()}; granularity {cuda_gran} B (CUDA driver VMM)")
    lines += ["", "Attention kernels (the rule: vmkv/kernels/registry.py; the measured orders: vmkv/kernels/measured.json)"]
    lines += _kernel_lines()
    lines += ["", "Optional packages"]
    for extra, names in (("hf", ["transformers"]), ("serve", ["fastapi", "uvicorn"]), ("bench", ["matplotlib", "tqdm"]),
                         ("cuda", ["cuda.bindings"]), ("flash", ["flash_attn"]), ("optional", ["flashinfer"])):
        states = ", ".join(f"{n} {'yes' if installed(n) else 'no'}" for n in names)
        lines.append(f"  [{extra}] {states}")
    return lines


def _cuda_granularity() -> int:
    import torch

    from .vm import granularity

    return granularity(torch.device("cuda"))


def _kernel_lines() -> list[str]:
    """Each mode's kernels as the rule judges them: on this CPU, and on this GPU (or an assumed sm80+ one)."""
    import torch

    from .kernels.facts import MachineFacts
    from .kernels.registry import KernelSpec, describe

    cuda = torch.device("cuda", 0)
    gpu = MachineFacts.probe(cuda)
    where = "this GPU"
    if gpu.capability is None:
        gpu, where = MachineFacts.assumed_gpu(), "an sm80+ GPU with this machine's packages"
    cases = (("VMM mode (slots)", "cpu, float32, head_dim 128",
              KernelSpec("slots", torch.device("cpu"), torch.float32, 8, 128), None),
             ("VMM mode (slots)", f"cuda ({where}), float16, head_dim 128",
              KernelSpec("slots", cuda, torch.float16, 8, 128), gpu),
             ("paged mode (blocks)", "cpu, float32, block 16",
              KernelSpec("blocks", torch.device("cpu"), torch.float32, 8, 128, 16), None),
             ("paged mode (blocks)", f"cuda ({where}), float16, block 16",
              KernelSpec("blocks", cuda, torch.float16, 8, 128, 16), gpu),
             ("paged mode (blocks)", f"cuda ({where}), float16, block 256",
              KernelSpec("blocks", cuda, torch.float16, 8, 128, 256), gpu))
    lines = []
    for mode, case, spec, facts in cases:
        lines.append(f"  {mode}, {case}:")
        lines += describe(spec, facts)
    return lines


# ---- vmkv serve --------------------------------------------------------------------------------
def serve(rest: list[str]) -> int:
    """``vmkv serve``: parse ``rest`` with :mod:`vmkv.server.cli` and run the server."""
    try:
        server_cli = importlib.import_module("vmkv.server.cli")
        parser = argparse.ArgumentParser(prog="vmkv serve", description="OpenAI-compatible server over a vmkv cache")
        server_cli.add_arguments(parser)
    except ImportError as exc:
        print(f"vmkv serve needs the serve extra: {install_hint('serve')} ({exc})", file=sys.stderr)
        return 2
    try:
        return int(server_cli.run(parser.parse_args(rest)) or 0)
    except ImportError as exc:
        print(f"vmkv serve needs the serve extra: {install_hint('serve')} ({exc})", file=sys.stderr)
        return 2


# ---- contributed commands (vmkv bench) ---------------------------------------------------------
def contributed_commands() -> dict[str, importlib.metadata.EntryPoint]:
    """The ``vmkv.commands`` entry points, by name: every installed distribution's, and, from a source
    checkout, its ``pyproject.toml``'s, which win (they name the code that runs).
    """
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP)}
    found.update(checkout_commands(Path(__file__).resolve().parents[1] / "pyproject.toml"))
    return found


def checkout_commands(pyproject: Path) -> dict[str, importlib.metadata.EntryPoint]:
    """The ``vmkv.commands`` entry points vmkv's own ``pyproject`` declares (none if missing, foreign, or on
    Python 3.10, which reads no TOML).
    """
    try:
        import tomllib
    except ModuleNotFoundError:
        return {}
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    if project.get("name") != "vmkv":
        return {}
    declared = project.get("entry-points", {}).get(COMMANDS_GROUP, {})
    return {name: importlib.metadata.EntryPoint(name, value, COMMANDS_GROUP) for name, value in declared.items()}


def load_command(name: str, commands: dict[str, importlib.metadata.EntryPoint]) -> tuple[Any, str]:
    """The command ``name`` of ``commands`` loaded, or ``(None, why)`` (with what to install, where vmkv documents it)."""
    entry = commands.get(name)
    if entry is None:
        return None, f"vmkv {name} needs {KNOWN_COMMANDS.get(name, 'a package that provides it')}"
    try:
        command = entry.load()
    except Exception as exc:  # noqa: BLE001 - whatever the contributed code raises, the user gets one line
        return None, f"vmkv {name}: {entry.value} could not be loaded ({type(exc).__name__}: {exc})"
    missing = [attr for attr in ("HELP", "main") if not hasattr(command, attr)]
    if missing:
        return None, f"vmkv {name}: {entry.value} is not a vmkv command (it has no {' or '.join(missing)})"
    return command, ""


def run_command(name: str, argv: list[str], commands: dict[str, importlib.metadata.EntryPoint]) -> int:
    """Run the contributed command ``name`` with the words after it; 2 when it is unavailable."""
    command, why = load_command(name, commands)
    if command is None:
        print(why, file=sys.stderr)
        return 2
    return int(command.main(argv) or 0)


# ---- entry point -------------------------------------------------------------------------------
class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that refuses unknown options with its own usage."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def build_parser(commands: dict[str, importlib.metadata.EntryPoint] | None = None) -> argparse.ArgumentParser:
    """The top-level parser: ``info``, ``serve``, ``ledger`` and every contributed command."""
    import vmkv

    commands = contributed_commands() if commands is None else commands
    parser = argparse.ArgumentParser(prog="vmkv",
                                     description="KV-cache memory managed like virtual memory: info, benchmarks, server")
    parser.add_argument("--version", action="version", version=f"vmkv {vmkv.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    sub.add_parser("info", help="backends, page granularity, kernels per mode and why")
    for name in sorted({*KNOWN_COMMANDS, *commands}):
        command, why = load_command(name, commands)
        help_text = f"{command.HELP} (vmkv {name} --help)" if command is not None else f"unavailable: {why}"
        sub.add_parser(name, add_help=False, help=help_text).add_argument("rest", nargs=argparse.REMAINDER)
    serve_parser = sub.add_parser("serve", add_help=False, help="OpenAI-compatible server (vmkv serve --help)")
    serve_parser.add_argument("rest", nargs=argparse.REMAINDER)
    ledger_parser = sub.add_parser("ledger", help="members of a shared KV budget (shared_budget=NAME:SIZE)")
    ledger_parser.add_argument("name", help="the ledger's name (or path)")
    ledger_parser.add_argument("--reap", action="store_true", help="first free what dead members hold")
    return parser


def show_ledger(name: str, reap: bool) -> int:
    """``vmkv ledger NAME``: print the ledger's report; 1 if it does not exist or cannot be read."""
    from .errors import VMKVError
    from .ledger import report

    try:
        print("\n".join(report(name, reap=reap)))
    except FileNotFoundError:
        print(f"vmkv ledger: no ledger named {name!r} (it appears when a cache with shared_budget='{name}:SIZE' "
              "opens, and goes with its last member)", file=sys.stderr)
        return 1
    except VMKVError as exc:
        print(f"vmkv ledger: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vmkv`` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve` belongs to the server's own parser
        return serve(argv[1:])
    commands = contributed_commands()
    if argv[:1] and (argv[0] in commands or argv[0] in KNOWN_COMMANDS):  # so do a contributed command's words
        return run_command(argv[0], argv[1:], commands)
    ns = build_parser(commands).parse_args(argv)
    if ns.command == "info":
        print("\n".join(info_lines()))
        return 0
    return show_ledger(ns.name, ns.reap)


if __name__ == "__main__":
    sys.exit(main())
