"""The NVMe tier's records as columns: a row per stored record, found by place or by key.

Pure (no I/O). One Python object per stored block cost the daemon about 1.3 KB a block
(docs/architecture.md, "The index at scale"); here a record is a row of numpy columns, 68 bytes,
plus its share of the buckets and of the place map, and the collector sees a dozen arrays
however many blocks the disk holds.

*Rows.* Columns of one entry a row: the key (32 bytes, zero-padded, as four little-endian u64
words) and its length, the namespace's number (u16; :meth:`ColdIndex.namespace` numbers the
16-byte digests), the record's flags, stored and raw lengths, payload xxh3-64, seq, and its place
(segment and slot index). A key length of 0 marks a free row; freed rows go on a free stack and
are reused first, so rows stay dense. Beside them, state that is no part of a record and is not
saved: a reference byte a row for the NVMe tier's CLOCK (:mod:`kvtierd.store.clock`), set when
the row is added and by :meth:`ColdIndex.touch`, cleared by the sweeping hand.

*Places.* Per segment, an array of ``row + 1`` per slot (0: no record there): the tier finds a
record by the :class:`~kvtierd.store.segments.DiskSlot` the store holds.

*Buckets.* Open addressing with linear probing, a power of two of them, at most 0.7 full
(tombstones counted): a 32-bit hash of ``(namespace, key)`` and the row, 8 bytes. Hash values 0
and 1 mean empty and tombstone; a hash that lands on them is moved to 2 or 3. A hit is
confirmed on the row's full key, so two keys with one hash cost a probe, never a wrong answer.
The hash is a keyed mix (a random seed per index, so keys cannot be chosen to collide) that
numpy computes for millions of keys at once, which is what lets a restart build the buckets
without a Python step per block. A key's bucket names its newest row (the highest seq; on a tie
the one there first); an older row of the key keeps its place until it is removed, so a record
being replaced stays readable by its place meanwhile.

*Growth, on the event loop without holding it.* Every insert runs on the daemon's loop (a
client's put written back), so neither growth may cost in proportion to the index: the columns
grow by ``mremap`` (no copy), and a large bucket table moves to its successor a few buckets per
insert, both tables probed meanwhile (:meth:`ColdIndex._grow`).
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.store.buckets import (
    EMPTY,
    MAX_LOAD,
    TOMBSTONE,
    WORDS,
    build_table,
    by_identity,
    capacity_for,
    hash_of,
    identity_hashes,
    repeated,
    same_identity,
)
from kvtierd.store.freestack import FreeStack
from kvtierd.store.mapped import anonymous, resized, zeros
from kvtierd.store.records import RecordHeader

__all__ = [
    "COLUMNS",
    "MAX_RAW_BYTES",
    "ColdIndex",
    "Columns",
    "identity_hashes",
    "impossible_lengths",
    "repeated",
]

#: Every column of a row: name, element type, elements a row.
COLUMNS: tuple[tuple[str, type[np.generic], int], ...] = (
    ("key", np.uint64, MAX_KEY_BYTES // 8),
    ("klen", np.uint8, 1),
    ("ns", np.uint16, 1),
    ("flags", np.uint8, 1),
    ("stored", np.uint32, 1),
    ("raw", np.uint32, 1),
    ("checksum", np.uint64, 1),
    ("seq", np.uint64, 1),
    ("segment", np.uint32, 1),
    ("index", np.uint32, 1),
)
Columns = Mapping[str, npt.NDArray[Any]]
#: Columns of a row's state beside its record (grown with the others, never saved): ``ref``,
#: CLOCK's reference byte (1 B a row; a bit would save 7/8 of a byte and cost a shift per use).
_STATE: tuple[tuple[str, type[np.generic], int], ...] = (("ref", np.uint8, 1),)

#: No block is larger: the ceiling of ``limits.max_block_bytes`` (:mod:`kvtierd.config`).
MAX_RAW_BYTES = 1 << 30

_M64 = (1 << 64) - 1
_MAX_NAMESPACES = 1 << 16
_GROWTH = 1.25  # rows: a smaller factor than doubling keeps the slack per block low
#: Tables of fewer buckets than this are rebuilt at once (a millisecond or two); larger ones move
#: to their successor a few buckets per insert (:meth:`ColdIndex._grow`).
INCREMENTAL_FROM = 1 << 14


def _padded(key: bytes) -> bytes:
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} bytes, not {len(key)}")
    return key.ljust(MAX_KEY_BYTES, b"\0")


class ColdIndex:
    """Records by row, by place ``(segment, index)`` and by ``(namespace digest, key)``."""

    def __init__(
        self, *, seed: int | None = None, rows: int = 1024, incremental_from: int = INCREMENTAL_FROM
    ) -> None:
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed & _M64
        self._cols: dict[str, npt.NDArray[Any]] = {}
        self._maps: dict[str, mmap.mmap] = {}  # the columns' memory (:meth:`_alloc_rows`)
        #: The columns as memoryviews (the key's as bytes): reading one element of one is a
        #: Python int at once, several times cheaper than a numpy scalar.
        self._flat: dict[str, memoryview] = {}
        self._alloc_rows(max(16, rows))
        self._high = 0  # rows ever used: those at or past it are free and not on the stack
        self._free = FreeStack()
        self._live = 0
        self._digests: list[bytes] = []
        self._numbers: dict[bytes, int] = {}
        self._place: list[npt.NDArray[np.uint32]] = []
        self._places: list[memoryview] = []  # the same, as memoryviews
        self._hash: npt.NDArray[np.uint32] = np.zeros(16, np.uint32)
        self._brow: npt.NDArray[np.uint32] = np.zeros(16, np.uint32)
        self._filled = 0  # buckets holding a key or a tombstone
        self._keys = 0
        #: While the buckets grow: the table they leave, drained from ``_cursor`` on by
        #: ``_step`` buckets an insert; every key is in exactly one of the two tables.
        self._old_hash: npt.NDArray[np.uint32] = np.zeros(0, np.uint32)
        self._old_brow: npt.NDArray[np.uint32] = np.zeros(0, np.uint32)
        self._cursor = self._step = 0
        self._incremental_from = incremental_from

    def __len__(self) -> int:
        """Rows in use (records), newest of their key or not."""
        return self._live

    @property
    def keys(self) -> int:
        """Keys with a row."""
        return self._keys

    @property
    def moving(self) -> int:
        """Buckets of the table being left that are still to be moved (0: no growth under
        way)."""
        return len(self._old_hash) - self._cursor

    @property
    def digests(self) -> list[bytes]:
        """The namespace digests by number."""
        return list(self._digests)

    @property
    def seed(self) -> int:
        """The key of the bucket hash (:func:`identity_hashes`)."""
        return self._seed

    def number(self, digest: bytes) -> int | None:
        """The number of the namespace ``digest``, if it has one (nothing numbered)."""
        return self._numbers.get(digest)

    def namespace(self, digest: bytes) -> int:
        """The number of the namespace ``digest`` (numbered on first sight)."""
        number = self._numbers.get(digest)
        if number is None:
            if len(digest) != 16:
                raise ValueError("a namespace digest is 16 bytes")
            if len(self._digests) == _MAX_NAMESPACES:
                raise ValueError(f"more than {_MAX_NAMESPACES} namespaces")
            number = self._numbers[digest] = len(self._digests)
            self._digests.append(digest)
        return number

    # -- one record ----------------------------------------------------------------------------

    def add(self, digest: bytes, header: RecordHeader, segment: int, index: int) -> int:
        """Index ``header``, the record at slot ``index`` of ``segment``; its row. It becomes
        its key's row unless that key has one with an equal or higher seq. Raises
        ``ValueError`` when the place already holds a row or ``header`` is impossible."""
        if self.at(segment, index) >= 0:
            raise ValueError(f"slot {index} of segment {segment} already holds a record")
        padded = _padded(header.key)
        ns = self.namespace(digest)
        row = self._new_row()
        c = self._cols
        c["key"][row] = WORDS.unpack(padded)
        c["klen"][row] = len(header.key)
        c["ns"][row] = ns
        c["flags"][row] = header.flags
        c["stored"][row] = header.stored_bytes
        c["raw"][row] = header.raw_bytes
        c["checksum"][row] = header.payload_checksum
        c["seq"][row] = header.seq
        c["segment"][row] = segment
        c["index"][row] = index
        c["ref"][row] = 1  # an insert is an access
        self._set_place(segment, index, row + 1)
        self._live += 1
        klen = len(header.key)
        self._enter(row, self._hash_of(ns, klen, padded), ns, klen, padded)
        return row

    def remove(self, row: int) -> None:
        """Forget the record in ``row`` (and its key, when ``row`` is the key's row)."""
        c = self._cols
        if not 0 <= row < self._high or not c["klen"][row]:
            raise ValueError(f"row {row} holds no record")
        ns, klen = int(c["ns"][row]), int(c["klen"][row])
        h = self._hash_of(ns, klen, c["key"][row].tobytes())
        for table_h, table_r in self.tables():
            mask = len(table_h) - 1
            i = h & mask
            while (found := int(table_h[i])) != EMPTY:
                if found == h and int(table_r[i]) == row:
                    table_h[i] = TOMBSTONE
                    self._keys -= 1
                    break
                i = (i + 1) & mask
            else:
                continue
            break
        self._set_place(int(c["segment"][row]), int(c["index"][row]), 0)
        c["klen"][row] = 0
        self._free.push(row)
        self._live -= 1

    def find(self, digest: bytes, key: bytes) -> int:
        """The row of ``key``'s newest record in the namespace ``digest``, or -1."""
        ns = self._numbers.get(digest)
        if ns is None or not 0 < len(key) <= MAX_KEY_BYTES:
            return -1
        padded = _padded(key)
        h = self._hash_of(ns, len(key), padded)
        for table_h, table_r in self.tables():
            i = self._bucket(table_h, table_r, h, ns, len(key), padded)
            if i >= 0:
                return int(table_r[i])
        return -1

    def at(self, segment: int, index: int) -> int:
        """The row of the record in slot ``index`` of ``segment``, or -1."""
        if not 0 <= segment < len(self._places) or not 0 <= index < len(self._places[segment]):
            return -1
        return self._places[segment][index] - 1

    def record(self, row: int) -> RecordHeader:
        """The record in ``row`` as its header (on a READ's path: read through memoryviews,
        about a microsecond, where numpy scalars cost five)."""
        f, digest, key = self._identified(row)
        return RecordHeader.known(
            digest,
            key,
            f["stored"][row],
            f["raw"][row],
            f["checksum"][row],
            f["seq"][row],
            f["flags"][row],
        )

    def place(self, row: int) -> tuple[int, int]:
        """``(segment, index)`` of the record in ``row``."""
        return self._flat["segment"][row], self._flat["index"][row]

    def identity(self, row: int) -> tuple[bytes, bytes] | None:
        """``(namespace digest, key)`` of the record in ``row`` (the store's block id), or
        ``None`` for a free row."""
        f = self._flat
        klen = f["klen"][row] if 0 <= row < self._high else 0
        if not klen:
            return None
        at = row * MAX_KEY_BYTES
        return self._digests[f["ns"][row]], f["key"][at : at + klen].tobytes()

    # -- reference bytes (the NVMe tier's CLOCK) -------------------------------------------------

    @property
    def extent(self) -> int:
        """Rows ever used: every row in use is below it (the range a sweeping hand covers)."""
        return self._high

    def touch(self, row: int) -> None:
        """Set ``row``'s reference byte (the record was read)."""
        if 0 <= row < self._high:
            self._flat["ref"][row] = 1

    def unreferenced(self, first: int, end: int) -> npt.NDArray[np.intp]:
        """The rows in use from ``first`` to ``end`` whose reference byte is clear, in order."""
        end = min(end, self._high)
        c = self._cols
        clear = (c["klen"][first:end] > 0) & (c["ref"][first:end] == 0)
        return np.flatnonzero(clear) + first

    def clear_references(self, first: int, end: int) -> None:
        """Clear the reference bytes of the rows from ``first`` to ``end`` (a hand passed)."""
        self._cols["ref"][first : min(end, self._high)] = 0

    # -- all records ---------------------------------------------------------------------------

    def rows(self) -> npt.NDArray[np.intp]:
        """Every row in use, in row order."""
        return np.flatnonzero(self._cols["klen"][: self._high])

    def shadowed(self) -> npt.NDArray[np.intp]:
        """Rows in use that are not their key's row (an older record of a key)."""
        return np.flatnonzero((self._cols["klen"][: self._high] > 0) & ~self._named())

    def key_rows(self) -> npt.NDArray[np.intp]:
        """Each key's row (its newest record), in row order."""
        return np.flatnonzero(self._named())

    def _named(self) -> npt.NDArray[np.bool_]:
        named = np.zeros(self._high, bool)
        for table_h, table_r in self.tables():
            named[table_r[table_h > TOMBSTONE]] = True
        return named

    def column(self, name: str) -> npt.NDArray[Any]:
        """Column ``name`` (a view, valid until the next insert: read it at once)."""
        return self._cols[name]

    def max_seq(self) -> int:
        live = self.rows()
        return int(self._cols["seq"][live].max()) if len(live) else 0

    def columns(self) -> dict[str, npt.NDArray[Any]]:
        """Every row in use, column by column (copies, in row order)."""
        live = self.rows()
        return {name: self._cols[name][live] for name, _, _ in COLUMNS}

    def chunks(self, rows: int = 1 << 16) -> Iterator[dict[str, npt.NDArray[Any]]]:
        """:meth:`columns` in pieces of up to ``rows`` rows (no copy of the whole index at
        once); the rows in use when each piece is taken."""
        for first in range(0, self._high, rows):
            live = np.flatnonzero(self._cols["klen"][first : first + rows]) + first
            if len(live):
                yield {name: self._cols[name][live] for name, _, _ in COLUMNS}

    @classmethod
    def from_columns(
        cls, columns: Columns, digests: list[bytes], *, seed: int | None = None
    ) -> ColdIndex:
        """An index of the rows of ``columns`` (as :meth:`columns` gives them; ``ns`` numbers
        ``digests``), built with numpy alone. A key listed more than once is indexed by its
        highest seq (on a tie, its first listing); the rest are :meth:`shadowed`. Raises
        ``ValueError`` for columns of unequal length, an impossible key length or namespace
        number, or a place listed twice."""
        count = len(columns["klen"])
        index = cls(seed=seed, rows=count + count // 8)
        for digest in digests:
            index.namespace(digest)
        for name, dtype, width in COLUMNS:
            column = np.asarray(columns[name], dtype=dtype)
            if column.shape != ((count, width) if width > 1 else (count,)):
                raise ValueError(f"column {name} has shape {column.shape}, not {count} rows")
            index._cols[name][:count] = column
        c = index._cols
        klen, ns = c["klen"][:count], c["ns"][:count]
        if count and (klen.min() < 1 or klen.max() > MAX_KEY_BYTES):
            raise ValueError("a key length is outside 1 to 32")
        if count and int(ns.max()) >= len(digests):
            raise ValueError("a namespace number names no digest")
        places = (c["segment"][:count].astype(np.uint64) << np.uint64(32)) | c["index"][:count]
        if repeated(places).any():
            raise ValueError("a place is listed twice")
        index._high = index._live = count
        by_segment = np.argsort(c["segment"][:count], kind="stable")
        segments = c["segment"][by_segment].astype(np.int64)
        starts = np.flatnonzero(np.diff(segments, prepend=-1, append=-1))
        for first, end in itertools.pairwise(starts):
            mine = by_segment[first:end]
            index._set_places(int(segments[first]), c["index"][mine], mine + 1)
        hashes = identity_hashes(c["key"][:count], klen, ns, index._seed)
        # Only rows whose hash repeats can share a key: sort those exactly. Per (namespace,
        # key): the highest seq, then the first listed, sorts last and wins.
        suspects = np.flatnonzero(repeated(hashes))
        losers = np.zeros(count, bool)
        order = suspects[by_identity(c, suspects, -suspects, c["seq"][suspects])]
        losers[order[:-1][same_identity(c, order)]] = True
        winners = np.flatnonzero(~losers)
        index._build(hashes[winners], winners.astype(np.uint32), capacity_for(len(winners)))
        return index

    # -- internals -----------------------------------------------------------------------------

    def _alloc_rows(self, rows: int) -> None:
        """Room for ``rows`` rows (never fewer than now). Each column lives in its own private
        anonymous mapping grown with ``mremap`` (:mod:`kvtierd.store.mapped`): a copy into a
        larger array cost about 0.2 s for 400 MB, on the event loop, at 10M rows (68 bytes a
        row). No view of a column is kept outside this class, so none blocks the resize."""
        old_maps, self._cols, self._flat = self._maps, {}, {}
        self._maps = {}
        for name, dtype, width in COLUMNS + _STATE:
            size = rows * width * np.dtype(dtype).itemsize
            mapped = old_maps.get(name)
            mapped = anonymous(size) if mapped is None else resized(mapped, size)
            self._maps[name] = mapped
            column = np.frombuffer(mapped, dtype)
            self._cols[name] = column.reshape(rows, width) if width > 1 else column
        self._flat = {name: _flat(column) for name, column in self._cols.items()}

    def _new_row(self) -> int:
        if len(self._free):
            return self._free.pop()
        if self._high == len(self._cols["klen"]):
            self._alloc_rows(int(self._high * _GROWTH) + 16)
        self._high += 1
        return self._high - 1

    def _set_place(self, segment: int, index: int, value: int) -> None:
        self._set_places(segment, np.array([index]), np.array([value]))

    def _set_places(
        self, segment: int, indices: npt.NDArray[Any], values: npt.NDArray[Any]
    ) -> None:
        while len(self._place) <= segment:
            self._place.append(np.zeros(0, np.uint32))
            self._places.append(_flat(self._place[-1]))
        slots = self._place[segment]
        need = int(indices.max()) + 1
        if need > len(slots):
            grown = np.zeros(max(need, 2 * len(slots)), np.uint32)
            grown[: len(slots)] = slots
            self._place[segment] = slots = grown
            self._places[segment] = _flat(grown)
        slots[indices] = values

    def _hash_of(self, ns: int, klen: int, padded: bytes) -> int:
        """:func:`~kvtierd.store.buckets.identity_hashes` of one key."""
        return hash_of(self._seed, ns, klen, padded)

    def _is(self, row: int, ns: int, klen: int, padded: bytes) -> bool:
        f, at = self._flat, row * MAX_KEY_BYTES
        return (
            f["ns"][row] == ns
            and f["klen"][row] == klen
            and f["key"][at : at + MAX_KEY_BYTES] == padded
        )

    def tables(self) -> Iterator[tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]]]:
        """The bucket tables to look in: the current one, then the one it is leaving."""
        yield self._hash, self._brow
        if self.moving:
            yield self._old_hash, self._old_brow

    def _bucket(
        self,
        table_h: npt.NDArray[np.uint32],
        table_r: npt.NDArray[np.uint32],
        h: int,
        ns: int,
        klen: int,
        padded: bytes,
    ) -> int:
        """The bucket of ``table_h`` naming the key, or -1."""
        mask = len(table_h) - 1
        i = h & mask
        while (found := int(table_h[i])) != EMPTY:
            if found == h and self._is(int(table_r[i]), ns, klen, padded):
                return i
            i = (i + 1) & mask
        return -1

    def _enter(self, row: int, h: int, ns: int, klen: int, padded: bytes) -> None:
        """Make ``row`` its key's row unless the key's row has an equal or higher seq."""
        if self.moving:
            self._move(self._step)
        seq = self._cols["seq"]
        for table_h, table_r in self.tables():
            i = self._bucket(table_h, table_r, h, ns, klen, padded)
            if i >= 0:
                if int(seq[row]) > int(seq[int(table_r[i])]):
                    table_r[i] = row
                return
        self._put(h, row)
        self._keys += 1
        if self._filled > MAX_LOAD * len(self._hash):
            self._grow()

    def _put(self, h: int, row: int) -> None:
        """Bucket ``(h, row)`` in the current table, at the first tombstone or empty bucket
        from its home (its key is in neither table)."""
        table_h, mask = self._hash, len(self._hash) - 1
        i = h & mask
        while (found := int(table_h[i])) > TOMBSTONE:
            i = (i + 1) & mask
        self._filled += found == EMPTY
        table_h[i] = h
        self._brow[i] = row

    def _grow(self) -> None:
        """A fresh table, at least as large, for the current one, which is too full (of keys
        or of tombstones). A small table is rebuilt at once; a larger one stays and is moved
        over by :meth:`_move`, ``_step`` buckets an insert, a step chosen so that the move
        ends before the new table fills: rebuilding 10M keys at once held the event loop 1.3 s
        (0.13 s a million). The new table is a fresh mapping (:func:`~kvtierd.store.mapped.zeros`),
        so its pages cost nothing until the move touches them."""
        if self.moving:  # never, with the step below; kept for safety
            self._move(self.moving)
        capacity = max(len(self._hash), capacity_for(self._keys))
        if len(self._hash) < self._incremental_from:
            live = self._hash > TOMBSTONE
            self._build(self._hash[live], self._brow[live], capacity)
            return
        self._old_hash, self._old_brow = self._hash, self._brow
        self._hash = zeros(capacity, np.uint32)
        self._brow = zeros(capacity, np.uint32)
        self._filled = self._cursor = 0
        # Inserts until the new table is full: every one moved over and one new bucket per
        # insert at most.
        room = MAX_LOAD * capacity - self._keys - 1
        self._step = max(1, math.ceil(len(self._old_hash) / max(1.0, room)))

    def _move(self, buckets: int) -> None:
        """Move the keys of the next ``buckets`` buckets of the table being left to the
        current one, leaving tombstones (the probe sequences of the rest stay whole)."""
        first = self._cursor
        end = min(first + buckets, len(self._old_hash))
        hashes = self._old_hash[first:end]
        rows = self._old_brow[first:end].tolist()
        for k, h in enumerate(hashes.tolist()):
            if h > TOMBSTONE:
                self._put(h, rows[k])
        hashes[hashes > TOMBSTONE] = TOMBSTONE
        self._cursor = end
        if end == len(self._old_hash):
            self._old_hash, self._old_brow = np.zeros(0, np.uint32), np.zeros(0, np.uint32)
            self._cursor = 0

    def _build(
        self, hashes: npt.NDArray[np.uint32], rows: npt.NDArray[np.uint32], capacity: int
    ) -> None:
        """Make a table of ``capacity`` buckets of ``(hash, row)`` entries the current one."""
        self._hash, self._brow = build_table(hashes, rows, capacity)
        self._filled = self._keys = len(hashes)
        self._old_hash, self._old_brow = np.zeros(0, np.uint32), np.zeros(0, np.uint32)
        self._cursor = 0

    def ref_fields(self, row: int) -> tuple[bytes, bytes, int, int, int, int, int, int]:
        """``(digest, key, raw, checksum, seq, flags, segment, index)`` of the record in
        ``row``, read through the columns' memoryviews: what a store's ``BlockRef`` and disk
        slot are made of (on a cold READ's path, one per block), with no
        :class:`RecordHeader` made between."""
        f, digest, key = self._identified(row)
        return (
            digest,
            key,
            f["raw"][row],
            f["checksum"][row],
            f["seq"][row],
            f["flags"][row],
            f["segment"][row],
            f["index"][row],
        )

    def _identified(self, row: int) -> tuple[dict[str, memoryview], bytes, bytes]:
        """The flat columns and ``row``'s namespace digest and key, through memoryviews (what
        :meth:`record` and :meth:`ref_fields` start from); ``ValueError`` for a free row."""
        f = self._flat
        klen = f["klen"][row] if 0 <= row < self._high else 0
        if not klen:
            raise ValueError(f"row {row} holds no record")
        at = row * MAX_KEY_BYTES
        return f, self._digests[f["ns"][row]], f["key"][at : at + klen].tobytes()


def _flat(column: npt.NDArray[Any]) -> memoryview:
    """``column`` as a flat memoryview of native unsigned ints (a key column: of bytes)."""
    raw = column.data.cast("B")
    if column.ndim > 1 or column.itemsize == 1:
        return raw
    return raw.cast({2: "H", 4: "I", 8: "Q"}[column.itemsize])  # type: ignore[call-overload, no-any-return]


def impossible_lengths(
    stored: npt.NDArray[Any], raw: npt.NDArray[Any], flags: npt.NDArray[Any]
) -> npt.NDArray[np.bool_]:
    """Which records' lengths no write made: an empty payload, a block past
    :data:`MAX_RAW_BYTES`, a compressed payload larger than its block, a plain one not the
    block's size. Such a row (a forged or scribbled header, or snapshot) is never indexed: its
    ``raw`` is what a read would allocate in DRAM."""
    stored, raw = stored.astype(np.int64), raw.astype(np.int64)
    plain: npt.NDArray[np.bool_] = (flags & RecordHeader.FLAG_ZSTD) == 0
    wrong: npt.NDArray[np.bool_] = (stored < 1) | (raw > MAX_RAW_BYTES) | (stored > raw)
    wrong |= plain & (stored != raw)
    return wrong
