"""TierPolicy's deferred telemetry: every event reaches the policy in order, under a LOOKUP
storm request chains are sampled per period, whatever pace the journal is drained at, and a
READ's batch of accesses is one event (or, for a policy that marks reads by place, told at
once)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.store.index import Block, BlockIndex
from kvtierd.store.namespaces import Namespace, NamespaceSpec
from kvtierd.store.tier import BlockRef
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


class _PlacedRecorder(_Recorder):
    """A recorder that, like CLOCK, takes reads by the places of their copies."""

    def accessed_at(self, locations: Sequence[Hashable]) -> None:
        self.events.extend(("accessed at", location) for location in locations)


def _blocks(*keys: bytes) -> list[Block]:
    ns = Namespace(1, NamespaceSpec("ns", "tenant", 4096, None, 0, 1), b"d" * 16, b"d" * 16, b"")
    return [Block(ns, BlockRef(ns.digest, key, 4096, 0, 1)) for key in keys]


def test_a_batch_of_reads_is_one_event_in_its_place_in_the_journal() -> None:
    recorder = _Recorder()
    tracking = TierPolicy(recorder, BlockIndex())
    a, b, c = _blocks(b"a", b"b", b"c")
    tracking.inserted(c, 0.0)
    tracking.accessed_many([a, b], 0.0, [AccessContext(), AccessContext()], ["pa", "pb"])
    tracking.removed(c)
    assert tracking.backlog == 3
    assert recorder.events == []
    tracking.flush()
    assert recorder.events == [
        ("inserted", c.id),
        ("accessed", a.id),
        ("accessed", b.id),
        ("removed", c.id),
    ]


def test_a_policy_that_marks_reads_by_place_is_told_at_once() -> None:
    recorder = _PlacedRecorder()
    tracking = TierPolicy(recorder, BlockIndex())
    a, b = _blocks(b"a", b"b")
    tracking.accessed_many([a, b], 0.0, [AccessContext(), AccessContext()], ["pa", "pb"])
    assert tracking.backlog == 0
    assert recorder.events == [("accessed at", "pa"), ("accessed at", "pb")]
