"""Policies by name, and the one function that replays a trace under several of them.

Online policies are built from the capacity alone; only :attr:`PolicyName.BELADY`, which is
``offline``, is given the trace. That is the structural half of the causality guarantee (the
other half is :class:`~kvtierd.replay.trace.ArrivalFeed`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from kvtierd.policy import CachePolicy
from kvtierd.replay.baselines import ArcPolicy, LfuPolicy, S3FifoPolicy
from kvtierd.replay.belady import BeladyPolicy
from kvtierd.replay.clock import ReplayClock
from kvtierd.replay.simulator import CacheSimulator, ReplayResult
from kvtierd.replay.trace import ArrivalFeed, TraceRequest, distinct_blocks
from kvtierd.slsap.policy import SlsapPolicy
from kvtierd.store.policy import LruPolicy

__all__ = ["PolicyName", "capacity_in_blocks", "make_policy", "simulate"]


class PolicyName(enum.StrEnum):
    LRU = "lru"
    CLOCK = "clock"
    LFU = "lfu"
    ARC = "arc"
    S3FIFO = "s3fifo"
    BELADY = "belady"
    SLSAP = "slsap"

    @property
    def offline(self) -> bool:
        """Whether the policy sees the future (only Belady)."""
        return self is PolicyName.BELADY


def make_policy(
    name: PolicyName, capacity_blocks: int, requests: Sequence[TraceRequest] = ()
) -> CachePolicy:
    """A fresh policy. ``requests`` (the future) is used by offline policies only."""
    match name:
        case PolicyName.LRU:
            return LruPolicy()
        case PolicyName.CLOCK:
            return ReplayClock()
        case PolicyName.LFU:
            return LfuPolicy()
        case PolicyName.ARC:
            return ArcPolicy(capacity_blocks)
        case PolicyName.S3FIFO:
            return S3FifoPolicy(capacity_blocks)
        case PolicyName.BELADY:
            return BeladyPolicy(requests)
        case PolicyName.SLSAP:
            return SlsapPolicy()


def capacity_in_blocks(capacity: float, requests: Iterable[TraceRequest]) -> int:
    """``capacity`` below 1 is a fraction of the trace's distinct blocks; otherwise blocks."""
    if capacity <= 0:
        raise ValueError("capacity must be positive")
    if capacity < 1:
        return max(1, int(capacity * distinct_blocks(requests)))
    if capacity != int(capacity):
        raise ValueError("a capacity of 1 or more is a whole number of blocks")
    return int(capacity)


def simulate(
    requests: Sequence[TraceRequest],
    policy: PolicyName,
    capacity_blocks: int,
    *,
    block_bytes: int = 65536,
) -> ReplayResult:
    """Replay ``requests`` through one cache of ``capacity_blocks`` under ``policy``."""
    cache = make_policy(policy, capacity_blocks, requests if policy.offline else ())
    simulator = CacheSimulator(
        cache, capacity_blocks, name=policy.value, offline=policy.offline, block_bytes=block_bytes
    )
    return simulator.replay(ArrivalFeed(requests))
