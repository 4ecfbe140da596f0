"""Recovery of the NVMe tier's index from a damaged data file or a snapshot that disagrees with
it: nothing acknowledged is lost to metadata.

* a flipped bit in a segment header (or an unreadable one) costs at most that segment: the
  header is rebuilt from the record headers behind it and written back, and the segments after
  it are all found;
* a snapshot that decodes but disagrees with the file (a segment past its end, a slot that does
  not exist, a record listed twice...) is discarded with a WARNING and the headers are scanned;
* a record the medium cannot read, or whose place lies outside the file, is a miss, not an
  error on every READ.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvtierd.errors import BlockNotFoundError, StorageIOError
from kvtierd.io import IoBackend, open_io_backend
from kvtierd.store import snapshot as snapshots
from kvtierd.store.index import Owner
from kvtierd.store.nvme import NvmeTier, open_nvme_tier
from kvtierd.store.records import PAGE_BYTES, RecordHeader, SegmentHeader, checksum
from kvtierd.store.recovery import SNAPSHOT_NAME
from kvtierd.store.segments import DiskSlot, slot_bytes_for
from kvtierd.store.snapshot import Snapshot
from kvtierd.store.staging import StagingPages
from kvtierd.store.tier import BlockRef
from tests.store.test_store_pressure import key_of, put, small_store

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

NS = bytes(range(16))
DATA_FILE = "nvme.data"
FILE_BYTES = 16 << 20
SEGMENT_BYTES = 1 << 20
SMALL = 64 << 10  # 68 KiB slots: 15 to a 1 MiB segment
LARGE = 200 << 10
STAGING_PAGES = 32
BUFFER_BYTES = 256 << 10


def content(key: bytes, nbytes: int) -> bytes:
    return (key * (nbytes // len(key) + 1))[:nbytes]


def key_for(i: int) -> bytes:
    return b"blk-%06d" % i + bytes(6)


@dataclass
class Tier:
    """An open NVMe tier and a scratch buffer to load into."""

    tier: NvmeTier
    backend: IoBackend
    buffer: memoryview
    seq: int = 0
    stored: dict[bytes, tuple[BlockRef, Hashable]] = field(default_factory=dict)

    async def put(self, key: bytes, nbytes: int) -> None:
        data = content(key, nbytes)
        self.seq += 1
        ref = BlockRef(NS, key, nbytes, checksum(data), self.seq)
        self.buffer[:nbytes] = data
        self.stored[key] = (
            ref,
            await self.tier.store(ref, self.buffer[: -(-nbytes // 4096) * 4096]),
        )

    async def get(self, ref: BlockRef, location: Hashable) -> bytes:
        await self.tier.load(ref, location, self.buffer[: -(-ref.raw_bytes // 4096) * 4096])
        return bytes(self.buffer[: ref.raw_bytes])

    @property
    def segments(self) -> list[SegmentHeader]:
        return list(self.tier._segmap.segments)


@contextlib.asynccontextmanager
async def open_tier(
    directory: Path,
    *,
    backend_name: str = "threads",
    hook: Callable[[IoBackend], None] = lambda backend: None,
) -> AsyncIterator[Tier]:
    memory = mmap.mmap(-1, STAGING_PAGES * PAGE_BYTES + BUFFER_BYTES)
    view = memoryview(memory)
    async with open_io_backend(backend_name, queue_depth=16) as backend:
        with contextlib.suppress(StorageIOError):
            backend.register_buffer(view)
        hook(backend)
        pages = StagingPages(view[: STAGING_PAGES * PAGE_BYTES], STAGING_PAGES)
        async with open_nvme_tier(
            directory / DATA_FILE,
            FILE_BYTES,
            backend=backend,
            pages=pages,
            segment_bytes=SEGMENT_BYTES,
        ) as tier:
            yield Tier(tier, backend, view[STAGING_PAGES * PAGE_BYTES :])


async def write_blocks(directory: Path, sizes: list[int]) -> tuple[dict[bytes, int], list[int]]:
    """Store blocks of ``sizes`` and close cleanly; their sizes by key, and the segments'
    starts."""
    async with open_tier(directory) as t:
        for i, nbytes in enumerate(sizes):
            await t.put(key_for(i), nbytes)
        await t.tier.sync()
        starts = [s.start for s in t.segments]
    return {key_for(i): n for i, n in enumerate(sizes)}, starts


async def check_all_back(t: Tier, expected: dict[bytes, int]) -> None:
    found = {r.ref.key: r for r in t.tier.recovered()}
    assert set(found) == set(expected), f"lost: {sorted(set(expected) - set(found))[:5]}"
    for key, nbytes in expected.items():
        assert await t.get(found[key].ref, found[key].location) == content(key, nbytes), key


def crash(directory: Path) -> None:
    """Remove what only a clean stop leaves: the next open scans, as after ``kill -9``."""
    (directory / SNAPSHOT_NAME).unlink(missing_ok=True)


def flip(directory: Path, offset: int, mask: int = 0x01) -> None:
    """Damage as the medium does it: a bit changes, the file's mtime does not (a write would
    make the snapshot stale, so the next start would scan instead of trusting it)."""
    fd = os.open(directory / DATA_FILE, os.O_RDWR)
    try:
        before = os.fstat(fd)
        byte = os.pread(fd, 1, offset)[0]
        os.pwrite(fd, bytes([byte ^ mask]), offset)
        os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))
        os.fsync(fd)
    finally:
        os.close(fd)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The recovery's warnings (not the tier's word that the last stop was a crash, which every
    start after ``crash`` says)."""
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return [m for m in said if "did not stop cleanly last time" not in m]


