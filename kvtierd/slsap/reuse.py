"""The reuse model: an online-fitted hit density per block class and age.

Theory of operation. Every tracked block belongs to a *class* (how many distinct requests have
named it, how far from the end of its naming request it sits, how long that request was) and
has an *age*: the number of block references the model has observed since the block was last
named. The model learns, per class, the distribution of the age at which a block is named again
(a *reuse*) or is dropped from tracking without one (an *end*, a censored observation).

From these two histograms it derives the *hit density* of a block of class ``c`` at age ``a``
(Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit Density", NSDI 2018): the
expected number of hits per unit of cache space-time the block will earn if kept. Kept how
long? A cache does not keep a block forever: it keeps it until it is read or until it stops
being worth its room. So the density is taken at the best *horizon*: the block stays until it is
reused or reaches age ``h``, whichever comes first, and

    density(c, a) = max over h of  P(reused in (a, h] | survived to a)
                                   / E[residence until reuse or h | survived to a]

over horizons ``h`` at least ``min_horizon`` references beyond ``a`` (the refit's argument: a
horizon shorter than a block's stay once admitted is one the policy cannot act on) or never.
A class read again soon or never (a RAG document's next question, a session's next turn) is
worth a short trial; without horizons its never-reused majority would count as resident
forever. Evicting the lowest density and admitting only blocks denser than the weakest resident
is the space-time optimal greedy rule when reuse times are independent per class.

Ages are bucketed on a log2 scale (``SUB_BUCKETS`` per octave), so the model has no time unit to
tune: the same table covers reuse after ten references and after ten million. Censored ends are
given a residual life equal to the age they reached (the age they survived is the best unbiased
guess of how much longer they would have lived), which keeps blocks near the tracking horizon
from looking immortal. Sparse classes are shrunk towards the pooled distribution of all classes
with a weight of ``prior_events`` pseudo-observations, and histograms decay by ``decay`` at every
refit so the model follows a drifting workload. Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = [
    "AGE_BUCKETS",
    "FREQUENCY_CLASSES",
    "LENGTH_CLASSES",
    "NUM_CLASSES",
    "SUB_BUCKETS",
    "TAIL_CLASSES",
    "ReuseModel",
    "age_bucket",
    "age_bucket_of",
    "block_class",
    "block_class_of",
    "request_block_classes",
]

SUB_BUCKETS = 4
"""Age buckets per doubling of age."""
AGE_BUCKETS = SUB_BUCKETS * 40
"""Buckets cover ages up to 2**40 references."""
FREQUENCY_CLASSES = 5
"""Distinct requests that named the block: 1, 2-3, 4-7, 8-15, 16 or more."""
TAIL_CLASSES = 4
"""Blocks between this one and the end of its request: 0, 1, 2, 3 or more (or unknown)."""
LENGTH_CLASSES = 4
"""Blocks in the naming request: 1-3, 4-15, 16-63, 64 or more (or unknown). Only for blocks named
by one request so far: whether a first-seen block belongs to a long document or a short turn is
informative, but once a block is reused its reuse count says more, and splitting reused blocks
by length only thins their statistics."""
NUM_CLASSES = FREQUENCY_CLASSES * TAIL_CLASSES * LENGTH_CLASSES

_EDGES = np.exp2(np.arange(AGE_BUCKETS + 1, dtype=np.float64) / SUB_BUCKETS) - 1.0
_MIDS = (_EDGES[:-1] + _EDGES[1:]) / 2.0
_TINY = 1e-30
"""Added to every residence, so that a class with nothing left to observe has density 0."""

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def age_bucket(age: npt.ArrayLike) -> IntArray:
    """The log-scale bucket of each age (references since last named); negative ages are 0."""
    a = np.maximum(np.asarray(age, dtype=np.float64), 0.0)
    b = np.floor(np.log2(a + 1.0) * SUB_BUCKETS).astype(np.int64)
    return np.asarray(np.minimum(b, AGE_BUCKETS - 1), dtype=np.int64)


def age_bucket_of(age: float) -> int:
    """:func:`age_bucket` of one age, without numpy overhead."""
    if age <= 0:
        return 0
    return min(int(math.log2(age + 1.0) * SUB_BUCKETS), AGE_BUCKETS - 1)


_FREQ_LUT = np.minimum(
    np.floor(np.log2(np.maximum(np.arange(17), 1))).astype(np.int64), FREQUENCY_CLASSES - 1
)
_LENGTH_LUT = np.minimum(
    np.floor(np.log2(np.maximum(np.arange(65), 1)) / 2).astype(np.int64), LENGTH_CLASSES - 1
)
_LENGTH_LUT[0] = LENGTH_CLASSES - 1


def block_class(count: npt.ArrayLike, tail: npt.ArrayLike, length: npt.ArrayLike) -> IntArray:
    """The class of blocks named by ``count`` distinct requests, ``tail`` blocks before the end
    of a request of ``length`` blocks. ``tail < 0`` or ``length <= 0`` mean unknown."""
    # np.minimum/np.maximum rather than np.clip: the same result without clip's Python-level
    # wrapper, which costs more than the work on the short arrays of one request.
    c = np.asarray(count, dtype=np.int64)
    freq = _FREQ_LUT[np.minimum(np.maximum(c, 1), 16)]
    t = np.asarray(tail, dtype=np.int64)
    tail_c = np.where(t < 0, TAIL_CLASSES - 1, np.minimum(t, TAIL_CLASSES - 1))
    length_a = np.asarray(length, dtype=np.int64)
    len_c = _LENGTH_LUT[np.minimum(np.maximum(length_a, 0), 64)]
    len_c = np.where(c >= 2, LENGTH_CLASSES - 1, len_c)
    return np.asarray((freq * TAIL_CLASSES + tail_c) * LENGTH_CLASSES + len_c, dtype=np.int64)


# block_class of every (count 0-16, known tail 0-3, length 0-64): what the class depends on once
# counts and lengths are clamped to the ranges its lookup tables cover.
_CLASS_TABLE = block_class(
    np.arange(17)[:, None, None], np.arange(TAIL_CLASSES)[None, :, None], np.arange(65)
)


def request_block_classes(counts: npt.ArrayLike, tails: npt.ArrayLike, length: int) -> IntArray:
    """:func:`block_class` of blocks named by one request of ``length`` blocks, with ``counts``
    >= 0 and known ``tails`` (>= 0): one lookup in a precomputed table, where the general
    function takes a dozen numpy calls (a per-request cost)."""
    by_count_and_tail = _CLASS_TABLE[:, :, 0 if length < 0 else 64 if length > 64 else length]
    return np.asarray(
        by_count_and_tail[np.minimum(counts, 16), np.minimum(tails, TAIL_CLASSES - 1)], np.int64
    )


_FREQ_LIST: list[int] = _FREQ_LUT.tolist()
_LENGTH_LIST: list[int] = _LENGTH_LUT.tolist()


def block_class_of(count: int, tail: int, length: int) -> int:
    """:func:`block_class` of one block, without numpy overhead (the per-event path)."""
    freq = _FREQ_LIST[1 if count < 1 else 16 if count > 16 else count]
    tail_c = TAIL_CLASSES - 1 if tail < 0 else min(tail, TAIL_CLASSES - 1)
    if count >= 2:
        len_c = LENGTH_CLASSES - 1
    else:
        len_c = _LENGTH_LIST[0 if length < 0 else 64 if length > 64 else length]
    return (freq * TAIL_CLASSES + tail_c) * LENGTH_CLASSES + len_c


class ReuseModel:
    """Per-class reuse/end histograms and the hit-density table derived from them.

    ``record_reuse`` and ``record_end`` take parallel arrays of classes and ages; ``refit``
    recomputes the table (and ages the histograms); ``density`` and ``reuse_probability`` look
    values up. Before the first refit every density is 1.0, so callers fall back to their tie
    break (recency). Deterministic: the same calls give the same table.
    """

    def __init__(self, *, prior_events: float = 40.0, decay: float = 0.9) -> None:
        if prior_events < 0:
            raise ValueError("prior_events must be >= 0")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.prior_events = prior_events
        self.decay = decay
        self._reuses = np.zeros((NUM_CLASSES, AGE_BUCKETS), dtype=np.float64)
        self._ends = np.zeros((NUM_CLASSES, AGE_BUCKETS), dtype=np.float64)
        self._density = np.ones((NUM_CLASSES, AGE_BUCKETS), dtype=np.float64)
        # The same table as nested lists: one block's lookup is a per-event cost, and list
        # indexing is several times cheaper than a numpy scalar read.
        self._density_rows: list[list[float]] = self._density.tolist()
        self._probability = np.ones((NUM_CLASSES, AGE_BUCKETS), dtype=np.float64)
        self.refits = 0

    def record_reuse(self, classes: npt.ArrayLike, ages: npt.ArrayLike) -> None:
        """Blocks of ``classes`` were named again at ``ages``."""
        self._add(self._reuses, classes, ages)

    def record_reuse_of(self, klass: int, age: float) -> None:
        """:meth:`record_reuse` of one block, without numpy overhead."""
        self._reuses[klass, age_bucket_of(age)] += 1.0

    def record_end(self, classes: npt.ArrayLike, ages: npt.ArrayLike) -> None:
        """Blocks of ``classes`` stopped being tracked at ``ages`` without a reuse (censored)."""
        self._add(self._ends, classes, ages)

    @staticmethod
    def _add(hist: FloatArray, classes: npt.ArrayLike, ages: npt.ArrayLike) -> None:
        flat = np.asarray(classes, dtype=np.int64) * AGE_BUCKETS + age_bucket(ages)
        if flat.size > 256:
            hist += np.bincount(flat, minlength=hist.size).reshape(hist.shape)
        elif flat.size:
            np.add.at(hist.reshape(-1), flat, 1.0)

    def refit(
        self,
        open_classes: npt.ArrayLike = (),
        open_ages: npt.ArrayLike = (),
        *,
        min_horizon: float = 0.0,
    ) -> None:
        """Recompute the density table from the histograms, then decay the histograms.

        ``open_classes``/``open_ages`` describe the blocks tracked now, not yet named again:
        censored at their current age for this fit only (they are still open, so they must not
        accumulate). Without them a class whose blocks are never reused would look perfect
        until its blocks expire from tracking. ``min_horizon`` (references, >= 0) is the
        shortest residence a density may assume (module docstring).
        """
        if not min_horizon >= 0:  # NaN too
            raise ValueError("min_horizon must be >= 0")
        ends = self._ends.copy()
        self._add(ends, open_classes, open_ages)
        if self._reuses.sum() + ends.sum() <= 0:
            return
        r, e = _shrink(self._reuses, ends, self.prior_events)
        # A class with no observations of its own has the shape of its (frequency, tail)
        # parent, bit for bit, like its empty siblings (most classes always: length splits only
        # blocks named once), and a density does not depend on scale: each shape is fitted once.
        own = self._reuses.any(axis=1) | ends.any(axis=1)
        classes = np.arange(NUM_CLASSES)
        shape = np.where(own, classes, NUM_CLASSES + classes // LENGTH_CLASSES)
        _, first, inverse = np.unique(shape, return_index=True, return_inverse=True)
        density, probability = _horizon_density(r[first], e[first], min_horizon)
        self._density, self._probability = density[inverse], probability[inverse]
        self._density_rows = self._density.tolist()
        self._reuses *= self.decay
        self._ends *= self.decay
        self.refits += 1

    def density(self, classes: npt.ArrayLike, ages: npt.ArrayLike) -> FloatArray:
        """Expected hits per reference of cache residence for each (class, age)."""
        return np.asarray(
            self._density[np.asarray(classes, dtype=np.int64), age_bucket(ages)], np.float64
        )

    def density_of(self, klass: int, age: float) -> float:
        """:meth:`density` of one block, without numpy overhead."""
        if age <= 0:
            return self._density_rows[klass][0]
        bucket = int(math.log2(age + 1.0) * SUB_BUCKETS)
        return self._density_rows[klass][bucket if bucket < AGE_BUCKETS else AGE_BUCKETS - 1]

    def reuse_probability(self, classes: npt.ArrayLike, ages: npt.ArrayLike) -> FloatArray:
        """P(named again | tracked and unnamed up to ``ages``) for each (class, age)."""
        return np.asarray(
            self._probability[np.asarray(classes, dtype=np.int64), age_bucket(ages)], np.float64
        )

    def observations(self) -> float:
        """Decayed number of reuse and end observations behind the current histograms."""
        return float(self._reuses.sum() + self._ends.sum())


def _shrink(reuses: FloatArray, ends: FloatArray, weight: float) -> tuple[FloatArray, FloatArray]:
    """Histograms shrunk along the class hierarchy (all blocks, then frequency, then frequency
    and tail, then the full class): each level adds ``weight`` pseudo-observations shaped like
    its parent, so a sparse class speaks with its parent's voice until it has data of its own."""
    shape = (FREQUENCY_CLASSES, TAIL_CLASSES, LENGTH_CLASSES, AGE_BUCKETS)
    r, e = reuses.reshape(shape), ends.reshape(shape)
    parent_r = r.sum(axis=(0, 1, 2), keepdims=True)
    parent_e = e.sum(axis=(0, 1, 2), keepdims=True)
    for axes in ((1, 2), (2,), ()):
        level_r = r.sum(axis=axes, keepdims=True) if axes else r
        level_e = e.sum(axis=axes, keepdims=True) if axes else e
        parent_n = parent_r.sum(axis=-1, keepdims=True) + parent_e.sum(axis=-1, keepdims=True)
        scale = np.where(parent_n > 0, weight / np.maximum(parent_n, 1e-300), 0.0)
        parent_r = level_r + scale * parent_r
        parent_e = level_e + scale * parent_e
    return (
        np.asarray(parent_r.reshape(reuses.shape), np.float64),
        np.asarray(parent_e.reshape(ends.shape), np.float64),
    )


