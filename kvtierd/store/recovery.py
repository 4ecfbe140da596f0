"""Rebuilding the NVMe tier's index when the daemon starts: snapshot, or a scan of the headers.

After a clean shutdown the tier writes its index snapshot (to a temporary name, fsynced, renamed,
directory fsynced) into the daemon's data directory, never beside the data file, which may be
another directory shared with other daemons or a raw device: :func:`snapshot_path` names it, one
per data file. At start-up a snapshot whose file id matches the data file is deleted *before* the
tier serves anything, so a snapshot is never trusted after a crash that happened later; so is
one that older versions left beside the data file (``legacy``), which is loaded only when the
data directory holds none (with both, one is stale: neither is). A snapshot of a regular file
records its mtime, so a write since (by a daemon with another data directory) makes it stale.
It is adopted only when it agrees with the file: its segments follow each other inside the
file and match the segment headers on disk, every record names a slot that exists and that it
fits, and no slot or ``(namespace, key, seq)`` is listed twice. Anything
else, and the snapshot is ignored (a WARNING) and the headers are scanned instead: a snapshot is
a shortcut, never an authority. A segment header on disk that is damaged where the snapshot
agrees with everything else is rewritten from the snapshot.

The scan steps from segment header to segment header, then reads every slot header (concurrently,
through the I/O backend) and adopts each whose checksum holds; when two records claim one key the
higher ``seq`` wins and the loser is discarded. Payloads are not read here: they are verified
against their checksum on every load, so a torn payload costs a miss, never a wrong answer.

Ties. Two records of one key with one ``seq`` are two writes of one block: a write-back whose
header page landed before the device failed it (its slot freed, the block written again
elsewhere), or one written whole whose checkpoint mark failed. Which of them the scan meets first
depends on the order its reads complete, and one may be torn, so neither header decides: the
tier reads both payloads before it discards either (:attr:`RecoveredIndex.ties`), and the loser
is the one that fails its checksum. Ties exist only after a failed write, so reading them costs
nothing on a healthy disk.

Damage. A segment header is what lets the scan find the next one, so one flipped bit in it must
not hide the segments after it. A page at the expected place that is recognisably a damaged
segment header of this file (:func:`~kvtierd.store.records.damaged_segment_header`), or that
cannot be read, starts a search: the file is read forward in large runs up to the next intact
segment header of this file (one whose ``start`` is its own offset) or the end of the file, and
the record headers found on the way give the lost header's slot size, which the next header's
offset (or, for the last segment, the planning rule) turns into a slot count
(:meth:`SegmentMap.rebuild_segment`). The rebuilt header is written back durably, so the next
start scans plainly. When nothing gives the geometry, only that segment is lost: a placeholder
header keeps its extent accounted for and the scan goes on after it. A page that is zeroes,
payload bytes, a record header or another file's segment header ends the scan as before: that
is the never-carved tail of the file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from kvtierd.errors import NoSpaceError, StorageIOError
from kvtierd.io import IoBackend
from kvtierd.store import snapshot as snapshots
from kvtierd.store.coldindex import ColdIndex, Columns, impossible_lengths
from kvtierd.store.copyhash import default_hasher
from kvtierd.store.durable import fsync_directory, replace_durably
from kvtierd.store.records import (
    PAGE_BYTES,
    CorruptRecord,
    RecordHeader,
    SegmentHeader,
    damaged_segment_header,
    record_headers,
)
from kvtierd.store.segments import DiskSlot, SegmentMap
from kvtierd.store.staging import StagingPages

__all__ = [
    "DATA_FILE_NAME",
    "SNAPSHOT_NAME",
    "RecoveredIndex",
    "check_segment_headers",
    "find_segments",
    "load_snapshot",
    "recovered",
    "save_snapshot",
    "scan",
    "scan_segments",
    "segments_of",
    "snapshot_path",
]

log = logging.getLogger("kvtierd.recovery")
#: The data file in the data directory when ``nvme.path`` names none, and its snapshot's name.
DATA_FILE_NAME = "nvme.data"
SNAPSHOT_NAME = "index.snapshot"
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
_RUN_BYTES = 1 << 20
_SMALL_SLOT_BYTES = 64 << 10
_SCAN_WORKERS = 16
#: Slots from which a scan waits for the native checksum module's probe.
_NATIVE_SCAN_FROM = 1 << 16
_KNOWN_FLAGS = RecordHeader.FLAG_ZSTD


@dataclass
class RecoveredIndex:
    """What recovery found: the records adopted, as the tier's index, places to discard (older
    records of a key that a newer one replaced), and ties to settle by reading payloads."""

    cold: ColdIndex = field(default_factory=ColdIndex)
    stale: list[DiskSlot] = field(default_factory=list)
    #: Rows left in ``cold`` beside their key's row, with its ``seq``: another write of the
    #: same block, one of the two possibly torn (see the module's *Ties*).
    ties: list[int] = field(default_factory=list)
    source: str = "empty"
    #: Segments whose slot headers were read (all of them for a scan, none for a snapshot).
    scanned_segments: int = 0

    @property
    def max_seq(self) -> int:
        return self.cold.max_seq()


def recovered(
    segmap: SegmentMap,
    columns: Columns,
    digests: list[bytes],
    source: str,
) -> RecoveredIndex:
    """Mark the slots ``columns`` name used in ``segmap`` (the rest of its segments free) and
    index them, newest record of each key first; older ones become ``stale``, ones as new as
    their key's row ``ties``."""
    segment = np.asarray(columns["segment"])
    order = np.argsort(segment, kind="stable")
    bounds = np.searchsorted(segment[order], np.arange(len(segmap.segments) + 1))
    index = np.asarray(columns["index"])[order]
    for number, header in enumerate(segmap.segments):
        used = np.zeros(header.slot_count, bool)
        used[index[bounds[number] : bounds[number + 1]]] = True
        segmap.adopt_used(number, used)
    cold = ColdIndex.from_columns(columns, digests)
    stale, ties = [], []
    seqs = cold.column("seq")
    for row in cold.shadowed().tolist():
        identity = cold.identity(row)
        assert identity is not None
        if seqs[cold.find(*identity)] == seqs[row]:
            ties.append(row)
            continue
        stale.append(segmap.slot(*cold.place(row)))
        cold.remove(row)
    return RecoveredIndex(cold, stale, ties, source)


