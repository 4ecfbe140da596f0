"""The daemon's private staging memory, at the head of the arena where no client maps.

Header pages: disk I/O moves a record as ``[header page, payload]`` in one vectored operation.
The header page must be 4 KiB-aligned memory and, for io_uring's fixed-buffer path, lie inside
the registered arena; so the arena's first ``count`` pages are kept for this. Holding a page is
an async context manager; waiting for one is the back-pressure that bounds concurrent disk
operations.

Block copies (:class:`StagedCopies`): a committed block's slot stays mapped by its tenant's
clients, which may still write to it, so no slot is ever written to disk as it is. At COMMIT,
while there is room, the daemon copies each block here and hashes the copy in the same pass
(the hash it takes at COMMIT anyway): the checksum then describes bytes no client can reach,
and write-back writes that copy as it is. A block committed when the room is taken is hashed in
its slot instead; write-back then copies it here and hashes the copy again, and writes it only
if the two hashes agree. Either way what reaches the disk is what was committed, and a record's
checksum always describes its payload. Part of the memory (``reserve``) is write-back's own,
carved apart from the copies made at COMMIT, so that write-back never waits for room that only
write-back itself could free.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from kvtierd.errors import NoSpaceError
from kvtierd.store.codec import copy_checksum_off_loop
from kvtierd.store.records import PAGE_BYTES
from kvtierd.store.slots import Slot, SlotAllocator

__all__ = ["ChangedAfterCommit", "StagedCopies", "StagingPages"]


class ChangedAfterCommit(Exception):
    """The slot's bytes no longer hash to the checksum taken at COMMIT: a client of the
    block's tenant wrote to it after committing. Its DRAM copy is not the committed block."""


class StagingPages:
    """``count`` pages at the start of ``region`` (a view of the arena's head)."""

    def __init__(self, region: memoryview, count: int) -> None:
        if len(region) < count * PAGE_BYTES:
            raise ValueError("the staging region is smaller than its pages")
        self._region = region
        self._free = list(range(count))
        # A free page is taken without a turn of the loop (``fast_acquire``): every holder
        # awaits I/O next, which is the checkpoint; a yield per block cost as much loop time as
        # reading a 448 KiB block.
        self._available = anyio.Semaphore(count, fast_acquire=True)
        self._several = anyio.Lock(fast_acquire=True)
        self.count = count

    @contextlib.asynccontextmanager
    async def page(self) -> AsyncIterator[memoryview]:
        """A page for the duration of the ``async with`` block."""
        async with self._available:
            index = self._free.pop()
            try:
                yield self._region[index * PAGE_BYTES : (index + 1) * PAGE_BYTES]
            finally:
                self._free.append(index)

    @contextlib.asynccontextmanager
    async def pages(self, n: int) -> AsyncIterator[list[memoryview]]:
        """``n`` pages (1 to :attr:`count`) for the duration of the ``async with`` block, for
        one vectored read of ``n`` records. They are taken one at a time under a lock: two
        callers never each hold part of what the other waits for, and a single page held
        elsewhere comes back once its I/O ends. Raises :class:`ValueError` for another ``n``."""
        if not 1 <= n <= self.count:
            raise ValueError(f"{n} pages asked of {self.count}")
        taken: list[int] = []
        try:
            async with self._several:
                for _ in range(n):
                    try:
                        self._available.acquire_nowait()  # no checkpoint per free page
                    except anyio.WouldBlock:
                        await self._available.acquire()
                    taken.append(self._free.pop())
            yield [self._region[i * PAGE_BYTES : (i + 1) * PAGE_BYTES] for i in taken]
        finally:
            for index in taken:
                self._free.append(index)
                self._available.release()


class StagedCopies:
    """Private copies of blocks on their way to a lower tier, in ``region`` (a view of private
    arena memory starting at arena offset ``base``); ``reserve`` bytes of it only for copies
    made at write-back."""

    def __init__(self, region: memoryview, base: int, *, reserve: int = 0) -> None:
        self._region = region
        self._base = base
        reserve = min(
            -(-reserve // PAGE_BYTES) * PAGE_BYTES, len(region) - len(region) % PAGE_BYTES
        )
        split = len(region) - len(region) % PAGE_BYTES - reserve
        #: Copies made at COMMIT, and write-back's own (``reserve`` bytes at the end).
        self._slots = SlotAllocator(base, split)
        self._writeback = SlotAllocator(base + split, reserve)
        self._freed = anyio.Event()
        self.reserve = reserve
        #: Blocks staged at COMMIT, and those write-back had to copy (and verify) itself.
        self.staged_at_commit = 0
        self.copied_at_writeback = 0

    def padded(self, nbytes: int) -> int:
        return self._slots.size_class(nbytes)

    def take(self, nbytes: int) -> Slot | None:
        """Room for a copy made at COMMIT, or ``None`` at once (never waits): the block is then
        hashed in place and copied at write-back."""
        return self._slots.allocate(nbytes)

    async def stage(self, slot: Slot, source: memoryview) -> int:
        """Copy ``source`` into ``slot`` (zero-padded to whole pages: ``O_DIRECT`` writes whole
        pages, and the padding must not carry an earlier copy's bytes, another tenant's
        perhaps) and return the xxh3-64 of the copy, taken in the same pass."""
        copy = self.view(slot, len(source))
        copy[len(source) :] = bytes(len(copy) - len(source))
        self.staged_at_commit += 1
        return await copy_checksum_off_loop(copy[: len(source)], source)

    def view(self, slot: Slot, nbytes: int) -> memoryview:
        """The staged copy of an ``nbytes`` block in ``slot``, padded to whole pages."""
        start = slot.offset - self._base
        return self._region[start : start + self.padded(nbytes)]

    def free(self, slot: Slot) -> None:
        """Give back a copy made at COMMIT."""
        self._slots.free(slot)

    @contextlib.asynccontextmanager
    async def copy_of(self, source: memoryview, checksum: int) -> AsyncIterator[memoryview]:
        """For write-back, a private copy of ``source`` (a block hashed in its slot at COMMIT)
        for the ``async with`` block, verified against ``checksum`` and padded like
        :meth:`stage`; raises :class:`ChangedAfterCommit` when the bytes changed. Waits while
        the memory is taken by other copies."""
        padded = self.padded(len(source))
        if padded > self.reserve:
            raise NoSpaceError(
                f"a {len(source)}-byte block exceeds write-back's {self.reserve}-byte staging"
            )
        while (slot := self._writeback.allocate(len(source))) is None:
            await self._freed.wait()
        try:
            copy = self.view(slot, len(source))
            copy[len(source) :] = bytes(padded - len(source))
            self.copied_at_writeback += 1
            if await copy_checksum_off_loop(copy[: len(source)], source) != checksum:
                raise ChangedAfterCommit
            yield copy
        finally:
            self._writeback.free(slot)
            self._freed.set()
            self._freed = anyio.Event()
