"""The sparse-attention block index of one sequence: insert, remove, select, predict.

Theory of operation. A decode step's query attends mostly to a few blocks. For each (layer, KV
head), called a *group*, the index keeps every block's box as float32 centre ``c`` and half-width
``r`` (from the min and max keys, see :mod:`.summary`), its mean key, and, once the sequence is
long, its cluster (:mod:`.ivf`). Selecting for a query runs in four stages, all vectorised over
the groups, on ``[groups, heads, candidates]`` arrays (reductions run along the last axis):

1. **Forced**: the first ``sink_blocks`` positions (attention sinks) and the newest
   ``recent_blocks`` positions are always selected, ahead of everything else.
2. **Pool** (sub-linear): the members of the query's best k-means clusters, about
   ``pool_factor`` times the free budget per group; a sequence of at most ``pool_min_blocks``
   blocks (or of at most that pool) pools every block.
3. **Shortlist**: one matrix product of the pooled boxes with the query heads gives
   ``q.c + shortlist_radius * |q|.r`` (Quest's bound is ``q.c + |q|.r``; half the width term
   follows the box estimate of attention mass more closely); the ``candidate_factor`` times the
   free budget with the largest group mass of that score are kept.
4. **Re-rank**: candidates are scored from their boxes (``score``, default the box estimate of
   attention mass: Quest's bound plus :func:`~.scoring.box_spread`), the query heads of a group
   are combined by summing their softmax shares, and the best ``budget - forced`` are kept per
   group, followed by a reserve of the next best for :meth:`SparseIndex.predict_next`.

The shortlist replaced 1,024-bit SimHash sketches of the centred centres: on the pool, an exact
product costs less than gathering and popcounting the sketches, and it ranks better, so half as
many candidates get the expensive score (``docs/slsap-sparse.md``). Boxes are float32 because
numpy widens float16 at ~1.5 ns an element, more than the product itself.

Block ids are the caller's integers (the daemon's block handles); positions are block indices in
the sequence (position 0 holds the first ``block_tokens`` tokens). Everything is deterministic:
the same calls give the same selections.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvtierd.errors import BlockNotFoundError, InvalidRequestError
from kvtierd.slsap.sparse.config import RerankScore, Selection, SparseConfig
from kvtierd.slsap.sparse.ivf import ClusterLists, take_rows
from kvtierd.slsap.sparse.scoring import box_spread
from kvtierd.slsap.sparse.summary import BlockSummary

__all__ = ["SparseIndex"]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]
_MIN_RADIUS = np.float32(1e-6)
_MIN_QUERY = np.float32(1e-6)


class SparseIndex:
    """Block summaries of one sequence and their clusters (see the module docstring).

    Not thread-safe: the owner serialises calls (the daemon runs one per namespace session in a
    worker thread).
    """

    def __init__(self, config: SparseConfig) -> None:
        self.config = config
        self._groups = len(config.layers) * config.kv_heads
        self._dim = config.head_dim
        # Per slot and group: the box's centre then its half-width, float32, the form both
        # bounds read directly (one matrix product, no conversion); the mean key apart.
        self._boxes = np.zeros((0, self._groups, 2 * self._dim), dtype=np.float32)
        self._means = np.zeros((0, self._groups, self._dim), dtype=config.summary_dtype)
        self._ids = np.zeros(0, dtype=np.int64)
        self._pos = np.zeros(0, dtype=np.int64)
        self._live = np.zeros(0, dtype=bool)
        self._slot_of: dict[int, int] = {}
        self._slot_at: dict[int, int] = {}
        self._next = 0
        self._newest = -1
        self._fitted_at = 0
        #: Bumped whenever live blocks change slots (:meth:`_compact`): a fit made on a
        #: snapshot of older slots is dropped (:meth:`fit_later`).
        self._generation = 0
        self._forced: I64 | None = None
        self._clusters = ClusterLists(self._groups, self._dim, seed=config.seed)
        self._group_col = np.arange(self._groups, dtype=np.int64)[:, None]

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._slot_of

    def memory_bytes(self) -> int:
        """Bytes held by the arrays of the index (the id and position dicts not counted)."""
        arrays = (self._boxes, self._means, self._ids, self._pos, self._live)
        return sum(int(a.nbytes) for a in arrays) + self._clusters.memory_bytes()

    def insert(self, block_id: int, position: int, summary: BlockSummary) -> None:
        """Add a block at sequence ``position`` with the summary of all the model's layers.

        Raises:
            InvalidRequestError: the id or the position is already indexed, or the summary's
                shape does not match the configuration.
        """
        boxes = summary.stacked()
        if boxes.shape[1:] != (self.config.kv_heads, 3, self._dim):
            raise InvalidRequestError(f"summary shape {summary.shape} does not match {self.config}")
        if max(self.config.layers) >= boxes.shape[0]:
            raise InvalidRequestError(f"summary has {boxes.shape[0]} layers, config needs more")
        self.insert_many([block_id], [position], boxes[None, list(self.config.layers)])

    def insert_many(
        self,
        block_ids: npt.ArrayLike,
        positions: npt.ArrayLike,
        boxes: npt.ArrayLike,
        *,
        fit: bool = True,
    ) -> None:
        """Add many blocks at once.

        Args:
            block_ids, positions: ``[n]`` integers, unique and not yet indexed.
            boxes: ``[n, len(config.layers), kv_heads, 3, head_dim]``, the stacked summaries of
                the *indexed* layers only, in ``config.layers`` order.
            fit: cluster afresh now if the index has outgrown its clusters; ``False`` leaves
                that to the owner (:meth:`fit_due`, :meth:`fit_later`), and selections score
                every block until then.

        Raises:
            InvalidRequestError: a duplicate id or position, or a shape mismatch.
        """
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        arr = np.asarray(boxes, dtype=np.float32)
        want = (len(ids), len(self.config.layers), self.config.kv_heads, 3, self._dim)
        if arr.shape != want or len(pos) != len(ids):
            raise InvalidRequestError(f"boxes {arr.shape} / positions {pos.shape}, want {want}")
        fresh = set(ids.tolist())
        if len(fresh) < len(ids) or any(i in self._slot_of for i in fresh):
            raise InvalidRequestError("block id already indexed")
        if len(set(pos.tolist())) < len(pos) or any(int(p) in self._slot_at for p in pos):
            raise InvalidRequestError("position already indexed")
        slots = np.arange(self._next, self._next + len(ids), dtype=np.int64)
        self._grow(self._next + len(ids))
        new = slice(self._next, self._next + len(ids))  # the slots, as a view's range
        self._next += len(ids)
        arr = arr.reshape(len(ids), self._groups, 3, self._dim)
        centre = self._boxes[new, :, : self._dim]
        np.add(arr[:, :, 1], arr[:, :, 0], out=centre)
        centre *= np.float32(0.5)
        # Half-widths are kept >= _MIN_RADIUS (a key's bound moves by |q| 1e-6 at most): then
        # the box estimate needs no guard against a zero width (see scoring.box_spread).
        radius = self._boxes[new, :, self._dim :]
        np.subtract(arr[:, :, 1], arr[:, :, 0], out=radius)
        radius *= np.float32(0.5)
        np.maximum(radius, _MIN_RADIUS, out=radius)
        self._means[new], self._ids[new], self._pos[new] = arr[:, :, 2], ids, pos
        self._live[new] = True
        self._forced = None
        self._slot_of.update(zip(ids.tolist(), slots.tolist(), strict=True))
        self._slot_at.update(zip(pos.tolist(), slots.tolist(), strict=True))
        self._newest = max(self._newest, int(pos.max()))
        self._clusters.add(slots, centre)
        if fit:
            self._maybe_refit()

    def remove(self, block_id: int) -> None:
        """Forget a block.

        Raises:
            BlockNotFoundError: the block is not indexed.
        """
        slot = self._slot_of.pop(block_id, None)
        if slot is None:
            raise BlockNotFoundError(f"block {block_id} is not in the sparse index")
        del self._slot_at[int(self._pos[slot])]
        self._live[slot] = False
        self._forced = None
        self._clusters.discard(np.array([slot], dtype=np.int64))
        if self._next - len(self) > max(64, len(self)):
            self._compact()
            self._fitted_at = 0
            self._maybe_refit()

    def forced(self) -> I64:
        """Ids always selected: the sink positions ``0..sink_blocks-1``, then the recent window,
        positions ``newest - recent_blocks + 1 .. newest``, newest first (absent ones skipped)."""
        return self._ids[self._forced_slots()]

    def _forced_slots(self) -> I64:
        """Slots of :meth:`forced`, kept until the next insert or removal."""
        if self._forced is not None:
            return self._forced
        cfg = self.config
        slots: list[int] = []
        if self._slot_at:
            if self._newest not in self._slot_at:
                self._newest = max(self._slot_at)
            newest = self._newest
            window = range(newest, max(newest - cfg.recent_blocks, cfg.sink_blocks - 1), -1)
            positions = [*range(cfg.sink_blocks), *window]
            slots = [self._slot_at[p] for p in positions if p in self._slot_at]
        self._forced = np.asarray(slots, dtype=np.int64)
        return self._forced

    def select(
        self,
        queries: F32,
        budget_blocks: int,
        *,
        exhaustive: bool = False,
        score: RerankScore | None = None,
    ) -> Selection:
        """Rank the blocks the current decode step will attend to, per (layer, KV head).

        Args:
            queries: float32 post-RoPE queries ``[len(config.layers), q_heads, head_dim]`` for
                the current step, or ``[len(config.layers), q_heads, steps, head_dim]`` for
                several steps that share one selection; rows follow ``config.layers``.
            budget_blocks: blocks to keep per (layer, KV head), forced blocks included.
            exhaustive: score every block (the full-scan reference) instead of candidates.
            score: override ``config.score`` (the evaluation's baselines).

        Raises:
            InvalidRequestError: wrong query shape or a budget below 1.
        """
        q = self._group_queries(queries)
        if budget_blocks < 1:
            raise InvalidRequestError(f"budget_blocks must be >= 1, got {budget_blocks}")
        cfg, groups = self.config, self._groups
        forced_slots = self._forced_slots()[:budget_blocks]
        forced = self._ids[forced_slots]
        free = budget_blocks - len(forced)
        reserve = math.ceil(cfg.reserve_factor * free)
        chosen = np.full((groups, budget_blocks), -1, dtype=np.int64)
        chosen[:, : len(forced)] = forced
        spare = np.full((groups, reserve), -1, dtype=np.int64)
        if free <= 0 or len(self) <= len(forced):
            return Selection(chosen, spare, cfg.layers, cfg.kv_heads, 0)
        q = q * np.float32(1 / math.sqrt(self._dim))  # logits in units of q.k / sqrt(d)
        q_abs = np.abs(q) + _MIN_QUERY
        slots, valid = self._candidates(q, q_abs, free, exhaustive)  # [groups, width]
        excluded = np.zeros(self._next, dtype=bool)
        excluded[forced_slots] = True
        valid = ~excluded[slots] if valid is None else valid & ~excluded[slots]
        flat = slots * groups + self._group_col  # rows of the [slots * groups, 2d] box table
        table = self._boxes.reshape(-1, 2 * self._dim)
        keep = math.ceil(cfg.candidate_factor * free)
        if not exhaustive and slots.shape[1] > keep:
            # Shortlist: one product with every pooled box, q.c + w |q|.r (w = shortlist_radius),
            # ranked by its group mass; only the best ``keep`` get the full score.
            weights = np.concatenate([q, np.float32(cfg.shortlist_radius) * q_abs], axis=2)
            short = _heads_major(np.matmul(table.take(flat, 0), weights.transpose(0, 2, 1)))
            top = np.argpartition(-_group_mass(short, valid), keep - 1, axis=1)[:, :keep]
            flat, valid = take_rows(flat, top), take_rows(valid, top)
        boxes = table.take(flat, 0)  # [groups, candidates, 2d]: centre, half-width
        score = score or cfg.score
        if score is RerankScore.MEAN_KEY:
            means = self._means.reshape(-1, self._dim).take(flat, 0).astype(np.float32)
            logits = _heads_major(np.matmul(means, q.transpose(0, 2, 1)))
        else:
            weights = np.concatenate([q, q_abs], axis=2)
            logits = _heads_major(np.matmul(boxes, weights.transpose(0, 2, 1)))  # Quest's bound
            if score is RerankScore.BOX_MASS:
                logits += box_spread(q_abs, boxes[:, :, self._dim :])
        mass = _group_mass(logits, valid)
        want = min(free + reserve, mass.shape[1])
        if want < mass.shape[1]:
            top = np.argpartition(-mass, want - 1, axis=1)[:, :want]
            mass, flat = take_rows(mass, top), take_rows(flat, top)
        order = np.argsort(-mass, axis=1, kind="stable")
        ids = self._ids[take_rows(flat, order) // groups]
        ids[take_rows(mass, order) < 0] = -1
        head = min(free, want)
        chosen[:, len(forced) : len(forced) + head] = ids[:, :head]
        spare[:, : want - head] = ids[:, head:]
        return Selection(chosen, spare, cfg.layers, cfg.kv_heads, int(valid.sum()))

    def predict_next(self, selection: Selection) -> I64:
        """Blocks to have on their way for the next step, per group: ``[groups, budget +
        reserve]`` ids (-1 padded), the current selection followed by its reserve, since
        consecutive decode steps select mostly the same blocks."""
        return np.concatenate([selection.block_ids, selection.reserve_ids], axis=1)

    def _group_queries(self, queries: F32) -> F32:
        cfg = self.config
        q = np.asarray(queries, dtype=np.float32)
        if q.ndim == 3:
            q = q[:, :, None, :]
        if q.ndim != 4 or q.shape[:2] != (len(cfg.layers), cfg.q_heads) or q.shape[3] != self._dim:
            raise InvalidRequestError(
                f"queries must be float32 [{len(cfg.layers)}, {cfg.q_heads}, (steps,) "
                f"{self._dim}], got {np.shape(queries)}"
            )
        per_group = cfg.q_heads // cfg.kv_heads
        return q.reshape(self._groups, per_group * q.shape[2], self._dim)

    def _candidates(self, q: F32, q_abs: F32, free: int, exhaustive: bool) -> tuple[I64, B | None]:
        """The pool: ``(slots, valid)`` ``[groups, width]`` (``valid`` None: all valid)."""
        count = len(self)
        target = math.ceil(self.config.pool_factor * free)
        dense = count <= max(target, self.config.pool_min_blocks) or not self._clusters.fitted
        if exhaustive or dense:
            live = (
                np.arange(count, dtype=np.int64)
                if count == self._next
                else np.flatnonzero(self._live[: self._next]).astype(np.int64)
            )
            return np.broadcast_to(live, (self._groups, count)), None
        return self._clusters.pool(np.concatenate([q, q_abs], axis=2), target)

    def fit_due(self) -> bool:
        """Whether the index has outgrown its clusters: past ``pool_min_blocks`` and never
        clustered, or grown 4x since."""
        n = len(self)
        return n > self.config.pool_min_blocks and not (self._fitted_at and n < 4 * self._fitted_at)

    def fit_later(self) -> Callable[[Callable[[], bool]], Callable[[], None]]:
        """The clustering :meth:`_maybe_refit` does, split so that its cost need not hold the
        index: returns ``work(stop)``, which may run in any thread while the owner goes on using
        the index (it raises :class:`~.ivf.FitStopped` soon after ``stop()`` turns true), and
        which returns ``install``, to be called where the owner's other calls are
        serialised. ``install`` takes the new clusters, with the blocks inserted meanwhile added
        to them and those removed left out, unless live blocks changed slots meanwhile (a
        compaction): then it drops them, and :meth:`fit_due` still says so."""
        self._compact()
        n, generation = self._next, self._generation
        vectors = self._boxes[:n, :, : self._dim]  # rows below n move only in a compaction
        slots = np.arange(n, dtype=np.int64)

        def work(stop: Callable[[], bool]) -> Callable[[], None]:
            clusters = ClusterLists(self._groups, self._dim, seed=self.config.seed)
            clusters.fit(slots, vectors, stop)

            def install() -> None:
                if self._generation != generation:
                    return
                clusters.discard(np.flatnonzero(~self._live[:n]).astype(np.int64))
                newer = n + np.flatnonzero(self._live[n : self._next]).astype(np.int64)
                clusters.add(newer, self._boxes[newer, :, : self._dim])
                self._clusters = clusters
                self._fitted_at = n

            return install

        return work

    def _compact(self) -> None:
        """Move the live blocks to slots ``0..n-1`` (slots of removed blocks are not reused
        until then, so no stale cluster entry can name a new block)."""
        if self._next == len(self):  # nothing removed: the live blocks fill 0..n-1 already
            return
        self._generation += 1
        live = np.flatnonzero(self._live[: self._next]).astype(np.int64)
        n = len(live)
        self._boxes[:n], self._means[:n] = self._boxes[live], self._means[live]
        self._ids[:n], self._pos[:n] = self._ids[live], self._pos[live]
        self._live[:] = False
        self._live[:n] = True
        self._next = n
        self._forced = None
        self._slot_of = dict(zip(self._ids[:n].tolist(), range(n), strict=True))
        self._slot_at = dict(zip(self._pos[:n].tolist(), range(n), strict=True))

    def _maybe_refit(self) -> None:
        """Cluster afresh once the sequence outgrows ``pool_min_blocks``, then each time it has
        grown 4x (amortised O(sqrt n) per insert): :meth:`fit_later`'s work and installation,
        at once."""
        if self.fit_due():
            self.fit_later()(_never)()

    def _grow(self, needed: int) -> None:
        if needed <= len(self._ids):
            return
        cap = max(needed, 2 * len(self._ids), 64)
        for name in ("_boxes", "_means", "_ids", "_pos", "_live"):
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)


def _never() -> bool:
    """A fit in place is never told to stop."""
    return False


def _heads_major(scores: F32) -> F32:
    """``[groups, n, heads]`` -> contiguous ``[groups, heads, n]``: the matrix products come out
    candidate-major, but reductions over the candidates run ~20x faster along the last axis."""
    return np.ascontiguousarray(scores.transpose(0, 2, 1))


def _group_mass(logits: F32, valid: B) -> F32:
    """``[groups, n]``: per group, the sum over heads of each head's softmax share of the valid
    candidates (``logits`` ``[groups, heads, n]``, overwritten); invalid candidates get -1,
    below any share."""
    np.copyto(logits, -np.inf, where=~valid[:, None, :])
    top = logits.max(axis=2, keepdims=True)
    top[~np.isfinite(top)] = 0
    logits -= top
    np.exp(logits, out=logits)
    total = logits.sum(axis=2, keepdims=True)
    total[total <= 0] = 1
    logits /= total
    mass: F32 = logits.sum(axis=1)
    mass[~valid] = -1
    return mass
