"""Pure placement of records in an NVMe data file: segments of equal-sized slots.

The file is carved front to back into segments; a segment holds slots of one size (a record
header page plus a payload rounded up to a page). Blocks of a namespace have one size, so a
segment's slots are reused in place forever and no compaction is ever needed. A segment is
planned here, its header written durably by the I/O layer, and only then added with
:meth:`SegmentMap.add_segment` and used.

Space of one size class is not given to another: a file full of 2 MiB slots cannot hold a
32 MiB block until an operator shrinks the first class (by a fresh tier). ``plan_segment``
returns ``None`` then and the store evicts within the class or reports ``ENOSPC``.

At recovery, a segment whose header was damaged is rebuilt here from what survives of it
(:meth:`SegmentMap.rebuild_segment`): its intact record headers, which sit at slot boundaries
and name their size, and the next intact segment header, which fixes where it ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtierd.store.freestack import FreeStack
from kvtierd.store.records import PAGE_BYTES, SegmentHeader

__all__ = ["DiskSlot", "SegmentMap", "slot_bytes_for"]


def slot_bytes_for(stored_bytes: int) -> int:
    """Size of the slot that holds a record of ``stored_bytes`` payload bytes."""
    return PAGE_BYTES + -(-stored_bytes // PAGE_BYTES) * PAGE_BYTES


@dataclass(frozen=True, slots=True)
class DiskSlot:
    """Slot ``index`` of segment ``segment``: ``size`` bytes at file ``offset``."""

    segment: int
    index: int
    offset: int
    size: int


class SegmentMap:
    """Which segments exist, and which of their slots are free."""

    def __init__(self, file_id: bytes, file_bytes: int, target_segment_bytes: int) -> None:
        self.file_id = file_id
        self.file_bytes = file_bytes - file_bytes % PAGE_BYTES
        self.target_segment_bytes = target_segment_bytes
        self.segments: list[SegmentHeader] = []
        self._tail = PAGE_BYTES  # after the superblock
        #: Free slots by slot size, each ``segment << 32 | index`` (8 bytes a free slot; a
        #: list of tuples cost about 100).
        self._free: dict[int, FreeStack] = {}
        #: One byte a slot, per segment: 1 while the slot holds a record. A set of
        #: ``(segment, index)`` tuples cost about 110 bytes a stored block; this costs one.
        self._used: list[npt.NDArray[np.uint8]] = []
        self._used_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return self.file_bytes - PAGE_BYTES

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def plan_segment(self, slot_bytes: int) -> SegmentHeader | None:
        """The next segment for ``slot_bytes`` slots, or ``None`` when the file is full."""
        room = self.file_bytes - self._tail - PAGE_BYTES
        if room < slot_bytes:
            return None
        count = max(1, self.target_segment_bytes // slot_bytes)
        count = min(count, room // slot_bytes)
        return SegmentHeader(self.file_id, self._tail, slot_bytes, count)

    def rebuild_segment(
        self, start: int, records: Sequence[tuple[int, int]], next_start: int | None
    ) -> SegmentHeader | None:
        """At recovery: the geometry of the segment at ``start``, whose header is lost.

        ``records`` are the ``(file offset, stored bytes)`` of the intact record headers found
        after ``start``; ``next_start`` is where the next intact segment header is, ``None``
        when there is none before the end of the file. A slot size is a candidate when a record
        of that size sits on a slot boundary for it; candidates are tried by how many records
        agree, and one is taken when it also ends the segment exactly at ``next_start`` (or,
        for the last segment, with the count :meth:`plan_segment` would have chosen, widened to
        the furthest record). ``None`` when no candidate fits.
        """
        first = start + PAGE_BYTES
        end = next_start if next_start is not None else self.file_bytes
        votes: Counter[int] = Counter()
        furthest: dict[int, int] = {}
        for offset, stored in records:
            slot_bytes = slot_bytes_for(stored)
            if slot_bytes < 2 * PAGE_BYTES or not first <= offset <= end - slot_bytes:
                continue
            index, misaligned = divmod(offset - first, slot_bytes)
            if not misaligned:
                votes[slot_bytes] += 1
                furthest[slot_bytes] = max(furthest.get(slot_bytes, 0), index)
        # Slot 0's header page is one the daemon wrote (or zeroed): when it holds a record, its
        # size decides, whatever pages inside payloads (a tenant's bytes) look like.
        at_first = [slot_bytes_for(stored) for offset, stored in records if offset == first]
        candidates = (
            [(at_first[0], 1)] if at_first and at_first[0] in votes else votes.most_common()
        )
        for slot_bytes, _ in candidates:
            if next_start is not None:
                count, rest = divmod(next_start - first, slot_bytes)
                if rest:
                    continue
            else:
                room = (self.file_bytes - first) // slot_bytes
                count = min(max(1, self.target_segment_bytes // slot_bytes), room)
                count = max(count, furthest[slot_bytes] + 1)
            return SegmentHeader(self.file_id, start, slot_bytes, count)
        return None

    def add_segment(self, header: SegmentHeader, *, all_free: bool = True) -> int:
        """Adopt a segment whose header is durable; returns its number."""
        if header.start != self._tail or header.end > self.file_bytes:
            raise ValueError(f"segment at {header.start} does not follow the tail {self._tail}")
        number = len(self.segments)
        self.segments.append(header)
        self._used.append(np.zeros(header.slot_count, np.uint8))
        self._tail = header.end
        if all_free:
            self.adopt_free(number, np.arange(header.slot_count))
        return number

    def adopt_free(self, segment: int, indices: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """At recovery: the listed slots of ``segment`` hold nothing (the first is used first)."""
        bucket = self._free.setdefault(self.segments[segment].slot_bytes, FreeStack())
        places = np.asarray(indices, dtype=np.uint64)[::-1] | np.uint64(segment << 32)
        bucket.extend(places)

    def adopt_used(self, segment: int, used: npt.NDArray[np.bool_]) -> None:
        """At recovery: the slots of ``segment`` where ``used`` is true hold records, the rest
        nothing."""
        mask = np.asarray(used, dtype=bool)
        self._used[segment][:] = mask
        self._used_bytes += int(mask.sum()) * self.segments[segment].slot_bytes
        self.adopt_free(segment, np.flatnonzero(~mask))

    def mark_used(self, segment: int, index: int) -> DiskSlot:
        """At recovery: slot ``index`` of ``segment`` holds a record."""
        return self._take(segment, index)

    def allocate(self, slot_bytes: int) -> DiskSlot | None:
        """A free slot of exactly ``slot_bytes``, or ``None``."""
        bucket = self._free.get(slot_bytes)
        if not bucket:
            return None
        place = bucket.pop()
        return self._take(place >> 32, place & 0xFFFFFFFF)

    def in_use(self, slot: DiskSlot) -> bool:
        return self._in_use(slot.segment, slot.index)

    def claim(self, slot: DiskSlot) -> bool:
        """Take ``slot`` if it is free (whether it was): to write it while no block may be
        given it; :meth:`free` it with ``last=True`` after. A scan of its size's free slots,
        for rare use."""
        bucket = self._free.get(slot.size)
        if self._in_use(slot.segment, slot.index) or bucket is None:
            return False
        if not bucket.remove(_packed(slot)):
            return False
        self._take(slot.segment, slot.index)
        return True

    def free(self, slot: DiskSlot, *, last: bool = False) -> None:
        """Return a slot, to be handed out next (``last``: after every other free slot of its
        size); raises ``ValueError`` if it is not in use."""
        place = (slot.segment, slot.index)
        if not self._in_use(*place):
            raise ValueError(f"disk slot {place} is not in use")
        self._used[slot.segment][slot.index] = 0
        self._used_bytes -= slot.size
        bucket = self._free.setdefault(slot.size, FreeStack())
        if last:
            bucket.push_bottom(_packed(slot))
        else:
            bucket.push(_packed(slot))

    def _in_use(self, segment: int, index: int) -> bool:
        return (
            0 <= segment < len(self._used)
            and 0 <= index < len(self._used[segment])
            and bool(self._used[segment][index])
        )

    def _take(self, segment: int, index: int) -> DiskSlot:
        slot = self.slot(segment, index)
        if not self._used[segment][index]:
            self._used[segment][index] = 1
            self._used_bytes += slot.size
        return slot

    def slot(self, segment: int, index: int) -> DiskSlot:
        """Slot ``index`` of ``segment``, used or not."""
        header = self.segments[segment]
        return DiskSlot(segment, index, header.slot_offset(index), header.slot_bytes)


def _packed(slot: DiskSlot) -> int:
    """``slot``'s place as its size's free stack holds it: ``segment << 32 | index``."""
    return slot.segment << 32 | slot.index
