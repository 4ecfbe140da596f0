"""The block table: per-block reuse state in parallel numpy arrays, addressed by slot.

Every block the reuse model tracks (resident in the tier, or a *ghost*: recently evicted or never
admitted, kept only as metadata) has one slot. A dict maps the store's block identifier to its
slot; the per-block state lives in fixed-width arrays so that scoring all residents is one
vectorised gather. Slots are recycled through a free list and the arrays double when full, so the
memory per tracked block is the array widths plus one dict entry and one list pointer.

Pure data structure: no policy decisions are taken here.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable

import numpy as np
import numpy.typing as npt

__all__ = ["BlockTable"]

_INITIAL_SLOTS = 1024


class BlockTable:
    """Slot-addressed arrays of block state.

    Columns: ``last`` (model clock when last named), ``count`` (distinct requests that named it),
    ``klass`` (the reuse class it was given when last named), ``resident`` (cached in the tier),
    ``version`` (bumped on every change, so queued decisions can tell they are stale) and
    ``request`` (the last request that named it, so one request counts once).
    """

    def __init__(self, initial_slots: int = _INITIAL_SLOTS) -> None:
        if initial_slots < 1:
            raise ValueError("initial_slots must be >= 1")
        self._index: dict[Hashable, int] = {}
        self.keys: list[Hashable | None] = [None] * initial_slots
        self.last = np.zeros(initial_slots, dtype=np.float64)
        self.count = np.zeros(initial_slots, dtype=np.int32)
        self.klass = np.zeros(initial_slots, dtype=np.int16)
        self.resident = np.zeros(initial_slots, dtype=np.bool_)
        self.version = np.zeros(initial_slots, dtype=np.uint32)
        self.request = np.full(initial_slots, -1, dtype=np.int64)
        self._free: list[int] = list(range(initial_slots - 1, -1, -1))
        self.resident_count = 0

    def __len__(self) -> int:
        """Tracked blocks (residents and ghosts)."""
        return len(self._index)

    @property
    def ghost_count(self) -> int:
        return len(self._index) - self.resident_count

    def find(self, key: Hashable) -> int:
        """The slot of ``key``, or -1 when it is not tracked."""
        return self._index.get(key, -1)

    def slots_of(self, keys: Iterable[Hashable]) -> npt.NDArray[np.int64]:
        """Slots of ``keys``, allocating fresh ghost slots (``count`` 0) for untracked ones."""
        index = self._index
        out = []
        for key in keys:
            slot = index.get(key)
            if slot is None:
                slot = self._allocate(key)
            out.append(slot)
        return np.asarray(out, dtype=np.int64)

    def slot_for(self, key: Hashable) -> int:
        """The slot of ``key``, allocating a fresh ghost slot when it is untracked."""
        slot = self._index.get(key)
        return self._allocate(key) if slot is None else slot

    def _allocate(self, key: Hashable) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._index[key] = slot
        self.keys[slot] = key
        # Dropped slots are never resident, and last/klass are written by the first observation.
        self.count[slot] = 0
        self.request[slot] = -1
        return slot

    def _grow(self) -> None:
        old = len(self.keys)
        new = old * 2
        self.keys.extend([None] * (new - old))
        self.last = np.concatenate([self.last, np.zeros(old, self.last.dtype)])
        self.count = np.concatenate([self.count, np.zeros(old, self.count.dtype)])
        self.klass = np.concatenate([self.klass, np.zeros(old, self.klass.dtype)])
        self.resident = np.concatenate([self.resident, np.zeros(old, self.resident.dtype)])
        self.version = np.concatenate([self.version, np.zeros(old, self.version.dtype)])
        self.request = np.concatenate([self.request, np.full(old, -1, self.request.dtype)])
        self._free.extend(range(new - 1, old - 1, -1))

    def set_resident(self, slot: int, resident: bool) -> None:
        """Mark ``slot`` cached (or a ghost), keeping ``resident_count`` true."""
        if bool(self.resident[slot]) != resident:
            self.resident[slot] = resident
            self.resident_count += 1 if resident else -1
        self.version[slot] += 1

    def drop(self, slots: npt.NDArray[np.int64]) -> None:
        """Stop tracking ``slots`` (ghosts only: callers never drop residents)."""
        for slot in slots.tolist():
            key = self.keys[slot]
            del self._index[key]
            self.keys[slot] = None
            self.version[slot] += 1
            self._free.append(slot)

    def tracked_slots(self) -> npt.NDArray[np.int64]:
        """Every slot in use, ascending."""
        return np.sort(np.fromiter(self._index.values(), dtype=np.int64, count=len(self._index)))

    def resident_slots(self) -> npt.NDArray[np.int64]:
        """Every resident slot, ascending."""
        return np.flatnonzero(self.resident).astype(np.int64)

    def ghost_slots(self) -> npt.NDArray[np.int64]:
        """Every tracked, non-resident slot, ascending."""
        tracked = self.tracked_slots()
        return tracked[~self.resident[tracked]]

    def nbytes(self) -> int:
        """Memory held by the arrays, the key list and the index (not by the keys themselves)."""
        arrays = sum(
            a.nbytes
            for a in (self.last, self.count, self.klass, self.resident, self.version, self.request)
        )
        pointers = sys.getsizeof(self.keys) + sys.getsizeof(self._free)
        return int(arrays + pointers + sys.getsizeof(self._index))