# -- the snapshot ------------------------------------------------------------------------------


def snapshot_path(data_dir: Path, data_file: Path) -> Path:
    """Where the snapshot of ``data_file`` lives: in ``data_dir``, ``index.snapshot`` for the
    default data file (the name every version used), else a name made of the data file's name
    and a 128-bit digest of its path with symbolic links resolved, so two data files never
    share one and two paths to one file (a link, ``/dev/disk/by-id``) never give it two (whose
    checkpoints and generation tables would each miss the other's writes)."""
    absolute = Path(os.path.realpath(data_file))
    if absolute == Path(os.path.realpath(data_dir / DATA_FILE_NAME)):
        return data_dir / SNAPSHOT_NAME
    digest = hashlib.blake2b(os.fsencode(absolute), digest_size=16).hexdigest()
    return data_dir / f"index.{_UNSAFE_NAME.sub('_', absolute.name)[:64]}.{digest}.snapshot"


async def load_snapshot(
    path: Path,
    fd: int,
    segmap: SegmentMap,
    backend: IoBackend,
    pages: StagingPages,
    *,
    legacy: Path | None = None,
    data_mtime_ns: int | None = None,
) -> RecoveredIndex | None:
    """Delete the snapshot at ``path`` and adopt it when it agrees with the data file ``fd``
    (whose mtime before this start is ``data_mtime_ns``; ``None`` for a block device); ``None``
    when there is none or it does not (logged; the caller scans). A snapshot of this file at
    ``legacy`` (where older versions wrote it) is deleted too, and adopted only when ``path``
    holds none: with both, one was left by a run of another version and is stale, so neither
    is trusted. One there of another file is left alone. Raises only ``OSError`` when a
    snapshot cannot be deleted, and what reading the file's segment headers raises."""
    snap = _take_snapshot(path, segmap, keep_foreign=False)
    if legacy is not None and legacy != path:
        old = _take_snapshot(legacy, segmap, keep_foreign=True)
        if snap is not None and old is not None:
            log.warning(
                "two index snapshots of this data file, %s and %s (an older version ran in "
                "between): one is stale, so the headers are scanned",
                path,
                legacy,
            )
            return None
        if old is not None:
            log.info("loading the index snapshot an older version left at %s", legacy)
            snap = old
    if snap is None:
        return None
    if None not in (snap.data_mtime_ns, data_mtime_ns) and snap.data_mtime_ns != data_mtime_ns:
        log.warning(
            "the data file was written after its index snapshot (by a daemon with another "
            "data directory?); scanning instead"
        )
        return None
    if snap.file_bytes != segmap.file_bytes:
        log.warning("index snapshot does not match the data file's size; scanning instead")
        return None
    problem = snapshots.problem(snap, segmap.file_bytes)
    if problem is None:
        problem = await check_segment_headers(fd, segments_of(snap), backend, pages)
    if problem is not None:
        log.warning("index snapshot disagrees with the data file (%s); scanning instead", problem)
        return None
    for header in segments_of(snap):
        segmap.add_segment(header, all_free=False)
    return recovered(segmap, snap.columns, snap.digests, "snapshot")


