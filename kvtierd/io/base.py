"""The disk I/O port: one small abstract class every backend implements, and what they share.

Theory of operation
-------------------
The NVMe tier moves whole blocks between arena slots and preallocated files opened with
``O_DIRECT``. With ``O_DIRECT`` the kernel transfers straight between the device and the caller's
pages: buffers, offsets and lengths must be aligned to the logical block size (4096 here), and the
bytes land in (or are taken from) the caller's memory *while the operation is in the kernel*. The
kernel may complete a vectored transfer partially (end of file, a full disk, a signal); a backend
resubmits the remainder until every byte moved, and turns "no progress" into an error, so a
caller never sees a short transfer.

The one rule every backend keeps: **a call returns or raises only after the kernel has released
the buffers**. Cancellation of the calling task is therefore deferred until the operation finished
and re-delivered right after it (the caller may free or reuse a buffer the moment its task
unwinds). Errors are translated once, here: ``ENOSPC`` becomes :class:`NoSpaceError`, every other
``OSError`` and every short transfer becomes :class:`StorageIOError`, with the errno in the
message and the original ``OSError`` as ``__cause__``.
"""

from __future__ import annotations

import abc
import bisect
import enum
import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from kvtierd.errors import InvalidRequestError, KvtierError, NoSpaceError, StorageIOError

__all__ = [
    "LATENCY_BUCKETS_S",
    "MAX_BUFFERS_PER_OP",
    "IoBackend",
    "IoBackendKind",
    "IoStatistics",
    "Latencies",
    "OpCounters",
    "advance",
    "check_request",
    "os_error",
    "short_transfer_error",
]

#: The kernel's ``IOV_MAX``: the most buffers one vectored call may carry.
MAX_BUFFERS_PER_OP = 1024


class IoBackendKind(enum.StrEnum):
    """The names backends are chosen by (see :func:`kvtierd.io.open_io_backend`)."""

    IO_URING = "io_uring"
    THREADS = "threads"
    AUTO = "auto"


#: Upper bounds (s) of the disk-operation latency buckets, 50 µs to 5 s, in 1-2.5-5 steps.
LATENCY_BUCKETS_S = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class Latencies:
    """How long disk operations took, from the slot each got to its completion (what the
    daemon waited on the device for, queueing in the kernel included), in the buckets of
    :data:`LATENCY_BUCKETS_S` (one more for what took longer). Touched from the event loop
    only: a bisect and two additions per operation."""

    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds


@dataclass(frozen=True)
class IoStatistics:
    """A snapshot of a backend's counters.

    ``submitted``/``completed`` count requests that got one of the ``queue_depth`` slots and
    went to the kernel, and those that came back; ``in_flight`` is their difference, never more
    than ``queue_depth`` (calls still waiting for a slot are not counted). io_uring counts a
    resubmitted partial transfer as another request; the threads backend counts calls.
    ``fixed_ops`` counts ``readv``/``writev`` calls served from registered (fixed) buffers.
    ``submit_calls`` counts the system calls that handed requests to the kernel: io_uring
    hands a turn of the loop's requests over in one (see :mod:`kvtierd.io.ring`), the threads
    backend makes one per call.
    """

    kind: str
    submitted: int
    completed: int
    in_flight: int
    bytes_read: int
    bytes_written: int
    fixed_ops: int
    fsyncs: int
    submit_calls: int
    #: Operations the backend keeps in the kernel at most.
    queue_depth: int = 0
    #: :class:`Latencies`: per bucket (not cumulative), and their sum.
    latency_counts: tuple[int, ...] = ()
    latency_sum_s: float = 0.0


