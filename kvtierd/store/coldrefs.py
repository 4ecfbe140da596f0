"""The NVMe tier's rows as the store sees its blocks: what a Python ``Block`` is made from.

An idle block that only the NVMe tier holds has no ``Block`` (docs/architecture.md, "The index
at scale", step 4): it is a row of the tier's :class:`~kvtierd.store.coldindex.ColdIndex`. The
store's :class:`~kvtierd.store.index.BlockIndex` looks in its dict of live blocks first and asks
this view second, to count a LOOKUP's hits without making anything, or to make a ``Block``
(its :class:`~kvtierd.store.tier.BlockRef` and :class:`~kvtierd.store.segments.DiskSlot`
rebuilt from the row's columns) when a READ, promotion, pool copy or FORGET needs one. A
restart adopts the rows in bulk: per-namespace counts from one ``bincount``, the keys as the
columns they are. Pure: no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator

import numpy as np
import numpy.typing as npt

from kvtierd.store.coldindex import ColdIndex
from kvtierd.store.coldprobe import find_many
from kvtierd.store.records import RecordHeader
from kvtierd.store.refs import BlockRef, Recovered
from kvtierd.store.segments import DiskSlot, SegmentMap

__all__ = ["ColdRows"]

#: Fewer keys than this are looked up one by one: numpy's probe of many keys pays some tens of
#: us per linear-probing step, as many steps as the longest chain among them, where one key's
#: probe in Python is about 2.7 us. Measured on 200K rows (tables three quarters full): 64 keys
#: not stored 165 us one by one against 409 together, 192 keys 502 against 582, 256 keys 656
#: against 625 (keys stored: 176 against 153 at 64, 694 against 471 at 256). It was 8.
_ONE_BY_ONE = 256


class ColdRows:
    """The newest record of each key in ``cold``, by ``(namespace digest, key)``; ``segmap``
    gives the slots. Holds the index the tier has once it has recovered (it is never replaced
    after that)."""

    def __init__(self, cold: ColdIndex, segmap: SegmentMap) -> None:
        self._cold = cold
        self._segmap = segmap

    def contains(self, digest: bytes, key: bytes) -> bool:
        """Whether the tier holds a record of ``key`` in namespace ``digest``."""
        return self._cold.find(digest, key) >= 0

    def contains_many(self, digest: bytes, keys: list[bytes]) -> list[bool]:
        """:meth:`contains` of each of ``keys``: a few one by one, more hashed and probed
        together (:func:`~kvtierd.store.coldprobe.find_many`, numpy's fixed cost paid once)."""
        if len(keys) < _ONE_BY_ONE:
            return [self._cold.find(digest, key) >= 0 for key in keys]
        return (find_many(self._cold, digest, keys) >= 0).tolist()  # type: ignore[no-any-return]

    def find(self, digest: bytes, key: bytes) -> Recovered | None:
        """``key``'s newest record as the ref and slot a ``Block`` holds, or ``None``."""
        row = self._cold.find(digest, key)
        return None if row < 0 else self.made(row)

    def raw_sizes(self, digest: bytes, keys: list[bytes]) -> list[int]:
        """Each of ``keys``' size as committed (its newest record's raw length), -1 for a key
        with no record: what a LIST_KEYS page reports of keys idle on NVMe, probed together as
        :meth:`contains_many` does and gathered from the column, nothing made per key."""
        if len(keys) < _ONE_BY_ONE:
            rows = np.array([self._cold.find(digest, key) for key in keys], np.intp)
        else:
            rows = find_many(self._cold, digest, keys)
        sizes = np.full(len(keys), -1, np.int64)
        found = rows >= 0
        sizes[found] = self._cold.column("raw")[rows[found]]
        return sizes.tolist()

    def stands_for(self, digest: bytes, key: bytes, seq: int, location: Hashable) -> bool:
        """Whether the record of ``seq`` is at ``location`` and is ``key``'s newest: then its
        row may stand for the block (checked on every DRAM eviction of a block written back,
        so by place, no hash: a seq names one commit, and a newer record of a key is written
        only after the key was forgotten, which ends its ``Block``)."""
        if not isinstance(location, DiskSlot):
            return False
        row = self._cold.at(location.segment, location.index)
        return row >= 0 and int(self._cold.column("seq")[row]) == seq

    def made(self, row: int) -> Recovered:
        """The ref and slot of the record in ``row`` (a couple of microseconds: the fields
        read through the columns' memoryviews, a ref, a slot)."""
        digest, key, raw, checksum, seq, flags, segment, index = self._cold.ref_fields(row)
        ref = BlockRef(digest, key, raw, checksum, seq, bool(flags & RecordHeader.FLAG_ZSTD))
        return Recovered(ref, self._segmap.slot(segment, index))

    def counts(self) -> dict[bytes, int]:
        """Keys with a record, by namespace digest (one ``bincount`` over the keys' rows)."""
        rows = self._cold.key_rows()
        numbers = self._cold.column("ns")[rows]
        digests = self._cold.digests
        counts = np.bincount(numbers, minlength=len(digests)).tolist() if len(rows) else []
        return {digests[n]: count for n, count in enumerate(counts) if count}

    def max_seq(self) -> int:
        return self._cold.max_seq()

    def key_columns(self) -> Iterator[tuple[bytes, npt.NDArray[np.uint64], npt.NDArray[np.uint8]]]:
        """Every key with a record, as ``(digest, words, lengths)``, one namespace each: the
        rows' key columns (:meth:`KeyOrder.from_columns <kvtierd.store.keyorder.KeyOrder.
        from_columns>` takes them as they are), gathered after one sort of the rows by
        namespace, no Python step per key: what a restart hands the listing order."""
        digests = self._cold.digests
        rows = self._cold.key_rows()
        numbers = self._cold.column("ns")[rows]
        by_ns = np.argsort(numbers, kind="stable")
        rows, numbers = rows[by_ns], numbers[by_ns].astype(np.int64)
        key, klen = self._cold.column("key"), self._cold.column("klen")
        bounds = np.flatnonzero(np.diff(numbers, prepend=-1, append=-1)).tolist()
        for start, end in itertools.pairwise(bounds):
            piece = rows[start:end]
            yield digests[int(numbers[start])], key[piece], klen[piece]
