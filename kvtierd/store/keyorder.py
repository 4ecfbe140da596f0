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

*Layers.* The keys stored at the last merge are sorted codes in chunks (numpy arrays of at
most about :data:`CHUNK`), each with a lower bound: chunk ``i`` holds codes of ``[bounds[i],
bounds[i + 1])``. Above them lie two overlays, each a pair of sorted sets: codes added, and
codes of the layers below forgotten. The *top* overlay (``SortedList``s) takes every change;
the *frozen* one is the top overlay as it was when the sweep under way
began, being folded into the chunks. The keys are ``((chunks - frozen removed) | frozen
added) - removed | added``: an add of a key forgotten in the same layer takes it out of the
removed set, else goes in the added set, and a remove likewise, so each layer's added codes
are absent below it and its removed codes present. A page merges the layers in that order,
from each only the codes up to where the first full source ends.

*Merging, on the event loop without holding it.* ``add`` and ``remove`` run on the daemon's
loop, so the overlay is never folded in all at once (a copy of the whole array: about 0.1 s
at 10M keys). Once the top overlay holds :data:`MERGE_AT` codes it is frozen (a fresh one
takes the changes) and a *sweep* starts: each later ``add`` or ``remove`` rebuilds one chunk
with the frozen codes in its range (at most :data:`STEP` of each kind a step; the chunk is cut
there and its rest merged next), a chunk copied two or three times, a fraction of a
millisecond whatever the namespace's size. The sweep consumes the frozen sets from the front
(codes below the chunk it is at are folded already), so nothing is deleted from them one by
one (a ``SortedList`` deletes a slice a code at a time, about 5 us each); it ends after
about one step a chunk, long before the top overlay fills again.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from typing import Any

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList  # type: ignore[import-untyped]

from kvtierd.keys import MAX_KEY_BYTES

__all__ = ["CHUNK", "CODE_BYTES", "MERGE_AT", "STEP", "KeyOrder", "decode", "encode"]

#: Bytes of a key's code: the padded key and its length.
CODE_BYTES = MAX_KEY_BYTES + 1
_CODE = np.dtype(f"S{CODE_BYTES}")
#: Keys a chunk holds at most after a merge step (about 0.5 MiB of codes).
CHUNK = 1 << 14
#: Overlay codes (added and removed) that start a sweep.
MERGE_AT = 1 << 16
#: Overlay codes of each kind a merge step folds in at most.
STEP = 1 << 11
_LENGTHS = [bytes((n,)) for n in range(MAX_KEY_BYTES + 1)]
_PAD = b"\0" * MAX_KEY_BYTES
_BEFORE_ALL = b""  # sorts before every code
_SLICE = 1 << 18  # rows converted at a time by from_columns
_NONE = np.empty(0, _CODE)


def encode(key: bytes) -> bytes:
    """``key``'s code (see the module's docstring); ``ValueError`` unless 1 to 32 bytes."""
    n = len(key)
    if not 0 < n <= MAX_KEY_BYTES:
        raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} bytes, not {n}")
    return bytes(key) + _PAD[n:] + _LENGTHS[n]


def decode(code: bytes) -> bytes:
    """The key a code names."""
    return code[: code[MAX_KEY_BYTES]]


def _decode_all(codes: npt.NDArray[Any]) -> list[bytes]:
    """The keys of ``codes``, with no Python step per key but for keys ending in a zero byte:
    numpy's ``S`` strings drop trailing zero bytes, the padding's and a key's own alike."""
    if not len(codes):
        return []
    rows = codes.view(np.uint8).reshape(len(codes), CODE_BYTES)
    klen = rows[:, MAX_KEY_BYTES]
    longest = int(klen.max())
    padded = np.ascontiguousarray(rows[:, :longest]).view(f"S{longest}")
    keys: list[bytes] = padded.reshape(len(codes)).tolist()
    for i in np.flatnonzero(rows[np.arange(len(rows)), klen.astype(np.intp) - 1] == 0).tolist():
        keys[i] = rows[i, : klen[i]].tobytes()
    return keys


