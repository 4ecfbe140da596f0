"""Disk I/O backends: io_uring (fixed buffers, eventfd wake-ups) and a thread-pool fallback.

:func:`open_io_backend` is the one place a backend is chosen by name, once, at start-up (like
trio's ``TheIOManager``): ``io_uring`` or ``threads`` exactly as asked, or ``auto``, which opens
io_uring, proves that a request completes and wakes the event loop, and falls back to threads
when it does not, saying why at WARNING. The chosen backend is logged at INFO on ``kvtierd.io``.
See ``docs/io.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from kvtierd.errors import StorageIOError
from kvtierd.io.base import IoBackend, IoBackendKind, IoStatistics
from kvtierd.io.threads import open_thread_backend

__all__ = ["IoBackend", "IoBackendKind", "IoStatistics", "open_io_backend"]

logger = logging.getLogger("kvtierd.io")

#: The most requests one backend keeps in the kernel (io_uring's ring size limit is 32768).
MAX_QUEUE_DEPTH = 4096


def open_io_backend(
    kind: IoBackendKind | str = IoBackendKind.AUTO, *, queue_depth: int = 64
) -> contextlib.AbstractAsyncContextManager[IoBackend]:
    """The backend named by ``kind``, keeping at most ``queue_depth`` operations in the kernel.

    ``kind`` is an :class:`IoBackendKind` or its value (``"io_uring"``, ``"threads"``,
    ``"auto"``). Raises :class:`ValueError` at once for an unknown name or a queue depth outside
    1..4096; entering raises :class:`StorageIOError` when ``io_uring`` was asked for explicitly
    and is unavailable. Leaving the context waits for operations still in flight, then releases
    the backend's resources, even after an error.
    """
    try:
        chosen = IoBackendKind(kind)
    except ValueError:
        valid = ", ".join(member.value for member in IoBackendKind)
        raise ValueError(f"unknown io backend {kind!r}; valid names: {valid}") from None
    if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise ValueError(f"queue_depth must be in 1..{MAX_QUEUE_DEPTH}, not {queue_depth}")
    return _open(chosen, queue_depth)


@contextlib.asynccontextmanager
async def _open(kind: IoBackendKind, queue_depth: int) -> AsyncIterator[IoBackend]:
    async with contextlib.AsyncExitStack() as stack:
        backend: IoBackend
        if kind is IoBackendKind.THREADS:
            backend = await stack.enter_async_context(open_thread_backend(queue_depth))
        elif kind is IoBackendKind.IO_URING:
            backend = await stack.enter_async_context(_open_uring(queue_depth))
        else:
            try:
                backend = await stack.enter_async_context(_open_uring(queue_depth))
            except StorageIOError as exc:
                logger.warning("io_uring unavailable, falling back to threads: %s", exc)
                backend = await stack.enter_async_context(open_thread_backend(queue_depth))
        logger.info(
            "io backend: %s (queue depth %d, fixed buffers %s)",
            backend.kind.value,
            queue_depth,
            "supported" if backend.supports_fixed_buffers else "unsupported",
        )
        yield backend


def _open_uring(queue_depth: int) -> contextlib.AbstractAsyncContextManager[IoBackend]:
    """The io_uring backend; an import failure of the binding reads as io_uring unavailable."""
    try:
        from kvtierd.io.uring import open_uring_backend
    except ImportError as exc:
        raise StorageIOError(f"the liburing package cannot be imported: {exc}") from exc
    return open_uring_backend(queue_depth)
