"""Configuration and results of the sparse index: what the daemon passes in and gets back.

:class:`SparseConfig` is fixed per namespace (it follows the model's attention shapes) and
:class:`Selection` is what one HINT with query vectors answers. The defaults were chosen on real
SmolLM2-135M attention (``tools/attention_recall.py``) and are the same for every document.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvtierd.errors import ConfigError

__all__ = ["RerankScore", "Selection", "SparseConfig"]

I64 = npt.NDArray[np.int64]


class RerankScore(enum.Enum):
    """How candidates are scored from their boxes (see :mod:`.scoring`)."""

    #: Estimated attention mass, keys uniform in the min/max box (the default).
    BOX_MASS = "box_mass"
    #: Quest's upper bound of the best key's logit.
    QUEST_BOUND = "quest_bound"
    #: The mean key's logit.
    MEAN_KEY = "mean_key"


@dataclass(frozen=True)
class SparseConfig:
    """Shapes of the indexed model and the selection policy.

    Attributes:
        layers: model layers that are indexed; query rows follow this order. Layers 0 and 1 of
            small models attend broadly and gain little from sparsity, hence the usual start at 2.
        q_heads, kv_heads, head_dim: attention shapes; ``q_heads`` is a multiple of ``kv_heads``.
        sink_blocks: first positions always selected (the attention sink).
        recent_blocks: newest indexed positions always selected (the current, partial block is
            the engine's own and never indexed).
        pool_factor: blocks per group the clusters return, as a multiple of the free budget.
        pool_min_blocks: sequences up to this many blocks skip the clusters: the pool is every
            block (one matrix product over them is cheap, and exact where it matters most).
        candidate_factor: candidates per group kept from the pool by the shortlist bound and
            scored with ``score``, as a multiple of the free budget.
        shortlist_radius: weight of the half-width term in the shortlist bound
            ``q.c + shortlist_radius * |q|.r`` (1 is Quest's bound; 0.5 follows the box
            estimate of attention mass more closely, see ``docs/slsap-sparse.md``).
        reserve_factor: extra ranked blocks per group, as a share of the free budget, named for
            the next step's prefetch.
        score: candidate re-rank score.
        summary_dtype: storage dtype of the mean keys (read by the mean-key baseline only; the
            boxes are kept as float32 centre and half-width, which the bounds read directly).
        seed: seed of k-means.
    """

    layers: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    sink_blocks: int = 1
    recent_blocks: int = 1
    pool_factor: float = 8.0
    pool_min_blocks: int = 1024
    candidate_factor: float = 2.0
    shortlist_radius: float = 0.5
    reserve_factor: float = 0.25
    score: RerankScore = RerankScore.BOX_MASS
    summary_dtype: str = "float16"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.layers or min(self.layers) < 0 or len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"layers must be distinct non-negative indices, got {self.layers}")
        if min(self.q_heads, self.kv_heads, self.head_dim) <= 0:
            raise ConfigError("q_heads, kv_heads and head_dim must be positive")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"q_heads {self.q_heads} is not a multiple of kv_heads")
        if min(self.sink_blocks, self.recent_blocks) < 0:
            raise ConfigError("sink_blocks and recent_blocks must be >= 0")
        if self.candidate_factor < 1 or self.pool_factor < self.candidate_factor:
            raise ConfigError("need 1 <= candidate_factor <= pool_factor")
        if self.reserve_factor < 0:
            raise ConfigError("reserve_factor must be >= 0")
        if self.pool_min_blocks < 0:
            raise ConfigError("pool_min_blocks must be >= 0")
        if not 0 <= self.shortlist_radius <= 1:
            raise ConfigError("shortlist_radius must be in [0, 1]")
        if self.summary_dtype not in ("float16", "float32"):
            raise ConfigError(f"summary_dtype must be float16 or float32, not {self.summary_dtype}")

    @classmethod
    def for_model(
        cls, layers: int, q_heads: int, kv_heads: int, head_dim: int, first_layer: int = 2
    ) -> SparseConfig:
        """The default configuration for a model, indexing layers ``first_layer..layers-1``."""
        return cls(tuple(range(min(first_layer, layers - 1), layers)), q_heads, kv_heads, head_dim)


@dataclass(frozen=True)
class Selection:
    """The answer to one query: ranked block ids per group.

    A group is one (indexed layer, KV head): row ``i * kv_heads + h`` is layer ``layers[i]``,
    KV head ``h``.

    Attributes:
        block_ids: ``[groups, budget]`` int64, forced blocks first, then best first; -1 pads a
            row when the sequence has fewer blocks than the budget.
        reserve_ids: ``[groups, reserve]`` int64, the next best blocks (-1 padded).
        layers, kv_heads: the group layout.
        candidates: (group, block) pairs scored, for telemetry.
    """

    block_ids: I64
    reserve_ids: I64
    layers: tuple[int, ...]
    kv_heads: int
    candidates: int = field(default=0)

    def blocks(self) -> I64:
        """Every selected block once, in prefetch order: chosen by most groups first, ties by
        their best rank."""
        ids = self.block_ids
        cols = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
        valid = ids >= 0
        uniq, inverse, counts = np.unique(ids[valid], return_inverse=True, return_counts=True)
        best = np.full(len(uniq), ids.shape[1], dtype=np.int64)
        np.minimum.at(best, inverse, cols[valid])
        ranked: I64 = uniq[np.lexsort((best, -counts))].astype(np.int64)
        return ranked

    def for_layer(self, layer: int) -> I64:
        """``[kv_heads, budget]`` ids selected for model layer ``layer``."""
        i = self.layers.index(layer)
        return self.block_ids[i * self.kv_heads : (i + 1) * self.kv_heads]
