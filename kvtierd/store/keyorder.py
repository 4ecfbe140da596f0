"""One namespace's keys in byte order, compactly: what LIST_KEYS pages through.

Pure (no I/O). A ``SortedList`` of the keys cost about 60 bytes a key beside the key's own
``bytes`` object (docs/architecture.md, "The index at scale"); here a key is 33 bytes of a numpy
array, and the collector sees one array per :data:`CHUNK` keys.

*Codes.* A key is held as its *code*: the key zero-padded to :data:`MAX_KEY_BYTES`, then its
length as one byte. Codes compare (as bytes, and as numpy ``S33`` strings, which compare
unsigned) exactly as the keys do: where two padded keys first differ inside both keys, so do
the keys; where one key has ended, its zero padding meets a nonzero byte of the longer key, of
which it is a prefix, and sorts first, as a prefix does; and two keys equal once padded (one is
the other plus zero bytes) are ordered by the length byte, the shorter first. The length byte
is never zero, so numpy, which drops a string's trailing zero bytes, never shortens a code.

*Chunks and the overlay.* The keys stored at the last merge are sorted codes in chunks (numpy
arrays of at most about :data:`CHUNK`), each with a lower bound: chunk ``i`` holds keys of
``[bounds[i], bounds[i + 1])``. Keys added since sit in a small sorted overlay (``_added``, a
``SortedList`` of codes), and chunk keys forgotten since in another (``_removed``): a key is
in one of the three places at most, so a page is a merge of two sorted streams, one filtered.

*Merging, on the event loop without holding it.* ``add`` and ``remove`` run on the daemon's
loop, so the overlay is never folded in all at once (a copy of the whole array: about 0.1 s
at 10M keys). Once the overlay holds :data:`MERGE_AT` codes a *sweep* starts, and each later
``add`` or ``remove`` rebuilds one chunk with the overlay's codes in its range (at most
:data:`CHUNK` of each kind a step, the rest left for the next sweep): a chunk copied two or
three times, a fraction of a millisecond, whatever the namespace's size. A sweep ends after
one step a chunk, long before the overlay doubles.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList  # type: ignore[import-untyped]

from kvtierd.keys import MAX_KEY_BYTES

__all__ = ["CHUNK", "CODE_BYTES", "MERGE_AT", "KeyOrder", "decode", "encode"]

#: Bytes of a key's code: the padded key and its length.
CODE_BYTES = MAX_KEY_BYTES + 1
_CODE = np.dtype(f"S{CODE_BYTES}")
#: Keys a chunk holds at most after a merge step (about 1 MiB of codes).
CHUNK = 1 << 15
#: Overlay codes (added and removed) that start a sweep.
MERGE_AT = 1 << 16
_LENGTHS = [bytes((n,)) for n in range(MAX_KEY_BYTES + 1)]
_PAD = b"\0" * MAX_KEY_BYTES
_BEFORE_ALL = b""  # sorts before every code
_SLICE = 1 << 18  # rows converted at a time by from_columns


def encode(key: bytes) -> bytes:
    """``key``'s code (see the module's docstring); ``ValueError`` unless 1 to 32 bytes."""
    n = len(key)
    if not 0 < n <= MAX_KEY_BYTES:
        raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} bytes, not {n}")
    return bytes(key) + _PAD[n:] + _LENGTHS[n]


def decode(code: bytes) -> bytes:
    """The key a code names."""
    return code[: code[MAX_KEY_BYTES]]


def _after(key: bytes) -> bytes:
    """A code that every code of a key sorting after ``key`` (``b""``: every key) sorts after,
    and no other. A key past 32 bytes is cut there: a key of at most 32 bytes sorts after it
    exactly when it sorts after its first 32 (were it equal to those, it would be a prefix)."""
    return encode(key[:MAX_KEY_BYTES]) if key else _BEFORE_ALL


class KeyOrder:
    """A set of keys listed in byte order from any cursor, at 33 bytes a key."""

    def __init__(self, *, chunk: int = CHUNK, merge_at: int = MERGE_AT) -> None:
        """An empty order. ``chunk`` and ``merge_at`` are for tests (small values exercise the
        sweeps)."""
        if chunk < 1 or merge_at < 1:
            raise ValueError("chunk and merge_at must be positive")
        self._chunk, self._merge_at = chunk, merge_at
        #: Sorted codes, never empty but for a lone chunk; ``_bounds[i]`` is chunk ``i``'s
        #: lower bound (``b""`` for the first), at most its first code.
        self._chunks: list[npt.NDArray[Any]] = [np.empty(0, _CODE)]
        self._bounds: list[bytes] = [_BEFORE_ALL]
        self._in_chunks = 0
        self._added = SortedList()
        self._removed = SortedList()
        #: The next chunk a sweep under way merges (``None``: no sweep).
        self._sweep: int | None = None

    @classmethod
    def from_columns(
        cls,
        words: npt.NDArray[np.uint64],
        klen: npt.NDArray[np.integer],
        *,
        chunk: int = CHUNK,
        merge_at: int = MERGE_AT,
    ) -> KeyOrder:
        """The order of the keys given as columns, as :class:`~kvtierd.store.coldindex.
        ColdIndex` holds them: rows of four little-endian u64 words (the key zero-padded) and
        the lengths; in any order, a key listed twice held once. One numpy sort, no Python step
        per key (what a restart needs). Raises ``ValueError`` for columns of unequal length, a
        length outside 1 to 32, or a nonzero byte past a key's length."""
        words = np.asarray(words)
        klen = np.asarray(klen)
        count = len(klen)
        if words.shape != (count, MAX_KEY_BYTES // 8) or klen.shape != (count,):
            raise ValueError(f"key columns of shapes {words.shape} and {klen.shape} do not match")
        if count and (int(klen.min()) < 1 or int(klen.max()) > MAX_KEY_BYTES):
            raise ValueError(f"a key length is outside 1 to {MAX_KEY_BYTES}")
        codes = np.empty((count, CODE_BYTES), np.uint8)
        past = np.arange(MAX_KEY_BYTES)
        for first in range(0, count, _SLICE):  # slices: no temporary the size of the keys
            key = np.ascontiguousarray(words[first : first + _SLICE], "<u8").view(np.uint8)
            length = klen[first : first + _SLICE]
            if (key[past >= length[:, None]]).any():
                raise ValueError("a key has nonzero bytes past its length")
            codes[first : first + _SLICE, :MAX_KEY_BYTES] = key
            codes[first : first + _SLICE, MAX_KEY_BYTES] = length
        return cls._of_codes(codes.view(_CODE).reshape(count), chunk=chunk, merge_at=merge_at)

    @classmethod
    def of(cls, keys: list[bytes], *, chunk: int = CHUNK, merge_at: int = MERGE_AT) -> KeyOrder:
        """The order of ``keys`` (any order, repeats held once)."""
        codes = np.array([encode(key) for key in keys], _CODE).reshape(len(keys))
        return cls._of_codes(codes, chunk=chunk, merge_at=merge_at)

    @classmethod
    def _of_codes(cls, codes: npt.NDArray[Any], *, chunk: int, merge_at: int) -> KeyOrder:
        order = cls(chunk=chunk, merge_at=merge_at)
        codes.sort()
        if len(codes) > 1:
            codes = codes[np.concatenate(([True], codes[1:] != codes[:-1]))]
        # Copies, so a chunk rebuilt later frees its memory rather than leave the whole array.
        order._chunks = [codes[i : i + chunk].copy() for i in range(0, len(codes), chunk)]
        order._chunks = order._chunks or [np.empty(0, _CODE)]
        order._bounds = [_BEFORE_ALL] + [c[0].tobytes() for c in order._chunks[1:]]
        order._in_chunks = len(codes)
        return order

    def __len__(self) -> int:
        return self._in_chunks - len(self._removed) + len(self._added)

    def __contains__(self, key: bytes) -> bool:
        code = encode(key)
        if code in self._added:
            return True
        if code in self._removed:
            return False
        chunk = self._chunks[bisect_right(self._bounds, code) - 1]
        at = int(np.searchsorted(chunk, code))
        return at < len(chunk) and bool(chunk[at] == code)

    @property
    def overlay(self) -> int:
        """Codes waiting to be merged (added and removed): what a sweep bounds."""
        return len(self._added) + len(self._removed)

    @property
    def sweeping(self) -> bool:
        return self._sweep is not None

    def add(self, key: bytes) -> None:
        """Store ``key``, which must not be stored (the caller's index knows; not checked:
        that would cost a search)."""
        code = encode(key)
        if code in self._removed:
            self._removed.remove(code)
        else:
            self._added.add(code)
        self._step()

    def remove(self, key: bytes) -> None:
        """Forget ``key``, which must be stored (not checked, as for :meth:`add`)."""
        code = encode(key)
        if code in self._added:
            self._added.remove(code)
        else:
            self._removed.add(code)
        self._step()

    def page(self, after: bytes, limit: int) -> tuple[list[bytes], bool]:
        """Up to ``limit`` keys sorting after ``after`` (``b""``: from the first), in byte
        order, and whether more follow; O(log n + limit) (plus the forgotten keys skipped,
        at most the overlay). Paging with each page's last key as the next ``after`` lists
        every key stored throughout exactly once, in order, however the keys change between
        pages; a key stored or forgotten meanwhile is listed or not by where it sorts."""
        start = _after(after)
        added = self._added.irange(minimum=start, inclusive=(False, False))
        found = list(itertools.islice(heapq.merge(self._chunked(start, limit), added), limit + 1))
        return [decode(code) for code in found[:limit]], len(found) > limit

    def _chunked(self, start: bytes, limit: int) -> Iterator[bytes]:
        """The chunks' codes after ``start``, less the removed ones, read ``limit + 1`` at a
        time."""
        removed = self._removed
        i = bisect_right(self._bounds, start) - 1
        at = int(np.searchsorted(self._chunks[i], start, side="right"))
        take = limit + 1
        while i < len(self._chunks):
            chunk = self._chunks[i]
            while at < len(chunk):
                for code in chunk[at : at + take].tolist():
                    if not removed or code not in removed:
                        yield code
                at += take
            i, at = i + 1, 0

    # -- merging ---------------------------------------------------------------------------

    def _step(self) -> None:
        """Start a sweep once the overlay is full; while one is under way, merge one chunk
        (passing over chunks whose range the overlay has no code of)."""
        if self._sweep is None:
            if self.overlay < self._merge_at:
                return
            self._sweep = 0
        while self._sweep is not None and self._sweep < len(self._chunks):
            if self._merge(self._sweep):
                break
        if self._sweep is not None and self._sweep >= len(self._chunks):
            self._sweep = None

    def _merge(self, i: int) -> bool:
        """Fold the overlay's codes in chunk ``i``'s range into it (at most ``chunk`` codes of
        each overlay, the chunk split after the last); set the next chunk to sweep, and say
        whether there was anything to fold."""
        low = self._bounds[i]
        high = self._bounds[i + 1] if i + 1 < len(self._bounds) else None
        added, removed = self._range(self._added, low, high), self._range(self._removed, low, high)
        if added[0] == added[1] and removed[0] == removed[1]:
            self._sweep = i + 1
            return False
        # Cut the range short where either overlay has more than a chunk's worth in it.
        for (first, end), overlay in ((added, self._added), (removed, self._removed)):
            if end - first > self._chunk:
                high = overlay[first + self._chunk]
        if high is not None:
            added, removed = (
                self._range(self._added, low, high),
                self._range(self._removed, low, high),
            )
        chunk = self._chunks[i]
        cut = len(chunk) if high is None else int(np.searchsorted(chunk, high))
        part = chunk[:cut]
        gone = np.array(self._removed[removed[0] : removed[1]], _CODE)
        if len(gone) and len(part):
            at = np.searchsorted(part, gone)
            at = at[(at < len(part)) & (part[np.minimum(at, len(part) - 1)] == gone)]
            part = np.delete(part, at)
            self._in_chunks -= len(at)
        new = np.array(self._added[added[0] : added[1]], _CODE)
        if len(new):
            part = np.insert(part, np.searchsorted(part, new), new)
            self._in_chunks += len(new)
        del self._added[added[0] : added[1]]
        del self._removed[removed[0] : removed[1]]
        # The rest copied, so the old chunk's memory goes now, not when the rest is rebuilt.
        self._replace(i, part, chunk[cut:].copy() if cut else chunk, high)
        return True

    @staticmethod
    def _range(overlay: Any, low: bytes, high: bytes | None) -> tuple[int, int]:
        """The positions in ``overlay`` of its codes in ``[low, high)``."""
        first = overlay.bisect_left(low)
        return first, len(overlay) if high is None else overlay.bisect_left(high)

    def _replace(
        self, i: int, merged: npt.NDArray[Any], rest: npt.NDArray[Any], high: bytes | None
    ) -> None:
        """Put ``merged`` (chunk ``i``'s range up to ``high``, merged) and ``rest`` (the rest
        of the chunk, untouched, bounded below by ``high``) in chunk ``i``'s place, ``merged``
        joined to the chunk before when both fit in one, or cut in even pieces when too
        long; an empty chunk is dropped, the first one's range passing to the next."""
        low = self._bounds[i]
        if i > 0 and len(self._chunks[i - 1]) + len(merged) <= self._chunk:
            i, low = i - 1, self._bounds[i - 1]
            merged = np.concatenate((self._chunks[i], merged))
            del self._chunks[i], self._bounds[i]
        pieces = -(-len(merged) // self._chunk)
        chunks = list(np.array_split(merged, pieces)) if pieces > 1 else [merged]
        bounds = [low] + [c[0].tobytes() for c in chunks[1:]]
        if len(rest):
            chunks.append(rest)
            bounds.append(high if high is not None else rest[0].tobytes())
        keep = [j for j, c in enumerate(chunks) if len(c)]
        chunks, bounds = [chunks[j] for j in keep], [bounds[j] for j in keep]
        self._chunks[i : i + 1] = chunks
        self._bounds[i : i + 1] = bounds
        self._sweep = i + len(chunks) - (1 if len(rest) else 0)
        if not self._chunks:
            self._chunks, self._bounds = [np.empty(0, _CODE)], [_BEFORE_ALL]
        self._bounds[0] = _BEFORE_ALL
