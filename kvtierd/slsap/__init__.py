"""SLSAP: Sub-Linear Sparse Attention Prefetch, the pure prefetch engines.

Nothing in this package does I/O or reads a clock: telemetry events go in, scores and plans come
out, so the same code runs inside the daemon and in trace replay. Two engines live here: the
reuse model (admission, eviction and prefetch planning from access telemetry) and the sparse
attention retrieval (block summaries, an LSH index and a min/max re-rank).
"""

from kvtierd.slsap.planner import (
    PrefetchPlan,
    PrefetchPlanner,
    Promotion,
    PromotionReason,
    QueuedRequest,
)
from kvtierd.slsap.policy import SlsapConfig, SlsapPolicy, SlsapStatistics
from kvtierd.slsap.reuse import ReuseModel

__all__ = [
    "PrefetchPlan",
    "PrefetchPlanner",
    "Promotion",
    "PromotionReason",
    "QueuedRequest",
    "ReuseModel",
    "SlsapConfig",
    "SlsapPolicy",
    "SlsapStatistics",
]