# -- damaged segment headers -------------------------------------------------------------------


# magic, file id, start, slot bytes, slot count, checksum
HEADER_BYTES = [0, 10, 24, 32, 40, 50]


@pytest.mark.parametrize("byte", HEADER_BYTES)
@pytest.mark.parametrize("which", [0, 1, -1])
async def test_a_flipped_bit_in_a_segment_header_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, which: int, byte: int
) -> None:
    expected, starts = await write_blocks(tmp_path, [SMALL] * 100)  # 7 segments, the last partial
    assert len(starts) == 7
    crash(tmp_path)
    flip(tmp_path, starts[which] + byte)
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            await check_all_back(t, expected)
            assert [s.start for s in t.segments] == starts
    assert any(f"offset {starts[which]} " in m and "rebuilt" in m for m in warnings_of(caplog))
    # the header was written back: the next start is a plain scan
    caplog.clear()
    crash(tmp_path)
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            await check_all_back(t, expected)
            # and the tier goes on carving where it left off
            await t.put(b"after-repair" + bytes(4), SMALL)
            expected[b"after-repair" + bytes(4)] = SMALL
    assert warnings_of(caplog) == []
    crash(tmp_path)
    async with open_tier(tmp_path) as t:
        await check_all_back(t, expected)


@pytest.mark.parametrize("byte", [0, 10, 40])  # magic, file id, checksum
async def test_a_flipped_bit_in_the_superblock_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, byte: int
) -> None:
    expected, _ = await write_blocks(tmp_path, [SMALL] * 40)
    crash(tmp_path)
    flip(tmp_path, byte)
    with caplog.at_level(logging.WARNING, "kvtierd.nvme"):
        async with open_tier(tmp_path) as t:
            await check_all_back(t, expected)
    assert any("superblock" in m for m in warnings_of(caplog))
    crash(tmp_path)
    async with open_tier(tmp_path) as t:
        await check_all_back(t, expected)


@pytest.mark.parametrize("backend_name", ["threads", "io_uring"])
async def test_segments_of_other_sizes_are_rebuilt_with_their_own_geometry(
    tmp_path: Path, backend_name: str, request: pytest.FixtureRequest
) -> None:
    if backend_name == "io_uring":
        request.getfixturevalue("uring_works")
    sizes = [SMALL] * 20 + [LARGE] * 12 + [SMALL] * 20 + [LARGE] * 3
    expected, starts = await write_blocks(tmp_path, sizes)
    crash(tmp_path)
    for start in starts[1:]:  # every header but the first: each is rebuilt in turn
        flip(tmp_path, start + 44, 0x80)
    async with open_tier(tmp_path, backend_name=backend_name) as t:
        await check_all_back(t, expected)
        assert [s.start for s in t.segments] == starts


