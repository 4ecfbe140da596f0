"""The store's plain policy: least recently used, the NVMe tier's default and the replay baseline.

It implements :class:`kvtierd.policy.CachePolicy`, the contract between the store and every
policy (which lives below the store, so the pure engines in ``kvtierd.slsap`` implement it
without importing the store). Like every policy it is pure: the store reports insertions, reads
and removals with the time, asks for victims, and carries the decision out.

Held blocks (:meth:`LruPolicy.hold`: dirty in DRAM, not written back yet) are not walked over
again and again: one that reaches the head of the order is *parked* aside with a stamp of its
place, and once released it waits in a heap by that stamp. A parked block was the oldest when
it left, and whatever enters the order later enters at its end, so the released ones, stamp
order, come before the whole order: victims follow exact recency among the blocks not held.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from kvtierd.policy import AccessContext, CachePolicy

__all__ = ["LruPolicy"]


class LruPolicy(CachePolicy):
    """Least recently used: admit everything, evict the block read longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._held: set[Hashable] = set()
        # Held blocks taken off the head of the order, by their stamp (older first).
        self._parked: dict[Hashable, int] = {}
        # Released parked blocks (older than every block in the order), each with its entry in
        # a heap of (stamp, block) by stamp; an entry no longer in ``_returned`` is stale.
        self._returned: dict[Hashable, tuple[int, Hashable]] = {}
        self._heap: list[tuple[int, Hashable]] = []
        self._stamps = 0

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        return True

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        if self._held or self._parked or self._returned:
            self._leave_aside(block)
        self._order[block] = None
        self._order.move_to_end(block)

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        if block in self._order:
            self._order.move_to_end(block)
        elif block in self._parked or block in self._returned:
            self._parked.pop(block, None)
            self._returned.pop(block, None)
            self._order[block] = None  # used again: the newest, held or not

    def removed(self, block: Hashable) -> None:
        self._order.pop(block, None)
        if self._held or self._parked or self._returned:
            self._leave_aside(block)

    def _leave_aside(self, block: Hashable) -> None:
        self._held.discard(block)
        self._parked.pop(block, None)
        self._returned.pop(block, None)

    def hold(self, block: Hashable) -> None:
        if block in self._order or block in self._parked:
            self._held.add(block)
        elif (entry := self._returned.pop(block, None)) is not None:
            self._held.add(block)
            self._parked[block] = entry[0]

    def release(self, block: Hashable) -> None:
        if block not in self._held:
            return
        self._held.discard(block)
        stamp = self._parked.pop(block, None)
        if stamp is not None:
            entry = (stamp, block)
            self._returned[block] = entry
            heapq.heappush(self._heap, entry)

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        chosen: list[Hashable] = []
        if count <= 0:
            return chosen
        if self._returned:
            self._from_returned(count, evictable, chosen)
        held = self._held
        for block in self._iter_oldest():
            if len(chosen) >= count:
                break
            if block not in held and evictable(block):
                chosen.append(block)
        return chosen

    def _from_returned(
        self, count: int, evictable: Callable[[Hashable], bool], chosen: list[Hashable]
    ) -> None:
        """The released blocks, oldest first: they precede the whole order."""
        heap, returned = self._heap, self._returned
        kept: list[tuple[int, Hashable]] = []
        while heap and len(chosen) < count:
            entry = heapq.heappop(heap)
            if returned.get(entry[1]) is not entry:
                continue  # stale: the block left, or was used or held again
            kept.append(entry)
            if evictable(entry[1]):
                chosen.append(entry[1])
        for entry in kept:
            heapq.heappush(heap, entry)
        if len(heap) > 2 * len(returned) + 64:  # mostly stale entries: compact
            self._heap = [e for e in heap if returned.get(e[1]) is e]
            heapq.heapify(self._heap)

    def _iter_oldest(self) -> Iterator[Hashable]:
        # Park the held blocks at the head first: walking past them on every call is what
        # made allocations cost a walk of every dirty block.
        order, held = self._order, self._held
        while order and held:
            block = next(iter(order))
            if block not in held:
                break
            del order[block]
            self._parked[block] = self._stamps
            self._stamps += 1
        return iter(order)

    def __len__(self) -> int:
        return len(self._order) + len(self._parked) + len(self._returned)
