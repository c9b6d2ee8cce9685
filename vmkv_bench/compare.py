"""Compare the verdicts of two ``vmkv bench`` runs: do they repeat?

::

    python -m vmkv_bench.compare bench-run-1/ bench-run-2/

Reads ``suite.json`` of each output directory and prints, per verdict (matched by key): both
results, whether the winner is the same, and whether the headline moved less than the spread
the runs report (the larger of the two min-max ranges; a deterministic value must not move).
Exits 0 when every verdict present in both runs agrees on both counts, 1 otherwise. The last
line sorts the disagreements: opposite winners (a contradiction) or a winner against a tie (a
margin near the tie band: neither run is wrong, the machine is too noisy to be sure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .common import format_table


def load_verdicts(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Verdicts of the benchmarks that ran fine, by key, from ``out_dir/suite.json``.

    Raises:
        FileNotFoundError: the directory has no ``suite.json``.
    """
    records = json.loads((Path(out_dir) / "suite.json").read_text())["records"]
    return {v["key"]: v for r in records if r["status"] == "ok" for v in r.get("verdicts", [])}


def winner_side(verdict: dict[str, Any]) -> str:
    """Who won, without margin or wording: the verdict's ``side`` (the winning option's name,
    ``"tie"``, or ``""`` when not judged). A verdict saved before verdicts carried ``side`` falls
    back to its winner text: ``"VMM, 1.62x"`` -> ``"VMM"``, ``"tie (...)"`` -> ``"tie"``."""
    if "side" in verdict:
        return verdict["side"]
    return verdict["winner"].split(",")[0].split(" (")[0].strip()


def compare(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per verdict key in both runs: results, same winner, moved less than the spread."""
    rows = []
    for key in [k for k in a if k in b]:
        va, vb = a[key], b[key]
        judged = bool(winner_side(va)) and va.get("reliable", True) and vb.get("reliable", True)  # "": nothing to repeat
        same = judged and winner_side(va) == winner_side(vb)
        moved, spread, within = None, None, None
        if va.get("value") is not None and vb.get("value") is not None:
            moved = abs(vb["value"] - va["value"])
            widths = [v["high"] - v["low"] for v in (va, vb) if v.get("low") is not None and v.get("high") is not None]
            spread = max(widths, default=0.0)
            within = moved <= spread + 1e-12
        rows.append({"question": va["question"], "run A": va["result"], "run B": vb["result"],
                     "winner A": winner_side(va), "winner B": winner_side(vb), "same winner": same,
                     "moved": moved, "spread": spread, "moved <= spread": within})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the comparison of two output directories; 0 if every verdict repeats."""
    parser = argparse.ArgumentParser(prog="python -m vmkv_bench.compare", description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path, help="output directory of the first run")
    parser.add_argument("run_b", type=Path, help="output directory of the second run")
    args = parser.parse_args(argv)
    rows = compare(load_verdicts(args.run_a), load_verdicts(args.run_b))
    if not rows:
        print("no verdict in common")
        return 1
    print(format_table(rows, wrap={"question": 40, "run A": 24, "run B": 24}))
    bad = [r for r in rows if not r["same winner"] or r["moved <= spread"] is False]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} verdicts repeat (same winner, moved less than the spread)")
    print(_disagreements(rows))
    return 0 if not bad else 1


def _disagreements(rows: list[dict[str, Any]]) -> str:
    """What the verdicts that did not repeat mean: opposite winners contradict each other; a
    winner in one run and a tie in the other is a margin near the tie band (not yet sure)."""
    opposite = [r for r in rows if r["winner A"] and r["winner B"] and "tie" not in (r["winner A"], r["winner B"])
                and r["winner A"] != r["winner B"]]
    borderline = [r for r in rows if not r["same winner"] and r not in opposite and r["winner A"] and r["winner B"]]
    return (f"{len(opposite)} contradict (opposite winners)"
            f"{': ' + '; '.join(r['question'] for r in opposite) if opposite else ''}; "
            f"{len(borderline)} borderline (a winner in one run, a tie in the other)"
            f"{': ' + '; '.join(r['question'] for r in borderline) if borderline else ''}")


if __name__ == "__main__":
    sys.exit(main())
