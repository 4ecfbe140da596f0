"""A stack of unsigned 64-bit numbers in one numpy array: 8 bytes an entry.

Free lists of millions of entries (the NVMe tier's free slots, the cold index's free rows) kept
as Python lists cost about 36 bytes an entry (a pointer and an int object) and one object for
the collector to walk each; here an entry is 8 bytes and the collector sees one object. The
array doubles when full and halves when a quarter full, so pushes and pops are amortised O(1);
it lives in a private anonymous mapping resized by ``mremap`` (:mod:`kvtierd.store.mapped`), so
neither copies the entries (a push or pop is a client's request on the event loop).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvtierd.store.mapped import anonymous, resized

__all__ = ["FreeStack"]

_MIN_CAPACITY = 16


class FreeStack:
    """Last in, first out, of numbers in ``[0, 2**64)``."""

    __slots__ = ("_items", "_map", "_size")

    def __init__(self) -> None:
        self._map = anonymous(_MIN_CAPACITY * 8)
        self._items: npt.NDArray[np.uint64] = np.frombuffer(self._map, np.uint64)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, value: int) -> None:
        if self._size == len(self._items):
            self._resize(2 * len(self._items))
        self._items[self._size] = value
        self._size += 1

    def extend(self, values: npt.ArrayLike) -> None:
        """Push ``values`` in order (the last one is popped first)."""
        more = np.asarray(values, dtype=np.uint64).ravel()
        need = self._size + len(more)
        if need > len(self._items):
            self._resize(max(need, 2 * len(self._items)))
        self._items[self._size : need] = more
        self._size = need

    def pop(self) -> int:
        """The last number pushed; raises ``IndexError`` when empty."""
        if not self._size:
            raise IndexError("pop from an empty stack")
        self._size -= 1
        value = int(self._items[self._size])
        if len(self._items) > _MIN_CAPACITY and self._size <= len(self._items) // 4:
            self._resize(len(self._items) // 2)
        return value

    def remove(self, value: int) -> bool:
        """Take ``value`` out, wherever it is, the others keeping their order; whether it was
        there. A scan of the stack: for rare removals, not for a hot path."""
        found = np.flatnonzero(self._items[: self._size] == np.uint64(value))
        if not len(found):
            return False
        at = int(found[0])
        self._items[at : self._size - 1] = self._items[at + 1 : self._size].copy()
        self._size -= 1
        return True

    def push_bottom(self, value: int) -> None:
        """Push ``value`` under every other entry: popped last. A shift of the stack: rare."""
        self.push(value)
        items = self._items[: self._size]
        items[1:] = items[:-1].copy()
        items[0] = value

    def values(self) -> npt.NDArray[np.uint64]:
        """A copy of the entries, bottom first."""
        return self._items[: self._size].copy()

    def _resize(self, capacity: int) -> None:
        del self._items  # the only view of the mapping: it may be resized in place
        self._map = resized(self._map, max(capacity, _MIN_CAPACITY) * 8)
        self._items = np.frombuffer(self._map, np.uint64)
