"""The store's plain policy: least recently used, the NVMe tier's default and the replay baseline.

It implements :class:`kvtierd.policy.CachePolicy`, the contract between the store and every
policy (which lives below the store, so the pure engines in ``kvtierd.slsap`` implement it
without importing the store). Like every policy it is pure: the store reports insertions, reads
and removals with the time, asks for victims, and carries the decision out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from kvtierd.policy import AccessContext, CachePolicy

__all__ = ["LruPolicy"]


class LruPolicy(CachePolicy):
    """Least recently used: admit everything, evict the block read longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        return True

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        if block in self._order:
            self._order.move_to_end(block)

    def removed(self, block: Hashable) -> None:
        self._order.pop(block, None)

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        chosen: list[Hashable] = []
        for block in self._iter_oldest():
            if len(chosen) >= count:
                break
            if evictable(block):
                chosen.append(block)
        return chosen

    def _iter_oldest(self) -> Iterator[Hashable]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
