"""The disk watch over a real NVMe tier: a dropped record whose header page could not be
zeroed (a FORGET a crash could undo) fails health as write-back's condition, which FSYNC
raises but does not latch, and which the next zeroing that succeeds clears, at an FSYNC or
at the timer's tick. (It was once filed as the sync's fault: FSYNC refused until restart.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtierd.errors import KvtierError, StorageIOError
from kvtierd.store.diskhealth import FaultSource
from kvtierd.store.diskwatch import DiskWatch
from kvtierd.store.records import checksum
from kvtierd.store.segments import DiskSlot
from kvtierd.store.tier import BlockRef
from kvtierd.store.writeback import WriteBack
from tests.store.test_recovery_damage import (
    DATA_FILE,
    NS,
    SMALL,
    Tier,
    content,
    key_for,
    open_tier,
    store_failing,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.mark.parametrize("recovery", ["fsync", "tick"])
async def test_a_failed_zeroing_fails_health_until_a_zeroing_succeeds(
    tmp_path: Path, recovery: str
) -> None:
    async with open_tier(tmp_path) as t:
        await t.put(key_for(0), SMALL)
        ref, slot = t.stored[key_for(0)]
        writeback = WriteBack(1)  # no block goes through it: only its failures are read
        watch = DiskWatch(t.tier, writeback)
        real = t.backend.writev
        failing = True

        async def writev(fd: int, offset: int, buffers: Any) -> int:
            if failing and offset == slot.offset and len(buffers) == 1:  # its zeroed page
                raise StorageIOError("injected: the medium refused the write")
            return await real(fd, offset, buffers)

        t.backend.writev = writev  # type: ignore[method-assign]
        with pytest.raises(StorageIOError):
            await t.tier.discard(ref, slot)
        with pytest.raises(KvtierError, match="injected"):
            await watch.sync()
        condition = watch.health.condition
        assert condition is not None
        assert condition.source is FaultSource.WRITE
        assert watch.health.refusal() is None  # FSYNC tries again, it is not refused for good
        await watch.check()  # the tick tries again too; still failing
        assert watch.health.condition == condition
        failing = False
        if recovery == "fsync":
            await watch.sync()
        else:
            await watch.check()
        assert watch.health.condition is None
        writeback.close()
    assert _page_at(tmp_path / DATA_FILE, slot.offset) == bytes(4096)  # the record is gone


async def a_failed_write(t: Tier) -> DiskSlot:
    """Block 5 stored, then block 0's write failed after it landed whole; its leftover's slot."""
    await t.put(key_for(5), SMALL)
    data = content(key_for(0), SMALL)
    t.buffer[:SMALL] = data
    await store_failing(t, BlockRef(NS, key_for(0), SMALL, checksum(data), 7), landed="whole")
    return next(iter(t.tier.leftovers._failed_writes))


def _page_at(path: Path, offset: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(4096)


async def test_the_tick_zeroes_what_a_failed_forget_left_and_clears_only_then(
    tmp_path: Path,
) -> None:
    """A FORGET's zeroing that failed outside any FSYNC (the store's own discard) is tried
    again by the timer's tick; health fails while it still fails, and a write-back recovering
    meanwhile does not clear it (a record still waits to be zeroed)."""
    async with open_tier(tmp_path) as t:
        await t.put(key_for(0), SMALL)
        ref, slot = t.stored[key_for(0)]
        writeback = WriteBack(1)
        watch = DiskWatch(t.tier, writeback)
        real = t.backend.writev
        failing = True

        async def writev(fd: int, offset: int, buffers: Any) -> int:
            if failing and offset == slot.offset and len(buffers) == 1:
                raise StorageIOError("injected: the medium refused the write")
            return await real(fd, offset, buffers)

        t.backend.writev = writev  # type: ignore[method-assign]
        with pytest.raises(StorageIOError):
            await t.tier.discard(ref, slot)  # no FSYNC, no disk watch involved
        assert t.tier.leftovers.pending
        await watch.check()
        condition = watch.health.condition
        assert condition is not None
        assert condition.source is FaultSource.WRITE
        watch.writes_recovered()  # write-back's failed blocks all written meanwhile
        assert watch.health.condition == condition  # the record still waits
        failing = False
        await watch.check()
        assert not t.tier.leftovers.pending
        assert watch.health.condition is None
        writeback.close()
    assert _page_at(tmp_path / DATA_FILE, slot.offset) == bytes(4096)


async def test_a_forget_failing_beside_the_ticks_zeroing_keeps_health_failing(
    tmp_path: Path,
) -> None:
    """A FORGET's zeroing fails while the tick zeroes what a failed write left: the tick
    does not report health back while that discarded record waits."""
    async with open_tier(tmp_path) as t:
        leftover = await a_failed_write(t)
        live_ref, live_slot = t.stored[key_for(5)]
        writeback = WriteBack(1)
        watch = DiskWatch(t.tier, writeback)
        watch.write_failed(StorageIOError("the failed write, as write-back reports it"))
        real = t.backend.writev
        forgot = False

        async def writev(fd: int, offset: int, buffers: Any) -> int:
            nonlocal forgot
            if offset == live_slot.offset and len(buffers) == 1:
                raise StorageIOError("injected: the FORGET's zeroing refused")
            if offset == leftover.offset and len(buffers) == 1 and not forgot:
                forgot = True  # a FORGET runs beside the leftover's zeroing, and fails
                with pytest.raises(StorageIOError):
                    await t.tier.discard(live_ref, live_slot)
            return await real(fd, offset, buffers)

        t.backend.writev = writev  # type: ignore[method-assign]
        await watch.check()
        assert forgot
        assert t.tier.leftovers.pending
        assert watch.health.condition is not None
        t.backend.writev = real  # type: ignore[method-assign]
        await watch.check()
        assert not t.tier.leftovers.pending
        assert watch.health.condition is None
        writeback.close()


async def test_a_leftover_that_cannot_be_read_fails_health_not_fsync(tmp_path: Path) -> None:
    async with open_tier(tmp_path) as t:
        leftover = await a_failed_write(t)
        writeback = WriteBack(1)
        watch = DiskWatch(t.tier, writeback)
        real = t.backend.readv
        refusing = True

        async def readv(fd: int, offset: int, buffers: Any) -> int:
            if refusing and offset == leftover.offset:
                raise StorageIOError("injected: unreadable sector")
            return await real(fd, offset, buffers)

        t.backend.readv = readv  # type: ignore[method-assign]
        await watch.sync()  # acknowledged: a scan could not read that page either
        condition = watch.health.condition
        assert condition is not None
        assert condition.source is FaultSource.WRITE
        refusing = False
        await watch.check()  # read now, and zeroed
        assert watch.health.condition is None
        writeback.close()
    assert _page_at(tmp_path / DATA_FILE, leftover.offset) == bytes(4096)
