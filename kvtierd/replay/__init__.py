"""Trace replay: Mooncake traces, the causal arrival feed, the cache simulator, the baseline
policies (LRU, LFU, ARC, S3-FIFO, and Belady, which sees the future) and the policy registry.

A replay mode is a :class:`Driver`; the simulator is the first. See ``tools/replay.py``.
"""

from kvtierd.replay.registry import PolicyName, capacity_in_blocks, make_policy, simulate
from kvtierd.replay.simulator import CacheSimulator, Driver, ReplayResult
from kvtierd.replay.trace import (
    ArrivalFeed,
    CausalityError,
    TraceFormatError,
    TraceRequest,
    distinct_blocks,
    parse_mooncake,
    read_mooncake,
)

__all__ = [
    "ArrivalFeed",
    "CacheSimulator",
    "CausalityError",
    "Driver",
    "PolicyName",
    "ReplayResult",
    "TraceFormatError",
    "TraceRequest",
    "capacity_in_blocks",
    "distinct_blocks",
    "make_policy",
    "parse_mooncake",
    "read_mooncake",
    "simulate",
]