class IoBackend(abc.ABC):
    """Positional vectored I/O on file descriptors the caller opened (normally ``O_DIRECT``).

    Any number of tasks may call the async methods concurrently; at most ``queue_depth`` operations
    are in the kernel at once and the others wait their turn. Every method returns or raises only
    once the kernel no longer uses the buffers, even when the calling task is cancelled.
    """

    kind: IoBackendKind
    supports_fixed_buffers: bool
    #: Why transfers pin the caller's pages per request although the backend supports fixed
    #: buffers: the kernel refused :meth:`register_buffer`, or :meth:`release_fixed_buffers`
    #: gave them up. Empty while they are used, and where nothing was ever offered.
    fixed_buffers_fallback: str = ""

    @abc.abstractmethod
    def register_buffer(self, buffer: memoryview) -> None:
        """Declare the memory (the arena) most buffers will lie in; call once, before I/O.

        Raises :class:`StorageIOError` when the kernel refuses it; the backend then stays fully
        usable without fixed buffers, so a caller may log the error and carry on.
        """

    @abc.abstractmethod
    def release_fixed_buffers(self) -> None:
        """Stop using the memory :meth:`register_buffer` declared as fixed buffers: later
        transfers map the caller's pages per request. For when the registered pages may no
        longer be the memory's pages (a client punched a hole in a shared region: the kernel
        still holds the old pages, and a fixed read would land there). A no-op where nothing
        is registered."""

    @abc.abstractmethod
    async def readv(self, fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill every buffer, in order, from ``fd`` at ``offset``; return the bytes read.

        Raises :class:`StorageIOError` on an error or end of file before all buffers are full,
        :class:`NoSpaceError` for ``ENOSPC``, :class:`InvalidRequestError` for malformed
        arguments, :class:`ClosedError` after the backend was closed.
        """

    async def readv_each(
        self, fd: int, requests: Sequence[tuple[int, Sequence[memoryview]]]
    ) -> list[int | StorageIOError]:
        """:meth:`readv` of each ``(offset, buffers)`` of ``requests``, all in flight at once
        (within the queue depth); for each, the bytes read or the :class:`StorageIOError` its
        own :meth:`readv` raised, so that one unreadable request spoils no other. Raises what
        :meth:`readv` raises for anything else (malformed arguments, a closed backend), once
        every request has finished. By default a task per request; io_uring queues them all
        from the calling task."""
        results: list[int | StorageIOError] = [0] * len(requests)
        other: list[KvtierError] = []

        async def one(i: int, offset: int, buffers: Sequence[memoryview]) -> None:
            try:
                results[i] = await self.readv(fd, offset, buffers)
            except StorageIOError as exc:
                results[i] = exc
            except KvtierError as exc:
                other.append(exc)

        async with anyio.create_task_group() as tg:
            for i, (offset, buffers) in enumerate(requests):
                tg.start_soon(one, i, offset, buffers)
        if other:
            raise other[0]
        return results

    @abc.abstractmethod
    async def writev(self, fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
        """Write every buffer, in order, to ``fd`` at ``offset``; return the bytes written.

        Raises as :meth:`readv` does; a full disk raises :class:`NoSpaceError`.
        """

    @abc.abstractmethod
    async def fdatasync(self, fd: int) -> None:
        """Make the data written to ``fd`` durable; raises :class:`StorageIOError`."""

    @abc.abstractmethod
    def statistics(self) -> IoStatistics:
        """A snapshot of the counters."""


class OpCounters:
    """The mutable counters behind :class:`IoStatistics`; touched only from the event loop."""

    __slots__ = (
        "bytes_read",
        "bytes_written",
        "completed",
        "fixed_ops",
        "fsyncs",
        "submit_calls",
        "submitted",
    )

    def __init__(self) -> None:
        self.submitted = 0
        self.completed = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.fixed_ops = 0
        self.fsyncs = 0
        self.submit_calls = 0

    def snapshot(self, kind: IoBackendKind, queue_depth: int, latencies: Latencies) -> IoStatistics:
        return IoStatistics(
            kind=kind.value,
            submitted=self.submitted,
            completed=self.completed,
            in_flight=self.submitted - self.completed,
            bytes_read=self.bytes_read,
            bytes_written=self.bytes_written,
            fixed_ops=self.fixed_ops,
            fsyncs=self.fsyncs,
            submit_calls=self.submit_calls,
            queue_depth=queue_depth,
            latency_counts=tuple(latencies.counts),
            latency_sum_s=latencies.sum_s,
        )


def check_request(fd: int, offset: int, buffers: Sequence[memoryview]) -> list[memoryview]:
    """Validate a vectored request; return its buffers as flat byte views.

    Raises :class:`InvalidRequestError` for a negative fd or offset, no buffers, too many buffers,
    an empty or non-contiguous buffer.
    """
    if fd < 0:
        # A negative fd is a closed or never-opened file, as EBADF says; keep one error class.
        raise os_error("io", fd, offset, errno.EBADF)
    if offset < 0:
        raise InvalidRequestError(f"negative file offset {offset}")
    if not buffers:
        raise InvalidRequestError("no buffers")
    if len(buffers) > MAX_BUFFERS_PER_OP:
        raise InvalidRequestError(f"{len(buffers)} buffers, at most {MAX_BUFFERS_PER_OP}")
    views = []
    for buffer in buffers:
        if not buffer.c_contiguous:
            raise InvalidRequestError("buffers must be contiguous")
        if buffer.nbytes == 0:
            raise InvalidRequestError("empty buffer")
        views.append(buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B"))
    return views


def advance(views: Sequence[memoryview], nbytes: int) -> list[memoryview]:
    """The part of ``views`` still to transfer after the first ``nbytes`` moved."""
    rest: list[memoryview] = []
    for view in views:
        if nbytes >= len(view):
            nbytes -= len(view)
        else:
            rest.append(view[nbytes:] if nbytes else view)
            nbytes = 0
    return rest


def os_error(op: str, fd: int, offset: int, err: int) -> KvtierError:
    """The kvtierd error for an errno returned by ``op`` (raise it ``from`` an ``OSError``)."""
    message = f"{op} fd={fd} offset={offset}: [Errno {err}] {os.strerror(err)}"
    if err == errno.ENOSPC:
        return NoSpaceError(message)
    return StorageIOError(message)


def short_transfer_error(op: str, fd: int, offset: int, done: int, total: int) -> StorageIOError:
    """The error for a transfer that stopped making progress (end of file) after ``done`` bytes."""
    return StorageIOError(
        f"{op} fd={fd} offset={offset}: [Errno {errno.EIO}] short transfer, "
        f"end of file after {done} of {total} bytes"
    )
