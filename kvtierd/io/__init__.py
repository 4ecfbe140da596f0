"""Disk I/O backends: io_uring (fixed buffers, eventfd wake-ups) and a thread-pool fallback.

:func:`open_io_backend` is the one place a backend is chosen by name, once, at start-up (like
trio's ``TheIOManager``): ``io_uring`` or ``threads`` exactly as asked, or ``auto``, which uses
io_uring where it works and falls back to threads where it does not, saying why in one WARNING.
io_uring's native binding is loaded into this process only after :mod:`kvtierd.io.probe` ran it
in a child process and it survived: a binding built for another CPU dies with SIGILL, and must
not take its caller with it. The chosen backend is logged at INFO on ``kvtierd.io``. See
``docs/io.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from functools import partial

import anyio.to_thread

from kvtierd.errors import StorageIOError
from kvtierd.io.base import IoBackend, IoBackendKind, IoStatistics
from kvtierd.io.binding import configured_binding, load_binding
from kvtierd.io.probe import BindingVerdict, probe_binding
from kvtierd.io.threads import open_thread_backend
from kvtierd.io.uring import open_uring_backend

__all__ = ["BindingVerdict", "IoBackend", "IoBackendKind", "IoStatistics", "open_io_backend"]

logger = logging.getLogger("kvtierd.io")

#: The most requests one backend keeps in the kernel (io_uring's ring size limit is 32768).
MAX_QUEUE_DEPTH = 4096


def open_io_backend(
    kind: IoBackendKind | str = IoBackendKind.AUTO,
    *,
    queue_depth: int = 64,
    binding: str | None = None,
    verdict: BindingVerdict | None = None,
) -> contextlib.AbstractAsyncContextManager[IoBackend]:
    """The backend named by ``kind``, keeping at most ``queue_depth`` operations in the kernel.

    ``kind`` is an :class:`IoBackendKind` or its value (``"io_uring"``, ``"threads"``,
    ``"auto"``). For io_uring, ``binding`` names the module that binds liburing (default:
    :func:`kvtierd.io.binding.configured_binding`), and ``verdict``
    is what :func:`kvtierd.io.probe.probe_binding` said of it (probed here, in a child process,
    when not given). Raises :class:`ValueError` at once for an unknown name or a queue depth
    outside 1..4096; entering raises :class:`StorageIOError` when ``io_uring`` was asked for
    explicitly and cannot work, with the reason. Leaving the context waits for operations still
    in flight, then releases the backend's resources, even after an error.
    """
    try:
        chosen = IoBackendKind(kind)
    except ValueError:
        valid = ", ".join(member.value for member in IoBackendKind)
        raise ValueError(f"unknown io backend {kind!r}; valid names: {valid}") from None
    if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise ValueError(f"queue_depth must be in 1..{MAX_QUEUE_DEPTH}, not {queue_depth}")
    return _open(chosen, queue_depth, binding or configured_binding(), verdict)


@contextlib.asynccontextmanager
async def _open(
    kind: IoBackendKind, queue_depth: int, binding: str, verdict: BindingVerdict | None
) -> AsyncIterator[IoBackend]:
    async with contextlib.AsyncExitStack() as stack:
        backend: IoBackend | None = None
        if kind is not IoBackendKind.THREADS:
            try:
                backend = await stack.enter_async_context(
                    _open_uring(queue_depth, binding, verdict)
                )
            except StorageIOError as exc:
                if kind is IoBackendKind.IO_URING:
                    raise
                logger.warning("io_uring unavailable, falling back to threads: %s", exc)
        if backend is None:
            backend = await stack.enter_async_context(open_thread_backend(queue_depth))
        logger.info(
            "io backend: %s (queue depth %d, fixed buffers %s)",
            backend.kind.value,
            queue_depth,
            "supported" if backend.supports_fixed_buffers else "unsupported",
        )
        yield backend


@contextlib.asynccontextmanager
async def _open_uring(
    queue_depth: int, binding: str, verdict: BindingVerdict | None
) -> AsyncIterator[IoBackend]:
    """The io_uring backend on ``binding``, which must have passed its probe."""
    if verdict is None:
        verdict = await anyio.to_thread.run_sync(partial(probe_binding, binding))
    if verdict.binding != binding:
        raise StorageIOError(f"the probe's verdict is about {verdict.binding}, not {binding}")
    if not verdict.ok:
        raise StorageIOError(verdict.detail)
    try:
        module = load_binding(binding)
    except ImportError as exc:
        raise StorageIOError(f"the liburing binding {binding} cannot be imported: {exc}") from exc
    cached = " (verdict cached)" if verdict.cached else ""
    logger.info("io_uring binding: %s%s", verdict.detail, cached)
    async with open_uring_backend(queue_depth, binding=module) as backend:
        yield backend
