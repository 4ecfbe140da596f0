"""The prefetch planner: which blocks to promote NVMe -> DRAM, in what order, within a budget.

Theory of operation. A LOOKUP names exactly the blocks a queued request will READ, in prefix
order, and the engine's queue says roughly when it will start. A promotion is useful only if it
lands before its READ, and a prefix is useful only from its head, so the planner:

1. serves queued requests earliest start first (ties by request id), and each request's blocks
   head first, skipping blocks already in DRAM, blocks no lower tier holds and duplicates;
2. charges each promotion ``block_bytes`` against the budget ``prefetch_bytes_per_s * horizon_s``
   and stops when it is spent; a promotion that the budget's bandwidth cannot land before its
   request's start is still planned (it shortens the wait) but counted as ``late``;
3. fills what budget is left with the reuse model's candidates: ghosts whose expected hit density
   beats the weakest DRAM resident (promotions when the disk is idle).

The plan is a decision, not an action: the store carries it out at a bandwidth share that never
starves demand reads, asking the policy for victims as it needs room. Pure and deterministic.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "PrefetchPlan",
    "PrefetchPlanner",
    "Promotion",
    "PromotionReason",
    "QueuedRequest",
    "ReuseSource",
]


class PromotionReason(enum.Enum):
    PREFIX = "prefix"
    """A queued request named the block."""
    REUSE = "reuse"
    """The reuse model expects the block to be read again soon."""


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A request waiting in the engine's queue: its blocks in prefix order and when it is
    expected to READ them (seconds, on the caller's clock)."""

    request_id: int
    blocks: Sequence[Hashable]
    start_s: float


@dataclass(frozen=True, slots=True)
class Promotion:
    block: Hashable
    reason: PromotionReason
    deadline_s: float
    """When the block is needed (``inf`` for reuse promotions)."""
    request_id: int = -1


@dataclass(frozen=True, slots=True)
class PrefetchPlan:
    """Promotions in the order to issue them, their bytes, and how many will land late."""

    promotions: tuple[Promotion, ...]
    nbytes: int
    late: int


class ReuseSource(Protocol):
    """What the planner needs from the reuse model (``SlsapPolicy`` provides it)."""

    def promotion_candidates(self, limit: int) -> list[Hashable]: ...


class PrefetchPlanner:
    """Plans promotions of ``block_bytes``-sized blocks."""

    def __init__(self, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        self.block_bytes = block_bytes

    def plan(
        self,
        now_s: float,
        queued: Sequence[QueuedRequest],
        *,
        prefetch_bytes_per_s: float,
        horizon_s: float,
        in_dram: Callable[[Hashable], bool],
        in_lower_tier: Callable[[Hashable], bool],
        reuse: ReuseSource | None = None,
    ) -> PrefetchPlan:
        """The promotions to issue now for the next ``horizon_s`` seconds.

        Raises ``ValueError`` for a negative budget or horizon.
        """
        if prefetch_bytes_per_s < 0 or horizon_s < 0:
            raise ValueError("budget and horizon must be >= 0")
        slots = int(prefetch_bytes_per_s * horizon_s // self.block_bytes)
        seconds_per_block = self.block_bytes / prefetch_bytes_per_s if prefetch_bytes_per_s else 0.0
        chosen: list[Promotion] = []
        planned: set[Hashable] = set()
        late = 0
        for request in sorted(queued, key=lambda q: (q.start_s, q.request_id)):
            for block in request.blocks:
                if len(chosen) >= slots:
                    break
                if block in planned or in_dram(block) or not in_lower_tier(block):
                    continue
                planned.add(block)
                chosen.append(
                    Promotion(block, PromotionReason.PREFIX, request.start_s, request.request_id)
                )
                if now_s + len(chosen) * seconds_per_block > request.start_s:
                    late += 1
        if reuse is not None and len(chosen) < slots:
            room = slots - len(chosen)
            for block in reuse.promotion_candidates(room + len(planned)):
                if len(chosen) >= slots:
                    break
                if block in planned or in_dram(block) or not in_lower_tier(block):
                    continue
                planned.add(block)
                chosen.append(Promotion(block, PromotionReason.REUSE, float("inf")))
        return PrefetchPlan(tuple(chosen), len(chosen) * self.block_bytes, late)
