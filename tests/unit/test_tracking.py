"""TierPolicy's deferred telemetry: every event reaches the policy in order, and under a LOOKUP
storm request chains are sampled per period, whatever pace the journal is drained at."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.store.index import BlockIndex
from kvtierd.store.tracking import _MAX_PENDING_REQUESTS, TierPolicy


class _Recorder(CachePolicy):
    """A real (trivial) policy that records what it is told."""

    def __init__(self) -> None:
        self.requests: list[list[Hashable]] = []
        self.events: list[tuple[str, Hashable]] = []

    def observe_request(
        self, blocks: Sequence[Hashable], now: float = 0.0, request_id: int = -1
    ) -> None:
        self.requests.append(list(blocks))

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        return True

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self.events.append(("inserted", block))

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self.events.append(("accessed", block))

    def removed(self, block: Hashable) -> None:
        self.events.append(("removed", block))

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        return []

    def __len__(self) -> int:
        return 0


def test_chains_are_sampled_per_period_even_when_drained_at_once() -> None:
    recorder = _Recorder()
    tracking = TierPolicy(recorder, BlockIndex())
    for i in range(10 * _MAX_PENDING_REQUESTS):
        tracking.observe_request([i], 0.0, i)
        tracking.flush()  # a flusher that keeps up must not lift the bound
    assert len(recorder.requests) == _MAX_PENDING_REQUESTS
    assert tracking.sampled_out == 9 * _MAX_PENDING_REQUESTS
    tracking.new_period()
    tracking.observe_request(["next"], 0.0, 1)
    tracking.flush()
    assert recorder.requests[-1] == ["next"]


def test_chains_reach_the_policy_in_order_only_when_flushed() -> None:
    recorder = _Recorder()
    tracking = TierPolicy(recorder, BlockIndex())
    tracking.observe_request(["a", "b"], 0.0, 1)
    tracking.observe_request(["c"], 0.0, 2)
    assert recorder.requests == []
    tracking.flush()
    assert recorder.requests == [["a", "b"], ["c"]]
