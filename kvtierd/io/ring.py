"""An io_uring instance driven from an anyio event loop: submission, eventfd wake-ups, reaping.

Theory of operation
-------------------
io_uring is two rings shared with the kernel. We write submission queue entries (SQEs) and publish
them with ``io_uring_enter`` (``io_uring_submit``); the kernel consumes them *in order* and later
posts one completion queue entry (CQE) per request, carrying our 64-bit ``user_data`` and the
result (bytes moved, or ``-errno``). Until its CQE is posted the kernel may read or write the
request's buffers; after it, it never touches them again. The ring itself comes from a binding
of liburing (:mod:`kvtierd.io.binding`), which prepares and tags an SQE in one call.

* Everything runs on the event-loop thread: preparing SQEs, submitting, reaping. No locks.
* Submissions are grouped: a request's SQE is published at once, but handed to the kernel by a
  single submitter task, woken by the first request of a turn of the loop, which runs after
  every task of that turn has queued its own: one ``io_uring_enter`` per group, however many
  requests the group holds (the workers of a READ, the completions of one reap, each
  followed by its next request). A failed submission is retried by that task, every
  :data:`_RETRY_SUBMIT_S`, until it is taken or the ring breaks.
* Completions wake the loop through an eventfd registered with the ring
  (``io_uring_register_eventfd``): the kernel bumps it for every CQE it posts, and a single reaper
  waits for it: on asyncio a reader callback registered once for the ring's life, on trio a
  task in ``anyio.wait_readable`` (epoll on both). The reaper drains the eventfd *before*
  reading the CQ, so a CQE posted meanwhile re-arms it: no lost wake-up.
  The ring is created without ``COOP_TASKRUN``/``DEFER_TASKRUN``, so the kernel finishes
  completions (task work) by interrupting the thread even while it sleeps in epoll.
* Each request has a token (its ``user_data``) mapping to a :class:`_Waiter`. The submitting task
  waits for it inside a shielded cancel scope, so it cannot leave while the kernel owns its
  buffers; a cancellation is re-delivered once the CQE arrived.
* At most ``entries`` requests are in the kernel, and the CQ has twice as many slots, so the
  SQ is never full and the CQ never overflows. Requests past that wait in a FIFO backlog,
  unprepared; the reaper prepares the next as each completion frees a slot and hands them
  over in the same turn, one ``io_uring_enter`` for the whole reap: the queue is fed as each
  read ends, with no task wake-up, no semaphore and no extra turn of the loop between a
  completion and the next submission (at 448 KiB blocks those turns kept the disk idle).
* One task may have many requests in flight (:meth:`CompletionRing.run_many`: the blocks of a
  READ, each record group one request): they share one wake-up, set by the completion of
  the last of them, and each frees its own slot as it completes, so a slow one keeps only its
  own.
* A failed ``io_uring_enter`` consumes nothing. Transient failures (``EAGAIN``, ``EBUSY``,
  ``EINTR``) are retried; any other failure breaks the ring: the requests it did not consume are
  failed at once (the kernel will never see them, since nothing enters the ring again) and those
  it did consume still complete normally.
* The reaper runs shielded in the task group of :func:`open_completion_ring` and stops only when
  the ring closes, after the in-flight requests drained, so shielded waiters are always woken.
* Closing waits for the in-flight requests; past ``drain_timeout_s`` it asks the kernel to cancel
  them all (``IORING_OP_ASYNC_CANCEL``, which ends requests waiting on pipes, sockets, locks) and
  waits as long again. A request even that leaves in the kernel (a hung device) is abandoned:
  the ring is torn down and its caller gets ``-ECANCELED``, although the kernel may still write
  its buffer later. That is logged as an error; it is the price of closing at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import anyio.abc
import anyio.lowlevel
import sniffio

from kvtierd.errors import ClosedError, StorageIOError
from kvtierd.io.base import Latencies
from kvtierd.io.binding import RawRing, UringBinding

__all__ = ["CompletionRing", "Prep", "open_completion_ring"]

logger = logging.getLogger("kvtierd.io")

#: How long closing waits for in-flight requests, twice: before and after cancelling them.
DRAIN_TIMEOUT_S = 30.0
_RETRY_SUBMIT_S = 0.001
_TRANSIENT = frozenset({errno.EAGAIN, errno.EBUSY, errno.EINTR})

#: Queues one request tagged with the given token; returns what must live until its completion.
Prep = Callable[[int], object]


class _Batch:
    """The requests of one :meth:`CompletionRing.run_many` call: one wake-up for them all."""

    __slots__ = ("done", "remaining")

    def __init__(self, count: int) -> None:
        self.done = anyio.Event()
        self.remaining = count


class _Waiter:
    __slots__ = (
        "batch", "counted", "error", "keepalive", "prep", "result", "started", "submitted", "token",
    )  # fmt: skip

    def __init__(self, prep: Prep, batch: _Batch) -> None:
        self.prep: Prep | None = prep  # dropped once used: it holds the request's buffers
        self.batch = batch
        self.token = 0  # 0 while in the backlog: the kernel has not seen it
        self.keepalive: object = None  # the iovec array the kernel may read until completion
        self.result = 0
        self.submitted = False
        self.error: Exception | None = None
        self.counted = True
        self.started = 0.0  # when it got its slot (perf_counter)


class CompletionRing:
    """One io_uring with its eventfd; use it through :func:`open_completion_ring`."""

    def __init__(
        self, binding: UringBinding, entries: int, *, drain_timeout_s: float = DRAIN_TIMEOUT_S
    ) -> None:
        self._binding = binding
        self._raw: RawRing | None = None
        self._efd = -1
        self._entries = entries
        self._drain_timeout_s = drain_timeout_s
        #: Queue-depth slots not held by a request in the ring.
        self._free = entries
        #: Requests waiting for a slot, first come first served.
        self._backlog: deque[_Waiter] = deque()
        self._tokens = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._unsubmitted: deque[_Waiter] = deque()
        self._broken: OSError | None = None
        self._closing = False
        self._reaping = False
        self._drained = anyio.Event()
        self._reaper_scope: anyio.CancelScope | None = None
        self._submitter_scope: anyio.CancelScope | None = None
        self._queued = anyio.Event()
        #: ``io_uring_enter`` calls that handed requests to the kernel.
        self.enters = 0
        #: Requests handed to the ring (given a slot), and those of them that completed.
        self.submitted = 0
        self.completed = 0
        #: How long the counted requests took, from their slot to their completion.
        self.latencies = Latencies()

    @property
    def entries(self) -> int:
        """The queue depth: requests in the kernel at most."""
        return self._entries

    @property
    def raw(self) -> RawRing:
        """The binding's ring, for registrations and opcode checks (not for submitting)."""
        assert self._raw is not None, "the ring is not set up"
        return self._raw

    async def run(self, prep: Prep) -> int:
        """Submit one request prepared by ``prep`` and return its result (``-errno`` on error).

        Waits for a free slot (cancellable), then for the completion (not cancellable: a
        cancellation is re-delivered after it). Raises :class:`ClosedError` once closing began,
        :class:`StorageIOError` when the ring broke before the request reached the kernel.
        """
        return (await self.run_many((prep,)))[0]

    async def run_many(self, preps: Sequence[Prep]) -> list[int]:
        """:meth:`run` of every request of ``preps``, all in flight at once (as the queue
        depth allows, the rest in the backlog) from this one task; their results, in order.
        Waiting in the backlog is cancellable: a cancelled call takes back the requests the
        kernel has not got and waits for the others first."""
        if self._closing:
            raise ClosedError("the io_uring backend is closed")
        if self._broken is not None:
            raise StorageIOError(f"io_uring is broken: {self._broken}") from self._broken
        if not preps:
            return []
        batch = _Batch(len(preps))
        waiters = [_Waiter(prep, batch) for prep in preps]
        backlog = self._backlog
        for waiter in waiters:
            if self._free and not backlog:
                self._start(waiter)
            else:
                backlog.append(waiter)
        try:
            await batch.done.wait()
        except BaseException:
            for waiter in waiters:
                if not waiter.token and waiter.prep is not None:  # still in the backlog
                    backlog.remove(waiter)
                    waiter.prep = None
                    batch.remaining -= 1
            with anyio.CancelScope(shield=True):  # the kernel may own their buffers
                if batch.remaining:
                    await batch.done.wait()
            raise
        return [self._result(waiter) for waiter in waiters]

    def _start(self, waiter: _Waiter, *, counted: bool = True) -> None:
        """Give ``waiter`` a slot and queue its request in the SQ (submitted by the next flush);
        a request that cannot be queued completes at once with its error. ``counted``: in
        :attr:`submitted` and :attr:`completed` (the opening probe's NOP is not)."""
        prep = waiter.prep
        assert prep is not None
        waiter.prep = None
        if self._closing or self._broken is not None:
            reason = self._broken or "closed before the kernel took it"
            waiter.error = StorageIOError(f"io_uring request not submitted: {reason}")
            self._finish(waiter)
            return
        token = waiter.token = next(self._tokens)
        try:
            waiter.keepalive = prep(token)
        except OSError as exc:  # EBUSY: impossible while the slots bound the SQ
            waiter.error = StorageIOError(f"io_uring: cannot queue a request: {exc}")
            self._finish(waiter)
            return
        except Exception as exc:  # a bad argument: raised to its caller, never in the reaper
            waiter.error = exc
            self._finish(waiter)
            return
        self._free -= 1
        waiter.counted = counted
        waiter.started = time.perf_counter()
        self.submitted += counted
        self._waiters[token] = waiter
        self._unsubmitted.append(waiter)
        if not self._reaping:  # the reaper hands over what it queues itself
            self._queued.set()  # the submitter hands this turn's requests over in one call

    def _finish(self, waiter: _Waiter) -> None:
        batch = waiter.batch
        batch.remaining -= 1
        if not batch.remaining:
            batch.done.set()

    def _result(self, waiter: _Waiter) -> int:
        if waiter.error is not None:
            raise waiter.error
        if not waiter.submitted:
            reason = self._broken or "closed before the kernel took it"
            raise StorageIOError(f"io_uring request not submitted: {reason}") from self._broken
        return waiter.result

    async def probe(self, timeout_s: float) -> None:
        """Prove that a request completes and wakes the loop; raises :class:`StorageIOError`."""
        waiter = _Waiter(self.raw.prep_nop, _Batch(1))
        self._start(waiter, counted=False)
        with anyio.move_on_after(timeout_s):
            await waiter.batch.done.wait()
        if waiter.error is not None:
            raise waiter.error
        if not waiter.batch.done.is_set():
            self._reap()  # collect the NOP anyway, so that closing does not wait for it
            raise StorageIOError(f"io_uring: no completion through the eventfd in {timeout_s} s")
        if waiter.result < 0:
            raise StorageIOError(f"io_uring: NOP failed: {os.strerror(-waiter.result)}")

    def _flush(self) -> None:
        """Hand the published SQEs to the kernel; the first ``n`` unsubmitted were consumed."""
        if not self._unsubmitted or self._broken is not None:
            return
        try:
            consumed = self.raw.submit()
        except OSError as exc:
            if exc.errno in _TRANSIENT:
                return
            self._break(exc)
            return
        self.enters += 1
        for _ in range(min(consumed, len(self._unsubmitted))):
            self._unsubmitted.popleft().submitted = True

    async def _submit_forever(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.CancelScope(shield=True) as self._submitter_scope:
            task_status.started()
            while True:
                await self._queued.wait()
                self._queued = anyio.Event()
                self._flush()
                while self._unsubmitted and self._broken is None:  # EAGAIN, EBUSY, EINTR
                    await anyio.sleep(_RETRY_SUBMIT_S)
                    self._flush()

    def _break(self, exc: OSError) -> None:
        logger.error("io_uring submission failed, the backend is unusable: %s", exc)
        self._broken = exc
        while self._unsubmitted:  # each completion fails a backlog request in its slot
            waiter = self._unsubmitted.popleft()
            del self._waiters[waiter.token]
            self._complete(waiter, -(exc.errno or errno.EIO))
        self._check_drained()

    async def _reap_forever(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.CancelScope(shield=True) as self._reaper_scope:
            if sniffio.current_async_library() == "asyncio":
                # The eventfd's reader stays registered and reaps from its callback: waiting
                # with anyio.wait_readable registers and drops it again at every wake-up (two
                # epoll_ctl calls, a future and a task step per wake-up, about one per block
                # of a READ of small blocks).
                loop = asyncio.get_running_loop()
                loop.add_reader(self._efd, self._on_eventfd)
                try:
                    task_status.started()
                    await anyio.sleep_forever()  # until the ring closes
                finally:
                    loop.remove_reader(self._efd)
            else:
                task_status.started()
                while True:
                    await anyio.wait_readable(self._efd)
                    self._on_eventfd()

    def _on_eventfd(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        self._reap()

    def _reap(self) -> None:
        """Complete what the CQ holds, start the backlog's next requests in the slots that
        freed, and hand those over at once (one ``io_uring_enter``)."""
        self._reaping = True
        try:
            for token, result in self.raw.reap():
                waiter = self._waiters.pop(token, None)
                if waiter is not None:
                    self._complete(waiter, result)
        finally:
            self._reaping = False
        if self._unsubmitted:
            self._flush()
            if self._unsubmitted:  # EAGAIN and the like: the submitter retries
                self._queued.set()
        self._check_drained()

    def _complete(self, waiter: _Waiter, result: int) -> None:
        waiter.result = result
        waiter.keepalive = None
        if waiter.counted:
            self.completed += 1
            self.latencies.observe(time.perf_counter() - waiter.started)
        self._free += 1
        self._finish(waiter)
        backlog = self._backlog
        while self._free and backlog:
            self._start(backlog.popleft())

    def _check_drained(self) -> None:
        if self._closing and not self._waiters:
            self._drained.set()

    def _setup(self) -> None:
        try:
            self._raw = self._binding.open_ring(self._entries)
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._raw.register_eventfd(self._efd)
        except OSError as exc:
            self._teardown()
            raise StorageIOError(f"io_uring set-up failed: {exc}") from exc

    async def _drain(self) -> None:
        self._closing = True
        self._check_drained()
        with anyio.move_on_after(self._drain_timeout_s, shield=True):
            await self._drained.wait()
        if not self._waiters:
            return
        logger.warning("closing io_uring: cancelling %d stuck requests", len(self._waiters))
        if self._broken is None:
            with contextlib.suppress(OSError):
                self.raw.prep_cancel_all(0)  # no waiter has token 0
                self.raw.submit()
        with anyio.move_on_after(self._drain_timeout_s, shield=True):
            await self._drained.wait()

    def _abandon(self) -> None:
        """After teardown: wake the callers of requests the kernel never gave back."""
        if self._waiters:
            logger.error("io_uring closed with %d requests abandoned", len(self._waiters))
        self._closing = True  # the backlog's requests fail as slots free, never reach a ring
        for waiter in list(self._waiters.values()):
            self._complete(waiter, -errno.ECANCELED)
        self._waiters.clear()
        while self._backlog:
            self._start(self._backlog.popleft())

    def _teardown(self) -> None:
        if self._raw is not None:
            self._raw.close()
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1


@contextlib.asynccontextmanager
async def open_completion_ring(
    binding: UringBinding, entries: int, *, drain_timeout_s: float = DRAIN_TIMEOUT_S
) -> AsyncIterator[CompletionRing]:
    """A ready ring of ``binding`` with at most ``entries`` requests in flight and its reaper
    task running. Raises :class:`StorageIOError` when the ring cannot be set up.

    Leaving the context refuses new requests, drains the in-flight ones (see the module
    docstring), stops the reaper and tears the ring down, whatever happened inside.
    """
    ring = CompletionRing(binding, entries, drain_timeout_s=drain_timeout_s)
    ring._setup()
    # The caller's error is re-raised as itself, not wrapped in the task group's ExceptionGroup
    # (cancellation still passes through the group, where cancel scopes expect it).
    body_error: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(ring._reap_forever)
            await tg.start(ring._submit_forever)
            try:
                yield ring
            except Exception as exc:
                body_error = exc
            finally:
                await ring._drain()
                assert ring._reaper_scope is not None
                assert ring._submitter_scope is not None
                ring._reaper_scope.cancel()
                ring._submitter_scope.cancel()
    finally:
        ring._teardown()
        ring._abandon()
    if body_error is not None:
        raise body_error
