"""Loop time for requests whose work grows with their size: short slices, taken in turn.

Theory of operation. The store's state lives on the event loop thread and changes only between
``await`` points (:mod:`kvtierd.store.residency`), so the work a request does over its keys
cannot move to a worker thread without a lock around the whole index; and pure Python in a
thread would hold the GIL for the interpreter's switch interval (5 ms) at a time anyway. So a
request that walks many keys does it on the loop, in slices of at most :data:`SLICE_S`, and
gives the loop back between slices: other connections' frames are read and served in between.

Slicing one request is not enough: a client pipelining ``max_inflight`` large requests would put
that many slices in every turn of the loop. So the slices of all large requests, daemon-wide,
take turns through one fair (first come, first served) lock, the :class:`Lane`: at most one
slice of bulk work runs per turn of the loop, whoever asks, and a LOOKUP of another connection
waits for at most about one slice. Walks of at most :data:`INLINE_ITEMS` items (the common
small READ) skip the lane and never yield: slicing costs them nothing.

What a slice may rely on: nothing it saw in an earlier slice (a block found then may have been
forgotten, evicted or pinned since): each step checks what it acts on, or its caller pinned it
first. A walk never holds the lane across real I/O: :meth:`Walk.release` before such an
``await``; the next :meth:`Walk.pause` takes the lane again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

import anyio

__all__ = ["INLINE_ITEMS", "SLICE_S", "Lane", "Walk"]

T = TypeVar("T")
R = TypeVar("R")

#: Loop time one slice of bulk work may take before it lets others run.
SLICE_S = 0.001
#: Walks of at most this many items run in one go (about 0.1-0.5 ms of work).
INLINE_ITEMS = 256


class Lane:
    """The daemon-wide turn for bulk work (one per store)."""

    def __init__(self, slice_s: float = SLICE_S, inline_items: int = INLINE_ITEMS) -> None:
        self.slice_s = slice_s
        self.inline_items = inline_items
        self._lock = anyio.Lock()
        #: Slices handed over so far (each one a turn of the loop given to others).
        self.turns = 0

    def walk(self, items: int) -> Walk:
        """A walk over ``items`` items: ``async with lane.walk(n) as walk`` and ``await
        walk.pause()`` before each item."""
        return Walk(self, items > self.inline_items)

    async def map(self, items: Sequence[T], step: Callable[[T], R]) -> list[R]:
        """``[step(item) for item in items]``, in slices."""
        if len(items) <= self.inline_items:
            return [step(item) for item in items]
        results: list[R] = []
        async with self.walk(len(items)) as walk:
            for item in items:
                await walk.pause()
                results.append(step(item))
        return results


class Walk:
    """One request's turn on the :class:`Lane`, taken at its first :meth:`pause`, handed on
    whenever its slice is spent, and given back on exit (cancellation included)."""

    def __init__(self, lane: Lane, sliced: bool) -> None:
        self._lane = lane
        self.sliced = sliced
        self._held = False
        self._since = 0.0

    async def __aenter__(self) -> Walk:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def pause(self) -> None:
        """Call before each item: returns at once while the slice lasts; else lets the loop
        serve others (the lane goes to the next waiting walk, first come first served) and
        returns holding the lane again."""
        if not self.sliced:
            return
        if self._held:
            if time.perf_counter() - self._since < self._lane.slice_s:
                return
            self.release()
            self._lane.turns += 1
        await self._lane._lock.acquire()  # yields a turn of the loop even when free
        self._held = True
        self._since = time.perf_counter()

    def release(self) -> None:
        """Give the lane back (before awaiting I/O, and at the end)."""
        if self._held:
            self._held = False
            self._lane._lock.release()
