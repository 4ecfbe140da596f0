"""Aligned scratch pages for record headers, carved from the arena's reserved head.

Disk I/O moves a record as ``[header page, payload]`` in one vectored operation. The header
page must be 4 KiB-aligned memory and, for io_uring's fixed-buffer path, lie inside the
registered arena; so the arena's first ``count`` pages are kept for this and never given to
blocks. Holding a page is an async context manager; waiting for one is the back-pressure that
bounds concurrent disk operations.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from kvtierd.store.records import PAGE_BYTES

__all__ = ["StagingPages"]


class StagingPages:
    """``count`` pages at the start of ``region`` (a view of the arena's head)."""

    def __init__(self, region: memoryview, count: int) -> None:
        if len(region) < count * PAGE_BYTES:
            raise ValueError("the staging region is smaller than its pages")
        self._region = region
        self._free = list(range(count))
        self._available = anyio.Semaphore(count)
        self.count = count

    @contextlib.asynccontextmanager
    async def page(self) -> AsyncIterator[memoryview]:
        """A page for the duration of the ``async with`` block."""
        async with self._available:
            index = self._free.pop()
            try:
                yield self._region[index * PAGE_BYTES : (index + 1) * PAGE_BYTES]
            finally:
                self._free.append(index)
