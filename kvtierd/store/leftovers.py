"""Header pages the NVMe tier still owes a zeroing: records a crash must not bring back.

A restart's scan adopts every slot whose header page holds an intact record header, so a record
the tier let go of must have that page zeroed before a sync acknowledges the letting go (a
FORGET synced is one a restart keeps). Three kinds wait here when it could not be done at once:

* **a discarded record whose zeroing failed**: its slot stays held (no write may be given it)
  until the zeroing succeeds, then it is freed;
* **what a failed write left** in the slot it gave back (its header page, or all of it, may have
  landed before the failure): the slot is free, handed out after the others, and is claimed
  while it is zeroed, only if its page holds a record header (a write a full file system refused
  left nothing, and zeroing a page never allocated would need the space that is missing) and
  only if no write took it since (that write's header page replaces what was there);
* **a copy recovery could not settle** (a block written twice, neither copy readable at start):
  its slot stays held, and it is zeroed with its block's kept copy when that is discarded.

:meth:`Leftovers.zero` runs before every sync and at the disk watch's tick, one caller at a
time. The tier gives it the two I/O steps it needs (zero a header page, say whether a page holds
a record header); the bookkeeping here does no I/O of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio

from kvtierd.errors import StorageIOError
from kvtierd.store.segments import DiskSlot, SegmentMap

__all__ = ["Leftovers"]

log = logging.getLogger("kvtierd.nvme")


class Leftovers:
    """What the tier still has to zero (see the module docstring)."""

    def __init__(
        self,
        segmap: SegmentMap,
        zero_page: Callable[[DiskSlot], Awaitable[None]],
        holds_header: Callable[[DiskSlot], Awaitable[bool]],
    ) -> None:
        self._segmap = segmap
        self._zero_page = zero_page
        self._holds_header = holds_header
        #: Discarded records' slots, held until zeroed.
        self._discarded: list[DiskSlot] = []
        #: Free slots failed writes were given; a set in insertion order: a failing medium's
        #: retries fail in the same slot again and again.
        self._failed_writes: dict[DiskSlot, None] = {}
        #: Copies recovery could not settle, by block ``(namespace digest, key)``.
        self._left_copies: dict[tuple[bytes, bytes], DiskSlot] = {}
        self._zeroing = anyio.Lock()

    @property
    def pending(self) -> bool:
        """Whether a record dropped, or left by a failed write, still waits to be zeroed."""
        return bool(self._discarded or self._failed_writes)

    def write_failed(self, slot: DiskSlot) -> None:
        """A write into ``slot`` failed: give the slot back, handed out after the others (the
        medium refused it), and zero what reached it before the next sync."""
        self._segmap.free(slot, last=True)
        self._failed_writes[slot] = None

    def left_unsettled(self, block: tuple[bytes, bytes], slot: DiskSlot) -> None:
        """Recovery left a copy of ``block`` in ``slot`` (held): zero it with the block's kept
        copy."""
        self._left_copies[block] = slot

    async def discard(self, block: tuple[bytes, bytes], slot: DiskSlot) -> None:
        """Zero and free ``slot``, whose record of ``block`` the index no longer holds (and any
        copy of it recovery left, before the next sync); when the zeroing fails, keep the slot
        from reuse until :meth:`zero` does it, and raise."""
        left = self._left_copies.pop(block, None)
        if left is not None:
            self._discarded.append(left)
        await self.zero_and_free(slot)

    async def zero_and_free(self, slot: DiskSlot) -> None:
        """Zero the header page of ``slot``, whose row is gone, and free it; when that fails,
        keep it from reuse until :meth:`zero` does it, and raise."""
        try:
            await self._zero_page(slot)
        except BaseException:
            self._discarded.append(slot)
            raise
        self._segmap.free(slot)

    async def zero(self) -> int:
        """Zero every discarded record's page still waiting, then what failed writes left;
        one at a time, whoever calls. Raises the first failure to zero: that slot and those
        after it stay for the next call. A leftover whose page cannot be read stays for the
        next call too, without a failure (a scan could not read it either): how many did is
        returned."""
        unread = 0
        async with self._zeroing:
            await self._zero_discarded()
            for slot in list(self._failed_writes):
                del self._failed_writes[slot]
                try:
                    unread += not await self._zero_failed_write(slot)
                except BaseException:
                    self._failed_writes[slot] = None
                    raise
            await self._zero_discarded()  # discards that failed meanwhile
        return unread

    async def _zero_discarded(self) -> None:
        while self._discarded:
            await self.zero_and_free(self._discarded.pop())

    async def _zero_failed_write(self, slot: DiskSlot) -> bool:
        """Zero what a failed write may have left in ``slot``; ``False`` when its page could
        not be read (it stays, for the next call)."""
        if self._segmap.in_use(slot):
            return True  # a write took it since: its record's header page replaces the leftover
        try:
            if not await self._holds_header(slot):
                return True  # nothing a scan would adopt
        except StorageIOError as exc:
            log.warning("cannot read what a failed write left at offset %d: %s", slot.offset, exc)
            self._failed_writes[slot] = None  # tried again at the next sync or tick
            return False
        if not self._segmap.claim(slot):
            return True  # taken while the page was read
        try:
            await self._zero_page(slot)
        finally:
            # handed out last: the next writes take the slots a FORGET freed (where a full
            # file system has room), not the one a write just failed in
            self._segmap.free(slot, last=True)
        return True
