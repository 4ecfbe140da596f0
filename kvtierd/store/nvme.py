"""The NVMe tier: one preallocated data file (or block device) read and written with O_DIRECT.

Theory of operation. A block goes to disk as one vectored write of ``[header page, payload]``
from the arena, and comes back as one vectored read into ``[header page, arena slot]``: with the
io_uring backend both buffers lie in the registered arena, so the kernel moves the bytes between
the device and shared memory with no copy. A READ's records come back in batches
(:meth:`NvmeTier.load_run`, planned by :mod:`kvtierd.store.runs`): those that lie side by side
in one vectored read of all their ``[header page, arena slot]`` pairs, the others beside it,
all in flight at once from one task (:meth:`~kvtierd.io.IoBackend.readv_each`), each record
still checked alone. Placement
(:mod:`kvtierd.store.segments`) and the record format (:mod:`kvtierd.store.records`) are pure;
this module performs their decisions.

Guarantees this module gives the store:

* ``store`` returns once the record is written (not yet durable); ``sync`` makes every
  returned ``store`` durable with one ``fdatasync``;
* ``load`` fills the slot only with bytes whose header names the same namespace, key and
  sequence number and whose xxh3-64 matches, else raises ``BlockNotFoundError``; so does a
  record the medium cannot read (twice) or whose place is outside the file: a miss, after
  which the store drops the copy, never an error on every READ;
* ``discard`` overwrites the header page with zeroes, so recovery never resurrects the block.

A block device (``nvme.path`` naming one) is used from its start for ``nvme.size`` bytes, which
must fit in it; nothing creates, truncates or allocates it, and its logical block must divide the
4 KiB page every I/O is aligned to. A data file is locked (``flock``) and a device opened
``O_EXCL`` for as long as the tier is open, so a second daemon cannot use it. The index snapshot
never lies beside the data file (``/dev`` has no room for it, and a directory may hold several
daemons' files): it is in the data directory, named by
:func:`~kvtierd.store.recovery.snapshot_path`.

Opening and claiming the file, its superblock and the check that the path still names it are
:mod:`kvtierd.store.datafile`'s (they know no record), and what still waits to be zeroed is
:mod:`kvtierd.store.leftovers`'. What is left past 600 lines is the run reads (``load_run``,
issue 32) and recovery's settling of blocks written twice, which need the tier's records and
staging pages; splitting record keeping from reads follows the index's reshape
(docs/architecture.md, "The index at scale"), with issue 33's.

With ``checkpoint_every_bytes``, every write into a segment (a record, a discard) is first
marked in the durable generation table, and the index is checkpointed periodically, so a
start after a crash scans only the segments written since (:mod:`kvtierd.store.checkpoint`).

Optional zstd (per namespace) compresses through a bounce buffer in a worker thread, with one
compressor per thread (a shared ``ZstdCompressor`` crashes the process).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, Sequence
from pathlib import Path

import anyio
import numpy as np
import numpy.typing as npt
import zstandard

from kvtierd.errors import (
    BlockNotFoundError,
    KvtierError,
    NoSpaceError,
    StorageIOError,
)
from kvtierd.io import IoBackend
from kvtierd.io.base import MAX_BUFFERS_PER_OP
from kvtierd.policy import ServedBy
from kvtierd.store.checkpoint import (
    Checkpoints,
    TableRefusedError,
    checkpoint_paths,
    load_checkpoint,
    mark,
    mark_again,
    open_table,
)
from kvtierd.store.codec import (
    checksum_off_loop,
    checksums_off_loop,
    compress,
    copy_checksum_off_loop,
    decompress_into,
)
from kvtierd.store.coldindex import ColdIndex
from kvtierd.store.coldrefs import ColdRows
from kvtierd.store.counts import CheckpointFigures, TierFigures
from kvtierd.store.datafile import (
    check_data_file,
    identity_of,
    mtime_ns,
    open_superblock,
    prepare_file,
)
from kvtierd.store.leftovers import Leftovers
from kvtierd.store.records import (
    PAGE_BYTES,
    CorruptRecord,
    RecordHeader,
    Superblock,
)
from kvtierd.store.recovery import (
    SNAPSHOT_NAME,
    RecoveredIndex,
    load_snapshot,
    save_snapshot,
    scan,
    snapshot_path,
)
from kvtierd.store.segments import DiskSlot, SegmentMap, slot_bytes_for
from kvtierd.store.staging import StagingPages
from kvtierd.store.tier import (
    BlockRef,
    ClassFullError,
    LowerTier,
    MediumFullError,
    Recovered,
    TierCapabilities,
)

__all__ = ["NvmeTier", "open_nvme_tier"]

log = logging.getLogger("kvtierd.nvme")


def _bounce(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES))


def _close_bounce(bounce: mmap.mmap) -> None:
    # After a failed I/O the traceback may still hold views of the bounce buffer; the mapping
    # is then unmapped when they are collected.
    with contextlib.suppress(BufferError):
        bounce.close()


class NvmeTier(LowerTier):
    """Construct with :func:`open_nvme_tier`, which recovers the index first."""

    kind = ServedBy.NVME
    capabilities = TierCapabilities(
        durable=True, recovers_on_open=True, shared_across_hosts=False, evicts_itself=False
    )

    def __init__(
        self,
        fd: int,
        path: Path,
        snapshot: Path,
        segmap: SegmentMap,
        backend: IoBackend,
        pages: StagingPages,
        superblock: Superblock | None = None,
    ) -> None:
        self._fd = fd
        self.path = path
        self.snapshot = snapshot
        self._segmap = segmap
        self._backend = backend
        self._pages = pages
        #: The record in each used slot (:mod:`kvtierd.store.coldindex`): about 90 bytes a
        #: block, where a ``RecordHeader`` in a dict keyed by ``DiskSlot`` cost about 300.
        self._cold = ColdIndex()
        self._carving = anyio.Lock()
        self._counters = {
            "hits": 0,
            "misses": 0,
            "miss_bytes": 0,
            "bytes_read": 0,
            "bytes_written": 0,
        }
        #: Blocks whose read into a tenant's region did not match while the record did
        #: (:meth:`_read_privately`).
        self._slot_disagreed = 0
        #: Header pages still to be zeroed (:mod:`kvtierd.store.leftovers`).
        self.leftovers = Leftovers(segmap, self._tombstone, self._holds_header)
        self.max_seq = 0
        self.recovery_source = "empty"
        #: Segments whose headers recovery read (all after a full scan).
        self.recovery_scanned = 0
        #: Periodic checkpoints, when on (:mod:`kvtierd.store.checkpoint`), or why they could
        #: not be at start (their generation table could not be written).
        self.checkpoints: Checkpoints | None = None
        self.checkpoints_refused: str | None = None
        self._identity = identity_of(os.fstat(fd))
        #: The first page as written (``None``: not checked, a tier built by a test).
        self._superblock = superblock.pack() if superblock is not None else None

    # -- LowerTier ---------------------------------------------------------------------------

    @property
    def cold(self) -> ColdIndex:
        """The tier's records by row (the disk's CLOCK policy sweeps them)."""
        return self._cold

    def slot_class(self, ref: BlockRef) -> int:
        return slot_bytes_for(ref.raw_bytes)

    def stored_class(self, ref: BlockRef, location: Hashable) -> int:
        return location.size if isinstance(location, DiskSlot) else self.slot_class(ref)

    def segment_classes(self) -> npt.NDArray[np.int64]:
        """The slot class (:meth:`slot_class`: slot size) of each segment, by number (what
        the disk's CLOCK filters the rows of one class with)."""
        return np.fromiter((s.slot_bytes for s in self._segmap.segments), np.int64)

    async def store(self, ref: BlockRef, payload: memoryview) -> Hashable:
        stored: memoryview = payload[: ref.raw_bytes]
        flags = 0
        bounce = None
        if ref.compress:
            packed = await anyio.to_thread.run_sync(compress, stored)
            if len(packed) < ref.raw_bytes - PAGE_BYTES:
                bounce = _bounce(len(packed))
                bounce[: len(packed)] = packed
                stored, flags = memoryview(bounce)[: len(packed)], RecordHeader.FLAG_ZSTD
        header = RecordHeader(
            ref.ns_digest, ref.key, len(stored), ref.raw_bytes, ref.checksum, ref.seq, flags
        )
        padded = -(-len(stored) // PAGE_BYTES) * PAGE_BYTES
        body = memoryview(bounce)[:padded] if bounce is not None else payload[:padded]
        try:
            slot = await self._allocate(slot_bytes_for(len(stored)))
            try:
                generation = await mark(self.checkpoints, slot.segment)
                async with self._pages.page() as page:
                    page[:] = header.pack()
                    await self._backend.writev(self._fd, slot.offset, [page, body])
                # Marked again if a checkpoint was taken meanwhile (it may not hold the row),
                # before the row goes in: no await between the row and the return, so no READ
                # makes a block of a record its writer may still drop (a FORGET meanwhile).
                await mark_again(self.checkpoints, slot.segment, generation)
            except BaseException as exc:
                # The slot is given back (a failing medium must not fill the tier), and what
                # reached it is zeroed before the next sync (a record written whole, its mark
                # again failed, would otherwise outlive a FORGET of its block).
                self.leftovers.write_failed(slot)
                if isinstance(exc, NoSpaceError):
                    raise MediumFullError(f"{self.path}: the file system is full") from exc
                raise
        finally:
            if bounce is not None:
                stored.release()
                body.release()
                _close_bounce(bounce)
        self._cold.add(ref.ns_digest, header, slot.segment, slot.index)
        self._counters["bytes_written"] += PAGE_BYTES + padded
        if self.checkpoints is not None:
            self.checkpoints.wrote(PAGE_BYTES + padded, self._segmap, self._cold)
        return slot

    async def load(self, ref: BlockRef, location: Hashable, dest: memoryview) -> None:
        slot = self._slot(location)
        header, padded = self._readable(ref, slot)
        async with self._pages.page() as page:
            await self._read_record(slot, header, page, padded, dest)
            self._verify_header(page, ref)
        self._counters["bytes_read"] += PAGE_BYTES + padded
        value = await checksum_off_loop(dest[: ref.raw_bytes])
        if value != ref.checksum:
            value = await self._read_privately(ref, slot, dest)
        self._verified(ref, slot, value)

    def follows(self, before: Hashable, after: Hashable) -> bool:
        """Both are plain (uncompressed) records, ``after``'s slot starting where ``before``'s
        ends: one vectored read of ``[page, payload, page, payload]`` covers both."""
        if not isinstance(before, DiskSlot) or not isinstance(after, DiskSlot):
            return False
        return before.offset + before.size == after.offset and self._plain(before, after)

    def _plain(self, *slots: DiskSlot) -> bool:
        return all(_is_plain(slot, self._record_at(slot)) for slot in slots)

    async def load_run(
        self, items: Sequence[tuple[BlockRef, Hashable, memoryview]]
    ) -> list[BlockNotFoundError | None]:
        """The records of ``items`` read together: those that follow one another in one
        vectored request of their ``[header page, payload]`` pairs, every request in flight at
        once (:meth:`~kvtierd.io.IoBackend.readv_each`); then each header checked and every
        payload hashed in one pass (one worker-thread hop at most, :func:`checksums_off_loop`).
        A record that does not qualify (compressed, gone or replaced since it was planned,
        outside the file) is loaded alone, as :meth:`load` would, beside the others."""
        outcomes: list[BlockNotFoundError | None] = [None] * len(items)
        together: list[int] = []
        alone: list[int] = []
        indexed: dict[int, RecordHeader] = {}  # of ``together``: the record each was planned on
        file_bytes = self._segmap.file_bytes
        for i, (ref, location, _) in enumerate(items):
            slot = self._slot(location)
            header = self._record_at(slot)
            if (
                header is not None
                and header.seq == ref.seq
                and _is_plain(slot, header)
                and slot.offset + slot.size <= file_bytes
            ):
                together.append(i)
                indexed[i] = header
            else:
                alone.append(i)
        failures: list[KvtierError] = []

        async def load_alone(i: int) -> None:
            try:
                await self.load(*items[i])
            except BlockNotFoundError as exc:
                outcomes[i] = exc
            except KvtierError as exc:  # raised as itself below, not in an exception group
                failures.append(exc)

        async def load_together() -> None:
            count = self._pages.count
            try:
                for first in range(0, len(together), count):
                    await self._load_together(
                        items, together[first : first + count], indexed, outcomes
                    )
            except KvtierError as exc:
                failures.append(exc)

        if alone:
            async with anyio.create_task_group() as tg:
                for i in alone:
                    tg.start_soon(load_alone, i)
                await load_together()
        else:  # the common case: no task at all
            await load_together()
        if failures:
            raise failures[0]
        return outcomes

    async def _load_together(
        self,
        items: Sequence[tuple[BlockRef, Hashable, memoryview]],
        chosen: list[int],
        indexed: dict[int, RecordHeader],
        outcomes: list[BlockNotFoundError | None],
    ) -> None:
        """:meth:`load_run` of the plain records ``chosen`` (indexes into ``items``, at most a
        page each of the staging pages; ``indexed``: the record of each in the index when
        planned), their outcomes set in ``outcomes``."""
        slots = [self._slot(items[i][1]) for i in chosen]
        read: list[int] = []  # of chosen, those whose record was read and whose header matched
        async with self._pages.pages(len(chosen)) as pages:
            #: (offset, buffers, positions in ``chosen``) of each request
            requests: list[tuple[int, list[memoryview], list[int]]] = []
            for k, (i, slot) in enumerate(zip(chosen, slots, strict=True)):
                buffers = [pages[k], items[i][2][: slot.size - PAGE_BYTES]]  # a plain record
                before = slots[k - 1] if k else None  # fills its slot
                if (
                    before is not None
                    and before.offset + before.size == slot.offset
                    and len(requests[-1][1]) + 2 <= MAX_BUFFERS_PER_OP
                ):
                    requests[-1][1].extend(buffers)
                    requests[-1][2].append(k)
                else:
                    requests.append((slot.offset, buffers, [k]))
            results = await self._backend.readv_each(
                self._fd, [(offset, buffers) for offset, buffers, _ in requests]
            )
            for (offset, buffers, members), result in zip(requests, results, strict=True):
                if isinstance(result, StorageIOError):  # once more, alone
                    raw = sum(items[chosen[k]][0].raw_bytes for k in members)
                    unreadable = await self._read_run(offset, buffers, raw, attempts=1)
                    if unreadable is not None:
                        for k in members:
                            outcomes[chosen[k]] = unreadable
                        continue
                self._counters["bytes_read"] += sum(slots[k].size for k in members)
                for k in members:
                    try:
                        if not _as_indexed(pages[k], indexed[chosen[k]], items[chosen[k]][0]):
                            self._verify_header(pages[k], items[chosen[k]][0])
                    except BlockNotFoundError as exc:
                        outcomes[chosen[k]] = exc
                    else:
                        read.append(k)
        sums = await checksums_off_loop(
            [items[chosen[k]][2][: items[chosen[k]][0].raw_bytes] for k in read]
        )
        for k, value in zip(read, sums, strict=True):
            ref, _, dest = items[chosen[k]]
            try:
                if value != ref.checksum:
                    value = await self._read_privately(ref, slots[k], dest)
                self._verified(ref, slots[k], value)
            except BlockNotFoundError as exc:
                outcomes[chosen[k]] = exc

    async def _read_run(
        self, offset: int, buffers: list[memoryview], raw_bytes: int, *, attempts: int = 2
    ) -> BlockNotFoundError | None:
        """Read ``buffers`` from ``offset``, trying ``attempts`` times (``raw_bytes``: their
        blocks' bytes, missed when it fails); the miss every record
        of them is when the medium still refuses (as :meth:`_read_record` makes of one)."""
        for attempt in range(1, attempts + 1):
            try:
                await self._backend.readv(self._fd, offset, buffers)
                return None
            except StorageIOError as exc:
                if attempt == attempts:
                    self._missed(len(buffers) // 2, raw_bytes)
                    log.error(
                        "cannot read the blocks at offset %d of %s: %s", offset, self.path, exc
                    )
                    return BlockNotFoundError(f"stored block unreadable: {exc}")
        raise AssertionError("unreachable")

    def _readable(self, ref: BlockRef, slot: DiskSlot) -> tuple[RecordHeader, int]:
        """The record ``slot`` holds for ``ref`` and its payload's length on disk (whole pages);
        raises :class:`BlockNotFoundError` when the slot holds another block now, or lies
        outside the data file."""
        header = self._record_at(slot)
        if header is None or header.seq != ref.seq:
            raise BlockNotFoundError("the disk slot no longer holds this block")
        padded = -(-header.stored_bytes // PAGE_BYTES) * PAGE_BYTES
        if slot.offset + PAGE_BYTES + padded > self._segmap.file_bytes:
            self._missed(1, ref.raw_bytes)
            log.error("a block's place, offset %d, lies outside %s", slot.offset, self.path)
            raise BlockNotFoundError("the block's disk slot lies outside the data file")
        return header, padded

    async def _read_privately(self, ref: BlockRef, slot: DiskSlot, dest: memoryview) -> int:
        """``dest``, where ``ref``'s record was read, did not hash to its checksum. ``dest`` is
        a slot of a tenant's region, memory every client of the tenant may write (or punch a
        hole in, after which a fixed-buffer read lands in pages the region no longer has): a
        mismatch there proves nothing about the disk. So the record is read once more into
        daemon-private memory and judged there: intact, it is copied into ``dest`` (and fixed
        buffers are given up, in case the region's pages changed) and its checksum returned;
        else the checksum it has, and the caller drops it as torn. Raises
        :class:`BlockNotFoundError` as :meth:`load` does when it cannot be read at all."""
        async with self._private_copy(ref, slot) as (payload, value):
            if value == ref.checksum:
                await copy_checksum_off_loop(dest[: ref.raw_bytes], payload)
                self._slot_disagreed += 1
                if self._slot_disagreed & (self._slot_disagreed - 1) == 0:  # 1, 2, 4, ...
                    log.warning(
                        "a block read from offset %d of %s into its tenant's region did not "
                        "match, the record re-read into private memory did (%d times so "
                        "far): a client wrote to its region while the block was read",
                        slot.offset,
                        self.path,
                        self._slot_disagreed,
                    )
                self._backend.release_fixed_buffers()
            return value

    @contextlib.asynccontextmanager
    async def _private_copy(
        self, ref: BlockRef, slot: DiskSlot
    ) -> AsyncIterator[tuple[memoryview, int]]:
        """``ref``'s record in ``slot`` read into daemon-private memory: its payload and the
        payload's checksum, valid inside the block. Raises :class:`BlockNotFoundError` as
        :meth:`load` does when it cannot be read at all."""
        header, padded = self._readable(ref, slot)
        bounce = _bounce(max(padded, ref.raw_bytes))
        try:
            with memoryview(bounce) as private, private[: ref.raw_bytes] as payload:
                async with self._pages.page() as page:
                    await self._read_record(slot, header, page, padded, private)
                    self._verify_header(page, ref)
                yield payload, await checksum_off_loop(payload)
        finally:
            _close_bounce(bounce)

    def _verified(self, ref: BlockRef, slot: DiskSlot, value: int) -> None:
        """Count a hit when the payload read from ``slot`` hashed to ``value`` matches ``ref``;
        else count a miss and raise :class:`BlockNotFoundError` (torn or corrupt)."""
        if value != ref.checksum:
            self._missed(1, ref.raw_bytes)
            log.error(
                "torn or corrupt block at offset %d of %s: checksum mismatch",
                slot.offset,
                self.path,
            )
            raise BlockNotFoundError("stored block failed its checksum")
        self._counters["hits"] += 1

    async def _read_record(
        self, slot: DiskSlot, header: RecordHeader, page: memoryview, padded: int, dest: memoryview
    ) -> None:
        """Read the record into ``page`` and ``dest``, trying twice. A medium that still refuses
        makes the block a miss (the store drops the copy), not an error on every READ."""
        for attempt in (1, 2):
            try:
                if header.flags & RecordHeader.FLAG_ZSTD:
                    await self._load_compressed(slot, page, padded, dest)
                else:
                    await self._backend.readv(self._fd, slot.offset, [page, dest[:padded]])
                return
            except StorageIOError as exc:
                if attempt == 2:
                    self._missed(1, header.raw_bytes)
                    log.error(
                        "cannot read the block at offset %d of %s: %s", slot.offset, self.path, exc
                    )
                    raise BlockNotFoundError(f"stored block unreadable: {exc}") from exc

    async def discard(self, ref: BlockRef, location: Hashable) -> None:
        """Drop ``ref``'s record at ``location``: its row at once, then its header page zeroed
        and the slot freed. A slot that holds no record, or another block's now (a copy
        dropped twice, or by a ``Block`` made before an earlier discard), is left alone."""
        slot = self._slot(location)
        row = self._cold.at(slot.segment, slot.index)
        if row < 0 or self._cold.column("seq")[row] != ref.seq:
            return
        # The row goes before the first await: a READ or LOOKUP beside this discard must not
        # make a block of it, which would name a slot about to be freed and written by
        # another block's record (a failed read of it then dropped that record: a block
        # acknowledged by FSYNC was lost).
        self._cold.remove(row)
        await self.leftovers.discard((ref.ns_digest, ref.key), slot)

    async def _tombstone(self, slot: DiskSlot) -> None:
        """Zero ``slot``'s header page, its segment marked first (a no-op once marked)."""
        if slot.offset + PAGE_BYTES > self._segmap.file_bytes:
            return  # never write past the end of the file (it would grow a regular file)
        await mark(self.checkpoints, slot.segment)
        async with self._pages.page() as page:
            page[:] = bytes(PAGE_BYTES)
            await self._backend.writev(self._fd, slot.offset, [page])

    async def _holds_header(self, slot: DiskSlot) -> bool:
        """Whether ``slot``'s header page holds a record header (what a scan would adopt)."""
        if slot.offset + PAGE_BYTES > self._segmap.file_bytes:
            return False
        async with self._pages.page() as page:
            await self._backend.readv(self._fd, slot.offset, [page])
            try:
                RecordHeader.unpack(page)
            except CorruptRecord:
                return False
        return True

    async def sync(self) -> None:
        """:meth:`Leftovers.zero` (a FORGET synced is one a restart keeps), then
        ``fdatasync``, then :meth:`check_data_file`: a sync onto a file that is no longer the
        data file makes nothing durable there, so it raises instead of returning."""
        await self.leftovers.zero()
        await self._backend.fdatasync(self._fd)
        await self.check_data_file()

    async def check_data_file(self) -> None:
        """Raise :class:`~kvtierd.store.diskhealth.DataFileLostError` when :attr:`path` no
        longer names the open file or the file is no longer what the tier wrote
        (:func:`~kvtierd.store.datafile.check_data_file`)."""
        await check_data_file(
            self.path,
            self._fd,
            self._identity,
            self._segmap.file_bytes,
            self._superblock,
            self._backend,
            self._pages,
        )

    def recovered(self) -> Iterator[Recovered]:
        """Made from the index's rows as it is asked for (:meth:`ColdRows.made
        <kvtierd.store.coldrefs.ColdRows.made>`, the one way a row becomes a ref and slot):
        nothing per block is kept for it; a row freed while the caller iterates is passed."""
        rows = self.cold_rows()
        for row in self._cold.rows().tolist():
            try:
                found = rows.made(row)
            except ValueError:  # freed since the rows were listed
                continue
            yield found

    def cold_rows(self) -> ColdRows:
        """The records as the store's index finds blocks in them (the index recovered at
        open, which is never replaced after)."""
        return ColdRows(self._cold, self._segmap)

    def checkpoint_figures(self) -> CheckpointFigures | None:
        taken = self.checkpoints
        if taken is None:  # refused at start, or off by configuration (every_bytes = 0)
            refused = self.checkpoints_refused
            state = f"given up: {refused}" if refused is not None else "off"
            return CheckpointFigures(state, 0, None, 0, 0.0)
        last = taken.last_written_s
        return CheckpointFigures(
            "on" if taken.abandoned is None else f"given up: {taken.abandoned}",
            taken.written,
            time.monotonic() - last if last is not None else None,
            taken.bytes_since,
            taken.longest_slice_s,
        )

    def statistics(self) -> TierFigures:
        c = self._counters
        return TierFigures(
            "nvme",
            len(self._cold),
            self._segmap.used_bytes,
            self._segmap.capacity_bytes,
            c["hits"],
            c["misses"],
            0,
            c["bytes_read"],
            c["bytes_written"],
            c["miss_bytes"],
        )

    # -- internals ---------------------------------------------------------------------------

    def _missed(self, blocks: int, nbytes: int) -> None:
        self._counters["misses"] += blocks
        self._counters["miss_bytes"] += nbytes

    def _slot(self, location: Hashable) -> DiskSlot:
        if not isinstance(location, DiskSlot):
            raise TypeError("not an NVMe location")
        return location

    def _record_at(self, slot: DiskSlot) -> RecordHeader | None:
        """The record ``slot`` holds, or ``None``."""
        row = self._cold.at(slot.segment, slot.index)
        return self._cold.record(row) if row >= 0 else None

    def _verify_header(self, page: memoryview, ref: BlockRef) -> None:
        try:
            header = RecordHeader.unpack(page)
        except CorruptRecord as exc:
            raise BlockNotFoundError(f"stored header unreadable: {exc}") from exc
        if (header.ns_digest, header.key, header.seq) != (ref.ns_digest, ref.key, ref.seq):
            raise BlockNotFoundError("disk slot holds another block")

    async def _load_compressed(
        self, slot: DiskSlot, page: memoryview, padded: int, dest: memoryview
    ) -> None:
        bounce = _bounce(padded)
        try:
            with memoryview(bounce) as view:
                await self._backend.readv(self._fd, slot.offset, [page, view[:padded]])
                header = RecordHeader.unpack(page)
                await anyio.to_thread.run_sync(
                    decompress_into, view[: header.stored_bytes], dest[: header.raw_bytes]
                )
        except (CorruptRecord, zstandard.ZstdError) as exc:
            raise BlockNotFoundError(f"compressed block unreadable: {exc}") from exc
        finally:
            _close_bounce(bounce)

    async def _allocate(self, slot_bytes: int) -> DiskSlot:
        slot = self._segmap.allocate(slot_bytes)
        if slot is not None:
            return slot
        async with self._carving:
            slot = self._segmap.allocate(slot_bytes)
            if slot is not None:
                return slot
            header = self._segmap.plan_segment(slot_bytes)
            if header is None:
                raise ClassFullError(f"NVMe tier has no free {slot_bytes}-byte slot", slot_bytes)
            try:
                async with self._pages.page() as page:
                    page[:] = header.pack()
                    await self._backend.writev(self._fd, header.start, [page])
                await self._backend.fdatasync(self._fd)
            except NoSpaceError as exc:
                raise MediumFullError(f"{self.path}: the file system is full") from exc
            self._segmap.add_segment(header)
        slot = self._segmap.allocate(slot_bytes)
        assert slot is not None
        return slot

    async def _adopt(self, found: RecoveredIndex) -> None:
        self._cold = found.cold
        for row in found.ties:
            if (settled := await self._settle_tie(row)) is not None:
                found.stale.append(settled)
        for slot in found.stale:
            await self.leftovers.zero_and_free(slot)
        self.max_seq = found.max_seq
        self.recovery_source = found.source
        self.recovery_scanned = found.scanned_segments

    async def _settle_tie(self, row: int) -> DiskSlot | None:
        """Keep one of two records of a block written twice (``row``, beside its key's row with
        the same seq; see :mod:`kvtierd.store.recovery`): the key's row unless its payload is
        proven torn (its checksum fails) where ``row``'s is not, or does not verify where
        ``row``'s does. The other leaves the index; its slot is returned to discard when the
        kept copy verified or the other is proven torn, else ``None``: a copy neither proven
        whole nor torn (the medium refused to read it) is left on the medium, never erased on
        a read error's word, and erased when its block's kept copy is (:meth:`discard`), so a
        FORGET it outlived is never undone by a crash."""
        identity = self._cold.identity(row)
        assert identity is not None
        named = self._cold.find(*identity)
        kept_whole = await self._intact(named)
        other_whole = None if kept_whole else await self._intact(row)
        if (kept_whole is False and other_whole is not False) or (
            kept_whole is None and other_whole
        ):
            replaced = self._slot_of(named)
            log.warning(
                "a block written twice had a copy at offset %d of %s that %s; the other kept",
                replaced.offset,
                self.path,
                "is torn" if kept_whole is False else "cannot be read",
            )
            header, place = self._cold.record(row), self._cold.place(row)
            self._cold.remove(named)
            self._cold.remove(row)
            self._cold.add(identity[0], header, *place)  # now its key's row
            return replaced
        other = self._slot_of(row)
        self._cold.remove(row)
        if kept_whole or other_whole is False:
            return other
        self.leftovers.left_unsettled(identity, other)  # neither could be read
        return None

    def _slot_of(self, row: int) -> DiskSlot:
        return self._segmap.slot(*self._cold.place(row))

    async def _intact(self, row: int) -> bool | None:
        """Whether the record in ``row`` reads whole and its payload matches its checksum;
        ``None`` when it cannot be read at all (the medium refused it twice)."""
        ref = self.cold_rows().made(row).ref
        try:
            async with self._private_copy(ref, self._slot_of(row)) as (
                _,
                value,
            ):
                return value == ref.checksum
        except BlockNotFoundError:
            return None

    def save_snapshot(self) -> None:
        save_snapshot(
            self.snapshot, self._segmap, self._cold, data_mtime_ns=mtime_ns(os.fstat(self._fd))
        )


def _is_plain(slot: DiskSlot, header: RecordHeader | None) -> bool:
    """``slot`` holds the uncompressed record ``header`` and is just its size: the record is
    ``[header page, payload]`` filling the slot, which a run read may cover."""
    return (
        header is not None
        and not header.flags & RecordHeader.FLAG_ZSTD
        and slot.size == slot_bytes_for(header.stored_bytes)
    )


def _as_indexed(page: memoryview, header: RecordHeader, ref: BlockRef) -> bool:
    """``page`` holds exactly the header the index has for the slot, and that is ``ref``'s
    record: then :meth:`NvmeTier._verify_header` would accept it (the page is a sealed header
    whose namespace, key and sequence are ``ref``'s). Packing the known header and comparing
    the bytes an unpack reads (not the page's padding, which nothing reads) costs about a third
    of unpacking the page into a new :class:`RecordHeader`; any other page (``False``) is
    judged by :meth:`NvmeTier._verify_header` as before."""
    if (header.ns_digest, header.key, header.seq) != (ref.ns_digest, ref.key, ref.seq):
        return False
    sealed = header.sealed()
    return page[: len(sealed)] == sealed


@contextlib.asynccontextmanager
async def open_nvme_tier(
    path: Path,
    size_bytes: int,
    *,
    backend: IoBackend,
    pages: StagingPages,
    segment_bytes: int = 64 << 20,
    preallocate: bool = True,
    progress: Callable[[int], None] | None = None,
    snapshot_dir: Path | None = None,
    reinitialize: bool = False,
    checkpoint_every_bytes: int = 0,
) -> AsyncIterator[NvmeTier]:
    """Open (creating if needed) the data file, recover its index, and yield the tier. On a
    clean exit the index snapshot is written into ``snapshot_dir`` (the daemon's data directory;
    default: the data file's), so the next start skips the scan. ``progress`` is told, during a
    scan, how many records it has recovered so far. ``reinitialize``: initialise an existing
    file whose superblock cannot be read instead of refusing (:func:`open_superblock`).
    ``checkpoint_every_bytes``: write a checkpoint every so many bytes written (0: none, and
    any left by an earlier run is deleted), which a start after a crash begins from."""
    snapshot = snapshot_path(snapshot_dir if snapshot_dir is not None else path.parent, path)
    fd, file_bytes, modified_ns, held_bytes = await anyio.to_thread.run_sync(
        prepare_file, path, size_bytes, preallocate
    )
    try:
        started = time.monotonic()
        superblock = await open_superblock(
            fd, path, file_bytes, backend, pages, held_bytes=held_bytes, reinitialize=reinitialize
        )
        segmap = SegmentMap(superblock.file_id, file_bytes, segment_bytes)
        tier = NvmeTier(fd, path, snapshot, segmap, backend, pages, superblock)
        legacy = path.parent / SNAPSHOT_NAME  # where earlier versions wrote it
        checkpoint, generations = checkpoint_paths(snapshot)
        table = open_table(generations, segmap.file_id, checkpoint_every_bytes)
        found = (
            await load_snapshot(
                snapshot, fd, segmap, backend, pages, legacy=legacy, data_mtime_ns=modified_ns
            )
            or await load_checkpoint(checkpoint, table, fd, segmap, backend, pages)
            or await scan(fd, segmap, backend, pages, progress=progress)
        )
        # The table goes on only from the checkpoint it covers. After any other start (a clean
        # snapshot, a scan: perhaps the file was written by a writer that marks nothing, as the
        # snapshot's mtime check may just have found) a fresh one, and the checkpoint goes.
        kept = table if found.source == "checkpoint" else None
        try:
            tier.checkpoints = await anyio.to_thread.run_sync(
                Checkpoints.open,
                checkpoint,
                generations,
                kept,
                segmap.file_id,
                checkpoint_every_bytes,
                fd,
            )
        except TableRefusedError as exc:  # given up for this run (logged)
            tier.checkpoints_refused = str(exc)
        await tier._adopt(found)
        log.info(
            "NVMe tier %s: %d blocks recovered by %s in %.3f s",
            path,
            len(found.cold),
            found.source,
            time.monotonic() - started,
        )
        if held_bytes and found.source != "snapshot":
            log.warning(
                "kvtierd did not stop cleanly last time (killed, crashed, or the host lost "
                "power: no index snapshot of a clean stop was found for %s); its index was "
                "rebuilt from the %s, and every block FSYNC acknowledged is kept, but blocks "
                "not yet synced then may be gone: see journalctl -u kvtierd -b -1 for why it "
                "stopped",
                path,
                found.source,
            )
        # The checkpoints' task is the tier's: whatever ends the tier ends it, and waits for
        # its write (a worker thread syncing this data file) before the file is closed.
        async with anyio.create_task_group() as tasks:
            if tier.checkpoints is not None:
                tier.checkpoints.serve(tasks)
            try:
                yield tier
            finally:
                tasks.cancel_scope.cancel()  # the clean-stop snapshot follows: no need for one
        try:
            await tier.sync()  # the snapshot may only name records that are durable
        except KvtierError as exc:  # the next start scans the headers instead
            log.error("no index snapshot written for %s: the last sync failed: %s", path, exc)
            return
        try:
            tier.save_snapshot()
        except OSError as exc:  # only a shortcut: the next start scans the headers instead
            log.warning("cannot write the index snapshot for %s: %s", path, exc)
    finally:
        os.close(fd)