async def test_a_segment_with_nothing_readable_costs_that_segment_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected, starts = await write_blocks(tmp_path, [SMALL] * 60)  # 4 full segments
    crash(tmp_path)
    flip(tmp_path, starts[1] + 50)
    for index in range(15):  # and every record header of segment 1
        flip(tmp_path, starts[1] + PAGE_BYTES + index * (SMALL + PAGE_BYTES) + 60)
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            lost = {key_for(i) for i in range(15, 30)}
            await check_all_back(t, {k: n for k, n in expected.items() if k not in lost})
            assert [s.start for s in t.segments] == starts
            for i in range(20):  # the tier stays usable, the lost extent included
                await t.put(b"new-%04d" % i + bytes(8), SMALL)
    assert any("lost" in m and f"offset {starts[1]} " in m for m in warnings_of(caplog))


async def test_a_damaged_last_segment_with_nothing_in_it_is_carved_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_tier(tmp_path) as t:
        for i in range(20):
            await t.put(key_for(i), SMALL)
        for i in range(15, 20):  # the second segment holds nothing any more
            await t.tier.discard(*t.stored[key_for(i)])
        await t.tier.sync()
        starts = [s.start for s in t.segments]
    crash(tmp_path)
    flip(tmp_path, starts[1] + 40)
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            await check_all_back(t, {key_for(i): SMALL for i in range(15)})
            assert [s.start for s in t.segments] == starts[:1]
            await t.put(b"carved-again" + bytes(4), SMALL)
            assert [s.start for s in t.segments] == starts
    assert any("carved again" in m for m in warnings_of(caplog))


async def test_an_unreadable_segment_header_is_rebuilt(tmp_path: Path) -> None:
    expected, starts = await write_blocks(tmp_path, [SMALL] * 40)
    crash(tmp_path)
    failures = 0

    def hook(backend: IoBackend) -> None:
        real = backend.readv

        async def readv(fd: int, offset: int, buffers: Any) -> int:
            nonlocal failures
            if offset <= starts[1] < offset + sum(len(b) for b in buffers) and failures < 1:
                failures += 1
                raise StorageIOError("injected: unreadable sector")
            return await real(fd, offset, buffers)

        backend.readv = readv  # type: ignore[method-assign]

    async with open_tier(tmp_path, hook=hook) as t:
        await check_all_back(t, expected)
    assert failures == 1


@pytest.mark.parametrize("nbytes", [16 << 10, SMALL])  # read in runs of slots, or one by one
async def test_an_unreadable_slot_header_costs_that_block_only(tmp_path: Path, nbytes: int) -> None:
    expected, starts = await write_blocks(tmp_path, [nbytes] * 40)
    crash(tmp_path)
    slot_bytes = nbytes + PAGE_BYTES
    per_segment = SEGMENT_BYTES // slot_bytes
    bad = starts[-1] + PAGE_BYTES + 3 * slot_bytes

    def hook(backend: IoBackend) -> None:
        real = backend.readv

        async def readv(fd: int, offset: int, buffers: Any) -> int:
            if offset <= bad < offset + sum(len(b) for b in buffers):
                raise StorageIOError("injected: unreadable sector")
            return await real(fd, offset, buffers)

        backend.readv = readv  # type: ignore[method-assign]

    async with open_tier(tmp_path, hook=hook) as t:
        found = {r.ref.key for r in t.tier.recovered()}
    assert found == set(expected) - {key_for((len(starts) - 1) * per_segment + 3)}


