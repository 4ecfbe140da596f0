"""Raw addresses of caller buffers and the registered (fixed) buffer table.

Theory of operation
-------------------
The io_uring backend hands the kernel *addresses*. Python buffers do not expose theirs, so
:func:`buffer_address` reads it through ctypes (numpy for a read-only view, which ctypes refuses)
and lets go of the export at once: nothing here keeps a caller's buffer exported, so the caller
can always ``release()`` its memoryviews and close its mmap. ctypes takes about 1.4 us, numpy
6.5: a cold READ asks for two addresses per block.

Registered buffers: Linux refuses to register one buffer larger than 1 GiB (``EFAULT``), so
:class:`FixedRegions` registers an arena as consecutive chunks of at most ``chunk_bytes``, buffer
indices 0, 1, ... (an arena of up to 1 GiB is exactly index 0). An operation uses the fixed form
when all its buffers lie inside one chunk; otherwise it takes the plain vectored form. The kernel
pins the registered pages until the ring is torn down, so the arena must stay mapped (at the same
address, with the same pages) for the backend's lifetime.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtierd.io.binding import Span

__all__ = [
    "MAX_FIXED_CHUNK_BYTES",
    "FixedRegions",
    "Span",
    "advance_spans",
    "buffer_address",
]

#: The kernel's limit on one registered buffer.
MAX_FIXED_CHUNK_BYTES = 1 << 30


def buffer_address(view: memoryview) -> int:
    """The address of the first byte of a contiguous, non-empty ``view``."""
    if view.readonly:
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def advance_spans(spans: Sequence[Span], nbytes: int) -> list[Span]:
    """The part of ``spans`` still to transfer after the first ``nbytes`` moved."""
    rest: list[Span] = []
    for address, length in spans:
        if nbytes >= length:
            nbytes -= length
        else:
            rest.append((address + nbytes, length - nbytes))
            nbytes = 0
    return rest


@dataclass(frozen=True)
class FixedRegions:
    """A registered memory range split into chunks; chunk ``i`` is registered buffer index ``i``."""

    start: int
    nbytes: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError("a registered buffer must not be empty")
        if not 0 < self.chunk_bytes <= MAX_FIXED_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_FIXED_CHUNK_BYTES}")

    def chunks(self) -> list[Span]:
        """The ``(address, length)`` of every chunk, in buffer-index order."""
        return [
            (self.start + pos, min(self.chunk_bytes, self.nbytes - pos))
            for pos in range(0, self.nbytes, self.chunk_bytes)
        ]

    def index_for(self, spans: Sequence[Span]) -> int | None:
        """The buffer index of the one chunk holding every span, or ``None`` if there is none."""
        index: int | None = None
        end = self.start + self.nbytes
        for address, length in spans:
            if address < self.start or address + length > end:
                return None
            first = (address - self.start) // self.chunk_bytes
            last = (address + length - 1 - self.start) // self.chunk_bytes
            if first != last or (index is not None and first != index):
                return None
            index = first
        return index
