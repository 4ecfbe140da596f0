"""The sparse-attention block index of one sequence: insert, remove, select, predict.

Theory of operation. A decode step's query attends mostly to a few blocks. For each (layer, KV
head), called a *group*, the index keeps every block's box (min, max, mean key, see
:mod:`.summary`), a SimHash sketch of its centred box centre (:mod:`.lsh`) and, once the sequence
is long, its cluster (:mod:`.ivf`). Selecting for a query runs in four stages, all vectorised over
the groups:

1. **Forced**: the first ``sink_blocks`` positions (attention sinks) and the newest
   ``recent_blocks`` positions are always selected, ahead of everything else.
2. **Pool** (sub-linear): the members of the query's best k-means clusters, about
   ``pool_factor`` times the free budget per group; a sequence of at most ``pool_min_blocks``
   blocks (or of at most that pool) pools every block.
3. **Shortlist**: the pool is ordered by Hamming similarity of ``sketch_bits``-bit SimHash
   sketches of ``centre - mu`` against the query (``mu`` the running mean of the centres: queries
   and keys live in different places, and centring spreads the keys around the origin, where
   random hyperplanes resolve angles); ``candidate_factor`` times the free budget are kept.
4. **Re-rank**: candidates are scored exactly from their boxes (``score``, default the box
   estimate of attention mass), the query heads of a group are combined by summing their
   softmax shares, and the best ``budget - forced`` are kept per group, followed by a reserve of
   the next best for :meth:`SparseIndex.predict_next`.

Why not hash for the Quest bound directly: it is an inner product ``q.c + |q|.r`` (box centre
``c``, half-width ``r``), and the MIPS-to-cosine transform (Neyshabur and Srebro, ICML 2015)
would make it an angle, but the completing coordinate ``sqrt(M^2 - |x|^2)`` dominates every key
and crushes the angles: on real SmolLM2 keys and on synthetic clusters the candidates were
barely better than random. ``|q|.r`` is nearly the same for every block; the centre carries the
ranking. ``mu`` is re-frozen, and every sketch recomputed, each time the index doubles up to
1,024 blocks; clusters are refitted each time it grows 4x beyond ``pool_min_blocks``.

Block ids are the caller's integers (the daemon's block handles); positions are block indices in
the sequence (position 0 holds the first ``block_tokens`` tokens).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from kvtierd.errors import BlockNotFoundError, InvalidRequestError
from kvtierd.slsap.sparse.config import RerankScore, Selection, SparseConfig
from kvtierd.slsap.sparse.ivf import ClusterLists
from kvtierd.slsap.sparse.lsh import SimHashSketches
from kvtierd.slsap.sparse.scoring import box_log_mass, mean_logit, quest_bound
from kvtierd.slsap.sparse.summary import BlockSummary

__all__ = ["SparseIndex"]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
_RECENTRE_UNTIL = 1024
_SCORES = {
    RerankScore.BOX_MASS: box_log_mass,
    RerankScore.QUEST_BOUND: quest_bound,
    RerankScore.MEAN_KEY: mean_logit,
}


class SparseIndex:
    """Block summaries of one sequence, their sketches and clusters (see the module docstring).

    Not thread-safe: the owner serialises calls (the daemon runs one per namespace session in a
    worker thread).
    """

    def __init__(self, config: SparseConfig) -> None:
        self.config = config
        self._groups = len(config.layers) * config.kv_heads
        self._dim = config.head_dim
        self._boxes = np.zeros((0, self._groups, 3, self._dim), dtype=config.summary_dtype)
        self._ids = np.zeros(0, dtype=np.int64)
        self._pos = np.zeros(0, dtype=np.int64)
        self._live = np.zeros(0, dtype=bool)
        self._slot_of: dict[int, int] = {}
        self._slot_at: dict[int, int] = {}
        self._next = 0
        self._newest = -1
        self._centre_sum = np.zeros((self._groups, self._dim), dtype=np.float64)
        self._centre = np.zeros((self._groups, self._dim), dtype=np.float32)
        self._frozen_at = 0
        self._fitted_at = 0
        self._sketches = SimHashSketches(
            self._groups, self._dim, bits=config.sketch_bits, seed=config.seed
        )
        self._clusters = ClusterLists(self._groups, self._dim, seed=config.seed)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._slot_of

    def memory_bytes(self) -> int:
        """Bytes held by the arrays of the index (the id and position dicts not counted)."""
        arrays = (self._boxes, self._ids, self._pos, self._live)
        own = sum(int(a.nbytes) for a in arrays)
        return own + self._sketches.memory_bytes() + self._clusters.memory_bytes()

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
        self, block_ids: npt.ArrayLike, positions: npt.ArrayLike, boxes: npt.ArrayLike
    ) -> None:
        """Add many blocks at once.

        Args:
            block_ids, positions: ``[n]`` integers, unique and not yet indexed.
            boxes: ``[n, len(config.layers), kv_heads, 3, head_dim]``, the stacked summaries of
                the *indexed* layers only, in ``config.layers`` order.

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
        self._next += len(ids)
        arr = arr.reshape(len(ids), self._groups, 3, self._dim)
        self._boxes[slots], self._ids[slots], self._pos[slots] = arr, ids, pos
        self._live[slots] = True
        self._slot_of.update(zip(ids.tolist(), slots.tolist(), strict=True))
        self._slot_at.update(zip(pos.tolist(), slots.tolist(), strict=True))
        self._newest = max(self._newest, int(pos.max()))
        self._centre_sum += ((arr[:, :, 0] + arr[:, :, 1]) / 2).sum(axis=0, dtype=np.float64)
        if len(self) >= 2 * self._frozen_at and self._frozen_at < _RECENTRE_UNTIL:
            self._recentre()
        else:
            vectors = self._key_vectors(slots)
            self._sketches.store(slots, self._sketches.hash(vectors))
            self._clusters.add(slots, vectors)
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
        box = self._boxes[slot].astype(np.float64)
        self._centre_sum -= (box[:, 0] + box[:, 1]) / 2
        self._clusters.discard(np.array([slot], dtype=np.int64))
        if self._next - len(self) > max(64, len(self)):
            self._compact()
            self._fitted_at = 0
            self._maybe_refit()

    def forced(self) -> I64:
        """Ids always selected: the sink positions ``0..sink_blocks-1``, then the recent window,
        positions ``newest - recent_blocks + 1 .. newest``, newest first (absent ones skipped)."""
        cfg = self.config
        if not self._slot_at:
            return np.zeros(0, dtype=np.int64)
        if self._newest not in self._slot_at:
            self._newest = max(self._slot_at)
        window = range(self._newest, max(self._newest - cfg.recent_blocks, cfg.sink_blocks - 1), -1)
        positions = [*range(cfg.sink_blocks), *window]
        slots = [self._slot_at[p] for p in positions if p in self._slot_at]
        return self._ids[np.asarray(slots, dtype=np.int64)]

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
        forced = self.forced()[:budget_blocks]
        free = budget_blocks - len(forced)
        reserve = math.ceil(self.config.reserve_factor * free)
        cand_groups, cand_slots = self._candidates(q, free, exhaustive)
        keep = ~np.isin(self._ids[cand_slots], forced)
        cand_groups, cand_slots = cand_groups[keep], cand_slots[keep]
        ranked_groups, ranked_slots, rank = self._rank(
            q, cand_groups, cand_slots, free + reserve, score or self.config.score
        )
        chosen = np.full((self._groups, budget_blocks), -1, dtype=np.int64)
        chosen[:, : len(forced)] = forced
        spare = np.full((self._groups, reserve), -1, dtype=np.int64)
        ids = self._ids[ranked_slots]
        head = rank < free
        chosen[ranked_groups[head], len(forced) + rank[head]] = ids[head]
        spare[ranked_groups[~head], rank[~head] - free] = ids[~head]
        return Selection(chosen, spare, self.config.layers, self.config.kv_heads, len(cand_slots))

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

    def _candidates(self, q: F32, free: int, exhaustive: bool) -> tuple[I64, I64]:
        count = len(self)
        if free <= 0 or count == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        keep = math.ceil(self.config.candidate_factor * free)
        target = math.ceil(self.config.pool_factor * free)
        dense = count <= max(target, self.config.pool_min_blocks) or not self._clusters.fitted
        if exhaustive or dense:
            live = np.flatnonzero(self._live[: self._next]).astype(np.int64)
            groups = np.repeat(np.arange(self._groups, dtype=np.int64), count)
            slots = np.tile(live, self._groups)
            if exhaustive or count <= keep:
                return groups, slots
        else:
            groups, slots = self._clusters.pool(q, target)
        return self._sketches.shortlist(self._sketches.hash(q), groups, slots, keep)

    def _rank(
        self, q: F32, groups: I64, slots: I64, keep: int, score: RerankScore
    ) -> tuple[I64, I64, I64]:
        """Score candidate (group, slot) pairs (sorted by group), combine heads, keep the best
        ``keep`` per group: returns (groups, slots, rank within group)."""
        if len(slots) == 0 or keep <= 0:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        boxes = self._boxes[slots, groups].astype(np.float32)
        logits = _SCORES[score](q[groups], boxes)  # [c, heads]
        starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
        seg = np.cumsum(np.r_[False, groups[1:] != groups[:-1]])
        top = np.maximum.reduceat(logits, starts, axis=0)[seg]
        share = np.exp(logits - top)
        share /= np.add.reduceat(share, starts, axis=0)[seg]
        mass = share.sum(axis=1)
        order = np.lexsort((-mass, groups))
        rank = np.arange(len(order)) - starts[seg[order]]
        sel = order[rank < keep]
        return groups[sel], slots[sel], rank[rank < keep]

    def _key_vectors(self, slots: I64) -> F32:
        """Centred box centres ``[n, groups, d]``: what SimHash sees of a block."""
        boxes = self._boxes[slots].astype(np.float32)  # [n, groups, 3, d]
        return np.asarray((boxes[:, :, 0] + boxes[:, :, 1]) / 2 - self._centre, dtype=np.float32)

    def _compact(self) -> None:
        """Move the live blocks to slots ``0..n-1`` (slots of removed blocks are not reused
        until then, so no stale cluster or sketch entry can name a new block)."""
        live = np.flatnonzero(self._live[: self._next]).astype(np.int64)
        n = len(live)
        self._boxes[:n], self._ids[:n], self._pos[:n] = (
            self._boxes[live],
            self._ids[live],
            self._pos[live],
        )
        self._sketches.compact(live)
        self._live[:] = False
        self._live[:n] = True
        self._next = n
        self._slot_of = dict(zip(self._ids[:n].tolist(), range(n), strict=True))
        self._slot_at = dict(zip(self._pos[:n].tolist(), range(n), strict=True))

    def _recentre(self) -> None:
        """Re-centre on the running mean and re-sketch every block: done as the index doubles
        up to ``_RECENTRE_UNTIL`` blocks (amortised O(1) per insert); beyond, the mean of a
        sequence's keys has settled and re-sketching would only cost."""
        self._compact()
        n = self._next
        self._centre = (self._centre_sum / max(n, 1)).astype(np.float32)
        slots = np.arange(n, dtype=np.int64)
        self._sketches.store(slots, self._sketches.hash(self._key_vectors(slots)))
        self._frozen_at = n
        self._fitted_at = 0

    def _maybe_refit(self) -> None:
        """Cluster afresh once the sequence outgrows ``pool_min_blocks``, then each time it has
        grown 4x (amortised O(sqrt n) per insert)."""
        n = len(self)
        if n <= self.config.pool_min_blocks or (self._fitted_at and n < 4 * self._fitted_at):
            return
        self._compact()
        slots = np.arange(n, dtype=np.int64)
        self._clusters.fit(slots, self._key_vectors(slots))
        self._fitted_at = n

    def _grow(self, needed: int) -> None:
        if needed <= len(self._ids):
            return
        cap = max(needed, 2 * len(self._ids), 64)
        for name in ("_boxes", "_ids", "_pos", "_live"):
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