@pytest.mark.parametrize("tail", ["random", "foreign header", "record header"])
async def test_what_is_not_a_damaged_header_still_ends_the_scan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, tail: str
) -> None:
    """Bytes at the tail that are not a damaged header of this file start no search, and nothing
    behind them is adopted."""
    expected, starts = await write_blocks(tmp_path, [SMALL] * 15)  # exactly one segment
    end = starts[0] + PAGE_BYTES + 15 * (SMALL + PAGE_BYTES)
    stray = RecordHeader(NS, b"stray" + bytes(11), 100, 100, 0, 10**9)
    pages = {
        "random": os.urandom(PAGE_BYTES),
        "foreign header": SegmentHeader(bytes(16), end, SMALL + PAGE_BYTES, 3).pack(),
        "record header": stray.pack(),
    }
    fd = os.open(tmp_path / DATA_FILE, os.O_RDWR)
    try:
        os.pwrite(fd, pages[tail], end)
        os.pwrite(fd, stray.pack(), end + PAGE_BYTES)
    finally:
        os.close(fd)
    crash(tmp_path)
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            await check_all_back(t, expected)
            assert len(t.segments) == 1
    assert warnings_of(caplog) == []


# -- snapshots that disagree with the file -----------------------------------------------------


def edit_snapshot(directory: Path, change: Callable[[Snapshot], None]) -> None:
    path = directory / SNAPSHOT_NAME
    snap = snapshots.decode(path.read_bytes())
    snap.columns = {name: column.copy() for name, column in snap.columns.items()}
    change(snap)
    path.write_bytes(snapshots.encode(snap))


def past_the_end(snap: Snapshot) -> None:
    start, slot_bytes, count = snap.segments[-1]
    snap.segments[-1] = (start, slot_bytes, count + 1000)


def shifted_segment(snap: Snapshot) -> None:
    start, slot_bytes, count = snap.segments[1]
    snap.segments[1] = (start + PAGE_BYTES, slot_bytes, count)


def other_geometry(snap: Snapshot) -> None:
    """Inside the file, contiguous, every record in a slot of it, but not what the segment
    header on disk says."""
    start, slot_bytes, count = snap.segments[-1]
    snap.segments[-1] = (start, slot_bytes, count - 1)


def record(snap: Snapshot, **changes: int) -> None:
    """Change fields (columns) of the first record."""
    for name, value in changes.items():
        snap.columns[name][0] = value


def duplicated_record(snap: Snapshot) -> None:
    snap.columns = {name: np.concatenate([c, c[:1]]) for name, c in snap.columns.items()}


def one_key_twice(snap: Snapshot) -> None:
    """The same key and sequence number in two slots."""
    for name in ("key", "klen", "ns", "seq"):
        snap.columns[name][1] = snap.columns[name][0]


def key_past_its_length(snap: Snapshot) -> None:
    key = snap.columns["key"].view(np.uint8).reshape(len(snap.columns["klen"]), -1)
    key[0, -1] = 1
    snap.columns["klen"][0] = 4


BAD_SNAPSHOTS: dict[str, Callable[[Snapshot], None]] = {
    "a segment past the end of the file": past_the_end,
    "segments not contiguous": shifted_segment,
    "a segment the headers on disk disagree with": other_geometry,
    "a record in a segment that does not exist": lambda s: record(s, segment=99),
    "a record in a slot past its segment": lambda s: record(s, index=15 + 5),
    "a slot index past every segment": lambda s: record(s, index=(1 << 32) - 1),
    "a record larger than its slot": lambda s: record(s, stored=SMALL * 4),
    "an empty key": lambda s: record(s, klen=0),
    "a key of a namespace not listed": lambda s: record(s, ns=7),
    "a key with bytes past its length": key_past_its_length,
    "unknown flags": lambda s: record(s, flags=0x80),
    "a record listed twice": duplicated_record,
    "a key twice with one sequence number": one_key_twice,
}


@pytest.mark.parametrize("damage", list(BAD_SNAPSHOTS), ids=list(BAD_SNAPSHOTS))
async def test_a_snapshot_that_disagrees_with_the_file_is_discarded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    expected, _ = await write_blocks(tmp_path, [SMALL] * 40)
    edit_snapshot(tmp_path, BAD_SNAPSHOTS[damage])
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            assert t.tier.recovery_source == "scan"
            await check_all_back(t, expected)
            assert t.tier.statistics().blocks == len(expected)
    assert any(
        "index snapshot disagrees with the data file" in m and "scanning instead" in m
        for m in warnings_of(caplog)
    )


