"""The prefetch planner: order, budget, skips, lateness and reuse fill."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from kvtierd.slsap import PrefetchPlanner, PromotionReason, QueuedRequest


class FakeReuse:
    def __init__(self, blocks: list[Hashable]) -> None:
        self.blocks = blocks

    def promotion_candidates(self, limit: int) -> list[Hashable]:
        return self.blocks[:limit]


def plan(queued: list[QueuedRequest], budget: float, **kwargs: object) -> list[Hashable]:
    planner = PrefetchPlanner(block_bytes=100)
    result = planner.plan(
        0.0,
        queued,
        prefetch_bytes_per_s=budget,
        horizon_s=1.0,
        in_dram=lambda b: b in kwargs.get("dram", set()),  # type: ignore[operator]
        in_lower_tier=lambda b: b not in kwargs.get("absent", set()),  # type: ignore[operator]
        reuse=kwargs.get("reuse"),  # type: ignore[arg-type]
    )
    return [p.block for p in result.promotions]


def test_earliest_request_first_and_head_first() -> None:
    queued = [QueuedRequest(2, ["b1", "b2"], 5.0), QueuedRequest(1, ["a1", "a2"], 1.0)]
    assert plan(queued, 1000) == ["a1", "a2", "b1", "b2"]


def test_skips_dram_absent_and_duplicate_blocks() -> None:
    queued = [QueuedRequest(1, ["x", "a", "b", "c"], 1.0), QueuedRequest(2, ["x", "d"], 2.0)]
    assert plan(queued, 1000, dram={"a"}, absent={"b"}) == ["x", "c", "d"]


def test_budget_limits_the_plan() -> None:
    queued = [QueuedRequest(1, [f"k{i}" for i in range(10)], 100.0)]
    assert plan(queued, 300) == ["k0", "k1", "k2"]
    assert plan(queued, 0) == []


def test_late_promotions_are_counted() -> None:
    planner = PrefetchPlanner(block_bytes=100)
    queued = [QueuedRequest(1, ["a", "b", "c", "d"], 0.25)]
    result = planner.plan(
        0.0,
        queued,
        prefetch_bytes_per_s=400,
        horizon_s=1.0,
        in_dram=lambda b: False,
        in_lower_tier=lambda b: True,
    )
    assert result.nbytes == 400
    assert result.late == 3  # only "a" lands by 0.25 s


def test_reuse_fills_the_remaining_budget() -> None:
    queued = [QueuedRequest(1, ["a"], 1.0)]
    result = plan(queued, 300, reuse=FakeReuse(["a", "r1", "r2", "r3"]))
    assert result == ["a", "r1", "r2"]
    planner = PrefetchPlanner(block_bytes=100)
    full = planner.plan(
        0.0,
        queued,
        prefetch_bytes_per_s=300,
        horizon_s=1.0,
        in_dram=lambda b: False,
        in_lower_tier=lambda b: True,
        reuse=FakeReuse(["r1"]),
    )
    assert [p.reason for p in full.promotions] == [PromotionReason.PREFIX, PromotionReason.REUSE]


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_bytes"):
        PrefetchPlanner(0)
    with pytest.raises(ValueError, match="budget"):
        PrefetchPlanner(1).plan(
            0.0,
            [],
            prefetch_bytes_per_s=-1,
            horizon_s=1,
            in_dram=lambda b: False,
            in_lower_tier=lambda b: True,
        )
