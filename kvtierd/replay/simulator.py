"""Trace replay in simulation: one cache tier driven by a ``CachePolicy``, block by block.

Hit accounting (documented in ``docs/slsap-reuse.md``). A request is served at its arrival:

1. ``observe_request`` (if the policy has it) is told the request's blocks, as LOOKUP would.
2. Each block reference is a *hit* if the block is cached at that moment, and the policy is told
   ``accessed``. *Prefix hits* count only the leading run of hits (what a prefix cache can use).
3. Then the missing blocks, head first, are offered to the tier: inserted at once while there is
   room; otherwise inserted only if ``admit`` says so, displacing ``victims(1)`` chosen among
   blocks the request does not name (those are leased by the running request).

Every miss is a block read from the lower tier (or recomputed): ``lower_tier_bytes`` is misses
times ``block_bytes``. A missing block that is not admitted is still served, from below.

The :class:`Driver` protocol is what a replay mode implements: this simulator now, a driver that
replays against a running daemon later. Both take requests from an
:class:`~kvtierd.replay.trace.ArrivalFeed`, so neither can show a request before its timestamp.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtierd.policy import AccessContext, CachePolicy, ServedBy
from kvtierd.replay.trace import ArrivalFeed, TraceRequest

__all__ = ["CacheSimulator", "Driver", "ReplayResult"]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one replay measured. Ratios are over block references."""

    policy: str
    offline: bool
    capacity_blocks: int
    requests: int
    references: int
    hits: int
    prefix_hits: int
    lower_tier_bytes: int
    elapsed_s: float

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.references if self.references else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hits / self.references if self.references else 0.0

    def as_dict(self) -> dict[str, object]:
        """The result as plain JSON-able values, ratios included."""
        return {
            "policy": self.policy,
            "offline": self.offline,
            "capacity_blocks": self.capacity_blocks,
            "requests": self.requests,
            "references": self.references,
            "hits": self.hits,
            "hit_ratio": self.hit_ratio,
            "prefix_hit_ratio": self.prefix_hit_ratio,
            "lower_tier_bytes": self.lower_tier_bytes,
            "elapsed_s": self.elapsed_s,
        }


class Driver(Protocol):
    """A replay mode: consumes a feed, reports a :class:`ReplayResult`."""

    def replay(self, feed: ArrivalFeed) -> ReplayResult: ...


class CacheSimulator:
    """One cache of ``capacity_blocks`` blocks under ``policy`` (a :class:`Driver`).

    ``offline`` only labels the result: whether the policy was given the future.
    """

    def __init__(
        self,
        policy: CachePolicy,
        capacity_blocks: int,
        *,
        name: str,
        offline: bool = False,
        block_bytes: int = 65536,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        if block_bytes < 0:
            raise ValueError("block_bytes must be >= 0")
        self.policy = policy
        self.capacity_blocks = capacity_blocks
        self.name = name
        self.offline = offline
        self.block_bytes = block_bytes
        self._cached: set[Hashable] = set()

    def replay(self, feed: ArrivalFeed) -> ReplayResult:
        """Serve every request of ``feed`` in arrival order; see the module docstring."""
        started = time.perf_counter()
        requests = references = hits = prefix_hits = misses = 0
        for index, request in feed.arrivals():
            feed.check_visible(request)
            h, p, m = self._serve(index, request)
            requests += 1
            references += len(request.hash_ids)
            hits, prefix_hits, misses = hits + h, prefix_hits + p, misses + m
        return ReplayResult(
            policy=self.name,
            offline=self.offline,
            capacity_blocks=self.capacity_blocks,
            requests=requests,
            references=references,
            hits=hits,
            prefix_hits=prefix_hits,
            lower_tier_bytes=misses * self.block_bytes,
            elapsed_s=time.perf_counter() - started,
        )

    def _serve(self, index: int, request: TraceRequest) -> tuple[int, int, int]:
        now = request.arrival_s
        blocks: Sequence[int] = request.hash_ids
        policy, cached = self.policy, self._cached
        observe = getattr(policy, "observe_request", None)
        if observe is not None:
            observe(blocks, now, index)
        hits = prefix = 0
        leading = True
        missing: list[tuple[int, int]] = []
        for position, block in enumerate(blocks):
            if block in cached:
                hits += 1
                prefix += leading
                policy.accessed(block, now, AccessContext(index, b"", position, ServedBy.DRAM))
            else:
                leading = False
                missing.append((position, block))
        leased = set(blocks)
        for position, block in missing:
            if block in cached:
                continue
            context = AccessContext(index, b"", position, ServedBy.MISS)
            if len(cached) >= self.capacity_blocks:
                if not policy.admit(block, now, context):
                    continue
                victims = policy.victims(1, lambda b: b not in leased)
                if not victims:
                    continue
                cached.discard(victims[0])
                policy.removed(victims[0])
            cached.add(block)
            policy.inserted(block, now, context)
        return hits, prefix, len(missing)
