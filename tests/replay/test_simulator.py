"""The simulator's accounting, Belady's optimality, determinism, and a real-trace slice."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.replay import PolicyName, TraceRequest, capacity_in_blocks, simulate
from tests.replay.conftest import one_block_requests


def brute_force_hits(blocks: Sequence[int], capacity: int) -> int:
    """The most hits any cache of ``capacity`` can score, bypass allowed (exhaustive search)."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(blocks):
            return 0
        x = blocks[i]
        if x in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {x}))
        else:
            options.extend(best(i + 1, (cache - {v}) | {x}) for v in cache)
        return max(options)

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    capacity=st.integers(1, 3),
)
def test_belady_is_optimal(blocks: list[int], capacity: int) -> None:
    result = simulate(one_block_requests(blocks), PolicyName.BELADY, capacity)
    assert result.hits == brute_force_hits(blocks, capacity)


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.lists(st.integers(0, 6), min_size=1, max_size=14),
    capacity=st.integers(1, 4),
)
def test_no_online_policy_beats_belady(blocks: list[int], capacity: int) -> None:
    requests = one_block_requests(blocks)
    best = simulate(requests, PolicyName.BELADY, capacity).hits
    for name in PolicyName:
        assert simulate(requests, name, capacity).hits <= best, name


def test_accounting_hits_prefix_hits_and_lower_tier_bytes() -> None:
    requests = [
        TraceRequest(0.0, 1, 1, (1, 2, 3)),
        TraceRequest(1.0, 1, 1, (1, 2, 4)),
        TraceRequest(2.0, 1, 1, (9, 2, 3)),
    ]
    result = simulate(requests, PolicyName.LRU, 10, block_bytes=100)
    assert result.references == 9
    assert result.hits == 4  # 1, 2 in the second request; 2, 3 in the third
    assert result.prefix_hits == 2  # the third request misses its head
    assert result.lower_tier_bytes == 5 * 100


def test_blocks_of_the_running_request_are_not_evicted() -> None:
    # Capacity 2 and a 3-block request: the third block finds only leased blocks, so it is
    # served from below and not cached; the next request still hits both leading blocks.
    requests = [TraceRequest(0.0, 1, 1, (1, 2, 3)), TraceRequest(1.0, 1, 1, (1, 2))]
    for name in PolicyName:
        assert simulate(requests, name, 2).hits == 2, name


def test_replay_is_deterministic(trace_slice: list[TraceRequest]) -> None:
    capacity = capacity_in_blocks(0.05, trace_slice)
    for name in (PolicyName.SLSAP, PolicyName.ARC, PolicyName.S3FIFO):
        first = simulate(trace_slice, name, capacity)
        second = simulate(trace_slice, name, capacity)
        assert (first.hits, first.prefix_hits) == (second.hits, second.prefix_hits), name


def test_online_policies_stay_below_belady_on_the_real_trace(
    trace_slice: list[TraceRequest],
) -> None:
    capacity = capacity_in_blocks(0.05, trace_slice)
    results = {name: simulate(trace_slice, name, capacity) for name in PolicyName}
    best = results[PolicyName.BELADY].hits
    assert best > 0
    for name, result in results.items():
        assert 0 <= result.hits <= best, name
        assert result.references == sum(len(r.hash_ids) for r in trace_slice)
