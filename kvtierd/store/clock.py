"""CLOCK over the NVMe tier's rows: the disk's default eviction policy, a byte a block.

An LRU keeps an ordered-dict entry per block keyed by its id tuple, about 105 bytes a block on
top of the tuple (docs/architecture.md, "The index at scale"); at tens of millions of blocks
that alone is past the goal of 128 bytes a block. CLOCK approximates recency with one reference
byte per row of the tier's :class:`~kvtierd.store.coldindex.ColdIndex`: set when a record is
written and whenever its block is read or promoted, cleared by a hand that sweeps the rows. A
row the hand finds referenced loses its byte and is passed over (a second chance); one it finds
clear is a victim, if the store allows (``evictable``) and its block is not held.

It is a :class:`~kvtierd.policy.CachePolicy` (ids in, ids out) that finds a block's row by
probing the cold index with its id, rather than an eviction inside the tier: the store's
:class:`~kvtierd.store.tracking.TierPolicy`, its journal of deferred telemetry and its
``evictable`` checks (slot class, loading) stay the same for every policy, and LRU and SLSAP
remain selectable. The policy keeps no state per block beyond the held ones (blocks the store
cannot evict yet, bounded by the arena), and the hand.

What the table may do under the hand: rows are freed (a free row is never a candidate) and
reused (a reused row starts referenced: an insert is an access), the table grows (the hand
covers the rows in use when it is asked) or is replaced at recovery (a hand past the end starts
over). An id with no row (a block still dirty in DRAM) has nothing to mark; its row, once
written, starts referenced.

Bounded per call: the hand passes at most every row twice (all referenced: the first pass
clears them, the second finds victims), clearing bytes a window at a time with numpy, and asks
about at most :data:`MAX_CHECKS` clear rows one by one (``evictable``, held, the key's newest
row). A call that runs out returns what it found; the next one goes on from the hand.

Slot classes. Space of one slot size is never given to another (store/segments.py), so a
write-back that needs a slot of one size can only use a victim of that size
(:meth:`ClockPolicy.victims_in_class`). The rows of other sizes are filtered out with numpy
(each row's segment, each segment's slot size) before any is asked about one by one: asking
about them would spend the checks, and on a disk full of small blocks a large one would find
no victim among 4,096 small rows although large ones exist. Each class has its own hand, which
clears only its own rows' bytes: sweeping for large victims takes no second chance from the
small blocks read since their hand last passed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.store.coldindex import ColdIndex
from kvtierd.store.segments import DiskSlot

__all__ = ["MAX_CHECKS", "WINDOW", "ClockPolicy"]

#: Rows the hand takes at once (their bytes read and cleared by numpy: about 0.1 ms for
#: 64K rows, so two passes over 10M rows hold the loop some tens of milliseconds).
WINDOW = 1 << 16
#: At most this many clear rows are looked at one by one in a call (about 5 us each; a hand
#: that finds no victim among them returns empty-handed rather than hold the event loop).
MAX_CHECKS = 4096


class ClockPolicy(CachePolicy):
    """Second-chance eviction over the rows of ``rows()`` (the NVMe tier's cold index, read
    at each call: recovery may replace it). Block ids are ``(namespace digest, key)``."""

    recovers_by_insertion = False  # its state is the rows' own reference byte

    def __init__(
        self,
        rows: Callable[[], ColdIndex],
        *,
        window: int = WINDOW,
        classes: Callable[[], npt.NDArray[np.int64]] | None = None,
    ) -> None:
        """``classes``: the slot class (slot size) of each segment of the rows' tier, read at
        each call (a segment is added when a class needs room); without it every row is of
        one class."""
        self._rows = rows
        self._window = window
        self._classes = classes
        self._hands: dict[int | None, int] = {None: 0}  # by slot class (None: every row)
        self._held: set[Hashable] = set()

    @property
    def hand(self) -> int:
        """The next row the hand over every row looks at."""
        return self._hands[None]

    def class_hand(self, slot_class: int) -> int:
        """The next row the hand over ``slot_class``'s rows looks at."""
        return self._hands.get(slot_class, 0)

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        return True

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        # The row's byte was set when the tier added it; a new insertion ends a hold.
        self._held.discard(block)

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        cold = self._rows()
        digest, key = cast(tuple[bytes, bytes], block)
        cold.touch(cold.find(digest, key))  # no row (-1): nothing to mark

    def accessed_at(self, locations: Sequence[Hashable]) -> None:
        """The blocks whose disk copies are at ``locations`` (the tier's
        :class:`~kvtierd.store.segments.DiskSlot` each) were read: their rows found by place,
        a list index each, where :meth:`accessed` hashes and probes each id (a READ's blocks
        carry their slots, so a batch of reads costs no probe). Setting a byte commutes with
        every other event, so the store tells this at once, not through its journal; a slot
        whose row is gone (freed, or reused by a newer record, which starts referenced
        anyway) marks nothing or a row already marked."""
        cold = self._rows()
        at, touch = cold.at, cold.touch
        for location in locations:
            slot = cast(DiskSlot, location)
            touch(at(slot.segment, slot.index))  # no row (-1): nothing to mark

    def removed(self, block: Hashable) -> None:
        self._held.discard(block)  # the tier frees the row

    def hold(self, block: Hashable) -> None:
        self._held.add(block)

    def release(self, block: Hashable) -> None:
        self._held.discard(block)

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        return self._sweep(count, evictable, None)

    def victims_in_class(
        self, count: int, slot_class: int, evictable: Callable[[Hashable], bool]
    ) -> list[Hashable]:
        """:meth:`victims` among the rows in segments of ``slot_class`` only, by that class's
        own hand (every row when the policy was given no ``classes``)."""
        return self._sweep(count, evictable, None if self._classes is None else slot_class)

    def _sweep(
        self, count: int, evictable: Callable[[Hashable], bool], slot_class: int | None
    ) -> list[Hashable]:
        chosen: list[Hashable] = []
        cold = self._rows()
        extent = cold.extent
        if count <= 0 or not extent:
            return chosen
        segments = None
        if slot_class is not None:
            assert self._classes is not None
            wanted = self._classes() == slot_class  # whether each segment is of the class
            if not wanted.any():
                return chosen
            if not wanted.all():  # (one class on the disk, the usual case: nothing to filter)
                segments = np.append(wanted, False)  # (last: a segment added since, not)
        hand = self._hands.get(slot_class, 0)
        hand = hand if hand < extent else 0
        rows_left, checks = 2 * extent, MAX_CHECKS
        while rows_left and checks and len(chosen) < count:
            end = min(extent, hand + self._window, hand + rows_left)
            stop = end
            of_class = None if segments is None else _of_class(cold, hand, end, segments)
            for row in _clear_rows(cold, hand, end, of_class)[:checks].tolist():
                checks -= 1
                block = self._victim(cold, row, evictable)
                if block is not None and block not in chosen:  # (a second pass meets it again)
                    chosen.append(block)
                if len(chosen) == count or not checks:
                    stop = row + 1
                    break
            _clear_references(cold, hand, stop, of_class)  # passed over: a second chance
            rows_left -= stop - hand
            hand = stop if stop < extent else 0
        self._hands[slot_class] = hand
        return chosen

    def _victim(
        self, cold: ColdIndex, row: int, evictable: Callable[[Hashable], bool]
    ) -> Hashable | None:
        """The block of the clear ``row`` if it may go: not held, the row its key's newest (an
        older record of a key being replaced is not its block's age), and ``evictable``."""
        block = cold.identity(row)
        if block is None or block in self._held or cold.find(*block) != row:
            return None
        return block if evictable(block) else None

    def __len__(self) -> int:
        return self._rows().keys


