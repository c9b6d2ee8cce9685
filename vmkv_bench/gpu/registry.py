"""What a section of the GPU check is, the context it runs in, and the optional packages it may use.

**Adding a section** (a Triton kernel check, CUDA graphs, ...):

1. Write ``def my_section(ctx: Context) -> dict`` in a module of this package. It returns a
   JSON-able dict; a list under ``"failures"`` (the reasons) fails the section, none or an empty
   one passes it. It raises :class:`SectionSkipped` with the reason when it cannot run here (no
   CUDA device, a package missing), which is recorded, not a failure. ``ctx.shape`` is the
   decode workload (tiny with ``--smoke``), ``ctx.seconds_left()`` what its process has left.
2. Add one line to :data:`vmkv_bench.gpu.sections.SECTIONS`, in the order it should run::

       Section("my_section", estimate_s=40, run=my_section, headline=my_headline,
               about="what it checks, in one line")

   ``estimate_s`` is its time on an H200, process start included (the runner skips it, with
   the reason, when that does not fit in what is left of ``--budget-s``); ``headline(result)``
   gives the one number the summary shows; ``skip_reason(device, smoke)`` may say, cheaply and
   without touching CUDA, why it cannot run (then no process is started for it).

The runner (:mod:`vmkv_bench.gpu.runner`) runs every section in a process of its own, with a
time limit, and writes its entry into ``DIR/gpu_check.json``; ``--list`` prints the registry.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .workload import FULL, SMOKE, Shape

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
"""The command: ``python benchmarks/gpu_check.py`` (sections' processes run it with ``--worker``)."""

OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "flash-attn": ("flash_attn", "flash-attn"),
    "FlashInfer": ("flashinfer", "flashinfer-python"),
    "vLLM": ("vllm", "vllm"),
    "triton": ("triton", "triton"),
}
"""Packages a section uses when present: display name -> (import name, distribution name)."""


class SectionSkipped(Exception):
    """A section cannot run here; the message says why (recorded, not a failure)."""


@dataclass(frozen=True)
class Context:
    """What a section gets in its process.

    Attributes:
        device: the device under test (``cuda:N``, or ``cpu`` for the dry run).
        smoke: tiny shapes and few iterations (a dry run of the code paths).
        out: the output directory (``DIR`` of ``DIR/gpu_check.json``).
        options: the command's options (``kernels``, ``tests``, ``test_timeout``).
        deadline: ``time.monotonic()`` at which the section's process is killed.
    """

    device: torch.device
    smoke: bool
    out: Path
    options: argparse.Namespace
    deadline: float

    @property
    def shape(self) -> Shape:
        """The decode workload: :data:`~vmkv_bench.gpu.workload.SMOKE` with ``--smoke``, else ``FULL``."""
        return SMOKE if self.smoke else FULL

    def seconds_left(self) -> float:
        """Seconds until the section's process is killed."""
        return self.deadline - time.monotonic()


def _runs_anywhere(device: torch.device, smoke: bool) -> str | None:
    return None


@dataclass(frozen=True)
class Section:
    """One registered section (see the module docstring for how to add one).

    Attributes:
        name: its name on the command line and in the JSON.
        estimate_s: seconds it takes on an H200, its process's start included (an estimate;
            every run records the real ``seconds`` in the JSON).
        run: the work, inside the section's process.
        headline: the one number (with its words) the summary shows, from a passed result.
        about: one line: what it checks.
        skip_reason: ``(device, smoke) -> reason or None``, asked in the parent before a process
            is started (cheap: no CUDA initialisation).
        timeout_s: its process's time limit (``None``: ``--section-timeout``); what is left of
            the budget caps it.
        alone: too long for the default run's budget: it runs only when named in ``--sections``.
    """

    name: str
    estimate_s: float
    run: Callable[[Context], dict[str, Any]]
    headline: Callable[[dict[str, Any]], str]
    about: str
    skip_reason: Callable[[torch.device, bool], str | None] = _runs_anywhere
    timeout_s: float | None = None
    alone: bool = False


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or ``None``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def optional_packages() -> dict[str, str | None]:
    """Each of :data:`OPTIONAL_PACKAGES`: its version, ``"installed"`` (importable, no
    metadata), or ``None`` when it is not installed. Imports nothing."""
    found: dict[str, str | None] = {}
    for shown, (module, distribution) in OPTIONAL_PACKAGES.items():
        present = importlib.util.find_spec(module) is not None
        found[shown] = (package_version(distribution) or "installed") if present else None
    return found


def describe_exit(returncode: int) -> str:
    """How a process ended, in words: ``exit status 1``, ``killed by SIGSEGV``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


@dataclass(frozen=True)
class Finished:
    """How a process run by :func:`run_process` ended."""

    returncode: int | None  # None: killed at its time limit
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        """stdout, then stderr."""
        return self.stdout + self.stderr

    @property
    def ended(self) -> str:
        """In words: ``exit status 0``, ``killed by SIGSEGV``, ``timed out after 5 s``."""
        return f"timed out after {self.seconds:.0f} s" if self.returncode is None else describe_exit(self.returncode)


def run_process(cmd: list[str], timeout: float) -> Finished:
    """Run ``cmd`` from the repository root in a session of its own; at ``timeout`` seconds kill
    it *and every process it started* (a benchmark's server, pytest's children), so nothing is
    left holding the GPU for the next section. Also on an exception here (Ctrl-C).

    Args:
        cmd: the command.
        timeout: seconds it may run.
    """
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(timeout, 0.1))
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        returncode = None
    except BaseException:
        _kill_group(proc)
        raise
    return Finished(returncode, out or "", err or "", time.monotonic() - began)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile
        pass
