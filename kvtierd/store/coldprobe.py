"""Many keys looked up in a :class:`~kvtierd.store.coldindex.ColdIndex` at once, with numpy.

:meth:`ColdIndex.find <kvtierd.store.coldindex.ColdIndex.find>` of one key costs a few
microseconds of Python (the keyed hash is four mixes of 64-bit words, then a probe), against
0.03 us for the dict probe of a live block. An ALLOC or LOOKUP of thousands of keys not live
(new keys, or blocks idle on NVMe) would pay that per key on the event loop, so they are
hashed together (:func:`~kvtierd.store.coldindex.identity_hashes`) and probed together: each
step of linear probing is one gather over the keys still unresolved, a key resolved when its
bucket is empty (absent) or holds its hash and a row with its full key (present). Pure.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.store.coldindex import ColdIndex, identity_hashes

__all__ = ["find_many"]

_EMPTY = 0


def find_many(index: ColdIndex, digest: bytes, keys: list[bytes]) -> npt.NDArray[np.int64]:
    """The row of each of ``keys``' newest record in namespace ``digest``, -1 where none:
    what :meth:`ColdIndex.find` gives key by key."""
    rows = np.full(len(keys), -1, np.int64)
    ns = index.number(digest)
    if ns is None or not keys:
        return rows
    lengths = np.fromiter(map(len, keys), np.int64, len(keys))
    valid = (lengths > 0) & (lengths <= MAX_KEY_BYTES)
    if not valid.all():  # no such key is stored: look up the others
        inside = np.flatnonzero(valid)
        rows[inside] = find_many(index, digest, [keys[i] for i in inside.tolist()])
        return rows
    words = np.frombuffer(b"".join(key.ljust(MAX_KEY_BYTES, b"\0") for key in keys), "<u8").reshape(
        len(keys), MAX_KEY_BYTES // 8
    )
    klen = lengths.astype(np.uint8)
    hashes = identity_hashes(words, klen, np.full(len(keys), ns, np.uint16), index.seed)
    key, row_klen, row_ns = (index.column(name) for name in ("key", "klen", "ns"))
    todo = np.arange(len(keys))
    for table_h, table_r in index.tables():  # a key is in one of them: look in the next for misses
        mask = len(table_h) - 1
        pending, at = todo, hashes[todo].astype(np.intp) & mask
        while len(pending):
            found = table_h[at]
            same = np.flatnonzero(found == hashes[pending])
            candidates = table_r[at[same]].astype(np.intp)
            theirs = pending[same]
            hit = (
                (row_ns[candidates] == ns)
                & (row_klen[candidates] == klen[theirs])
                & (key[candidates] == words[theirs]).all(axis=1)
            )
            rows[theirs[hit]] = candidates[hit]
            done = found == _EMPTY
            done[same[hit]] = True
            pending, at = pending[~done], (at[~done] + 1) & mask
        todo = todo[rows[todo] < 0]
    return rows
