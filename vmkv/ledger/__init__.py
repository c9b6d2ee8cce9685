"""A host-wide KV budget that several processes share, the way an OS shares RAM between them.

A ledger is a small file in shared memory (``/dev/shm/vmkv-ledger.NAME``) every member maps: one
byte budget and, per member, what it holds. Modules: :mod:`.format` (layout, sealed images),
:mod:`.liveness`, :mod:`.ledger` (:class:`Ledger`, :class:`Member`), :mod:`.reports`, :mod:`.settings`.

Invariants (checked on every locked read; a file that breaks one is refused, never trusted):
    * ``sum(held) <= budget``: no member ever holds memory past the ledger's budget;
    * ``min <= max`` and ``held <= max`` for every member;
    * an empty slot (``pid == 0``) holds nothing;
    * a request stands only while a live member waits (``want``) for the bytes it asks.

A process may be killed at any instruction: a file appears only complete, and a slot changes by
its whole image.
"""

from .format import FILE_BYTES, HOLDS_LOCK, MAGIC, MAX_BUDGET, NUM_SLOTS, VERSION
from .ledger import WAIT_STEP_S, Ledger, Member, MemberInfo
from .liveness import pid_namespace, process_alive, process_start
from .reports import prometheus_lines, report, verdict
from .settings import LEDGER_DIR, SharedBudget, check_budget, ledger_path, member_max

__all__ = ["FILE_BYTES", "HOLDS_LOCK", "LEDGER_DIR", "MAGIC", "MAX_BUDGET", "NUM_SLOTS", "VERSION", "WAIT_STEP_S",
           "Ledger", "Member", "MemberInfo", "SharedBudget", "check_budget", "ledger_path", "member_max",
           "pid_namespace", "process_alive", "process_start", "prometheus_lines", "report", "verdict"]
