"""The per-segment generation table: which segments were written since a checkpoint.

A checkpoint (:mod:`kvtierd.store.checkpoint`) is the index snapshot written while serving,
labelled with a generation ``g``; taking it moves the tier to generation ``g + 1``. Before the
first write into a segment in a generation (a record, or a discard's zeroed header page), that
segment's entry here is set to the generation and the table is written durably (temporary file,
fsync, rename, directory fsync): once a segment a period, never once a write. So after a crash
the segments whose entry is above ``g`` are exactly those whose slots may differ from what
checkpoint ``g`` says, and recovery scans only those (segments the table does not list, carved
since its last write, count as changed too).

The table also records ``since``: the first generation it has watched every write of. A table
that is missing or damaged is started afresh only after every checkpoint of the data file is
deleted, so no checkpoint older than the table's watch is ever trusted.

Format (little-endian)::

    magic "KVTG", version (u16), reserved (u16), file id (16 bytes), since (u64),
    generation (u64), segments (u32), each segment's generation (u64), xxh3-64 of all before
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import anyio
import numpy as np
import numpy.typing as npt
import xxhash

from kvtierd.store.durable import replace_durably

__all__ = ["ChangeTable", "CorruptTable"]

_MAGIC = b"KVTG"
_VERSION = 1
_HEAD = struct.Struct("<4sH2x16sQQI")
_CHECK = struct.Struct("<Q")
#: More segments than any file has (a 64 TiB file of the smallest, 1 MiB, segments).
_MAX_SEGMENTS = 1 << 26


class CorruptTable(ValueError):
    """The bytes are not a generation table."""


class ChangeTable:
    """The table of one data file, as kept in memory and on disk at :attr:`path`."""

    def __init__(self, path: Path, file_id: bytes, since: int, generation: int) -> None:
        self.path = path
        self.file_id = file_id
        self.since = since
        #: The generation writes are marked with now (a checkpoint taken moves it on).
        self.generation = generation
        #: Each segment's generation as the next save writes it.
        self.segments: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        #: Each segment's generation as a save that returned wrote it.
        self._durable: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self._lock = anyio.Lock()
        self._saving = threading.Lock()

    # -- on disk -----------------------------------------------------------------------------

    def encode(self) -> bytes:
        # One read of the array: the loop may replace it (a mark past the end) while a worker
        # thread encodes, and a count from one array with the body of another is a torn table.
        segments = self.segments
        head = _HEAD.pack(
            _MAGIC, _VERSION, self.file_id, self.since, self.generation, len(segments)
        )
        body = head + segments.astype("<u8").tobytes()
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, path: Path, raw: bytes) -> ChangeTable:
        if len(raw) < _HEAD.size + _CHECK.size:
            raise CorruptTable("short generation table")
        magic, version, file_id, since, generation, count = _HEAD.unpack_from(raw)
        if magic != _MAGIC or version != _VERSION:
            raise CorruptTable("not a generation table of this version")
        if count > _MAX_SEGMENTS or len(raw) != _HEAD.size + 8 * count + _CHECK.size:
            raise CorruptTable("a generation table of another length than it says")
        (check,) = _CHECK.unpack_from(raw, len(raw) - _CHECK.size)
        if xxhash.xxh3_64_intdigest(raw[: -_CHECK.size]) != check:
            raise CorruptTable("generation table checksum mismatch")
        table = cls(path, file_id, since, generation)
        table.segments = np.frombuffer(raw, "<u8", count, _HEAD.size).astype(np.uint64)
        table._durable = table.segments.copy()
        if since > generation or (count and int(table.segments.max()) > generation):
            raise CorruptTable("a segment or the watch is newer than the table's generation")
        return table

    @classmethod
    def load(cls, path: Path, file_id: bytes) -> ChangeTable:
        """The table at ``path``; raises :class:`CorruptTable` (or ``FileNotFoundError``)
        when it is damaged, of another data file, or larger than any table can be."""
        with open(path, "rb") as file:
            raw = file.read(_HEAD.size + 8 * _MAX_SEGMENTS + _CHECK.size + 1)
        table = cls.decode(path, raw)
        if table.file_id != file_id:
            raise CorruptTable("the generation table names another data file")
        return table

    def save(self) -> None:
        """Write the table durably (blocking: call it in a worker thread). Saves from several
        threads write one after the other, each what the table held when its turn came, so the
        last write on disk is never older than an earlier one."""
        with self._saving:
            replace_durably(self.path, self.encode())

    # -- marking -----------------------------------------------------------------------------

    def covers(self, generation: int) -> bool:
        """Whether every write since checkpoint ``generation`` was taken is marked here."""
        return self.since <= generation < self.generation

    def changed_since(self, generation: int, count: int) -> npt.NDArray[np.bool_]:
        """Of segments ``0 .. count - 1``, those written (or carved) since checkpoint
        ``generation``: an entry above it, or none."""
        changed = np.ones(count, bool)
        known = min(count, len(self.segments))
        changed[:known] = self.segments[:known] > generation
        return changed

    async def mark(self, segment: int) -> None:
        """Make durable that ``segment`` is written in the current generation; returns at once
        when it already is (the common case: once a segment a generation costs a write).

        :attr:`segments` (what every save writes) takes the mark before the save, so no save
        from another thread can write a table without it; the fast path reads ``_durable``,
        which takes it only once a save returned, so a second write into the segment waits for
        the first one's mark instead of passing it."""
        if self._is_durable(segment):
            return
        async with self._lock:
            if self._is_durable(segment):
                return
            if segment >= len(self.segments):
                self.segments = _grown(self.segments, segment + 1)
                self._durable = _grown(self._durable, segment + 1)
            generation = self.generation
            self.segments[segment], before = generation, self.segments[segment]
            try:
                await anyio.to_thread.run_sync(self.save)
            except BaseException:
                self.segments[segment] = max(before, self._durable[segment])
                raise
            self._durable[segment] = generation

    def _is_durable(self, segment: int) -> bool:
        return segment < len(self._durable) and self._durable[segment] == self.generation

    def advance(self) -> int:
        """Move on to the next generation and return the generation of the checkpoint being
        taken: the one whose writes it holds. Call it in the same step as the columns are
        taken, and :meth:`save` before the checkpoint is written, so the table on disk covers
        it."""
        taken = self.generation
        self.generation += 1
        return taken


def _grown(array: npt.NDArray[np.uint64], length: int) -> npt.NDArray[np.uint64]:
    grown = np.zeros(length, np.uint64)
    grown[: len(array)] = array
    return grown
