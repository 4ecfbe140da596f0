"""CLOCK for trace replay: the NVMe tier's policy (:mod:`kvtierd.store.clock`), run as it runs
in the daemon, over a cold index of its own.

In the daemon the rows are the tier's records and the tier adds and frees them; a simulated
cache has no disk, so this adapter keeps a :class:`~kvtierd.store.coldindex.ColdIndex` with a
row per cached block, written when the block enters and freed when it leaves. A trace's block
ids (integers) become keys of 16 bytes in one namespace, and back. Replaying it beside LRU
shows what the byte per block costs in hits.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.store.clock import ClockPolicy
from kvtierd.store.coldindex import ColdIndex
from kvtierd.store.records import RecordHeader

__all__ = ["ReplayClock"]

_NS = bytes(16)
_KEY_BYTES = 16


def _id(block: Hashable) -> tuple[bytes, bytes]:
    assert isinstance(block, int)
    return _NS, block.to_bytes(_KEY_BYTES, "little", signed=True)


def _block(block_id: Hashable) -> int:
    return int.from_bytes(block_id[1], "little", signed=True)  # type: ignore[index]


class ReplayClock(CachePolicy):
    """:class:`~kvtierd.store.clock.ClockPolicy` over rows this policy writes itself, for the
    simulator's integer block ids."""

    def __init__(self) -> None:
        self._cold = ColdIndex()
        self._clock = ClockPolicy(lambda: self._cold)
        self._free_places: list[int] = []  # slot numbers of freed rows, reused
        self._seq = 0

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        return True

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        digest, key = block_id = _id(block)
        if self._cold.find(digest, key) >= 0:  # already cached: an access
            self._clock.accessed(block_id, now, context)
        else:
            place = self._free_places.pop() if self._free_places else len(self._cold)
            self._seq += 1
            self._cold.add(digest, RecordHeader(digest, key, 1, 1, 0, self._seq, 0), 0, place)
        self._clock.inserted(block_id, now, context)

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self._clock.accessed(_id(block), now, context)

    def removed(self, block: Hashable) -> None:
        block_id = _id(block)
        row = self._cold.find(*block_id)
        if row >= 0:
            self._free_places.append(self._cold.place(row)[1])
            self._cold.remove(row)
        self._clock.removed(block_id)

    def hold(self, block: Hashable) -> None:
        self._clock.hold(_id(block))

    def release(self, block: Hashable) -> None:
        self._clock.release(_id(block))

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        chosen = self._clock.victims(count, lambda block_id: evictable(_block(block_id)))
        return [_block(block_id) for block_id in chosen]

    def __len__(self) -> int:
        return len(self._clock)
