"""The ledger file's layout, and its record: slots read, changed by sealed whole images, recovered
and checked.

::

    header   magic "VMKVLDG1" | version | slots | budget bytes | crc32 of the fields before it
    journal  slot index | a slot's new image | seal (crc32 of the two, or 0: empty)
    slot i   pid | process start time | pid namespace | flags | member name | page bytes | held |
             min | max | grants | returns | reclaims | request | want    (the image)
             reclaimable                                           (written without the lock)

Invariant: every slot is its old or its new image. A write goes to the journal, is sealed, copied,
unsealed; the next lock holder copies a sealed record again or drops an unsealed one.
"""

from __future__ import annotations

import itertools
import mmap
import struct
import zlib

from ..errors import LedgerCorrupt, LedgerMismatch

MAGIC = b"VMKVLDG1"
VERSION = 2
NUM_SLOTS = 32
MAX_BUDGET = (1 << 63) - 1
"""The largest budget a ledger records (its fields are 64-bit)."""
_HEADER = struct.Struct("<8sIIQ")  # magic, version, slots, budget; then a crc32 of these bytes
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _CRC.size
_SLOT = struct.Struct("<qQQQ32sQQQQQQQQQ")  # a slot's image: every field written under the lock
_FIELDS = ("pid", "start", "ns", "flags", "name", "page_bytes", "held", "min", "max", "grants", "returns",
           "reclaims", "request", "want")
_OFFSETS = dict(zip(_FIELDS, itertools.accumulate((32 if name == "name" else 8 for name in _FIELDS), initial=0)))
_OFFSETS["reclaimable"] = _SLOT.size  # the one field written without the lock, after the image
_SLOT_BYTES = 160
_INDEX = struct.Struct("<Q")
_JOURNAL = 64  # the journal record: the slot's index, then its new image; then the seal
_SEAL = _JOURNAL + _INDEX.size + _SLOT.size
_SLOTS = 256
FILE_BYTES = _SLOTS + NUM_SLOTS * _SLOT_BYTES
HOLDS_LOCK = 1
"""``flags`` bit: the member holds the OFD lock on its slot's first byte (:mod:`vmkv.ledger.liveness`)."""
_U64 = struct.Struct("<Q")


def slot_offset(index: int) -> int:
    """Where slot ``index`` starts in the file (its first byte carries the member's liveness lock)."""
    return _SLOTS + index * _SLOT_BYTES


def empty_file(budget: int) -> bytearray:
    """The bytes of a new ledger of ``budget`` bytes with no member."""
    header = _HEADER.pack(MAGIC, VERSION, NUM_SLOTS, budget)
    image = bytearray(FILE_BYTES)
    image[: _HEADER.size] = header
    _CRC.pack_into(image, _HEADER.size, zlib.crc32(header))
    return image


def read_header(head: bytes, size: int, path: str, advice: str) -> int:
    """The budget recorded in ``head`` (the first ``HEADER_BYTES`` of a file of ``size`` bytes).

    Raises:
        LedgerCorrupt: no ledger header (``advice`` says what to do), a bad checksum, slot count or size.
        LedgerMismatch: a ledger of another version.
    """
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise LedgerCorrupt(f"{path} is not a vmkv ledger ({size} bytes, no ledger header); {advice}")
    _, version, slots, budget = _HEADER.unpack_from(head)
    if version != VERSION:
        raise LedgerMismatch(f"{path} is a version {version} ledger; this vmkv reads version {VERSION}")
    if _CRC.unpack_from(head, _HEADER.size)[0] != zlib.crc32(head[: _HEADER.size]) or slots != NUM_SLOTS \
            or size != FILE_BYTES:
        raise LedgerCorrupt(f"{path} is a damaged vmkv ledger ({size} bytes, {slots} slots, or a bad "
                            "checksum); remove it when nothing uses it")
    return budget


def _seal(record: bytes) -> int:
    """The seal of a journal record: never 0 (0 marks an empty journal)."""
    return 1 << 32 | zlib.crc32(record)


class Record:
    """The slots of a ledger file mapped in memory; every method runs under the ledger's lock except
    :meth:`peek` and :meth:`set_reclaimable` (aligned 8-byte hints).
    """

    def __init__(self, fd: int, path: str) -> None:
        self.path = path
        self._map = mmap.mmap(fd, FILE_BYTES)

    def close(self) -> None:
        self._map.close()

    def slot(self, index: int) -> dict:
        """Slot ``index``'s image as a dict of its fields."""
        values = _SLOT.unpack_from(self._map, slot_offset(index))
        return dict(zip(_FIELDS, values))

    def write(self, index: int, **fields: int | bytes) -> None:
        """Change fields of slot ``index`` atomically (the module docstring)."""
        slot = self.slot(index)
        slot.update(fields)
        record = _INDEX.pack(index) + _SLOT.pack(*(slot[name] for name in _FIELDS))
        self._map[_JOURNAL:_SEAL] = record
        _U64.pack_into(self._map, _SEAL, _seal(record))
        self._apply(record)
        _U64.pack_into(self._map, _SEAL, 0)

    def clear(self, index: int) -> None:
        """Empty slot ``index`` (every field 0)."""
        self.write(index, **{name: b"" if name == "name" else 0 for name in _FIELDS})

    def _apply(self, record: bytes) -> None:
        base = slot_offset(_INDEX.unpack_from(record)[0])
        self._map[base : base + _SLOT.size] = record[_INDEX.size :]

    def recover(self) -> None:
        """Finish a write a killed writer left: copy a sealed journal record again, drop an unsealed one."""
        (seal,) = _U64.unpack_from(self._map, _SEAL)
        if not seal:
            return
        record = bytes(self._map[_JOURNAL:_SEAL])
        if seal == _seal(record):
            if _INDEX.unpack_from(record)[0] >= NUM_SLOTS:
                raise LedgerCorrupt(f"{self.path}: its journal names no slot; the file is damaged: remove it when "
                                    "nothing uses it")
            self._apply(record)
        _U64.pack_into(self._map, _SEAL, 0)

    def check(self, budget: int) -> list[dict]:
        """All slots, after checking the invariants of :mod:`vmkv.ledger` against ``budget``."""
        slots = [self.slot(i) for i in range(NUM_SLOTS)]
        total = 0
        for index, slot in enumerate(slots):
            if slot["pid"] < 0 or (slot["pid"] == 0 and (slot["held"] or slot["page_bytes"])):
                raise LedgerCorrupt(f"{self.path}: slot {index} is inconsistent (pid {slot['pid']}, "
                                    f"holding {slot['held']} B); the file is damaged: remove it when nothing uses it")
            if slot["pid"] and not (slot["min"] <= slot["max"] and slot["held"] <= slot["max"] and slot["page_bytes"]):
                raise LedgerCorrupt(f"{self.path}: member in slot {index} breaks min <= max, held <= max")
            total += slot["held"]
        if total > budget:
            raise LedgerCorrupt(f"{self.path}: members hold {total} B, more than the budget {budget} B")
        return slots

    def peek(self, index: int, field: str) -> int:
        """One 8-byte field of slot ``index`` (``request``, ``min``, ``reclaimable``...), read without the lock."""
        return _U64.unpack_from(self._map, slot_offset(index) + _OFFSETS[field])[0]

    def set_reclaimable(self, index: int, nbytes: int) -> None:
        """Write slot ``index``'s ``reclaimable`` hint (the one field written without the lock)."""
        _U64.pack_into(self._map, slot_offset(index) + _OFFSETS["reclaimable"], nbytes)
