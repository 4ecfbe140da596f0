"""Pure slot allocation over a linear region (the arena), by size class, with generations.

A request for ``n`` bytes is served from the free list of its size class (``n`` rounded up to
the alignment) or carved from the never-used tail of the region. Carved slots keep their place
and size: blocks of one model have one size, so a freed slot is almost always reused as it is,
with no fragmentation and no copying. When neither source has room, contiguous free slots of
any class are merged into one slot of the size asked for (rare; ``O(n log n)`` in free slots).

Every slot carries a generation, bumped each time it is freed. A reference to a slot is a
:class:`Slot` value holding the generation it was given out with; :meth:`SlotAllocator.is_live`
tells whether that reference is still the current use of those bytes, so a stale lease can
never be mistaken for a live one.

This module decides; it never touches memory.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Slot", "SlotAllocator"]


@dataclass(frozen=True, slots=True)
class Slot:
    """A slot reference: ``size`` bytes at ``offset`` in the region, as of ``generation``."""

    index: int
    offset: int
    size: int
    generation: int


class SlotAllocator:
    """Allocate ``align``-aligned slots in ``[base, base + capacity)``."""

    def __init__(
        self, base: int, capacity: int, align: int = 4096, boundary: int | None = None
    ) -> None:
        """``boundary``: carve no slot across a multiple of it (io_uring registers the arena in
        1 GiB fixed buffers, and an I/O that spans two of them cannot use the fixed path)."""
        if base % align or capacity < 0:
            raise ValueError("base must be aligned and capacity non-negative")
        self.base = base
        self.capacity = capacity - capacity % align
        self.align = align
        self.boundary = boundary
        self._tail = base
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self._generations: list[int] = []
        self._in_use: list[bool] = []
        self._free: dict[int, list[int]] = {}
        self._used_bytes = 0

    def size_class(self, nbytes: int) -> int:
        """The slot size that holds ``nbytes``."""
        if nbytes <= 0:
            raise ValueError("a slot holds at least one byte")
        return -(-nbytes // self.align) * self.align

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used_bytes

    def allocate(self, nbytes: int) -> Slot | None:
        """A slot of at least ``nbytes``, or ``None`` when there is no room (evict, then retry)."""
        size = self.size_class(nbytes)
        index = self._pop_free(size)
        if index is None:
            start = self._carve_start(size)
            if start + size <= self.base + self.capacity:
                self._tail = start
                index = self._carve(size)
        if index is None:
            index = self._merge(size)
        if index is None:
            return None
        self._in_use[index] = True
        self._used_bytes += size
        return self._ref(index)

    def free(self, slot: Slot) -> None:
        """Return ``slot``. Raises ``ValueError`` for a stale reference or a double free."""
        if not self.is_live(slot):
            raise ValueError(f"slot {slot.index} generation {slot.generation} is not live")
        index = slot.index
        self._in_use[index] = False
        self._generations[index] += 1
        self._used_bytes -= self._sizes[index]
        self._free.setdefault(self._sizes[index], []).append(index)

    def is_live(self, slot: Slot) -> bool:
        index = slot.index
        return (
            0 <= index < len(self._offsets)
            and self._in_use[index]
            and self._generations[index] == slot.generation
            and self._offsets[index] == slot.offset
        )

    def adopt(self, spans: list[tuple[int, int]]) -> list[Slot]:
        """Take the slots ``(offset, size)`` as allocated, in a fresh allocator: what a restarted
        daemon finds already in use (its predecessor's blocks, kept in DRAM). ``spans`` must be
        sorted by offset, aligned, of whole size classes, apart and inside the region; the gaps
        between them become free slots of the size of the slot after the gap (where the blocks
        of one model were, blocks of that model fit again, from their size's free list without
        a merge), the rest of a gap one slot, none across the ``boundary``. Raises
        ``ValueError`` for any other use (then nothing is changed)."""
        if self._offsets:
            raise ValueError("only a fresh allocator adopts slots")
        end = self.base
        for offset, size in spans:
            if offset < end or offset % self.align or size <= 0 or size % self.align:
                raise ValueError(f"slot [{offset}, +{size}) overlaps, or is not aligned")
            end = offset + size
        if end > self.base + self.capacity:
            raise ValueError(f"slot ending at {end} lies past the region")
        adopted = []
        for offset, size in spans:
            self._free_gap(self._tail, offset, size)
            index = self._carve(size, offset)
            self._tail = offset + size
            self._in_use[index] = True
            self._used_bytes += size
            adopted.append(self._ref(index))
        return adopted

    def _free_gap(self, start: int, end: int, unit: int) -> None:
        """Free slots covering ``[start, end)``: of ``unit`` bytes while they fit, the rest
        one slot, none across a ``boundary``."""
        while start < end:
            edge = end
            if self.boundary:
                edge = min(end, (start // self.boundary + 1) * self.boundary)
            size = unit if start + unit <= edge else edge - start
            index = self._carve(size, start)
            self._free.setdefault(size, []).append(index)
            start += size

    def _ref(self, index: int) -> Slot:
        return Slot(index, self._offsets[index], self._sizes[index], self._generations[index])

    def _carve_start(self, size: int) -> int:
        start = self._tail
        if self.boundary and size <= self.boundary:
            edge = (start // self.boundary + 1) * self.boundary
            if start + size > edge:
                start = edge  # the gap before the edge stays unused
        return start

    def _pop_free(self, size: int) -> int | None:
        bucket = self._free.get(size)
        return bucket.pop() if bucket else None

    def _carve(self, size: int, offset: int | None = None) -> int:
        if offset is None:
            offset, self._tail = self._tail, self._tail + size
        self._offsets.append(offset)
        self._sizes.append(size)
        self._generations.append(0)
        self._in_use.append(False)
        return len(self._offsets) - 1

    def _merge(self, size: int) -> int | None:
        """Fuse a run of adjacent free slots (any class, plus the uncarved tail) into one."""
        free = sorted((self._offsets[i], i) for bucket in self._free.values() for i in bucket)
        run: list[int] = []
        run_start = run_end = -1
        for offset, index in free:
            if offset != run_end:
                run, run_start = [], offset
            run.append(index)
            run_end = offset + self._sizes[index]
            if run_end - run_start >= size or (
                run_end == self._tail and self.base + self.capacity - run_start >= size
            ):
                return self._fuse(run, run_start, run_end, size)
        return None

    def _fuse(self, run: list[int], start: int, end: int, size: int) -> int:
        for index in run:
            self._free[self._sizes[index]].remove(index)
            self._generations[index] += 1
            self._sizes[index] = 0  # retired: never handed out again
        if end == self._tail:
            self._tail = start  # the run rejoins the uncarved tail, which then has room
            return self._carve(size)
        if end - start > size:
            rest = self._carve(end - start - size, start + size)
            self._free.setdefault(end - start - size, []).append(rest)
        return self._carve(size, start)
