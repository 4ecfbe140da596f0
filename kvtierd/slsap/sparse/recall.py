"""Recall of attention mass: how much of a query's true attention the selected blocks hold.

This is the measure behind ``tools/attention_recall.py``, kept here (pure numpy) so tests can run
it on constructed keys. Given the post-RoPE keys of a sequence and the queries of its last
positions, for each query position ``p`` (oldest first, as decode steps):

- the blocks are ``0..p // block_tokens``; the last one is the engine's current, partial block,
  resident by definition: it counts against the budget and its mass is always captured;
- the full blocks before it are in a :class:`~.index.SparseIndex` (inserted as ``p`` crosses a
  block boundary, as a daemon would see COMMITs);
- the budget is ``ceil(budget * blocks)`` blocks per (layer, KV head), the partial block included;
- a method's recall for a query head is the share of that head's softmax attention that falls in
  the selected blocks; it is averaged over query heads, indexed layers and query positions.

Methods: ``oracle`` (the best blocks for the group's true attention: an upper bound for any
selection shared by a GQA group), ``oracle_per_head`` (each query head its own best blocks; not
attainable with shared KV, reported for reference), ``slsap`` (the index with its defaults),
``box_full_scan`` (the same score over every block: what candidate selection may lose),
``quest_full_scan`` (Quest's bound over every block), ``mean_key`` and ``recency`` (sink and
newest blocks). All methods but the oracles keep the sink and the recent window.

Lead time: the share of step ``p+1``'s selected (group, block) pairs that
:meth:`~.index.SparseIndex.predict_next` named at step ``p``; ``lead_time_selection_only`` is the
same with the step-``p`` selection alone, without its reserve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtierd.errors import InvalidRequestError
from kvtierd.slsap.sparse.config import RerankScore, SparseConfig
from kvtierd.slsap.sparse.index import SparseIndex
from kvtierd.slsap.sparse.summary import summarize_sequence

__all__ = ["METHODS", "SequenceRecall", "attention_block_mass", "evaluate_sequence"]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
METHODS = (
    "oracle",
    "slsap",
    "quest_full_scan",
    "mean_key",
    "recency",
    "box_full_scan",
    "oracle_per_head",
)


@dataclass(frozen=True)
class SequenceRecall:
    """Recall figures of one sequence (means over layers, heads and query positions)."""

    recall: dict[str, float]
    recall_per_layer: dict[str, list[float]]
    lead_time: float
    lead_time_selection_only: float
    lead_time_blocks: float
    candidate_share: float
    budget_blocks: float
    context_blocks: float


def attention_block_mass(queries: F32, keys: F32, block_tokens: int) -> F32:
    """Softmax attention of the last queries, summed per block.

    Args:
        queries: ``[q_heads, steps, d]`` post-RoPE queries of positions ``n-steps..n-1``.
        keys: ``[kv_heads, n, d]`` post-RoPE keys of positions ``0..n-1``.

    Returns:
        ``[q_heads, steps, ceil(n / block_tokens)]`` float32; each (head, step) sums to 1.
    """
    heads, steps, d = queries.shape
    kv, n, _ = keys.shape
    k = np.repeat(keys.astype(np.float32), heads // kv, axis=0)
    logits = queries.astype(np.float32) @ k.transpose(0, 2, 1) / np.float32(math.sqrt(d))
    future = np.arange(n)[None, :] > np.arange(n - steps, n)[:, None]
    logits[:, future] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    blocks = -(-n // block_tokens)
    p = np.pad(p, ((0, 0), (0, 0), (0, blocks * block_tokens - n)))
    return np.asarray(p.reshape(heads, steps, blocks, block_tokens).sum(axis=-1), np.float32)


def _pick(scores: F32, count: int) -> I64:
    """Indices of the ``count`` largest entries of each row of ``scores`` ``[rows, n]``."""
    count = min(count, scores.shape[1])
    if count <= 0:
        return np.zeros((scores.shape[0], 0), dtype=np.int64)
    return np.argpartition(-scores, count - 1, axis=1)[:, :count].astype(np.int64)


def evaluate_sequence(
    queries: F32, keys: F32, config: SparseConfig, *, block_tokens: int = 16, budget: float = 0.125
) -> SequenceRecall:
    """Recall of every method in :data:`METHODS` on one sequence.

    Args:
        queries: ``[layers, q_heads, steps, head_dim]`` post-RoPE queries of the last ``steps``
            positions, for every model layer (rows are picked by ``config.layers``).
        keys: ``[layers, kv_heads, n, head_dim]`` post-RoPE keys of all ``n`` positions.
        config: the index configuration under test.
        block_tokens: tokens per block.
        budget: share of the sequence's blocks kept per (layer, KV head).

    Raises:
        InvalidRequestError: shapes disagree, or there is no full block before the queries.
    """
    layers, heads, steps, dim = queries.shape
    kv, n = keys.shape[1], keys.shape[2]
    if keys.shape[0] != layers or keys.shape[3] != dim or (n - steps) // block_tokens < 1:
        raise InvalidRequestError(f"queries {queries.shape} and keys {keys.shape} do not fit")
    sel_layers = list(config.layers)
    mass = np.stack(
        [attention_block_mass(queries[li], keys[li], block_tokens) for li in sel_layers]
    )  # [L, H, steps, blocks]
    g = heads // kv
    mass_g = mass.reshape(len(sel_layers) * kv, g, steps, -1)  # [G, g, steps, blocks]
    boxes = summarize_sequence(keys[sel_layers], block_tokens)  # [blocks, L, kv, 3, d]
    index = SparseIndex(config)
    sums = {m: np.zeros((len(sel_layers), heads)) for m in METHODS}
    lead = np.zeros(3)
    prev_pred: tuple[I64, I64] | None = None
    cand = budget_sum = ctx_sum = 0.0
    for step, pos in enumerate(range(n - steps, n)):
        full = pos // block_tokens
        if len(index) < full:
            new = np.arange(len(index), full)
            index.insert_many(new, new, boxes[new])
        blocks_budget = max(1, math.ceil(budget * (full + 1)))
        free = blocks_budget - 1
        q = queries[sel_layers, :, step]
        m = mass_g[:, :, step, :full]  # [G, g, full]
        chosen: dict[str, I64] = {}
        sel = index.select(q, free)
        chosen["slsap"] = sel.block_ids
        chosen["box_full_scan"] = index.select(q, free, exhaustive=True).block_ids
        chosen["quest_full_scan"] = index.select(
            q, free, exhaustive=True, score=RerankScore.QUEST_BOUND
        ).block_ids
        chosen["mean_key"] = index.select(
            q, free, exhaustive=True, score=RerankScore.MEAN_KEY
        ).block_ids
        chosen["oracle"] = _pick(m.sum(axis=1), free)
        recent = np.r_[0, np.arange(full - 1, 0, -1)][:free] if free else np.zeros(0, np.int64)
        chosen["recency"] = np.broadcast_to(recent, (m.shape[0], len(recent)))
        partial = mass_g[:, :, step, full]  # [G, g]
        for name, ids in chosen.items():
            got = np.take_along_axis(m, np.maximum(ids, 0)[:, None, :], axis=2)
            got = (got * (ids >= 0)[:, None, :]).sum(axis=2) + partial
            sums[name] += got.reshape(len(sel_layers), heads)
        per_head = _pick(m.reshape(-1, full), free).reshape(m.shape[0], g, -1)
        got = np.take_along_axis(m, per_head, axis=2).sum(axis=2) + partial
        sums["oracle_per_head"] += got.reshape(len(sel_layers), heads)
        if prev_pred is not None:
            lead += _lead_shares(prev_pred, sel.block_ids)
        prev_pred = (index.predict_next(sel), sel.block_ids)
        cand += sel.candidates / max(1, m.shape[0] * full)
        budget_sum += blocks_budget
        ctx_sum += full + 1
    pairs = max(1, steps - 1)
    return SequenceRecall(
        recall={k: float(v.mean() / steps) for k, v in sums.items()},
        recall_per_layer={k: (v.mean(axis=1) / steps).tolist() for k, v in sums.items()},
        lead_time=float(lead[0] / pairs),
        lead_time_selection_only=float(lead[1] / pairs),
        lead_time_blocks=float(lead[2] / pairs),
        candidate_share=cand / steps,
        budget_blocks=budget_sum / steps,
        context_blocks=ctx_sum / steps,
    )


def _lead_shares(previous: tuple[I64, I64], actual: I64) -> npt.NDArray[np.float64]:
    """(share named by the prediction, by the bare selection, block-level share) for one step."""
    predicted, selected = previous
    out = np.zeros(3)
    for row in range(actual.shape[0]):
        want = actual[row][actual[row] >= 0]
        if len(want):
            out[0] += np.isin(want, predicted[row]).mean()
            out[1] += np.isin(want, selected[row]).mean()
    out[:2] /= actual.shape[0]
    want_all = np.unique(actual[actual >= 0])
    out[2] = np.isin(want_all, predicted[predicted >= 0]).mean() if len(want_all) else 1.0
    return out
