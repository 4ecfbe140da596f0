"""Checkpoints: the index snapshot written while serving, and a crash restart from one.

A crash restart that scans every slot's header page is bound by the disk (one page a slot:
10M slots at 140K IOPS is 71 s). A checkpoint bounds it by what was written since instead:

* every ``nvme.checkpoint_every_bytes`` written, the tier copies the cold index's columns and
  the segment geometry on the event loop (one pass of numpy), moves the generation table
  (:mod:`kvtierd.store.changes`) to the next generation in the same step, and writes the
  snapshot (format 3, with the generation it holds) in a worker thread: the table saved first,
  then the checkpoint by temporary file, fsync, rename, directory fsync. The loop keeps
  inserting meanwhile; what it inserts is marked in the new generation.
* after a crash (no clean-stop snapshot), the newest checkpoint is read, checked against the
  file as a clean-stop snapshot is (:func:`~kvtierd.store.snapshot.problem`, the segment
  headers on disk), and accepted only when the generation table covers it; its rows of
  segments unchanged since are adopted, the changed segments (and those carved since) are
  scanned, and the newest record of each key across both wins
  (:meth:`~kvtierd.store.coldindex.ColdIndex.from_columns`' rule, as a full scan).

Any doubt (no table, a damaged table or checkpoint, a checkpoint the table does not cover, a
geometry that disagrees) costs the full scan, with a WARNING: a checkpoint is a shortcut, never
an authority. Unlike the clean-stop snapshot it is not deleted at start: the table keeps it
true, since every write into a segment is marked durably before it is made.

A table that cannot be written (the data directory full, its disk failing) does not fail the
writes: the checkpoints are given up for the rest of the run (:meth:`Checkpoints.abandon`, an
ERROR), the checkpoint deleted first, durably, so a crash restart scans every header. Only a
checkpoint that cannot be deleted either fails the write that needed the mark.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskGroup

from kvtierd.errors import StorageIOError
from kvtierd.io import IoBackend
from kvtierd.store import snapshot as snapshots
from kvtierd.store.changes import ChangeTable, CorruptTable
from kvtierd.store.coldindex import COLUMNS, ColdIndex
from kvtierd.store.durable import fsync_directory, replace_durably
from kvtierd.store.recovery import (
    RecoveredIndex,
    check_segment_headers,
    find_segments,
    recovered,
    scan_segments,
    segments_of,
)
from kvtierd.store.segments import SegmentMap
from kvtierd.store.staging import StagingPages

__all__ = [
    "Checkpoints",
    "TableRefusedError",
    "checkpoint_paths",
    "forget",
    "fresh_table",
    "load_checkpoint",
    "mark",
    "mark_again",
    "open_table",
    "read_checkpoint",
]

log = logging.getLogger("kvtierd.checkpoint")

#: Rows of the index copied in one step of the event loop (1.6-1.9 ms measured at 1M rows).
_SLICE_ROWS = 1 << 16


class TableRefusedError(Exception):
    """The generation table cannot be written at start: no checkpoint this run (why)."""


class Checkpoints:
    """Takes a checkpoint of the tier every ``every_bytes`` written, in the task group given
    to :meth:`serve` (the tier's: its exit waits for one being taken)."""

    def __init__(self, path: Path, table: ChangeTable, every_bytes: int, data_fd: int) -> None:
        self.path = path
        self.table = table
        self.every_bytes = every_bytes
        #: The data file, made durable before a checkpoint naming its records is.
        self._data_fd = data_fd
        #: Checkpoints written by this process (tests and the benchmark read it).
        self.written = 0
        #: Why checkpoints were given up in this run (:meth:`abandon`), or ``None``.
        self.abandoned: str | None = None
        #: The longest the event loop was held by one slice of a checkpoint's copy (seconds).
        self.longest_slice_s = 0.0
        #: ``time.monotonic()`` when the last checkpoint of this run was written, or ``None``.
        self.last_written_s: float | None = None
        self._since = 0
        self._taking = False
        self._tasks: TaskGroup | None = None
        #: Held while a checkpoint is written and while checkpoints are given up, so none is
        #: renamed into place after the one deleted by :meth:`abandon`.
        self._writing = threading.Lock()

    @classmethod
    def open(
        cls,
        path: Path,
        generations: Path,
        table: ChangeTable | None,
        file_id: bytes,
        every_bytes: int,
        data_fd: int,
    ) -> Checkpoints | None:
        """Once the index is recovered: checkpoints of the data file ``file_id`` at ``path``,
        with the generation ``table`` read at start (a fresh one when ``None``), or ``None``
        with ``every_bytes`` 0, any checkpoint and table deleted (writes will not be marked,
        so none may be trusted later). Raises :class:`TableRefusedError` when a fresh table
        cannot be written: checkpoints are given up for the run. Blocking: call it in a worker
        thread."""
        if not every_bytes:
            forget(path, generations)
            return None
        if table is None:
            forget(path)  # the table it would need is gone (raises when it cannot be deleted)
            try:
                table = fresh_table(generations, file_id)
            except OSError as exc:
                log.error("index checkpoints are off for this run: %s cannot be written: %s",
                          generations, exc)  # fmt: skip
                raise TableRefusedError(f"{generations} cannot be written: {exc}") from exc
        return cls(path, table, every_bytes, data_fd)

    def serve(self, tasks: TaskGroup) -> None:
        """Take the periodic checkpoints in ``tasks`` from now on."""
        self._tasks = tasks

    def wrote(self, nbytes: int, segmap: SegmentMap, cold: ColdIndex) -> None:
        """Count a record of ``nbytes`` written and indexed (its segment marked in the current
        generation: :func:`mark_again`); start a checkpoint when a period's worth is written
        and none is being."""
        self._since += nbytes
        if (
            self._since >= self.every_bytes
            and not self._taking
            and self.abandoned is None
            and self._tasks is not None
        ):
            self._taking = True  # (the take starts the next period)
            self._tasks.start_soon(self._take_owned, segmap, cold)

    async def _take_owned(self, segmap: SegmentMap, cold: ColdIndex) -> None:
        try:
            await self.take(segmap, cold)
        finally:
            self._taking = False

    async def take(self, segmap: SegmentMap, cold: ColdIndex) -> None:
        """Take a checkpoint now; returns once it is written (or could not be: a WARNING).

        The table moves on to the next generation first; then the index is copied a slice
        of rows at a time, each slice in one step of the event loop (:data:`_SLICE_ROWS`),
        while the loop goes on serving. A row that changes meanwhile
        is in a segment marked in the new generation (every insert and discard marks its
        segment, and an insert marked in the old one is marked again), so its copy, whatever
        moment it caught, is one recovery ignores: such segments are scanned. Their rows,
        and those of segments carved since, are left out of the checkpoint (they could name
        a slot twice), and the rest is written in a worker thread."""
        self._since = 0
        generation = self.table.advance()
        geometry = [(s.start, s.slot_bytes, s.slot_count) for s in segmap.segments]
        pieces = []
        longest = 0.0
        started = time.perf_counter()
        for piece in cold.chunks(_SLICE_ROWS):  # each piece taken in one step of the loop
            pieces.append(piece)
            longest = max(longest, time.perf_counter() - started)
            await anyio.lowlevel.checkpoint()
            started = time.perf_counter()
        self.longest_slice_s = max(self.longest_slice_s, longest)
        changed = self.table.changed_since(generation, len(geometry))  # (marked meanwhile)
        snap = snapshots.Snapshot(
            segmap.file_id, segmap.file_bytes, geometry, list(cold.digests), {}, None, generation
        )
        await anyio.to_thread.run_sync(self._write, snap, pieces, changed, longest)

    def _write(
        self,
        snap: snapshots.Snapshot,
        pieces: list[dict[str, npt.NDArray[Any]]],
        changed: npt.NDArray[np.bool_],
        longest_slice_s: float,
    ) -> None:
        with self._writing:
            if self.abandoned is not None:
                return
            kept = [_unchanged(piece, changed) for piece in pieces]
            try:
                # The rows copied include records written but not yet synced: durable first,
                # or power lost after the rename would leave the checkpoint naming slots that
                # hold older bytes, in segments it says are unchanged.
                os.fdatasync(self._data_fd)
                self.table.save()  # the table on disk covers the checkpoint before it exists
                replace_durably(self.path, snapshots.encode_pieces(snap, kept))
            except OSError as exc:  # the previous checkpoint (or a full scan) still serves
                log.warning("cannot write the index checkpoint %s: %s", self.path, exc)
                return
        self.written += 1
        self.last_written_s = time.monotonic()
        log.info(
            "index checkpoint %d written: %d blocks; its copy held the event loop at most "
            "%.1f ms at a time",
            snap.generation,
            sum(len(piece["klen"]) for piece in kept),
            longest_slice_s * 1e3,
        )

    @property
    def bytes_since(self) -> int:
        """Bytes written to the tier since the last checkpoint was called for."""
        return self._since

    def abandon(self, why: OSError) -> None:
        """Give checkpoints up for the rest of the run: a segment could not be marked, so no
        checkpoint may be trusted at a crash. The checkpoint is deleted durably (the table
        too, where it can be), after any being written; raises ``OSError`` when it cannot be
        (the caller fails the write that needed the mark). Blocking: call it in a worker
        thread."""
        with self._writing:
            if self.abandoned is None:
                forget(self.path)
                self.abandoned = str(why)
                log.error(
                    "index checkpoints are off for the rest of this run (a crash restart scans"
                    " every header): a segment could not be marked: %s",
                    why,
                )
        with contextlib.suppress(OSError):  # a table with no checkpoint is never used
            forget(self.table.path)


def _unchanged(
    piece: dict[str, npt.NDArray[Any]], changed: npt.NDArray[np.bool_]
) -> dict[str, npt.NDArray[Any]]:
    """The rows of ``piece`` in segments not ``changed`` (``changed``: one flag a segment of
    the checkpoint's geometry; a row past it is in a segment carved since)."""
    segment = piece["segment"].astype(np.int64)
    inside = segment < len(changed)
    keep = inside.copy()
    keep[inside] = ~changed[segment[inside]]
    if keep.all():
        return piece
    return {name: column[keep] for name, column in piece.items()}


def read_checkpoint(path: Path, segmap: SegmentMap) -> snapshots.Snapshot | None:
    """The checkpoint at ``path`` of the data file of ``segmap``; ``None`` (a WARNING for one
    that exists) when there is none, it cannot be decoded, is larger than any of this file can
    be, or names another file."""
    limit = snapshots.largest(segmap.file_bytes)
    try:
        with open(path, "rb") as file:
            raw = file.read(limit + 1)
    except FileNotFoundError:
        return None
    if len(raw) > limit:
        log.warning("ignoring index checkpoint %s: larger than any of this data file", path)
        return None
    try:
        snap = snapshots.decode(raw)
    except snapshots.CorruptSnapshot as exc:
        log.warning("ignoring unreadable index checkpoint %s: %s", path, exc)
        return None
    if snap.file_id != segmap.file_id or snap.generation is None:
        log.warning("ignoring index checkpoint %s: another data file's, or no checkpoint", path)
        return None
    return snap


async def load_checkpoint(
    path: Path,
    table: ChangeTable | None,
    fd: int,
    segmap: SegmentMap,
    backend: IoBackend,
    pages: StagingPages,
) -> RecoveredIndex | None:
    """The index from the checkpoint at ``path`` and a scan of the segments the generation
    ``table`` says changed since; ``None`` (a WARNING when a checkpoint exists) when there is
    none or any doubt: the caller scans the whole file. ``segmap`` is left untouched then."""
    snap = read_checkpoint(path, segmap)
    if snap is None:
        return None
    assert snap.generation is not None
    if table is None or not table.covers(snap.generation):
        problem: str | None = "the generation table does not cover it"
    elif snap.file_bytes != segmap.file_bytes:
        problem = "it does not match the data file's size"
    else:
        problem = snapshots.problem(snap, segmap.file_bytes)
        if problem is None:
            problem = await check_segment_headers(fd, segments_of(snap), backend, pages)
    if problem is not None or table is None:
        log.warning("index checkpoint %s not used (%s); scanning every header", path, problem)
        return None
    for header in segments_of(snap):
        segmap.add_segment(header, all_free=False)
    await find_segments(fd, segmap, backend, pages)
    changed_mask = table.changed_since(snap.generation, len(segmap.segments))
    changed_mask[len(snap.segments) :] = True  # carved since: the checkpoint knows none
    changed = np.flatnonzero(changed_mask)
    columns, digests, _ = await scan_segments(fd, segmap, changed.tolist(), backend, pages)
    merged, names = _merge(snap, changed, columns, digests)
    found = recovered(segmap, merged, names, "checkpoint")
    found.scanned_segments = len(changed)
    log.info(
        "index checkpoint %d adopted; %d of %d segments written since were scanned",
        snap.generation,
        len(changed),
        len(segmap.segments),
    )
    return found


def _merge(
    snap: snapshots.Snapshot,
    changed: npt.NDArray[np.intp],
    columns: dict[str, npt.NDArray[Any]],
    digests: list[bytes],
) -> tuple[dict[str, npt.NDArray[Any]], list[bytes]]:
    """The checkpoint's rows outside the ``changed`` segments and the scan's rows of those, as
    one set of columns numbering the namespaces of the returned digests."""
    keep = ~np.isin(snap.columns["segment"], changed)
    names = list(snap.digests)
    number = {digest: i for i, digest in enumerate(names)}
    for digest in digests:
        if digest not in number:
            number[digest] = len(names)
            names.append(digest)
    renumber = np.array([number[d] for d in digests], dtype=np.int64)
    scanned = dict(columns)
    if len(scanned["klen"]):
        scanned["ns"] = renumber[np.asarray(scanned["ns"], dtype=np.int64)]
    merged = {
        name: np.concatenate(
            [snap.columns[name][keep].astype(dtype), np.asarray(scanned[name]).astype(dtype)]
        )
        for name, dtype, _ in COLUMNS
    }
    return merged, names


def checkpoint_paths(snapshot: Path) -> tuple[Path, Path]:
    """The checkpoint and the generation table of the data file whose clean-stop snapshot is
    ``snapshot``: beside it, named after it."""
    return snapshot.with_name(snapshot.name + ".checkpoint"), snapshot.with_name(
        snapshot.name + ".generations"
    )


def forget(*paths: Path) -> None:
    """Delete the files at ``paths`` durably (a checkpoint before a fresh generation table is
    started, which would not cover it)."""
    for path in paths:
        path.unlink(missing_ok=True)
    for directory in {path.parent for path in paths}:
        fsync_directory(directory)


async def mark(checkpoints: Checkpoints | None, segment: int) -> int:
    """Mark ``segment`` written in the current generation, durably, before a write into it
    (:meth:`ChangeTable.mark`); the generation (0 with checkpoints off or given up). A table
    that cannot be written gives checkpoints up (:meth:`Checkpoints.abandon`); only a
    checkpoint that cannot be deleted then fails the write (``StorageIOError``): the write,
    unmarked, could be lost to a crash restart from it."""
    if checkpoints is None or checkpoints.abandoned is not None:
        return 0
    table = checkpoints.table
    generation = table.generation
    try:
        await table.mark(segment)
    except OSError as exc:
        try:
            await anyio.to_thread.run_sync(checkpoints.abandon, exc)
        except OSError as again:
            raise StorageIOError(
                f"cannot write the generation table ({exc}) nor delete the checkpoint ({again})"
            ) from exc
    return generation


async def mark_again(checkpoints: Checkpoints | None, segment: int, generation: int) -> None:
    """Mark ``segment`` in the current generation when it was marked in ``generation`` and a
    checkpoint was taken since (a record written meanwhile, which that checkpoint may not
    hold): call it after the write and before the record is indexed."""
    while (
        checkpoints is not None
        and checkpoints.abandoned is None
        and checkpoints.table.generation != generation
    ):
        generation = await mark(checkpoints, segment)


def open_table(path: Path, file_id: bytes, every_bytes: int) -> ChangeTable | None:
    """The generation table at ``path`` of data file ``file_id``; ``None`` when checkpoints
    are off (``every_bytes`` 0), there is none, or it cannot be trusted (a WARNING): then no
    checkpoint is."""
    if not every_bytes:
        return None
    try:
        return ChangeTable.load(path, file_id)
    except FileNotFoundError:
        return None
    except (CorruptTable, OSError) as exc:
        log.warning("ignoring the generation table %s: %s", path, exc)
        return None


def fresh_table(path: Path, file_id: bytes) -> ChangeTable:
    """A new generation table, written durably: call it only once the checkpoint it does not
    cover is deleted. Its generations start at the clock's nanoseconds, above any an earlier
    table of this file gave (blocking: call it in a worker thread)."""
    now = time.time_ns()
    table = ChangeTable(path, file_id, now, now)
    table.save()
    return table