def _take_snapshot(
    path: Path, segmap: SegmentMap, *, keep_foreign: bool
) -> snapshots.Snapshot | None:
    """Read and delete the snapshot at ``path`` when it names the data file of ``segmap``; one
    that does not, cannot be decoded, or is larger than any snapshot of that file can be (read
    no further: never an allocation the file's size), is deleted with a WARNING, or with
    ``keep_foreign`` left in place (it may be another daemon's)."""
    limit = snapshots.largest(segmap.file_bytes)
    try:
        with open(path, "rb") as file:  # read() allocates what it is asked for: ask no more
            raw = file.read(min(os.fstat(file.fileno()).st_size, limit) + 1)
    except FileNotFoundError:
        return None
    snap: snapshots.Snapshot | None
    if len(raw) > limit:
        snap, problem = None, f"ignoring index snapshot {path}: larger than any of this data file"
    else:
        try:
            snap = snapshots.decode(raw)
            problem = None
        except snapshots.CorruptSnapshot as exc:
            snap, problem = None, f"ignoring unreadable index snapshot {path}: {exc}"
    if snap is not None and snap.file_id != segmap.file_id:
        snap, problem = None, f"index snapshot {path} names another data file; scanning instead"
    if problem is not None and keep_foreign:
        return None
    _remove_durably(path)
    if problem is not None:
        log.warning("%s", problem)
    return snap


def segments_of(snap: snapshots.Snapshot) -> list[SegmentHeader]:
    return [SegmentHeader(snap.file_id, *geometry) for geometry in snap.segments]


async def check_segment_headers(
    fd: int, expected: list[SegmentHeader], backend: IoBackend, pages: StagingPages
) -> str | None:
    """Compare the segment headers on disk with ``expected``: the first disagreement, or
    ``None``. A header that is damaged (or unreadable) is rewritten from ``expected``."""
    problems: list[str] = []
    damaged: list[SegmentHeader] = []
    todo = iter(expected)

    async def worker() -> None:
        async with pages.page() as page:
            for header in todo:
                if problems:
                    return
                try:
                    await backend.readv(fd, header.start, [page])
                except StorageIOError:
                    damaged.append(header)
                    continue
                try:
                    on_disk = SegmentHeader.unpack(page)
                except CorruptRecord:
                    if damaged_segment_header(page, header.file_id):
                        damaged.append(header)
                    else:
                        problems.append(f"no segment header at offset {header.start}")
                    continue
                if on_disk != header:
                    problems.append(f"the segment header at offset {header.start} differs")

    async with anyio.create_task_group() as tg:
        for _ in range(min(pages.count, _SCAN_WORKERS)):
            tg.start_soon(worker)
    if problems:
        return problems[0]
    async with pages.page() as page:
        for header in damaged:
            log.warning(
                "the segment header at offset %d of the data file was damaged; rewritten from "
                "the index snapshot",
                header.start,
            )
            page[:] = header.pack()
            await _write_durably(fd, header.start, page, backend)
    return None