def _after(key: bytes) -> bytes:
    """A code that every code of a key sorting after ``key`` (``b""``: every key) sorts after,
    and no other. A key past 32 bytes is cut there: a key of at most 32 bytes sorts after it
    exactly when it sorts after its first 32 (were it equal to those, it would be a prefix)."""
    return encode(key[:MAX_KEY_BYTES]) if key else _BEFORE_ALL


class KeyOrder:
    """A set of keys listed in byte order from any cursor, at 33 bytes a key."""

    def __init__(self, *, chunk: int = CHUNK, merge_at: int = MERGE_AT, step: int = STEP) -> None:
        """An empty order. ``chunk``, ``merge_at`` and ``step`` are for tests and benchmarks
        (small values exercise the sweeps)."""
        if chunk < 1 or merge_at < 1 or step < 1:
            raise ValueError("chunk, merge_at and step must be positive")
        self._chunk, self._merge_at, self._step_codes = chunk, merge_at, step
        #: Sorted codes, never empty but for a lone chunk; ``_bounds[i]`` is chunk ``i``'s
        #: lower bound (``b""`` for the first), at most its first code.
        self._chunks: list[npt.NDArray[Any]] = [np.empty(0, _CODE)]
        self._bounds: list[bytes] = [_BEFORE_ALL]
        self._in_chunks = 0
        #: The top overlay.
        self._added = SortedList()
        self._removed = SortedList()
        #: The frozen overlay (the top one's ``SortedList``s as they were), folded in up to
        #: ``_frozen_at`` (added, removed).
        self._frozen_added = SortedList()
        self._frozen_removed = SortedList()
        self._frozen_at = (0, 0)
        #: The next chunk the sweep under way merges (``None``: no sweep).
        self._sweep: int | None = None

    @classmethod
    def from_columns(
        cls,
        words: npt.NDArray[np.uint64],
        klen: npt.NDArray[np.integer],
        *,
        chunk: int = CHUNK,
        merge_at: int = MERGE_AT,
        step: int = STEP,
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
        as_codes = codes.view(_CODE).reshape(count)
        return cls._of_codes(as_codes, chunk=chunk, merge_at=merge_at, step=step)

    @classmethod
    def of(
        cls, keys: list[bytes], *, chunk: int = CHUNK, merge_at: int = MERGE_AT, step: int = STEP
    ) -> KeyOrder:
        """The order of ``keys`` (any order, repeats held once)."""
        codes = np.array([encode(key) for key in keys], _CODE).reshape(len(keys))
        return cls._of_codes(codes, chunk=chunk, merge_at=merge_at, step=step)

    @classmethod
    def _of_codes(
        cls, codes: npt.NDArray[Any], *, chunk: int, merge_at: int, step: int
    ) -> KeyOrder:
        order = cls(chunk=chunk, merge_at=merge_at, step=step)
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
        added, removed = self._frozen_at
        frozen = len(self._frozen_added) - added - (len(self._frozen_removed) - removed)
        return self._in_chunks + frozen + len(self._added) - len(self._removed)

    def __contains__(self, key: bytes) -> bool:
        code = encode(key)
        if code in self._added:
            return True
        if code in self._removed:
            return False
        added, removed = self._frozen_at
        if _holds(self._frozen_added, code, added):
            return True
        if _holds(self._frozen_removed, code, removed):
            return False
        chunk = self._chunks[bisect_right(self._bounds, code) - 1]
        at = int(np.searchsorted(chunk, code))
        return at < len(chunk) and bool(chunk[at] == code)

    @property
    def overlay(self) -> int:
        """Codes of the top overlay (added and removed): what starts a sweep."""
        return len(self._added) + len(self._removed)

    @property
    def sweeping(self) -> bool:
        return self._sweep is not None

    def add(self, key: bytes) -> None:
        """Store ``key``, which must not be stored (the caller's index knows; not checked:
        that would cost a search)."""
        self._change(encode(key), self._added, self._removed)

    def remove(self, key: bytes) -> None:
        """Forget ``key``, which must be stored (not checked, as for :meth:`add`)."""
        self._change(encode(key), self._removed, self._added)

    def _change(self, code: bytes, into: Any, undone: Any) -> None:
        """Put ``code`` in one set of the top overlay, or take it out of the other, which
        held it when the change undoes one made since the overlay began."""
        if code in undone:
            undone.remove(code)
        else:
            into.add(code)
        self._step()

    def page(self, after: bytes, limit: int) -> tuple[list[bytes], bool]:
        """Up to ``limit`` keys sorting after ``after`` (``b""``: from the first), in byte
        order, and whether more follow; O(log n + limit) (plus the forgotten keys skipped,
        at most the overlays). Paging with each page's last key as the next ``after`` lists
        every key stored throughout exactly once, in order, however the keys change between
        pages; a key stored or forgotten meanwhile is listed or not by where it sorts."""
        start = _after(after)
        want = limit + 1
        found: list[npt.NDArray[Any]] = []
        got = 0
        while True:
            codes, last = self._window(start, want)
            found.append(codes)
            got += len(codes)
            if got >= want or last is None:
                break
            start = last
        codes = np.concatenate(found)[:want] if len(found) > 1 else found[0][:want]
        return _decode_all(codes[:limit]), len(codes) > limit

    def _window(self, start: bytes, want: int) -> tuple[npt.NDArray[Any], bytes | None]:
        """The codes stored in ``(start, last]``, where ``last`` (``None``: the end) is where
        the first source holding ``want`` codes after ``start`` ends, so that every source is
        read whole up to it: each layer's added codes merged in, its removed ones taken out."""
        stored = self._from_chunks(start, want)
        last = stored[-1].tobytes() if len(stored) == want else None
        added, removed = self._frozen_at
        frozen = (
            _slice(self._frozen_added, start, last, want, added),
            _slice(self._frozen_removed, start, last, None, removed),
        )
        top = (
            _irange(self._added, start, last, want),
            _irange(self._removed, start, last, None),
        )
        for more, _ in (frozen, top):
            if len(more) == want and (last is None or more[-1] < last):
                last = more[-1]
        codes = stored
        for more, gone in (frozen, top):
            codes = _merged(_without(codes, gone, last), more, last)
        return codes, last

    def _from_chunks(self, start: bytes, want: int) -> npt.NDArray[Any]:
        """Up to ``want`` of the chunks' codes after ``start``."""
        i = bisect_right(self._bounds, start) - 1
        at = int(np.searchsorted(self._chunks[i], start, side="right"))
        parts: list[npt.NDArray[Any]] = []
        got = 0
        while got < want and i < len(self._chunks):
            piece = self._chunks[i][at : at + want - got]
            parts.append(piece)
            got += len(piece)
            i, at = i + 1, 0
        return np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else _NONE

    # -- merging ---------------------------------------------------------------------------

    def _step(self) -> None:
        """Start a sweep once the top overlay is full (freezing it); while one is under way,
        merge one chunk (passing over chunks whose range the frozen overlay has nothing of)."""
        if self._sweep is None:
            if self.overlay < self._merge_at:
                return
            self._frozen_added, self._frozen_removed = self._added, self._removed
            self._frozen_at = (0, 0)
            self._added, self._removed = SortedList(), SortedList()
            self._sweep = 0
        while self._sweep is not None and self._sweep < len(self._chunks):
            if self._merge(self._sweep):
                break
        if self._sweep is not None and self._sweep >= len(self._chunks):
            self._sweep = None
            self._frozen_added, self._frozen_removed = SortedList(), SortedList()
            self._frozen_at = (0, 0)

    def _merge(self, i: int) -> bool:
        """Fold the frozen codes in chunk ``i``'s range into it (at most ``step`` of each kind,
        the chunk cut after the last), set the chunk the sweep goes on with, and say whether
        there was anything to fold. Every frozen code below the range is folded already."""
        high = self._bounds[i + 1] if i + 1 < len(self._bounds) else None
        first_added, first_removed = self._frozen_at
        lists = (self._frozen_added, self._frozen_removed)
        ends = [
            _below(codes, high, first) for codes, first in zip(lists, self._frozen_at, strict=True)
        ]
        if ends == [first_added, first_removed]:
            self._sweep = i + 1
            return False
        for codes, first, end in zip(lists, self._frozen_at, ends, strict=True):
            if end - first > self._step_codes:  # cut the range short
                cut_at = codes[first + self._step_codes]
                high = cut_at if high is None else min(high, cut_at)
        end_added, end_removed = (
            _below(c, high, f) for c, f in zip(lists, self._frozen_at, strict=True)
        )
        chunk = self._chunks[i]
        cut = len(chunk) if high is None else int(np.searchsorted(chunk, high))
        part = chunk[:cut]
        gone = np.array(self._frozen_removed[first_removed:end_removed], _CODE)
        if len(gone) and len(part):
            at = np.searchsorted(part, gone)
            at = at[(at < len(part)) & (part[np.minimum(at, len(part) - 1)] == gone)]
            part = np.delete(part, at)
            self._in_chunks -= len(at)
        new = np.array(self._frozen_added[first_added:end_added], _CODE)
        if len(new):
            part = np.insert(part, np.searchsorted(part, new), new)
            self._in_chunks += len(new)
        self._frozen_at = (end_added, end_removed)
        # The rest copied, so the old chunk's memory goes now, not when the rest is rebuilt.
        self._replace(i, part, chunk[cut:].copy() if cut else chunk, high)
        # Go on with the chunk whose range holds what is left (the end when nothing is).
        self._sweep = len(self._chunks) if high is None else bisect_right(self._bounds, high) - 1
        return True

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
        self._chunks[i : i + 1] = [chunks[j] for j in keep]
        self._bounds[i : i + 1] = [bounds[j] for j in keep]
        if not self._chunks:
            self._chunks, self._bounds = [np.empty(0, _CODE)], [_BEFORE_ALL]
        self._bounds[0] = _BEFORE_ALL


# The frozen overlay's helpers: ``codes`` is a ``SortedList`` of which ``codes[:first]`` are
# folded into the chunks already.


def _holds(codes: Any, code: bytes, first: int) -> bool:
    at = codes.bisect_left(code)
    return first <= at < len(codes) and bool(codes[at] == code)


def _below(codes: Any, high: bytes | None, first: int) -> int:
    """The end of the codes from ``first`` on that sort before ``high`` (``None``: all)."""
    return len(codes) if high is None else max(first, codes.bisect_left(high))


def _slice(
    codes: Any, start: bytes, last: bytes | None, most: int | None, first: int
) -> npt.NDArray[Any]:
    """Up to ``most`` (``None``: all) of ``codes[first:]`` in ``(start, last]``."""
    begin = max(first, codes.bisect_right(start))
    end = len(codes) if last is None else max(begin, codes.bisect_right(last))
    if most is not None:
        end = min(end, begin + most)
    return np.array(codes[begin:end], _CODE) if end > begin else _NONE


def _irange(codes: Any, start: bytes, last: bytes | None, most: int | None) -> npt.NDArray[Any]:
    """:func:`_slice` of a ``SortedList``."""
    if not codes:
        return _NONE
    found = codes.irange(start, last, inclusive=(False, True))
    return np.array(list(itertools.islice(found, most)), _CODE).reshape(-1)


def _without(
    codes: npt.NDArray[Any], gone: npt.NDArray[Any], last: bytes | None
) -> npt.NDArray[Any]:
    """``codes`` (those up to ``last``) less those in ``gone``."""
    if last is not None:
        codes = codes[: int(np.searchsorted(codes, last, side="right"))]
    if not len(gone) or not len(codes):
        return codes
    at = np.minimum(np.searchsorted(codes, gone), len(codes) - 1)
    keep = np.ones(len(codes), bool)
    keep[at[codes[at] == gone]] = False
    kept: npt.NDArray[Any] = codes[keep]
    return kept


def _merged(
    codes: npt.NDArray[Any], more: npt.NDArray[Any], last: bytes | None
) -> npt.NDArray[Any]:
    """Two sorted sets of codes as one (``more``'s up to ``last``)."""
    if last is not None and len(more):
        more = more[: int(np.searchsorted(more, last, side="right"))]
    if not len(more):
        return codes
    return np.insert(codes, np.searchsorted(codes, more), more)
