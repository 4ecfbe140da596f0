"""A multi-table SimHash forest: candidate blocks for a query in time that grows as ``log N``.

Theory of operation. Each of ``tables`` tables hashes a vector to a 32-bit SimHash code (the
signs of 32 random Gaussian projections); two vectors at angle ``theta`` agree on each bit with
probability ``1 - theta / pi``, so the longer the common prefix of two codes, the closer the
vectors. Entries are kept per table as one sorted ``uint64`` array of ``group << 32 | code``
(a group is one (layer, KV head) of the model: all groups share the array and every lookup runs
for all groups at once). In sorted order, the entries nearest a query's code are those sharing
its longest prefixes (LSH Forest, Bawa et al., WWW 2005), so a lookup is one ``searchsorted`` per
(group, query head, table) and a window of ``window`` entries around that position: a multi-probe
of the query's bucket and its neighbours whose size adapts itself to ``N`` (no bit count to tune).

Insertions go to a small unsorted *delta* that is matched by prefix length against the level
the window reached in the sorted array, and is merged into the sorted arrays when it outgrows
``max(64, live / 8)`` entries (capped at ``delta_max``): amortised ``O(1)`` copies per insertion.
Removals mark the slot dead; dead entries are filtered out of every answer and purged when they
are a quarter of the sorted entries. Slots are small integers owned by the caller
(:class:`~.index.SparseIndex`); a slot must not be re-added while it is still present.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["SimHashForest"]

U32 = npt.NDArray[np.uint32]
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
_BITS = 32
_CHUNK = 16384


def _prefix_len(a: npt.NDArray[np.unsignedinteger], b: npt.NDArray[np.unsignedinteger]) -> I64:
    """Length of the common most-significant-bit prefix of 32-bit codes ``a`` and ``b``."""
    x = (a.astype(np.uint64) ^ b.astype(np.uint64)).astype(np.float64)
    return (_BITS - np.frexp(x)[1]).astype(np.int64)


def _spans(starts: I64, ends: I64) -> I64:
    """Concatenation of ``arange(s, e)`` for each pair, without a Python loop."""
    lens = np.maximum(ends - starts, 0)
    total = int(lens.sum())
    offsets = np.repeat(np.cumsum(lens) - lens, lens)
    return np.asarray(np.repeat(starts, lens) + (np.arange(total) - offsets), dtype=np.int64)


class SimHashForest:
    """Multi-table SimHash over ``groups`` vector spaces of dimension ``dim``.

    Args:
        groups: independent spaces (one per (layer, KV head)); entries and queries name theirs.
        dim: length of the hashed vectors.
        tables: independent hash tables; more tables find more true neighbours at more cost.
        delta_max: largest unsorted delta before a merge.
        seed: seed of the random projections (fixed, so replays are deterministic).
    """

    def __init__(
        self,
        groups: int,
        dim: int,
        *,
        tables: int = 8,
        sketch_words: int = 32,
        delta_max: int = 4096,
        seed: int = 0,
    ) -> None:
        if min(groups, dim, tables, delta_max) <= 0 or sketch_words < tables:
            raise ValueError("sizes must be positive and sketch_words >= tables")
        self.groups, self.dim, self.tables, self.delta_max = groups, dim, tables, delta_max
        self.words = sketch_words
        rng = np.random.default_rng(seed)
        self._proj = rng.standard_normal((dim, sketch_words * _BITS)).astype(np.float32)
        self._live = np.zeros(0, dtype=bool)
        self._codes = np.zeros((0, groups, sketch_words), dtype=np.uint32)
        self._main_keys: list[U64] = [np.zeros(0, np.uint64) for _ in range(tables)]
        self._main_slots: list[I64] = [np.zeros(0, np.int64) for _ in range(tables)]
        self._group_lo = np.zeros((tables, groups), dtype=np.int64)
        self._group_hi = np.zeros((tables, groups), dtype=np.int64)
        self._delta: list[int] = []
        self._main_dead = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def memory_bytes(self) -> int:
        """Bytes held by the sketches and the sorted tables."""
        tables = sum(
            k.nbytes + s.nbytes for k, s in zip(self._main_keys, self._main_slots, strict=True)
        )
        return self._codes.nbytes + self._live.nbytes + tables

    def hash(self, vectors: F32) -> U32:
        """SimHash sketches ``[..., sketch_words]`` (uint32) of vectors ``[..., dim]``; the first
        ``tables`` words are the codes of the sorted tables. Large inputs go in chunks to bound
        the temporary bit matrix."""
        flat = vectors.reshape(-1, self.dim).astype(np.float32, copy=False)
        out = np.empty((len(flat), self.words), dtype=np.uint32)
        weights = np.array([1 << 24, 1 << 16, 1 << 8, 1], dtype=np.uint32)
        for lo in range(0, len(flat), _CHUNK):
            bits = (flat[lo : lo + _CHUNK] @ self._proj) > 0
            packed = np.packbits(bits.reshape(-1, self.words, 4, 8), axis=-1)[..., 0]
            out[lo : lo + _CHUNK] = packed.astype(np.uint32) @ weights
        return out.reshape(*vectors.shape[:-1], self.words)

    def add(self, slots: I64, codes: U32) -> None:
        """Add entries ``slots`` with their sketches ``[n, groups, sketch_words]``
        (from :meth:`hash`)."""
        slots = np.asarray(slots, dtype=np.int64)
        self._grow(int(slots.max(initial=-1)) + 1)
        if self._live[slots].any():
            raise ValueError("slot added twice")
        self._codes[slots] = codes
        self._live[slots] = True
        self._count += len(slots)
        self._delta.extend(slots.tolist())
        if len(self._delta) > min(self.delta_max, max(64, self._count // 8)):
            self._merge()

    def discard(self, slots: I64) -> None:
        """Forget entries ``slots`` (each must be present)."""
        slots = np.asarray(slots, dtype=np.int64)
        if not self._live[slots].all():
            raise KeyError("slot not present")
        self._live[slots] = False
        self._count -= len(slots)
        gone = set(slots.tolist())
        kept = [s for s in self._delta if s not in gone]
        self._main_dead += len(slots) - (len(self._delta) - len(kept))
        self._delta = kept
        if self._main_dead * 4 > len(self._main_keys[0]) // self.groups:
            self.rebuild()

    def load(self, slots: I64, codes: U32) -> None:
        """Replace every entry with ``slots`` and their sketches ``[n, groups, words]``, sorted
        at once (a bulk build, or a rehash after the hashed vectors were re-centred)."""
        slots = np.asarray(slots, dtype=np.int64)
        self._live[:] = False
        self._grow(int(slots.max(initial=-1)) + 1)
        self._codes[slots] = codes
        self._live[slots] = True
        self._count = len(slots)
        self._delta = slots.tolist()
        self.rebuild()

    def rebuild(self) -> None:
        """Sort every live entry into the main arrays, dropping dead ones."""
        self._main_keys = [np.zeros(0, np.uint64) for _ in range(self.tables)]
        self._main_slots = [np.zeros(0, np.int64) for _ in range(self.tables)]
        self._delta = np.flatnonzero(self._live).tolist()
        self._main_dead = 0
        self._merge()

    def candidates(self, query_codes: U32, window: int) -> tuple[I64, I64]:
        """Entries near each query code, deduplicated: ``(groups, slots)`` int64 arrays.

        Args:
            query_codes: ``[groups, heads, sketch_words]`` sketches of each group's query heads.
            window: sorted entries taken around each (group, head, table) position.
        """
        g_idx = np.arange(self.groups, dtype=np.uint64)[:, None]
        found: list[I64] = []
        d_slots = np.asarray(self._delta, dtype=np.int64)
        d_hit = np.zeros((len(d_slots), self.groups), dtype=bool)
        d_codes = self._codes[d_slots]
        for t in range(self.tables):
            keys, qc = self._main_keys[t], query_codes[:, :, t]
            pos = np.searchsorted(keys, (g_idx << np.uint64(32)) | qc.astype(np.uint64))
            lo, hi = self._group_lo[t][:, None], self._group_hi[t][:, None]
            start = np.clip(pos - window // 2, lo, np.maximum(lo, hi - window))
            end = np.minimum(start + window, hi)
            idx = _spans(start.ravel(), end.ravel())
            groups = np.repeat(np.arange(self.groups), query_codes.shape[1])
            found.append(
                np.repeat(groups, (end - start).ravel()) * len(self._live)
                + self._main_slots[t][idx]
            )
            if len(d_slots):
                level = self._window_level(keys, qc, start, end)
                match = _prefix_len(d_codes[:, :, t, None], qc[None])
                d_hit |= (match >= level[None]).any(axis=2)
        d_pairs = np.nonzero(d_hit)
        found.append(d_pairs[1] * len(self._live) + d_slots[d_pairs[0]])
        flat = np.unique(np.concatenate(found))
        groups_out, slots_out = np.divmod(flat, len(self._live))
        keep = self._live[slots_out]
        return groups_out[keep].astype(np.int64), slots_out[keep].astype(np.int64)

    def _window_level(self, keys: U64, qc: U32, start: I64, end: I64) -> I64:
        """The shortest common prefix between a query code and its window's two ends: delta
        entries that share at least that much are as close as what the window took."""
        if len(keys) == 0:
            return np.zeros_like(start)
        code = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        first = code[np.minimum(start, len(keys) - 1)]
        last = code[np.maximum(end - 1, 0)]
        level = np.minimum(_prefix_len(first, qc), _prefix_len(last, qc))
        return np.where(end > start, level, 0)

    def shortlist(self, query_codes: U32, groups: I64, slots: I64, keep: int) -> tuple[I64, I64]:
        """The ``keep`` entries per group whose sketches are closest (most equal bits to the
        best-matching query head) among ``(groups, slots)``, which must be sorted by group.

        With ``sketch_words * 32`` bits the Hamming similarity follows the angle far more
        finely than a table's prefix, so it orders a coarse pool cheaply before exact scoring.
        """
        if len(slots) == 0:
            return groups, slots
        diff = self._codes[slots, groups][:, None, :] ^ query_codes[groups]  # [n, heads, words]
        similar = -np.bitwise_count(diff).sum(axis=-1, dtype=np.int64).min(axis=1)
        order = np.lexsort((-similar, groups))
        starts = np.searchsorted(groups[order], groups[order], side="left")
        rank = np.arange(len(order)) - starts
        chosen = np.sort(order[rank < keep])
        return groups[chosen], slots[chosen]

    def _merge(self) -> None:
        slots = np.asarray([s for s in self._delta if self._live[s]], dtype=np.int64)
        self._delta = []
        groups = np.arange(self.groups, dtype=np.uint64) << np.uint64(32)
        bounds = groups[:, None] + np.array([0, 1 << 32], dtype=np.uint64)
        for t in range(self.tables):
            keys = (groups[None] | self._codes[slots][:, :, t].astype(np.uint64)).ravel()
            order = np.argsort(keys, kind="stable")
            new_keys, new_slots = keys[order], np.repeat(slots, self.groups)[order]
            main_keys, main_slots = self._main_keys[t], self._main_slots[t]
            if self._main_dead:
                live = self._live[main_slots]
                main_keys, main_slots = main_keys[live], main_slots[live]
            at = np.searchsorted(main_keys, new_keys)
            self._main_keys[t] = np.insert(main_keys, at, new_keys)
            self._main_slots[t] = np.insert(main_slots, at, new_slots)
            edges = np.searchsorted(self._main_keys[t], bounds.ravel()).reshape(self.groups, 2)
            self._group_lo[t], self._group_hi[t] = edges[:, 0], edges[:, 1]
        self._main_dead = 0

    def _grow(self, needed: int) -> None:
        if needed <= len(self._live):
            return
        cap = max(needed, 2 * len(self._live), 64)
        live = np.zeros(cap, dtype=bool)
        live[: len(self._live)] = self._live
        codes = np.zeros((cap, self.groups, self.words), dtype=np.uint32)
        codes[: len(self._codes)] = self._codes
        self._live, self._codes = live, codes