def save_snapshot(
    path: Path,
    segmap: SegmentMap,
    cold: ColdIndex,
    *,
    data_mtime_ns: int | None = None,
) -> None:
    """Write the snapshot of ``cold`` (format 2) atomically and durably, with the data file's
    mtime once its last write is done (``None`` for a block device); raises ``OSError``
    (leaving no file) when it cannot."""
    snap = snapshots.Snapshot(
        segmap.file_id,
        segmap.file_bytes,
        [(s.start, s.slot_bytes, s.slot_count) for s in segmap.segments],
        cold.digests,
        cold.columns(),
        data_mtime_ns,
    )
    replace_durably(path, snapshots.encode(snap))


def _remove_durably(path: Path) -> None:
    path.unlink(missing_ok=True)
    fsync_directory(path.parent)


# -- the scan ----------------------------------------------------------------------------------


async def scan(
    fd: int,
    segmap: SegmentMap,
    backend: IoBackend,
    pages: StagingPages,
    *,
    progress: Callable[[int], None] | None = None,
) -> RecoveredIndex:
    """Read every segment and slot header of the file and adopt the intact records;
    ``progress`` is told the number found so far before each run of headers. Each run's
    headers are parsed together (:func:`~kvtierd.store.records.record_headers`), and the
    newest record of each key is chosen once, for the whole file, with numpy."""
    await find_segments(fd, segmap, backend, pages)
    numbers = range(len(segmap.segments))
    found = recovered(segmap, *await scan_segments(fd, segmap, numbers, backend, pages, progress))
    found.scanned_segments = len(numbers)
    return found


async def find_segments(
    fd: int, segmap: SegmentMap, backend: IoBackend, pages: StagingPages
) -> None:
    """Add to ``segmap`` the segments after its last one (from the file's start when it has
    none), stepping from segment header to segment header."""
    async with pages.page() as page:
        while (header := await _next_segment(fd, segmap, backend, page)) is not None:
            segmap.add_segment(header, all_free=False)


async def scan_segments(
    fd: int,
    segmap: SegmentMap,
    numbers: Iterable[int],
    backend: IoBackend,
    pages: StagingPages,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, npt.NDArray[Any]], list[bytes], str]:
    """The intact records in the slots of segments ``numbers`` of ``segmap``, as cold index
    columns, the namespace digests their ``ns`` numbers, and the source ``"scan"``."""
    numbers = list(numbers)
    if sum(segmap.segments[n].slot_count for n in numbers) >= _NATIVE_SCAN_FROM:
        # Worth the probe's child (about 0.1-0.3 s): the native module checks each run's
        # header checksums in one call, a Python call a slot otherwise (about 1 us).
        await anyio.to_thread.run_sync(functools.partial(default_hasher().verdict, wait=True))
    runs = _header_runs(segmap, numbers)
    #: Per run with records: its segment, the slots holding them, and their fields.
    found: list[tuple[int, npt.NDArray[np.intp], dict[str, npt.NDArray[Any]]]] = []
    counted = 0

    def adopt(number: int, first: int, span: memoryview, count: int) -> None:
        nonlocal counted
        slot_bytes = segmap.segments[number].slot_bytes
        at, fields = record_headers(span, slot_bytes, count, slot_bytes)
        known = (fields["flags"] | _KNOWN_FLAGS) == _KNOWN_FLAGS  # else a later version's
        known &= ~impossible_lengths(fields["stored"], fields["raw"], fields["flags"])
        if len(at):
            found.append((number, at[known] + first, {k: v[known] for k, v in fields.items()}))
            counted += int(known.sum())

    async def worker() -> None:
        bounce = mmap.mmap(-1, _RUN_BYTES)
        view = memoryview(bounce)
        try:
            for number, first, count in runs:
                if progress is not None:
                    progress(counted)
                segment = segmap.segments[number]
                if count == 1:  # large slots: read the header page alone
                    async with pages.page() as page:
                        if await _read_quietly(fd, segment.slot_offset(first), page, backend):
                            adopt(number, first, page, 1)
                    continue
                with view[: count * segment.slot_bytes] as span:
                    offset = segment.slot_offset(first)
                    if not await _read_quietly(fd, offset, span, backend):
                        await _read_pages(fd, offset, span, segment.slot_bytes, backend)
                    adopt(number, first, span, count)
        finally:
            view.release()
            with contextlib.suppress(BufferError):
                bounce.close()

    async with anyio.create_task_group() as tg:
        for _ in range(min(pages.count, _SCAN_WORKERS)):
            tg.start_soon(worker)
    return (*_columns_of(found), "scan")