def _horizon_density(
    reuses: FloatArray, ends: FloatArray, min_horizon: float
) -> tuple[FloatArray, FloatArray]:
    """Hit density and reuse probability per (class, age bucket) (module docstring).

    A block of class ``c`` at age bucket ``a`` kept until it is reused or reaches the end of
    bucket ``h`` earns ``hits(a, h)`` hits in ``life(a, h)`` references of residence; its density
    is the best ratio over the horizons that end at least ``min_horizon`` references after its
    age, and the last bucket (never). Both are differences of running sums over ages,
    ``hits = Q[h] - P[a]`` and ``life = X[h] - Y[a]``, so the table is one broadcast over
    (class, age, horizon).
    """
    # An end (tracking stopped without a reuse) at age b is given a residual life of b: as an
    # event it sits one octave later.
    shifted = np.zeros_like(ends)
    shifted[:, SUB_BUCKETS:] = ends[:, :-SUB_BUCKETS]
    shifted[:, -1] += ends[:, -SUB_BUCKETS:].sum(axis=1)
    events = reuses + shifted
    used = np.flatnonzero(events.any(axis=0))
    width = int(used[-1]) + 1 if used.size else 1
    r, n = reuses[:, :width], events[:, :width]
    mids = _MIDS[:width]
    hits_to = np.cumsum(r, axis=1)  # reuses at or below each bucket
    events_to = np.cumsum(n, axis=1)
    mass_to = np.cumsum(n * (mids + 1.0), axis=1)
    total = events_to[:, -1:]
    hits_before, events_before = hits_to - r, events_to - n
    mass_before = mass_to - n * (mids + 1.0)
    ends_at = _EDGES[1 : width + 1]  # the age at which a horizon ends, per bucket
    # hits(a, h) = q[h] - p[a]; life(a, h) = x[h] - y[a]
    q, p = hits_to, hits_before
    x = mass_to + (total - events_to) * (ends_at + 1.0)
    y = mass_before + mids * (total - events_before)
    # Rounding can leave a difference of running sums a hair below its true value, which is
    # never below zero for hits, nor below the hits for a residence (each hit is at least one
    # reference of it): clamp both, so a density is in [0, 1] whatever the magnitudes. Horizons
    # a block at an age cannot use get an infinite residence; _TINY keeps 0 / 0 at 0.
    buckets = np.arange(width)
    unreachable = (ends_at[None, :] < mids[:, None] + min_horizon) | (
        buckets[None, :] < buckets[:, None]
    )
    unreachable[:, -1] = False  # never
    ratio = q[:, None, :] - p[:, :, None]
    np.maximum(ratio, 0.0, out=ratio)
    life = x[:, None, :] - y[:, :, None]
    np.maximum(life, ratio, out=life)
    life += np.where(unreachable, np.inf, _TINY)
    ratio /= life
    density = np.zeros(reuses.shape)
    density[:, :width] = ratio.max(axis=2)
    probability = np.zeros(reuses.shape)
    alive = total - events_before
    np.divide(hits_to[:, -1:] - hits_before, alive, out=probability[:, :width], where=alive > 0)
    return density, probability
