"""Belady's MIN: the offline optimum, which SEES THE FUTURE. A reference point, not a policy.

Given the whole trace, every block reference knows the arrival index of the next request that
names the block. The policy evicts the resident whose next use is farthest away and refuses
(bypasses) a missing block whose next use is farther than every resident's, which is optimal for
uniform-size blocks (Belady 1966; Mattson et al. 1970 for the bypass form). Requests are
identified by ``AccessContext.request_id``, which the simulator sets to the arrival index.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence

from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.replay.trace import TraceRequest

__all__ = ["BeladyPolicy", "next_uses"]

NEVER = 1 << 62
"""The next-use index of a block no later request names."""


def next_uses(requests: Sequence[TraceRequest]) -> list[dict[int, int]]:
    """For each request index, each of its blocks' next request index (``NEVER`` if none)."""
    following: dict[int, int] = {}
    out: list[dict[int, int]] = [{} for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        mine = out[index]
        for block in requests[index].hash_ids:
            mine[block] = following.get(block, NEVER)
        for block in requests[index].hash_ids:
            following[block] = index
    return out


class BeladyPolicy(CachePolicy):
    """Offline optimal eviction with bypass. ``offline`` is True: it is given the future."""

    offline = True

    def __init__(self, requests: Sequence[TraceRequest]) -> None:
        self._next = next_uses(requests)
        self._resident: dict[Hashable, int] = {}
        self._heap: list[tuple[int, int, Hashable]] = []
        self._tick = 0

    def _next_use(self, block: Hashable, context: AccessContext | None) -> int:
        if context is None:
            raise ValueError("Belady needs the request index in AccessContext.request_id")
        uses: dict[Hashable, int] = self._next[context.request_id]  # type: ignore[assignment]
        return uses.get(block, NEVER)

    def _set(self, block: Hashable, next_use: int) -> None:
        self._tick += 1
        self._resident[block] = next_use
        heapq.heappush(self._heap, (-next_use, self._tick, block))

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        farthest = self._farthest()
        return farthest is None or self._next_use(block, context) < farthest

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self._set(block, self._next_use(block, context))

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        if block in self._resident:
            self._set(block, self._next_use(block, context))

    def removed(self, block: Hashable) -> None:
        self._resident.pop(block, None)

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        chosen: list[Hashable] = []
        kept: list[tuple[int, int, Hashable]] = []
        while self._heap and len(chosen) < count:
            item = heapq.heappop(self._heap)
            if self._resident.get(item[2]) != -item[0]:
                continue
            kept.append(item)
            if evictable(item[2]):
                chosen.append(item[2])
        for item in kept:
            heapq.heappush(self._heap, item)
        return chosen

    def _farthest(self) -> int | None:
        while self._heap:
            neg, _, block = self._heap[0]
            if self._resident.get(block) == -neg:
                return -neg
            heapq.heappop(self._heap)
        return None

    def __len__(self) -> int:
        return len(self._resident)