async def test_a_snapshot_of_the_first_format_is_still_read(tmp_path: Path) -> None:
    expected, _ = await write_blocks(tmp_path, [SMALL] * 40)
    path = tmp_path / SNAPSHOT_NAME
    snap = snapshots.decode(path.read_bytes())
    c = snap.columns
    records = [
        (
            int(c["segment"][i]),
            int(c["index"][i]),
            snap.digests[c["ns"][i]],
            c["key"][i].tobytes()[: c["klen"][i]],
            int(c["stored"][i]),
            int(c["raw"][i]),
            int(c["checksum"][i]),
            int(c["seq"][i]),
            int(c["flags"][i]),
        )
        for i in range(len(c["klen"]))
    ]
    old = snapshots.SnapshotV1(
        snap.file_id, snap.file_bytes, snap.segments, records, snap.data_mtime_ns
    )
    path.write_bytes(msgspec.msgpack.encode(old))
    async with open_tier(tmp_path) as t:
        assert t.tier.recovery_source == "snapshot"
        await check_all_back(t, expected)
        assert t.tier.statistics().blocks == len(expected)


@pytest.mark.parametrize("at", [10, 40, -5])
async def test_a_damaged_snapshot_file_is_scanned_past(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, at: int
) -> None:
    """A flipped bit anywhere (the frame, the head, a column) fails a checksum."""
    expected, _ = await write_blocks(tmp_path, [SMALL] * 40)
    path = tmp_path / SNAPSHOT_NAME
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            assert t.tier.recovery_source == "scan"
            await check_all_back(t, expected)
    assert any("unreadable index snapshot" in m for m in warnings_of(caplog))


