"""The block table: per-block reuse state in parallel numpy arrays, addressed by slot.

Every block the reuse model tracks (resident in the tier, or a *ghost*: recently evicted or never
admitted, kept only as metadata) has one slot. A dict maps the store's block identifier to its
slot; the per-block state lives in fixed-width arrays so that scoring all residents is one
vectorised gather. Slots are recycled through a free list and the arrays double when full, so the
memory per tracked block is the array widths plus one dict entry and one list pointer.

The per-event paths (one block read, inserted or removed) touch single elements, and numpy's
scalar indexing, which boxes every element in a numpy scalar, costs about twice a memoryview's
plain Python value: each column therefore also has a ``*_cells`` memoryview over the same buffer,
rebound whenever the arrays grow. Vectorised code uses the arrays, scalar code the cells.

Pure data structure: no policy decisions are taken here.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable

import numpy as np
import numpy.typing as npt

__all__ = ["VERSION_MASK", "BlockTable"]

_INITIAL_SLOTS = 1024
VERSION_MASK = 0xFFFF_FFFF
"""``version`` is uint32: bumps through the cells wrap with this mask, as numpy's do."""


class BlockTable:
    """Slot-addressed arrays of block state.

    Columns: ``last`` (model clock when last named), ``count`` (distinct requests that named it),
    ``klass`` (the reuse class it was given when last named), ``resident`` (cached in the tier),
    ``version`` (bumped on every change, so queued decisions can tell they are stale),
    ``request`` (the last request that named it, so one request counts once) and ``tracked`` (the
    slot holds a block). ``last_cells``, ``count_cells``, ... are the same columns as memoryviews,
    for reading and writing one slot (see the module docstring).
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
        self.tracked = np.zeros(initial_slots, dtype=np.bool_)
        self._bind_cells()
        self._free: list[int] = list(range(initial_slots - 1, -1, -1))
        self.resident_count = 0

    def _bind_cells(self) -> None:
        # Float and bool columns are cast from their bytes, which tells the type checker what an
        # element reads as (``ndarray.data`` is typed as a view of ints).
        self.last_cells: memoryview[float] = self.last.view(np.uint8).data.cast("d")
        self.count_cells: memoryview[int] = self.count.data
        self.klass_cells: memoryview[int] = self.klass.data
        self.resident_cells: memoryview[bool] = self.resident.view(np.uint8).data.cast("?")
        self.version_cells: memoryview[int] = self.version.data
        self.request_cells: memoryview[int] = self.request.data
        self.tracked_cells: memoryview[bool] = self.tracked.view(np.uint8).data.cast("?")

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
        self.count_cells[slot] = 0
        self.request_cells[slot] = -1
        self.tracked_cells[slot] = True
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
        self.tracked = np.concatenate([self.tracked, np.zeros(old, self.tracked.dtype)])
        self._bind_cells()
        self._free.extend(range(new - 1, old - 1, -1))

    def set_resident(self, slot: int, resident: bool) -> None:
        """Mark ``slot`` cached (or a ghost), keeping ``resident_count`` true."""
        cells = self.resident_cells
        if cells[slot] != resident:
            cells[slot] = resident
            self.resident_count += 1 if resident else -1
        self.version_cells[slot] = (self.version_cells[slot] + 1) & VERSION_MASK

    def drop(self, slots: npt.NDArray[np.int64]) -> None:
        """Stop tracking ``slots`` (distinct ghosts only: callers never drop residents)."""
        index, keys, dropped = self._index, self.keys, slots.tolist()
        for slot in dropped:
            del index[keys[slot]]
            keys[slot] = None
        self._free.extend(dropped)
        self.version[slots] += 1
        self.tracked[slots] = False

    def tracked_slots(self) -> npt.NDArray[np.int64]:
        """Every slot in use, ascending."""
        return np.flatnonzero(self.tracked).astype(np.int64)

    def resident_slots(self) -> npt.NDArray[np.int64]:
        """Every resident slot, ascending."""
        return np.flatnonzero(self.resident).astype(np.int64)

    def ghost_slots(self) -> npt.NDArray[np.int64]:
        """Every tracked, non-resident slot, ascending."""
        return np.flatnonzero(self.tracked & ~self.resident).astype(np.int64)

    def nbytes(self) -> int:
        """Memory held by the arrays, the key list and the index (not by the keys themselves)."""
        arrays = sum(
            a.nbytes
            for a in (
                self.last,
                self.count,
                self.klass,
                self.resident,
                self.version,
                self.request,
                self.tracked,
            )
        )
        pointers = sys.getsizeof(self.keys) + sys.getsizeof(self._free)
        return int(arrays + pointers + sys.getsizeof(self._index))