def _of_class(
    cold: ColdIndex, first: int, end: int, segments: npt.NDArray[np.bool_]
) -> npt.NDArray[np.bool_]:
    """Whether each row from ``first`` to ``end`` is in a segment marked in ``segments`` (whose
    last entry, false, stands for every segment past it)."""
    of: npt.NDArray[Any] = cold.column("segment")[first : min(end, cold.extent)]
    return segments.take(of, mode="clip")


def _clear_rows(
    cold: ColdIndex, first: int, end: int, of_class: npt.NDArray[np.bool_] | None
) -> npt.NDArray[np.intp]:
    """The rows in use from ``first`` to ``end`` whose byte is clear, in order; only those
    marked in ``of_class`` (:func:`_of_class` of the same rows) when given."""
    rows = cold.unreferenced(first, end)
    if of_class is None or not len(rows):
        return rows
    return rows[of_class[rows - first]]


def _clear_references(
    cold: ColdIndex, first: int, end: int, of_class: npt.NDArray[np.bool_] | None
) -> None:
    """Clear the bytes of the rows from ``first`` to ``end``: only those marked in ``of_class``
    (:func:`_of_class` of the rows from ``first``) when given."""
    end = min(end, cold.extent)
    if of_class is None:
        cold.clear_references(first, end)
    elif end > first:
        np.copyto(cold.column("ref")[first:end], 0, where=of_class[: end - first])