def _columns_of(
    found: list[tuple[int, npt.NDArray[np.intp], dict[str, npt.NDArray[Any]]]],
) -> tuple[dict[str, npt.NDArray[Any]], list[bytes]]:
    """The scan's runs of records as one set of cold index columns, and the namespace digests
    their ``ns`` numbers."""

    def joined(name: str) -> npt.NDArray[Any]:
        return np.concatenate([fields[name] for _, _, fields in found])

    if not found:
        return ColdIndex().columns(), []
    digests, numbers = np.unique(joined("digest"), return_inverse=True)
    columns = {
        name: joined(name) for name in ("key", "klen", "flags", "stored", "raw", "checksum", "seq")
    }
    columns["ns"] = numbers.reshape(-1)
    columns["segment"] = np.concatenate([np.full(len(at), n) for n, at, _ in found])
    columns["index"] = np.concatenate([at for _, at, _ in found])
    return columns, [bytes(d) for d in digests]


def _header_runs(segmap: SegmentMap, numbers: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(segment, first slot, count)`` units of work in segments ``numbers``. Small slots are
    read in whole runs of up to :data:`_RUN_BYTES` (one I/O for many headers: thousands of
    tiny reads would cost more than the extra bytes); large slots by their header page only."""
    for number in numbers:
        header = segmap.segments[number]
        per_run = _RUN_BYTES // header.slot_bytes if header.slot_bytes <= _SMALL_SLOT_BYTES else 1
        for first in range(0, header.slot_count, max(1, per_run)):
            yield number, first, min(max(1, per_run), header.slot_count - first)


async def _read_quietly(fd: int, offset: int, buffer: memoryview, backend: IoBackend) -> bool:
    """Fill ``buffer`` from ``offset``; ``False`` (logged) when the medium refuses."""
    try:
        await backend.readv(fd, offset, [buffer])
    except StorageIOError as exc:
        log.warning(
            "cannot read %d bytes at offset %d of the data file: %s", len(buffer), offset, exc
        )
        return False
    return True


async def _read_pages(
    fd: int, offset: int, buffer: memoryview, stride: int, backend: IoBackend
) -> None:
    """After a failed large read: read the header page of every ``stride`` bytes of ``buffer``
    alone, zeroing those that cannot be read (zeroes are no evidence of anything)."""
    for at in range(0, len(buffer), stride):
        with buffer[at : at + PAGE_BYTES] as page:
            if not await _read_quietly(fd, offset + at, page, backend):
                page[:] = bytes(PAGE_BYTES)


async def _next_segment(
    fd: int, segmap: SegmentMap, backend: IoBackend, page: memoryview
) -> SegmentHeader | None:
    """The segment that follows the last one of ``segmap``, its header read or, when damaged,
    rebuilt; ``None`` at the end of the carved part of the file."""
    start = segmap.segments[-1].end if segmap.segments else PAGE_BYTES
    if start + PAGE_BYTES > segmap.file_bytes:
        return None
    if not await _read_quietly(fd, start, page, backend):
        return await _rebuild_segment(fd, segmap, backend, page, start)
    try:
        header = SegmentHeader.unpack(page)
    except CorruptRecord:
        if damaged_segment_header(page, segmap.file_id):
            return await _rebuild_segment(fd, segmap, backend, page, start)
        return None
    if header.file_id != segmap.file_id or header.end > segmap.file_bytes:
        return None  # another file's header (this one was re-initialised), or a shrunk file
    if header.start != start:
        return await _rebuild_segment(fd, segmap, backend, page, start)
    return header


async def _rebuild_segment(
    fd: int, segmap: SegmentMap, backend: IoBackend, page: memoryview, start: int
) -> SegmentHeader | None:
    """Rebuild the damaged segment header at ``start`` from what follows it, and write it back."""
    records, next_start = await _search(fd, segmap, backend, start)
    header = segmap.rebuild_segment(start, [(at, r.stored_bytes) for at, r in records], next_start)
    where = f"the segment header at offset {start} of the data file is damaged"
    if header is not None:
        log.warning(
            "%s; rebuilt from %d record headers as %d slots of %d bytes",
            where,
            len(records),
            header.slot_count,
            header.slot_bytes,
        )
    elif next_start is not None:
        # Nothing tells the geometry. A placeholder of one slot as large as the whole extent
        # keeps it accounted for, so the segments after it keep their places and the scan steps
        # over it. Its records are lost (at most this segment); its one slot serves a later
        # block of exactly that size class, so the bytes otherwise stay as they are.
        header = SegmentHeader(segmap.file_id, start, next_start - start - PAGE_BYTES, 1)
        log.warning(
            "%s and no record header in it tells its geometry: its %d bytes are lost; the scan "
            "goes on at offset %d",
            where,
            next_start - start,
            next_start,
        )
    else:
        # Nothing intact lies after it: it was the last segment and holds nothing recoverable.
        # Clearing the page makes it the never-carved tail again (the next segment is carved
        # here), so that the next start does not search the rest of the file again.
        log.warning("%s and nothing intact follows it; the file is carved again from there", where)
        page[:] = bytes(PAGE_BYTES)
        await _write_durably(fd, start, page, backend)
        return None
    page[:] = header.pack()
    await _write_durably(fd, start, page, backend)
    return header


async def _search(
    fd: int, segmap: SegmentMap, backend: IoBackend, start: int
) -> tuple[list[tuple[int, RecordHeader]], int | None]:
    """The intact record headers after ``start`` (with their offsets), up to the next intact
    segment header of this file, and that header's offset (``None``: none before the end)."""
    records: list[tuple[int, RecordHeader]] = []
    # The smallest segment is a header page and one two-page slot.
    earliest = start + 3 * PAGE_BYTES
    bounce = mmap.mmap(-1, _RUN_BYTES)
    view = memoryview(bounce)
    try:
        offset = start + PAGE_BYTES
        while offset < segmap.file_bytes:
            length = min(_RUN_BYTES, segmap.file_bytes - offset)
            with view[:length] as run:
                if not await _read_quietly(fd, offset, run, backend):
                    await _read_pages(fd, offset, run, PAGE_BYTES, backend)
            for at in range(0, length, PAGE_BYTES):
                magic = bounce[at : at + 4]
                if magic == SegmentHeader.MAGIC and offset + at >= earliest:
                    if _is_segment_at(bounce[at : at + PAGE_BYTES], offset + at, segmap):
                        return records, offset + at
                elif magic == RecordHeader.MAGIC:
                    with contextlib.suppress(CorruptRecord):
                        records.append(
                            (offset + at, RecordHeader.unpack(bounce[at : at + PAGE_BYTES]))
                        )
            offset += length
        return records, None
    finally:
        view.release()
        with contextlib.suppress(BufferError):
            bounce.close()


def _is_segment_at(page: bytes, offset: int, segmap: SegmentMap) -> bool:
    try:
        header = SegmentHeader.unpack(page)
    except CorruptRecord:
        return False
    return (
        header.file_id == segmap.file_id
        and header.start == offset
        and header.end <= segmap.file_bytes
    )


async def _write_durably(fd: int, offset: int, page: memoryview, backend: IoBackend) -> None:
    """Write a repaired header page; a failure is logged (the next start repairs it again)."""
    try:
        await backend.writev(fd, offset, [page])
        await backend.fdatasync(fd)
    except (StorageIOError, NoSpaceError) as exc:
        log.warning("cannot write the repaired header at offset %d: %s", offset, exc)