async def test_a_snapshot_repairs_a_damaged_segment_header(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected, starts = await write_blocks(tmp_path, [SMALL] * 40)
    flip(tmp_path, starts[1] + 40)
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            assert t.tier.recovery_source == "snapshot"
            await check_all_back(t, expected)
    assert any(f"offset {starts[1]} " in m for m in warnings_of(caplog))
    caplog.clear()
    crash(tmp_path)
    with caplog.at_level(logging.WARNING, "kvtierd.recovery"):
        async with open_tier(tmp_path) as t:
            await check_all_back(t, expected)
    assert warnings_of(caplog) == []


# -- records that cannot be read ---------------------------------------------------------------


async def test_a_record_outside_the_file_is_a_miss(tmp_path: Path) -> None:
    async with open_tier(tmp_path) as t:
        await t.put(key_for(0), SMALL)
        ref, _ = t.stored[key_for(0)]
        outside = DiskSlot(0, 99, FILE_BYTES + 8 * PAGE_BYTES, SMALL + PAGE_BYTES)
        header = RecordHeader(NS, ref.key, SMALL, SMALL, ref.checksum, ref.seq)
        row = t.tier._cold.add(NS, header, outside.segment, outside.index)
        with pytest.raises(BlockNotFoundError):
            await t.get(ref, outside)
        t.tier._cold.remove(row)
    assert (tmp_path / DATA_FILE).stat().st_size == FILE_BYTES


@pytest.mark.parametrize("failures", [1, 1000])
async def test_a_record_the_medium_cannot_read_is_a_miss(tmp_path: Path, failures: int) -> None:
    """One failed read is retried; a medium that keeps refusing makes the block a miss."""
    async with open_tier(tmp_path) as t:
        await t.put(key_for(0), SMALL)
        ref, location = t.stored[key_for(0)]
        real = t.backend.readv
        left = failures

        async def readv(fd: int, offset: int, buffers: Any) -> int:
            nonlocal left
            if left:
                left -= 1
                raise StorageIOError("injected: unreadable sector")
            return await real(fd, offset, buffers)

        t.backend.readv = readv  # type: ignore[method-assign]
        if failures == 1:
            assert await t.get(ref, location) == content(key_for(0), SMALL)
        else:
            with pytest.raises(BlockNotFoundError):
                await t.get(ref, location)


async def test_an_unreadable_block_stops_being_a_hit(tmp_path: Path) -> None:
    """The store drops a copy whose load is a miss, so LOOKUP stops reporting it (it used to
    answer EIO on every READ while LOOKUP kept reporting a hit)."""
    async with small_store(tmp_path, SMALL) as (store, ns):
        owner = Owner()
        keys = [key_of(i) for i in range(3)]
        for key in keys:
            await put(store, owner, ns, key)
        await store.fsync()
        await store.evict_dram(ns)
        assert store.lookup(ns, keys, promote=False)[0] == 3
        assert isinstance(store.lower, NvmeTier)
        backend = store.lower._backend
        real = backend.readv

        async def readv(fd: int, offset: int, buffers: Any) -> int:
            if len(buffers) == 2:  # a block's record, not a header page
                raise StorageIOError("injected: unreadable sector")
            return await real(fd, offset, buffers)

        backend.readv = readv  # type: ignore[method-assign]
        with pytest.raises(BlockNotFoundError):
            await store.read(owner, ns, keys[:1])
        assert store.lookup(ns, keys, promote=False)[0] == 0
        backend.readv = real  # type: ignore[method-assign]
        lease = await store.read(owner, ns, keys[1:])
        store.release(owner, [lease.id])


@pytest.mark.anyio
async def test_a_start_that_crashed_making_the_data_file_leaves_one_the_next_start_makes(
    tmp_path: Path,
) -> None:
    """A new data file is made under another name and renamed into place once its superblock
    is durable: a start killed while making it (the file sized, preallocated, no superblock
    yet) leaves that name, which the next start makes again, where a data file of zeroes
    would have been refused as overwritten (it might have held blocks)."""
    making = tmp_path / (DATA_FILE + ".making")
    _zeroes(making)  # as a kill before its superblock leaves it
    async with open_tier(tmp_path) as t:
        await t.put(b"after-the-crash", SMALL)
    assert not making.exists()
    async with open_tier(tmp_path) as t:
        assert [r.ref.key for r in t.tier.recovered()] == [b"after-the-crash"]
    # a data file of zeroes under its own name is still refused
    (tmp_path / DATA_FILE).unlink()
    _zeroes(tmp_path / DATA_FILE)
    with pytest.raises(StorageIOError, match="superblock cannot be read"):
        async with open_tier(tmp_path):
            pass


def _zeroes(path: Path) -> None:
    """A file of the data file's size holding only zeroes."""
    path.touch()
    os.truncate(path, FILE_BYTES)


# -- one block written twice -------------------------------------------------------------------


async def store_failing(t: Tier, ref: BlockRef, *, landed: str) -> None:
    """``t.tier.store`` of ``ref`` (its bytes already in ``t.buffer``) on a device that fails
    the write after ``landed`` reached the medium: ``"header"``, the header page alone (a torn
    record), or ``"whole"``, all of it (the failure reported after the write)."""
    real = t.backend.writev

    async def failing(fd: int, offset: int, buffers: Any) -> int:
        if len(buffers) == 1:  # a segment header (carved for the first record) or a zeroing
            return await real(fd, offset, buffers)
        await real(fd, offset, buffers if landed == "whole" else buffers[:1])
        raise StorageIOError("injected: the device failed the write")

    t.backend.writev = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(StorageIOError, match="injected"):
            await t.tier.store(ref, t.buffer[: -(-ref.raw_bytes // PAGE_BYTES) * PAGE_BYTES])
    finally:
        t.backend.writev = real  # type: ignore[method-assign]


async def crash_before_the_leftover_is_zeroed(t: Tier) -> None:
    """Make what was written durable, as a sync would, but leave what a failed write left in
    place: the crash comes before the sync that zeroes it."""
    t.tier.leftovers._failed_writes.clear()
    await t.backend.fdatasync(t.tier._fd)


async def tie_on_disk(directory: Path) -> tuple[BlockRef, bytes, DiskSlot, DiskSlot]:
    """Block 0 written twice, as a crash leaves it: torn (its header alone landed, its slot
    held by a write in flight at the crash), then whole; ``(ref, data, torn, whole)``."""
    key = key_for(0)
    data = content(key, SMALL)
    ref = BlockRef(NS, key, SMALL, checksum(data), 7)
    async with open_tier(directory) as t:
        t.buffer[:SMALL] = data
        await store_failing(t, ref, landed="header")
        torn = t.tier._segmap.allocate(slot_bytes_for(SMALL))
        assert torn is not None
        whole = await t.tier.store(ref, t.buffer[:SMALL])
        assert isinstance(whole, DiskSlot)
        await crash_before_the_leftover_is_zeroed(t)
    crash(directory)
    return ref, data, torn, whole


@pytest.mark.parametrize("torn_first", [True, False], ids=["torn-first", "whole-first"])
@pytest.mark.parametrize("nbytes", [16 << 10, SMALL])  # headers read in runs, or one by one
async def test_a_block_written_twice_keeps_its_whole_copy_whichever_the_scan_meets_first(
    tmp_path: Path, torn_first: bool, nbytes: int
) -> None:
    """A write-back whose header page landed before the device failed it leaves a torn record
    with its block's seq, and its slot free; the retry writes the block whole elsewhere, with
    the same seq. After a crash the scan meets both: the whole one is kept and the torn one
    discarded. (Recovery used to keep whichever it met first and discard the other: an
    FSYNC'd block lost.) The torn copy first is the case a failing device leaves when a write
    in flight at the crash holds its slot; whole first, one whose retry was written before."""
    key = key_for(0)
    data = content(key, nbytes)
    ref = BlockRef(NS, key, nbytes, checksum(data), 7)
    padded = -(-nbytes // 4096) * 4096
    async with open_tier(tmp_path) as t:
        t.buffer[:nbytes] = data
        if torn_first:
            await store_failing(t, ref, landed="header")
            # a write in flight when the crash came holds the torn record's slot
            assert t.tier._segmap.allocate(slot_bytes_for(nbytes)) is not None
            await t.tier.store(ref, t.buffer[:padded])
        else:
            await t.tier.store(ref, t.buffer[:padded])
            await store_failing(t, ref, landed="header")
        await crash_before_the_leftover_is_zeroed(t)
    for _ in range(2):  # the second start finds the torn copy discarded
        crash(tmp_path)
        async with open_tier(tmp_path) as t:
            found = list(t.tier.recovered())
            assert [r.ref for r in found] == [ref]
            assert await t.get(ref, found[0].location) == data
            assert len(t.tier._cold) == 1


async def test_a_copy_that_cannot_be_read_at_start_is_never_erased_for_the_other(
    tmp_path: Path,
) -> None:
    """A tie whose whole copy the medium refuses to read at start: neither copy is proven
    whole, so the whole one is not erased on a read error's word (only a copy proven torn is);
    the next start, reading again, keeps it."""
    ref, data, _, whole = await tie_on_disk(tmp_path)

    def unreadable_whole_copy(backend: IoBackend) -> None:
        real_readv = backend.readv

        async def readv(fd: int, offset: int, buffers: Any) -> int:
            if offset == whole.offset and len(buffers) == 2:  # the record, not a header run
                raise StorageIOError("injected: unreadable sector")
            return await real_readv(fd, offset, buffers)

        backend.readv = readv  # type: ignore[method-assign]

    async with open_tier(tmp_path, hook=unreadable_whole_copy) as t:
        pass  # the tie cannot be settled: both copies stay on the medium
    crash(tmp_path)
    async with open_tier(tmp_path) as t:
        found = list(t.tier.recovered())
        assert [r.ref for r in found] == [ref]
        assert await t.get(ref, found[0].location) == data


@pytest.mark.parametrize("reused", [False, True], ids=["left-free", "taken-since"])
async def test_a_failed_write_leaves_nothing_a_crash_brings_back(
    tmp_path: Path, reused: bool
) -> None:
    """A write the device failed after the whole record landed leaves no block: the block is
    forgotten (nothing was stored) and a crash after the next sync must not bring it back,
    so the sync zeroes what the failed write left in the slot it gave back. When another
    write took the slot since, its record replaces the leftover and is left alone."""
    key, other = key_for(0), key_for(1)
    data = content(key, SMALL)
    ref = BlockRef(NS, key, SMALL, checksum(data), 7)
    async with open_tier(tmp_path) as t:
        t.buffer[:SMALL] = data
        await store_failing(t, ref, landed="whole")
        if reused:
            await t.put(other, SMALL)  # takes the slot the failed write gave back
        await t.tier.sync()
    crash(tmp_path)
    async with open_tier(tmp_path) as t:
        found = {r.ref.key: r for r in t.tier.recovered()}
        assert key not in found
        if reused:
            assert await t.get(found[other].ref, found[other].location) == content(other, SMALL)


@pytest.mark.parametrize("unreadable", ["whole copy", "both copies"])
async def test_a_forget_synced_is_not_undone_by_a_copy_recovery_could_not_settle(
    tmp_path: Path, unreadable: str
) -> None:
    """A tie recovery could not settle (a copy the medium would not read at start) leaves no
    copy behind once the block is forgotten: FORGET (the kept copy discarded), FSYNC, crash,
    and the next start, reading again, finds nothing."""
    ref, _, torn, whole = await tie_on_disk(tmp_path)
    refused = {whole.offset} | ({torn.offset} if unreadable == "both copies" else set())

    def unreadable_records(backend: IoBackend) -> None:
        real_readv = backend.readv

        async def readv(fd: int, offset: int, buffers: Any) -> int:
            if offset in refused and len(buffers) == 2:  # a record, not a header run
                raise StorageIOError("injected: unreadable sector")
            return await real_readv(fd, offset, buffers)

        backend.readv = readv  # type: ignore[method-assign]

    async with open_tier(tmp_path, hook=unreadable_records) as t:
        found = list(t.tier.recovered())
        assert [r.ref for r in found] == [ref]
        await t.tier.discard(found[0].ref, found[0].location)  # FORGET
        await t.tier.sync()
    crash(tmp_path)
    async with open_tier(tmp_path) as t:
        assert list(t.tier.recovered()) == []


async def test_a_failed_write_whose_page_cannot_be_read_does_not_fail_every_fsync(
    tmp_path: Path,
) -> None:
    """A sector that refuses reads and writes: the write fails with nothing landed, and its
    leftover cannot be read to be zeroed (nor by a scan). FSYNC is not failed for it (it is
    tried again, and health reports it: tests/store/test_diskwatch.py), and the next write of
    that size is not handed the same slot."""
    key = key_for(0)
    data = content(key, SMALL)
    ref = BlockRef(NS, key, SMALL, checksum(data), 7)
    async with open_tier(tmp_path) as t:
        await t.put(key_for(9), SMALL)  # carves the segment
        t.buffer[:SMALL] = data
        real_writev, real_readv = t.backend.writev, t.backend.readv
        bad: list[int] = []

        async def writev(fd: int, offset: int, buffers: Any) -> int:
            if len(buffers) == 2 and not bad:
                bad.append(offset)
            if offset in bad:
                raise StorageIOError("injected: bad sector")
            return await real_writev(fd, offset, buffers)

        async def readv(fd: int, offset: int, buffers: Any) -> int:
            if offset in bad:
                raise StorageIOError("injected: bad sector")
            return await real_readv(fd, offset, buffers)

        t.backend.writev, t.backend.readv = writev, readv  # type: ignore[method-assign]
        with pytest.raises(StorageIOError):
            await t.tier.store(ref, t.buffer[:SMALL])
        for _ in range(3):
            await t.tier.sync()
            assert t.tier.leftovers.pending
        following = await t.tier.store(ref, t.buffer[:SMALL])
        assert isinstance(following, DiskSlot)
        assert following.offset not in bad
        t.backend.writev, t.backend.readv = real_writev, real_readv  # type: ignore[method-assign]
        await t.tier.sync()
        assert not t.tier.leftovers.pending
