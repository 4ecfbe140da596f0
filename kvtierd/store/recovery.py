"""Rebuilding the NVMe tier's index when the daemon starts: snapshot, or a scan of the headers.

After a clean shutdown the tier writes ``index.snapshot`` (written to a temporary name, fsynced,
renamed, directory fsynced). At start-up a snapshot whose file id and size match the data file
is loaded and then deleted *before* the tier serves anything, so a snapshot is never trusted
after a crash that happened later. Without one, every segment header and every slot header is
read (concurrently, through the I/O backend) and each header whose checksum holds is adopted;
when two records claim one key the higher ``seq`` wins and the loser is discarded. Payloads are
not read here: they are verified against their checksum on every load, so a torn payload costs
a miss, never a wrong answer.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec

from kvtierd.errors import StorageIOError
from kvtierd.io import IoBackend
from kvtierd.store.records import PAGE_BYTES, CorruptRecord, RecordHeader, SegmentHeader
from kvtierd.store.segments import DiskSlot, SegmentMap
from kvtierd.store.staging import StagingPages

__all__ = ["RecoveredIndex", "load_snapshot", "save_snapshot", "scan"]

log = logging.getLogger("kvtierd.recovery")
SNAPSHOT_NAME = "index.snapshot"
_RUN_BYTES = 1 << 20
_SMALL_SLOT_BYTES = 64 << 10
_SCAN_WORKERS = 16


class _Snapshot(msgspec.Struct, array_like=True):
    file_id: bytes
    file_bytes: int
    segments: list[tuple[int, int, int]]  # start, slot bytes, slot count
    records: list[tuple[int, int, bytes, bytes, int, int, int, int, int]]
    # segment, index, ns digest, key, stored, raw, checksum, seq, flags


@dataclass
class RecoveredIndex:
    """What recovery found: adopted records by place, and places to discard."""

    records: dict[DiskSlot, RecordHeader] = field(default_factory=dict)
    stale: list[DiskSlot] = field(default_factory=list)
    max_seq: int = 0
    source: str = "empty"

    def adopt(
        self, slot: DiskSlot, header: RecordHeader, best: dict[tuple[bytes, bytes], DiskSlot]
    ) -> None:
        identity = (header.ns_digest, header.key)
        previous = best.get(identity)
        if previous is not None and self.records[previous].seq >= header.seq:
            self.stale.append(slot)
            return
        if previous is not None:
            self.stale.append(previous)
            del self.records[previous]
        best[identity] = slot
        self.records[slot] = header
        self.max_seq = max(self.max_seq, header.seq)


def load_snapshot(directory: Path, segmap: SegmentMap) -> RecoveredIndex | None:
    """Adopt and delete a matching snapshot; ``None`` when there is none or it does not match."""
    path = directory / SNAPSHOT_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        snap = msgspec.msgpack.decode(raw, type=_Snapshot)
    except msgspec.DecodeError as exc:
        log.warning("ignoring unreadable index snapshot: %s", exc)
        snap = None
    _remove_durably(path)
    if snap is None or snap.file_id != segmap.file_id or snap.file_bytes != segmap.file_bytes:
        log.warning("index snapshot does not match the data file; scanning instead")
        return None
    found = RecoveredIndex(source="snapshot")
    for start, slot_bytes, count in snap.segments:
        segmap.add_segment(SegmentHeader(segmap.file_id, start, slot_bytes, count), all_free=False)
    used: dict[int, set[int]] = {}
    best: dict[tuple[bytes, bytes], DiskSlot] = {}
    for segment, index, digest, key, stored, raw_bytes, checksum, seq, flags in snap.records:
        slot = segmap.mark_used(segment, index)
        used.setdefault(segment, set()).add(index)
        record = RecordHeader(digest, key, stored, raw_bytes, checksum, seq, flags)
        found.adopt(slot, record, best)
    for number, header in enumerate(segmap.segments):
        taken = used.get(number, set())
        segmap.adopt_free(number, [i for i in range(header.slot_count) if i not in taken])
    return found


def save_snapshot(
    directory: Path, segmap: SegmentMap, records: dict[DiskSlot, RecordHeader]
) -> None:
    """Write the snapshot atomically and durably; raises ``OSError`` (leaving no file) when
    it cannot."""
    snap = _Snapshot(
        segmap.file_id,
        segmap.file_bytes,
        [(s.start, s.slot_bytes, s.slot_count) for s in segmap.segments],
        [
            (
                slot.segment,
                slot.index,
                h.ns_digest,
                h.key,
                h.stored_bytes,
                h.raw_bytes,
                h.payload_checksum,
                h.seq,
                h.flags,
            )
            for slot, h in records.items()
        ],
    )
    tmp = directory / (SNAPSHOT_NAME + ".tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(msgspec.msgpack.encode(snap))
            out.flush()
            os.fsync(out.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not keep a half-written file
        raise
    os.replace(tmp, directory / SNAPSHOT_NAME)
    _fsync_dir(directory)


def _remove_durably(path: Path) -> None:
    path.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def scan(
    fd: int, segmap: SegmentMap, backend: IoBackend, pages: StagingPages
) -> RecoveredIndex:
    """Read every segment and slot header of the file and adopt the intact records."""
    found = RecoveredIndex(source="scan")
    async with pages.page() as page:
        while True:
            header = await _read_segment_header(fd, segmap, backend, page)
            if header is None:
                break
            segmap.add_segment(header, all_free=False)
    best: dict[tuple[bytes, bytes], DiskSlot] = {}
    free: dict[int, list[int]] = {n: [] for n in range(len(segmap.segments))}
    runs = _header_runs(segmap)

    def adopt(number: int, index: int, header_page: memoryview) -> None:
        try:
            record = RecordHeader.unpack(header_page)
        except CorruptRecord:
            free[number].append(index)
            return
        found.adopt(segmap.mark_used(number, index), record, best)

    async def worker() -> None:
        bounce = mmap.mmap(-1, _RUN_BYTES)
        view = memoryview(bounce)
        try:
            for number, first, count in runs:
                segment = segmap.segments[number]
                if count == 1:  # large slots: read the header page alone
                    async with pages.page() as page:
                        await backend.readv(fd, segment.slot_offset(first), [page])
                        adopt(number, first, page)
                    continue
                span = view[: count * segment.slot_bytes]
                await backend.readv(fd, segment.slot_offset(first), [span])
                for i in range(count):
                    at = i * segment.slot_bytes
                    adopt(number, first + i, span[at : at + PAGE_BYTES])
                span.release()
        finally:
            view.release()
            bounce.close()

    async with anyio.create_task_group() as tg:
        for _ in range(min(pages.count, _SCAN_WORKERS)):
            tg.start_soon(worker)
    for number, indices in free.items():
        segmap.adopt_free(number, sorted(indices))
    return found


def _header_runs(segmap: SegmentMap) -> Iterator[tuple[int, int, int]]:
    """``(segment, first slot, count)`` units of work. Small slots are read in whole runs of up
    to :data:`_RUN_BYTES` (one I/O for many headers: thousands of tiny reads would cost more
    than the extra bytes); large slots by their header page only."""
    for number, header in enumerate(segmap.segments):
        per_run = _RUN_BYTES // header.slot_bytes if header.slot_bytes <= _SMALL_SLOT_BYTES else 1
        for first in range(0, header.slot_count, max(1, per_run)):
            yield number, first, min(max(1, per_run), header.slot_count - first)


async def _read_segment_header(
    fd: int, segmap: SegmentMap, backend: IoBackend, page: memoryview
) -> SegmentHeader | None:
    start = segmap.segments[-1].end if segmap.segments else PAGE_BYTES
    if start + PAGE_BYTES > segmap.file_bytes:
        return None
    try:
        await backend.readv(fd, start, [page])
    except StorageIOError:
        return None
    try:
        header = SegmentHeader.unpack(page)
    except CorruptRecord:
        return None
    if header.file_id != segmap.file_id or header.start != start or header.end > segmap.file_bytes:
        return None
    return header
