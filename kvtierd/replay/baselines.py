"""Published online policies as ``CachePolicy`` implementations: LFU, ARC and S3-FIFO.

They exist to be compared with SLSAP in trace replay (LRU is :class:`kvtierd.store.policy.
LruPolicy`). Each follows its paper; where the ``CachePolicy`` call order forces a choice, the
choice is stated on the class. All are deterministic.

- LFU: evict the resident read by the fewest requests since it was admitted, oldest first.
- ARC (Megiddo and Modha, FAST 2003): recency list T1, frequency list T2, their ghosts B1/B2 and
  the adaptive target ``p`` for T1.
- S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10 % of the capacity) that filters one-hit
  blocks, a main FIFO with 2-bit frequency counters and a ghost FIFO as large as the main one.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvtierd.policy import AccessContext, CachePolicy

__all__ = ["ArcPolicy", "LfuPolicy", "S3FifoPolicy"]


class LfuPolicy(CachePolicy):
    """In-cache LFU: frequency counts start at 1 on insertion and are forgotten on removal."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int]] = []
        self._keys: dict[int, Hashable] = {}
        self._tick = 0

    def _push(self, block: Hashable, freq: int) -> None:
        self._tick += 1
        self._entries[block] = (freq, self._tick)
        self._keys[self._tick] = block
        heapq.heappush(self._heap, (freq, self._tick, self._tick))

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        return True

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self._push(block, 1)

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        entry = self._entries.get(block)
        if entry is not None:
            self._keys.pop(entry[1], None)
            self._push(block, entry[0] + 1)

    def removed(self, block: Hashable) -> None:
        entry = self._entries.pop(block, None)
        if entry is not None:
            self._keys.pop(entry[1], None)

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        chosen: list[Hashable] = []
        skipped: list[tuple[int, int, int]] = []
        while self._heap and len(chosen) < count:
            item = heapq.heappop(self._heap)
            block = self._keys.get(item[2])
            if block is None:
                continue
            skipped.append(item)
            if evictable(block):
                chosen.append(block)
        for item in skipped:
            heapq.heappush(self._heap, item)
        return chosen

    def __len__(self) -> int:
        return len(self._entries)


class ArcPolicy(CachePolicy):
    """Adaptive Replacement Cache for ``capacity`` blocks.

    ``admit`` of a ghost adapts ``p`` as the paper's cases II and III; ``victims`` is REPLACE
    (with the pending block's ghost list); ``removed`` moves the victim to its ghost list;
    ``inserted`` places the block in T2 if it was a ghost, else T1, then trims the ghost lists
    (case IV).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.p = 0.0
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._pending_in_b2 = False

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        b1, b2 = len(self._b1), len(self._b2)
        if block in self._b1:
            self.p = min(float(self.capacity), self.p + max(b2 / b1, 1.0))
        elif block in self._b2:
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))
        self._pending_in_b2 = block in self._b2
        return True

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        if block in self._b1 or block in self._b2:
            self._b1.pop(block, None)
            self._b2.pop(block, None)
            self._t2[block] = None
        else:
            self._t1[block] = None
        self._pending_in_b2 = False
        c = self.capacity
        while len(self._t1) + len(self._b1) > c and self._b1:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c and self._b2:
            self._b2.popitem(last=False)

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        if block in self._t1:
            del self._t1[block]
            self._t2[block] = None
        elif block in self._t2:
            self._t2.move_to_end(block)

    def removed(self, block: Hashable) -> None:
        if block in self._t1:
            del self._t1[block]
            self._b1[block] = None
        elif block in self._t2:
            del self._t2[block]
            self._b2[block] = None

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        t1_first = bool(self._t1) and (
            len(self._t1) > self.p or (self._pending_in_b2 and len(self._t1) >= int(self.p))
        )
        lists = (self._t1, self._t2) if t1_first else (self._t2, self._t1)
        chosen: list[Hashable] = []
        for lst in lists:
            for block in lst:
                if len(chosen) >= count:
                    return chosen
                if evictable(block):
                    chosen.append(block)
        return chosen

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


class S3FifoPolicy(CachePolicy):
    """S3-FIFO for ``capacity`` blocks: small FIFO S, main FIFO M, ghost FIFO G.

    ``victims`` runs the eviction loop, moving blocks from S to M (read at least once) and
    re-inserting M blocks with a non-zero counter, until it reaches blocks to evict; ``removed``
    records an S victim in G. A block inserted while in G goes to M.
    """

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._small_target = max(1, int(capacity * small_fraction))
        self._small: OrderedDict[Hashable, None] = OrderedDict()
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        return True

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self._freq[block] = 0
        if block in self._ghost:
            del self._ghost[block]
            self._main[block] = None
        else:
            self._small[block] = None

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        if block in self._freq:
            self._freq[block] = min(self._freq[block] + 1, 3)

    def removed(self, block: Hashable) -> None:
        if block in self._small:
            del self._small[block]
            self._ghost[block] = None
            while len(self._ghost) > max(1, self.capacity - self._small_target):
                self._ghost.popitem(last=False)
        else:
            self._main.pop(block, None)
        self._freq.pop(block, None)

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        chosen: list[Hashable] = []
        budget = 4 * (len(self._small) + len(self._main)) + 4
        while len(chosen) < count and budget > 0:
            budget -= 1
            if len(self._small) >= self._small_target or not self._main:
                block = self._next_small(chosen)
            else:
                block = self._next_main(chosen)
            if block is None:
                break
            if evictable(block):
                chosen.append(block)
            elif block in self._small:
                self._small.move_to_end(block)
            else:
                self._main.move_to_end(block)
        return chosen

    def _next_small(self, chosen: list[Hashable]) -> Hashable | None:
        while self._small:
            block = _first_not_in(self._small, chosen)
            if block is None:
                break
            if self._freq.get(block, 0) > 0:
                del self._small[block]
                self._freq[block] = 0
                self._main[block] = None
                continue
            return block
        return self._next_main(chosen)

    def _next_main(self, chosen: list[Hashable]) -> Hashable | None:
        for _ in range(4 * len(self._main) + 1):
            block = _first_not_in(self._main, chosen)
            if block is None:
                return None
            if self._freq.get(block, 0) > 0:
                self._freq[block] -= 1
                self._main.move_to_end(block)
                continue
            return block
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


def _first_not_in(queue: OrderedDict[Hashable, None], chosen: list[Hashable]) -> Hashable | None:
    """The oldest block of ``queue`` not already chosen in this ``victims`` call."""
    for block in queue:
        if block not in chosen:
            return block
    return None
