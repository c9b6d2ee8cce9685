"""What people and monitors read of a ledger: ``vmkv ledger``'s table and verdict, and Prometheus lines."""

from __future__ import annotations

from ..sizes import format_size
from .ledger import Ledger, MemberInfo


def report(name: str, *, reap: bool = False) -> list[str]:
    """What ``vmkv ledger NAME`` prints: the budget, one row per member, and a verdict line.

    Args:
        name: the ledger's name or path.
        reap: first free the slots of members whose processes are gone.

    Raises:
        FileNotFoundError: no such ledger; LedgerCorrupt, LedgerMismatch: it cannot be read.
    """
    ledger = Ledger(name, None)
    try:
        freed = ledger.reap() if reap else 0
        members = ledger.members()
        budget = ledger.budget
    finally:
        ledger.close(unlink_if_empty=reap)  # a reaped ledger with no member left goes
    used = sum(m.held for m in members)
    lines = [f"ledger {name} ({ledger.path}): budget {format_size(budget)}, held {format_size(used)}, "
             f"free {format_size(budget - used)}"]
    header = ("member", "pid", "state", "page", "held", "pages", "min", "max", "grants", "returns", "reclaims",
              "asked", "idle")
    rows = [(m.name, str(m.pid), "alive" if m.alive else "dead", format_size(m.page_bytes), format_size(m.held),
             str(m.held // m.page_bytes), format_size(m.min), format_size(m.max), str(m.grants), str(m.returns),
             str(m.reclaims), format_size(m.request), format_size(m.reclaimable)) for m in members]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    return lines + [verdict(budget, members, freed)]


def verdict(budget: int, members: list[MemberInfo], reaped: int = 0) -> str:
    """One line that says what the ledger's state means."""
    used = sum(m.held for m in members)
    dead = [m for m in members if not m.alive]
    waiting = [m for m in members if m.want]
    if not members:
        state = "no members: the whole budget is free"
    elif dead:
        state = (f"{len(dead)} dead member(s) hold {format_size(sum(m.held for m in dead))}: the next member short "
                 "of budget takes it back (or run with --reap)")
    elif waiting:
        state = (f"{', '.join(m.name for m in waiting)} wait(s) for {format_size(sum(m.want for m in waiting))}; "
                 f"the others offer {format_size(sum(m.reclaimable for m in members if not m.want))} idle")
    else:
        state = (f"{len(members)} member(s) hold {used / budget:.0%} of the budget; "
                 f"{format_size(sum(m.reclaimable for m in members))} of it idle (given back on demand)")
    return f"verdict: {state}" + (f"; reaped {format_size(reaped)} of dead members" if reaped else "")


def prometheus_lines(name: str) -> list[str]:
    """Prometheus gauges of ledger ``name``: its budget, and each member's bytes held and idle."""
    with Ledger(name, None) as ledger:
        members, budget = ledger.members(), ledger.budget
    lines = ["# HELP vmkv_ledger_budget_bytes Bytes of the host-wide KV budget this cache shares",
             "# TYPE vmkv_ledger_budget_bytes gauge", f'vmkv_ledger_budget_bytes{{ledger="{_label(name)}"}} {budget}']
    for metric, field, text in (("held_bytes", "held", "Bytes of the shared KV budget a member holds"),
                                ("idle_bytes", "reclaimable", "Bytes a member could give back when asked"),
                                ("reclaims_total", "reclaims", "Pages a member gave back on request")):
        kind = "counter" if metric.endswith("_total") else "gauge"
        lines += [f"# HELP vmkv_ledger_member_{metric} {text}", f"# TYPE vmkv_ledger_member_{metric} {kind}"]
        lines += [f'vmkv_ledger_member_{metric}{{ledger="{_label(name)}",member="{_label(m.name)}",pid="{m.pid}"}} '
                  f"{getattr(m, field)}" for m in members]
    return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
