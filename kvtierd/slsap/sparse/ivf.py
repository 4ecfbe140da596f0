"""Clustered posting lists: the sub-linear pool of candidate blocks for a query.

Theory of operation. Per group (one (layer, KV head)), the box centres of the blocks are
clustered by k-means into ``k = 4 sqrt(n)`` clusters (an inverted-file index, as in FAISS's IVF;
finer clusters let a smaller pool hold the answer: at 10K synthetic blocks and a pool of 8x the
budget, 2, 4 and 8 clusters per sqrt(n) held 92, 95 and 98 % of the exact selection). A query
scores each cluster optimistically, ``q.centroid + 0.5 |q|.spread`` per head (``spread`` the
per-dimension standard deviation of the cluster's members: a Quest-like allowance for members
that sit off the centroid in the query's favour); each head's scores are taken relative to its
best cluster and a cluster counts with its best head. The pool is the members of the best
clusters until it holds ``target`` blocks. Cost per query: ``k * head_dim`` for the scores, a
partial sort of the best clusters, plus the pool itself, so it grows as ``sqrt(n)`` with a small
constant.

Members live in one sorted array (by ``group << 32 | cluster``) of slots with an offset table
per (group, cluster) (all groups share it and every lookup runs for all groups at once), plus a
small unsorted delta of recent insertions, merged in when it outgrows ``max(64, n / 8)`` (capped
at 4,096): amortised O(1) copies per insertion. New blocks join their nearest existing
centroid; the owner refits (:meth:`ClusterLists.fit`) as the index grows. Removed slots are
masked at once and purged at the next merge. Slots are small integers owned by
:class:`~.index.SparseIndex`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["ClusterLists", "FitStopped", "take_rows"]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]
T = TypeVar("T", bound=np.generic)
_ELEMENTS = 1 << 23  # bound on temporaries of the distance computations
_SPREAD_WEIGHT = 0.5
_DELTA_MAX = 4096
_PER_SQRT = 4  # clusters per sqrt(n): finer clusters make a smaller pool hold the answer


class FitStopped(Exception):
    """A fit was told to stop (:meth:`ClusterLists.fit`'s ``stop``)."""


def take_rows(values: npt.NDArray[T], columns: I64) -> npt.NDArray[T]:
    """``np.take_along_axis(values, columns, 1)`` for 2-D arrays, in two fast calls."""
    width = values.shape[1]
    offsets = np.arange(0, values.shape[0] * width, width, dtype=np.int64)[:, None]
    return np.take(values.reshape(-1), columns + offsets)


class ClusterLists:
    """k-means posting lists over ``groups`` spaces of dimension ``dim`` (see module docstring)."""

    def __init__(self, groups: int, dim: int, *, seed: int = 0, iterations: int = 5) -> None:
        self.groups, self.dim, self.iterations = groups, dim, iterations
        self._rng = np.random.default_rng(seed)
        self._centroids = np.zeros((groups, 0, dim), dtype=np.float32)
        self._spread = np.zeros((groups, 0, dim), dtype=np.float32)
        self._sizes = np.zeros((groups, 0), dtype=np.int64)
        self._assign = np.zeros((0, groups), dtype=np.int64)
        self._live = np.zeros(0, dtype=bool)
        self._score_t = np.zeros((groups, 2 * dim, 0), dtype=np.float32)
        self._prepared = self._prepare(self._centroids)
        self._keys = np.zeros(0, dtype=np.uint64)
        self._slots = np.zeros(0, dtype=np.int64)
        self._offsets = np.zeros(1, dtype=np.int64)
        self._delta: list[int] = []
        self._count = 0
        self._stale = 0  # removed slots still named by the lists or the delta

    @property
    def fitted(self) -> bool:
        return self._centroids.shape[1] > 0

    def memory_bytes(self) -> int:
        arrays = (
            self._centroids,
            self._spread,
            self._score_t,
            self._prepared[1],
            self._sizes,
            self._assign,
            self._keys,
            self._slots,
            self._offsets,
        )
        return sum(int(a.nbytes) for a in arrays) + int(self._live.nbytes)

    def fit(self, slots: I64, vectors: F32, stop: Callable[[], bool] | None = None) -> None:
        """Cluster ``vectors`` ``[n, groups, dim]`` of ``slots`` afresh and rebuild the lists.

        Raises:
            FitStopped: ``stop()`` said so between two steps (k-means iterations, or slices of
                the distance computations); the lists are then as they were.
        """
        n = len(slots)
        k = max(1, min(n, math.ceil(_PER_SQRT * math.sqrt(n))))
        sample = vectors[self._rng.choice(n, size=min(n, 32 * k), replace=False)]
        centroids = sample[self._rng.choice(len(sample), size=k, replace=False)].transpose(1, 0, 2)
        centroids = np.ascontiguousarray(centroids, dtype=np.float32)
        for _ in range(self.iterations):
            nearest = self._nearest(sample, centroids, stop=stop)
            centroids = self._update(sample, nearest, centroids)
        assign = self._nearest(vectors, centroids, stop=stop)  # [n, groups]
        self._centroids = centroids
        self._prepared = self._prepare(centroids)
        self._spread = self._member_spread(vectors, assign, k)
        stacked = np.concatenate([centroids, _SPREAD_WEIGHT * self._spread], axis=2)
        self._score_t = np.ascontiguousarray(stacked.transpose(0, 2, 1), dtype=np.float32)
        self._live = np.zeros(max(int(slots.max(initial=-1)) + 1, 64), dtype=bool)
        self._assign = np.zeros((len(self._live), self.groups), dtype=np.int64)
        self._sizes = np.zeros((self.groups, k), dtype=np.int64)
        self._keys, self._slots, self._delta, self._count = self._keys[:0], self._slots[:0], [], 0
        self._insert(slots, assign)
        self._merge()

    def add(self, slots: I64, vectors: F32) -> None:
        """Put new ``slots`` with ``vectors`` ``[n, groups, dim]`` into their nearest clusters."""
        if self.fitted and len(slots):
            self._insert(slots, self._nearest(vectors, self._centroids, self._prepared))

    def discard(self, slots: I64) -> None:
        """Forget ``slots`` (ignored for slots never added)."""
        slots = slots[slots < len(self._live)]
        slots = slots[self._live[slots]]
        if len(slots):
            self._live[slots] = False
            self._count -= len(slots)
            self._stale += len(slots)
            np.subtract.at(self._sizes, (np.arange(self.groups), self._assign[slots]), 1)

    def pool(self, queries: F32, target: int) -> tuple[I64, B | None]:
        """Members of each group's best clusters, at least ``target`` per group where the group
        has them: ``(slots, valid)``, both ``[groups, width]``, a group's members in the order of
        their clusters' scores, padded (``valid`` False, slot 0) to the widest group; ``valid`` is
        None when every entry is a live block.

        ``queries`` is ``[groups, heads, 2 * dim]``: the scaled query, then its absolute value
        (the form :meth:`~.index.SparseIndex.select` builds once for its own bound). A cluster's
        score for a head is ``q.centroid + 0.5 |q|.spread``; each head's scores are taken relative
        to its best cluster (softmax normalises each head on its own), and a cluster counts with
        its best head.
        """
        groups, k = self.groups, self._centroids.shape[1]
        score = np.matmul(queries, self._score_t)  # [groups, heads, k]
        score -= score.max(axis=2, keepdims=True)
        best = score.max(axis=1)  # [groups, k]
        # Only the best clusters are needed in order: sort a generous top slice, not all k.
        mean_size = max(1.0, self._count / (groups * k))
        head = min(k, 2 * math.ceil(target / mean_size) + 8)
        if head < k:
            order = np.argpartition(-best, head - 1, axis=1)[:, :head]
            order = take_rows(order, np.argsort(-take_rows(best, order), axis=1))
        else:
            order = np.argsort(-best, axis=1)
        sizes = take_rows(self._sizes, order)
        cum = np.cumsum(sizes, axis=1)
        if head < k and int(cum[:, -1].min()) < target:  # rare: uneven clusters, sort them all
            order = np.argsort(-best, axis=1)
            sizes = np.take_along_axis(self._sizes, order, axis=1)
            cum = np.cumsum(sizes, axis=1)
        taken = (cum - sizes) < target
        g, rank = np.nonzero(taken)
        cluster = order[g, rank]
        flat = g * k + cluster
        lo = self._offsets[flat]
        lens = self._offsets[flat + 1] - lo
        total = int(lens.sum())
        idx = np.repeat(lo - np.cumsum(lens) + lens, lens) + np.arange(total)
        found_g, found_s = np.repeat(g, lens), self._slots[idx]
        counts = np.bincount(found_g, minlength=groups)
        if self._delta:
            d = np.asarray(self._delta, dtype=np.int64)
            chosen = np.zeros((groups, k), dtype=bool)
            chosen[g, cluster] = True
            hit_g, hit_row = np.nonzero(chosen[np.arange(groups), self._assign[d]].T)
            extra = np.bincount(hit_g, minlength=groups)
            found_g = np.concatenate([found_g, hit_g])
            found_s = np.concatenate([found_s, d[hit_row]])
            before = np.cumsum(counts) - counts
            rank_in = np.concatenate(
                [
                    np.arange(total) - before[found_g[:total]],
                    counts[hit_g] + np.arange(len(hit_g)) - (np.cumsum(extra) - extra)[hit_g],
                ]
            )
            counts = counts + extra
        elif groups == 1 or counts.min(initial=0) == counts.max(initial=0):
            # Every group pooled as many: the rows are already in place (no padding).
            slots = found_s.reshape(groups, -1)
            return slots, (self._live[slots] if self._stale else None)
        else:
            rank_in = np.arange(total) - (np.cumsum(counts) - counts)[found_g]
        if groups == 1:
            return found_s[None], (self._live[found_s][None] if self._stale else None)
        slots = np.zeros((groups, int(counts.max(initial=0))), dtype=np.int64)
        valid = np.zeros(slots.shape, dtype=bool)
        slots[found_g, rank_in] = found_s
        valid[found_g, rank_in] = self._live[found_s]
        return slots, valid

    def _insert(self, slots: I64, assign: I64) -> None:
        needed = int(slots.max(initial=-1)) + 1
        if needed > len(self._live):
            cap = max(needed, 2 * len(self._live))
            self._live = np.concatenate([self._live, np.zeros(cap - len(self._live), bool)])
            grown = np.zeros((cap, self.groups), dtype=np.int64)
            grown[: len(self._assign)] = self._assign
            self._assign = grown
        self._assign[slots] = assign
        self._live[slots] = True
        self._count += len(slots)
        self._sizes += self._counts(assign, self._sizes.shape[1])
        self._delta.extend(slots.tolist())
        if len(self._delta) > min(_DELTA_MAX, max(64, self._count // 8)):
            self._merge()

    def _merge(self) -> None:
        fresh = np.asarray([s for s in self._delta if self._live[s]], dtype=np.int64)
        self._delta = []
        self._stale = 0
        old = self._live[self._slots]
        groups = np.arange(self.groups, dtype=np.uint64) << np.uint64(32)
        new_keys = (groups[None, :] | self._assign[fresh].astype(np.uint64)).ravel()
        keys = np.concatenate([self._keys[old], new_keys])
        slots = np.concatenate([self._slots[old], np.repeat(fresh, self.groups)])
        order = np.argsort(keys, kind="stable")
        self._keys, self._slots = keys[order], slots[order]
        k = self._centroids.shape[1]
        flat = (self._keys >> np.uint64(32)).astype(np.int64) * k + (
            self._keys & np.uint64(0xFFFFFFFF)
        ).astype(np.int64)
        self._offsets = np.r_[0, np.cumsum(np.bincount(flat, minlength=self.groups * k))]

    def _nearest(
        self,
        vectors: F32,
        centroids: F32,
        prepared: tuple[F32, F32] | None = None,
        *,
        stop: Callable[[], bool] | None = None,
    ) -> I64:
        """Index ``[n, groups]`` of the nearest centroid (squared Euclidean distance);
        ``prepared``: :meth:`_prepare` of ``centroids``, if kept; ``stop``: asked before each
        slice (:class:`FitStopped`)."""
        n, k = len(vectors), centroids.shape[1]
        out = np.empty((n, self.groups), dtype=np.int64)
        norms, cent_t = prepared or self._prepare(centroids)
        step = max(1, _ELEMENTS // max(1, self.groups * k))
        for lo in range(0, n, step):
            if stop is not None and stop():
                raise FitStopped
            part = np.ascontiguousarray(vectors[lo : lo + step].transpose(1, 0, 2), np.float32)
            dist = norms - 2 * np.matmul(part, cent_t)  # [groups, n, k]
            out[lo : lo + step] = dist.argmin(axis=2).T
        return out

    @staticmethod
    def _prepare(centroids: F32) -> tuple[F32, F32]:
        """Squared norms ``[groups, 1, k]`` and the transposed ``[groups, d, k]`` centroids."""
        norms = np.einsum("gkd,gkd->gk", centroids, centroids)[:, None, :]
        return norms, np.ascontiguousarray(centroids.transpose(0, 2, 1))

    def _cluster_sums(self, vectors: F32, assign: I64, k: int) -> F32:
        """Per (group, cluster): the sum of its members' ``vectors``, ``[groups, k, dim]``: the
        rows sorted by cluster and each cluster's run summed in one ``reduceat``."""
        flat = (np.arange(self.groups)[None, :] * k + assign).ravel()
        order = np.argsort(flat, kind="stable")
        values = np.asarray(vectors, dtype=np.float32).reshape(-1, self.dim)[order]
        counts = np.bincount(flat, minlength=self.groups * k)
        starts = np.cumsum(counts) - counts
        filled = counts > 0
        out = np.zeros((self.groups * k, self.dim), dtype=np.float32)
        out[filled] = np.add.reduceat(values, starts[filled], axis=0)
        return out.reshape(self.groups, k, self.dim)

    def _counts(self, assign: I64, k: int) -> I64:
        flat = (np.arange(self.groups)[None, :] * k + assign).ravel()
        return np.bincount(flat, minlength=self.groups * k).reshape(self.groups, k)

    def _update(self, sample: F32, assign: I64, centroids: F32) -> F32:
        k = centroids.shape[1]
        counts = self._counts(assign, k)
        sums = self._cluster_sums(sample, assign, k)
        filled = counts > 0
        out = centroids.copy()
        out[filled] = sums[filled] / counts[filled][:, None]
        return out

    def _member_spread(self, vectors: F32, assign: I64, k: int) -> F32:
        """Per (group, cluster): the members' standard deviation per dimension, from their
        squared deviations from the cluster's mean (two passes: no cancellation)."""
        c = np.maximum(self._counts(assign, k), 1)[..., None]
        mean = self._cluster_sums(vectors, assign, k) / c
        flat = (np.arange(self.groups)[None, :] * k + assign).ravel()
        deviation = vectors.reshape(-1, self.dim) - mean.reshape(-1, self.dim).take(flat, 0)
        np.square(deviation, out=deviation)
        spread: F32 = np.sqrt(self._cluster_sums(deviation, assign, k) / c).astype(np.float32)
        return spread
