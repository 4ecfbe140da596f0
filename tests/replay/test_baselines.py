"""The baseline policies on textbook reference strings, driven through the simulator."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvtierd.policy import CachePolicy
from kvtierd.replay import CacheSimulator, PolicyName, simulate
from kvtierd.replay.baselines import ArcPolicy, LfuPolicy, S3FifoPolicy
from kvtierd.replay.trace import ArrivalFeed
from tests.replay.conftest import one_block_requests

# Silberschatz, Operating System Concepts, ch. 10: 20 references, 3 frames.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def misses(name: PolicyName, blocks: Sequence[int], capacity: int) -> int:
    result = simulate(one_block_requests(blocks), name, capacity)
    return result.references - result.hits


def run(policy: CachePolicy, blocks: Sequence[int], capacity: int) -> set[Hashable]:
    simulator = CacheSimulator(policy, capacity, name="test")
    simulator.replay(ArrivalFeed(one_block_requests(blocks)))
    return set(simulator._cached)


def test_lru_textbook_faults() -> None:
    assert misses(PolicyName.LRU, TEXTBOOK, 3) == 12


def test_belady_textbook_faults() -> None:
    # The textbook's 9 is MIN loading every miss; with bypass (a miss whose next use is farther
    # than every resident's is not loaded) one fault less: 8, the brute-force optimum.
    assert misses(PolicyName.BELADY, TEXTBOOK, 3) == 8


def test_lfu_keeps_the_frequent_block() -> None:
    # 1 is read three times; 2, 3, 4 once each: with two slots 1 survives.
    assert run(LfuPolicy(), [1, 1, 1, 2, 3, 4], 2) == {1, 4}


def test_arc_survives_a_scan() -> None:
    # 1 and 2 are read twice (T2); a scan of one-time blocks must not flush them.
    cached = run(ArcPolicy(3), [1, 2, 1, 2, 10, 11, 12, 13, 14], 3)
    assert {1, 2} <= cached


def test_arc_adapts_towards_recency_on_a_b1_ghost_hit() -> None:
    # 1 moves to T2; 3 evicts 2 from T1 into B1; 2's return is a B1 hit: p grows, 2 joins T2.
    policy = ArcPolicy(2)
    run(policy, [1, 1, 2, 3, 2], 2)
    assert policy.p == 1.0
    assert 2 in policy._t2


def test_arc_textbook_faults_match_lru_on_a_pure_recency_string() -> None:
    # A cyclic working set that fits: both hit everything after the first pass.
    blocks = [1, 2, 3] * 4
    assert misses(PolicyName.ARC, blocks, 3) == misses(PolicyName.LRU, blocks, 3) == 3


def test_s3fifo_one_hit_blocks_do_not_displace_reused_ones() -> None:
    # 1..5 are reused; a long run of one-time blocks passes through the small FIFO only.
    hot = [1, 2, 3, 4, 5]
    blocks = hot + hot + list(range(100, 140)) + hot
    result = simulate(one_block_requests(blocks), PolicyName.S3FIFO, 10)
    lru = simulate(one_block_requests(blocks), PolicyName.LRU, 10)
    assert result.hits == 10
    assert lru.hits == 5


def test_s3fifo_ghost_goes_to_main() -> None:
    policy = S3FifoPolicy(10)
    run(policy, [1, *range(100, 110), 1], 10)
    assert 1 in policy._main


def test_s3fifo_textbook_faults() -> None:
    # Worked by hand: the small FIFO's target is 1 block, the ghost FIFO holds 2; misses at
    # references 1-4, 6, 8-10, 14, 15, 17, 18.
    assert misses(PolicyName.S3FIFO, TEXTBOOK, 3) == 12
