"""The thread-pool backend: ``os.preadv``/``os.pwritev``/``os.fdatasync`` in anyio worker threads.

Theory of operation
-------------------
A blocking positional vectored call is the portable way to do ``O_DIRECT`` I/O: it works on every
kernel, inside containers whose seccomp profile forbids io_uring, and on asyncio as well as trio.
Each call runs in an anyio worker thread; a semaphore of ``queue_depth`` slots bounds how many
are in the kernel at once (the others wait for a slot, cancellably, before any thread starts).
The calls release the GIL, so the threads overlap their waits on the device; what they cost is a
thread hand-off and a page pin/unpin per call, about 2-4x the CPU of io_uring with fixed buffers.

A worker thread cannot be interrupted: the call is started with ``abandon_on_cancel=False``, so
a cancelled task waits until the kernel returned, and the cancellation is re-delivered right
after (``checkpoint_if_cancelled``). The kernel may transfer fewer bytes than asked (end of file,
a full disk, a signal); the worker loops on the remainder and reports "no progress" as a short
transfer. Errors travel back from the thread as values and are raised on the loop, so a
cancellation and a failure never race.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

import anyio

from kvtierd.errors import ClosedError
from kvtierd.io.base import (
    IoBackend,
    IoBackendKind,
    IoStatistics,
    Latencies,
    OpCounters,
    advance,
    check_request,
    os_error,
    short_transfer_error,
)

__all__ = ["ThreadBackend", "open_thread_backend"]

#: How long closing waits for calls still in worker threads.
DRAIN_TIMEOUT_S = 30.0

_Vectored = Callable[[int, Sequence[memoryview], int], int]


class _ShortTransfer(Exception):
    def __init__(self, done: int) -> None:
        super().__init__(done)
        self.done = done


def _transfer_all(call: _Vectored, fd: int, offset: int, views: list[memoryview]) -> int:
    """Runs in a worker thread: repeat ``call`` until every byte moved; 0 bytes is EOF."""
    done = 0
    while views:
        moved = call(fd, views, offset + done)
        if moved == 0:
            raise _ShortTransfer(done)
        done += moved
        views = advance(views, moved)
    return done


class _Job:
    """The work handed to a worker thread. Emptied once it ran: an idle anyio worker thread keeps
    its last job referenced, and a buffer still referenced would stay exported (its mmap could not
    be closed)."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[], int]) -> None:
        self.func: Callable[[], int] | None = func

    def __call__(self) -> int | BaseException:
        """Runs in the worker: the result or the error, so that it crosses back as a value."""
        assert self.func is not None
        try:
            return self.func()
        except (OSError, _ShortTransfer) as exc:
            return exc.with_traceback(None)  # the traceback's frames hold the buffers


class ThreadBackend(IoBackend):
    """:class:`IoBackend` on worker threads; obtain one from :func:`open_thread_backend`."""

    kind = IoBackendKind.THREADS
    supports_fixed_buffers = False

    def __init__(self, queue_depth: int) -> None:
        # Admission in the loop (so that counters are exact), then a thread each: the limiter only
        # sizes anyio's worker pool and never makes a call wait.
        # fast_acquire: the call's thread hop that follows is the checkpoint (see ring.py).
        self._slots = anyio.Semaphore(queue_depth, fast_acquire=True)
        self._limiter = anyio.CapacityLimiter(queue_depth)
        self._queue_depth = queue_depth
        self._counters = OpCounters()
        self._latencies = Latencies()
        self._closing = False
        self._drained = anyio.Event()

    def register_buffer(self, buffer: memoryview) -> None:
        """Accepted and ignored: blocking calls pin pages per call, there is nothing to register."""

    def release_fixed_buffers(self) -> None:
        """Nothing was registered."""

    async def readv(self, fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
        views = check_request(fd, offset, buffers)
        done = await self._run("readv", fd, offset, views, os.preadv)
        self._counters.bytes_read += done
        return done

    async def writev(self, fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
        views = check_request(fd, offset, buffers)
        done = await self._run("writev", fd, offset, views, os.pwritev)
        self._counters.bytes_written += done
        return done

    async def fdatasync(self, fd: int) -> None:
        if fd < 0:
            raise os_error("fdatasync", fd, 0, errno.EBADF)

        def sync() -> int:
            os.fdatasync(fd)
            return 0

        await self._in_thread("fdatasync", fd, 0, 0, sync)
        self._counters.fsyncs += 1

    def statistics(self) -> IoStatistics:
        return self._counters.snapshot(self.kind, self._queue_depth, self._latencies)

    async def _run(
        self, op: str, fd: int, offset: int, views: list[memoryview], call: _Vectored
    ) -> int:
        total = sum(view.nbytes for view in views)
        return await self._in_thread(
            op, fd, offset, total, lambda: _transfer_all(call, fd, offset, views)
        )

    async def _in_thread(
        self, op: str, fd: int, offset: int, total: int, func: Callable[[], int]
    ) -> int:
        if self._closing:
            raise ClosedError("the thread backend is closed")
        async with self._slots:
            self._counters.submitted += 1
            self._counters.submit_calls += 1
            job = _Job(func)
            started = time.perf_counter()
            try:
                outcome = await anyio.to_thread.run_sync(
                    job, limiter=self._limiter, abandon_on_cancel=False
                )
            finally:
                job.func = None
                self._latencies.observe(time.perf_counter() - started)
                self._note_completed()
        await anyio.lowlevel.checkpoint_if_cancelled()
        if isinstance(outcome, _ShortTransfer):
            raise short_transfer_error(op, fd, offset, outcome.done, total)
        if isinstance(outcome, OSError):
            raise os_error(op, fd, offset, outcome.errno or errno.EIO) from outcome
        if isinstance(outcome, BaseException):  # _Job lets nothing else through
            raise outcome
        return outcome

    def _note_completed(self) -> None:
        self._counters.completed += 1
        if self._closing and self._counters.completed == self._counters.submitted:
            self._drained.set()

    async def _drain(self) -> None:
        self._closing = True
        if self._counters.completed == self._counters.submitted:
            return
        with anyio.move_on_after(DRAIN_TIMEOUT_S, shield=True):
            await self._drained.wait()


@contextlib.asynccontextmanager
async def open_thread_backend(queue_depth: int = 64) -> AsyncIterator[ThreadBackend]:
    """A thread-pool backend running at most ``queue_depth`` calls at once.

    Leaving the context refuses new calls and waits (shielded, up to ``DRAIN_TIMEOUT_S``) for
    those still running in worker threads.
    """
    backend = ThreadBackend(queue_depth)
    try:
        yield backend
    finally:
        await backend._drain()
