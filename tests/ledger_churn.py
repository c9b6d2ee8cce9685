"""Processes that drive a host-wide ledger alone, for the fault tests of tests/test_ledger.py.

It imports ``vmkv.ledger`` without the package's ``__init__`` (so without torch): a fork of this
process is cheap, which lets a test kill hundreds of members in seconds.

    python tests/ledger_churn.py kill NAME KILLS SEED   fork KILLS members one after another, each
        joining, taking (asking the others at times), giving, reaping and leaving in a loop, and
        SIGKILL each at a random moment; print {"kills", "failures"}
    python tests/ledger_churn.py cycle NAME SECONDS     create the ledger, join, leave and remove
        it, over and over; print {"ready"} first, then {"cycles"}
    python tests/ledger_churn.py hold NAME PAGES        join, take PAGES, print {"slot"}, leave
        once stdin closes
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import traceback
import types
from pathlib import Path

if "vmkv" not in sys.modules:  # the package's modules, without running its __init__ (torch)
    _package = types.ModuleType("vmkv")
    _package.__path__ = [str(Path(__file__).resolve().parent.parent / "vmkv")]
    sys.modules["vmkv"] = _package

from vmkv.errors import OutOfPages  # noqa: E402
from vmkv.ledger import Ledger  # noqa: E402

BUDGET = 4 << 20
PAGE = 32 << 10
KILL_WITHIN_S = 0.002
"""A churning member is killed at a uniformly random moment within this long after it started:
a few rounds of joining, taking, giving, reaping and leaving."""


def churn(name: str, seed: int) -> int:
    """Join, take (asking the others at times), give, reap and leave, forever.

    Returns:
        3, only if something other than ``OutOfPages`` was raised (its traceback on stderr).
    """
    rng = random.Random(seed)
    try:
        while True:
            ledger = Ledger(name, BUDGET)
            member = ledger.join("churn", PAGE)
            try:
                member.take(rng.randint(1, 8), extra=rng.randint(0, 4), wait_s=rng.choice((0.0, 0.0, 0.002)))
            except OutOfPages:
                pass
            member.offer(member.held)
            member.give(rng.randint(0, member.held))
            ledger.reap()
            member.leave()
            ledger.close(unlink_if_empty=True)
    except Exception:  # noqa: BLE001 -- reported to the killer by the exit status
        traceback.print_exc()
        return 3


def kill_loop(name: str, kills: int, seed: int) -> dict:
    """Fork ``kills`` churning members one after another; SIGKILL each at a random moment.

    Returns:
        ``{"kills": kills, "failures": [the exit status of each member that died of an error]}``.
    """
    rng = random.Random(seed)
    failures = []
    for kill in range(kills):
        started, start = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(start, b"s")
            os._exit(churn(name, seed * 1_000_003 + kill))
        os.read(started, 1)  # the delay counts from the start of its first round, not from the fork
        os.close(started)
        os.close(start)
        time.sleep(rng.uniform(0, KILL_WITHIN_S))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):
            failures.append(os.WEXITSTATUS(status))
    return {"kills": kills, "failures": failures}


def cycle(name: str, seconds: float) -> int:
    """Create ledger ``name``, join, leave and remove it again, for ``seconds``; return the cycles."""
    cycles, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        ledger = Ledger(name, BUDGET)
        ledger.join("cycle", PAGE).leave()
        ledger.close(unlink_if_empty=True)
        cycles += 1
    return cycles


def hold(name: str, pages: int) -> None:
    """Join ledger ``name`` holding ``pages`` pages; print the slot; leave when stdin closes."""
    ledger = Ledger(name, BUDGET)
    member = ledger.join("holder", PAGE)
    member.take(pages)
    print(json.dumps({"slot": member.slot}), flush=True)
    sys.stdin.read()
    member.leave()
    ledger.close(unlink_if_empty=True)


def main() -> None:
    command, name = sys.argv[1], sys.argv[2]
    if command == "kill":
        print(json.dumps(kill_loop(name, int(sys.argv[3]), int(sys.argv[4]))), flush=True)
    elif command == "cycle":
        print(json.dumps({"ready": True}), flush=True)
        print(json.dumps({"cycles": cycle(name, float(sys.argv[3]))}), flush=True)
    elif command == "hold":
        hold(name, int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown command {command!r}: kill, cycle or hold")


if __name__ == "__main__":
    main()
