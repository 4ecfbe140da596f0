"""Buffer objects at raw addresses, for bindings whose iovec type takes only Python buffers.

The PyPI ``liburing`` packages build ``struct iovec`` arrays from objects that support the
buffer protocol, never from ``(address, length)`` spans, which is what the binding port hands a
binding. A *segment* is a memoryview over a ``ctypes`` array placed at the span's address
(``from_address``): it owns nothing and pins nothing, so exporting it keeps no caller's mmap
exported. The 2026 wheels never release an export they take, so every segment they are given
leaks; :class:`SegmentCache` keeps one per distinct span, which for an arena of fixed slots
reused forever is a bounded set (the backend of commit 08ed047 did the same).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Sequence

from kvtierd.io.binding import Span

__all__ = ["SegmentCache"]


class SegmentCache:
    """One never-freed segment per ``(address, length)``, least recently used dropped past
    ``capacity`` (a dropped segment a binding still holds stays alive through that binding)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self._capacity = capacity
        self._segments: OrderedDict[Span, memoryview] = OrderedDict()

    def __len__(self) -> int:
        return len(self._segments)

    def segments(self, spans: Sequence[Span]) -> list[memoryview]:
        """A writable, unsigned-byte segment per span, in order."""
        return [self._segment(span) for span in spans]

    def _segment(self, span: Span) -> memoryview:
        segment = self._segments.get(span)
        if segment is not None:
            self._segments.move_to_end(span)
            return segment
        address, length = span
        segment = memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")
        self._segments[span] = segment
        if len(self._segments) > self._capacity:
            self._segments.popitem(last=False)
        return segment
