"""The cold index's bucket hash and the whole-table work done with numpy.

Pure (no I/O, no state). :class:`~kvtierd.store.coldindex.ColdIndex` keeps its records as rows
and finds a key's row through an open-addressing table of ``(hash, row)`` buckets; what is here
is what needs no row: the keyed hash of ``(namespace, key)`` for one key and for millions at
once (the two must agree bit for bit), the table's size for a number of keys, the table built
in one numpy pass (a restart's millions of keys without a Python step per key), and the sorts
that tell which rows share a key. Kept apart from the index so that each module has one
purpose: the index's rows and their upkeep there, the arithmetic of keys here.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtierd.keys import MAX_KEY_BYTES

__all__ = [
    "EMPTY",
    "MAX_LOAD",
    "TOMBSTONE",
    "WORDS",
    "build_table",
    "by_identity",
    "capacity_for",
    "hash_of",
    "identity_hashes",
    "repeated",
    "same_identity",
]

#: Hash values with a meaning of their own: a hash that lands on them is moved to 2 or 3.
EMPTY, TOMBSTONE = 0, 1
#: The most a table may be filled (keys and tombstones) before it grows.
MAX_LOAD = 0.7
#: A zero-padded key as little-endian u64 words.
WORDS = struct.Struct(f"<{MAX_KEY_BYTES // 8}Q")
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(z: int) -> int:
    z ^= z >> 30
    z = (z * _C1) & _M64
    z ^= z >> 27
    z = (z * _C2) & _M64
    return z ^ (z >> 31)


def _mix_all(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(_C1)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(_C2)
    return z ^ (z >> np.uint64(31))


def hash_of(seed: int, ns: int, klen: int, padded: bytes) -> int:
    """:func:`identity_hashes` of one key (``padded``: zero-padded to 32 bytes)."""
    h = seed ^ (ns << 8 | klen)
    for word in WORDS.unpack(padded):
        h = _mix(h ^ word)
    h &= _M32
    return h if h > TOMBSTONE else h + 2


def identity_hashes(
    key: npt.NDArray[np.uint64],
    klen: npt.NDArray[np.integer],
    ns: npt.NDArray[np.integer],
    seed: int,
) -> npt.NDArray[np.uint32]:
    """The bucket hash of many ``(namespace, key)`` at once (keys as rows of four words):
    what :func:`hash_of` gives for one. The low 32 bits of a 64-bit mix: a bucket is 8 bytes
    (hash and row) instead of 12, and 32 bits still tell keys apart far beyond any table's
    size (a hit is confirmed on the row's key anyway)."""
    h = np.uint64(seed) ^ ((ns.astype(np.uint64) << np.uint64(8)) | klen.astype(np.uint64))
    for w in range(MAX_KEY_BYTES // 8):
        h = _mix_all(h ^ key[:, w])
    low = h.astype(np.uint32)
    return np.where(low > TOMBSTONE, low, low + np.uint32(2))


def capacity_for(keys: int) -> int:
    """Buckets for ``keys``: the least power of two they fill at most 0.6 of (room for some
    more before :data:`MAX_LOAD` asks for a rebuild)."""
    capacity = 16
    while keys > 0.6 * capacity:
        capacity *= 2
    return capacity


def build_table(
    hashes: npt.NDArray[np.uint32], rows: npt.NDArray[np.uint32], capacity: int
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
    """A table of ``capacity`` buckets holding the ``(hash, row)`` entries, built at once: in
    order of their home bucket, each goes to its home or right after the one before it,
    whichever is later (what inserting them one by one with linear probing gives); the few
    pushed past the end wrap to the front one by one."""
    table_h = np.zeros(capacity, np.uint32)
    table_r = np.zeros(capacity, np.uint32)
    count = len(hashes)
    if count:
        home = (hashes.astype(np.int64)) & (capacity - 1)
        order = np.argsort(home, kind="stable")
        steps = np.arange(count, dtype=np.int64)
        spot = steps + np.maximum.accumulate(home[order] - steps)
        inside = spot < capacity
        table_h[spot[inside]] = hashes[order[inside]]
        table_r[spot[inside]] = rows[order[inside]]
        i = 0
        for k in order[~inside]:
            while table_h[i] != EMPTY:
                i += 1
            table_h[i], table_r[i] = hashes[k], rows[k]
    return table_h, table_r


def repeated(values: npt.NDArray[np.unsignedinteger]) -> npt.NDArray[np.bool_]:
    """Which of ``values`` occur more than once (one sort; a search only when some do)."""
    ordered = np.sort(values)
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    if not len(twice):
        return np.zeros(len(values), bool)
    return np.isin(values, twice)


def by_identity(
    c: Mapping[str, npt.NDArray[Any]], rows: npt.NDArray[np.intp], *last: npt.NDArray[Any]
) -> Any:
    """The order of ``rows`` by ``(namespace, key length, key)``, then by ``last`` (the last
    of them most significant among those)."""
    words = c["key"][rows]
    return np.lexsort((*last, c["klen"][rows], *words.T[::-1], c["ns"][rows]))


def same_identity(
    c: Mapping[str, npt.NDArray[Any]], order: npt.NDArray[np.intp]
) -> npt.NDArray[np.bool_]:
    """For rows in ``order``: whether each but the last has the key of the one after it."""
    ns, klen, words = c["ns"][order], c["klen"][order], c["key"][order]
    same = (ns[1:] == ns[:-1]) & (klen[1:] == klen[:-1])
    return same & (words[1:] == words[:-1]).all(axis=1)  # type: ignore[no-any-return]
