"""The io_uring backend: vectored ``O_DIRECT`` reads and writes, fixed buffers for the arena.

Theory of operation
-------------------
Each call becomes one ``IORING_OP_READV``/``WRITEV`` request, or ``READV_FIXED``/``WRITEV_FIXED``
(Linux 6.15+) when every buffer lies inside one chunk of the registered arena
(:class:`kvtierd.io.buffers.FixedRegions`). A fixed request skips pinning and unpinning the pages
on every call: the kernel pinned them once, at registration, which saves most of the kernel's CPU
per request. The vectored fixed forms serve a single buffer too. ``fdatasync`` is
``IORING_OP_FSYNC`` with ``IORING_FSYNC_DATASYNC``.

The kernel may complete a request partially (end of file, full disk); the remainder is
resubmitted until done or until a request moves nothing. Requests go through
:class:`kvtierd.io.ring.CompletionRing`, which owns the eventfd wake-ups, the queue-depth bound and
the cancellation shield, over a binding of liburing (:mod:`kvtierd.io.binding`).

Registration is synchronous and pins every page of the arena: about 25-30 ms per GiB when the
memory is already faulted in, seconds per GiB when it is not (pre-fault the arena first). The
arena must be anonymous or memfd/shmem memory (a file-backed mapping fails with ``EFAULT``) and
must stay mapped while the backend is open.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import AsyncIterator, Sequence
from functools import partial

from kvtierd.errors import StorageIOError
from kvtierd.io.base import (
    IoBackend,
    IoBackendKind,
    IoStatistics,
    OpCounters,
    check_request,
    os_error,
    short_transfer_error,
)
from kvtierd.io.binding import FSYNC_DATASYNC, RingOp, Span, UringBinding, load_binding
from kvtierd.io.buffers import MAX_FIXED_CHUNK_BYTES, FixedRegions, advance_spans, buffer_address
from kvtierd.io.ring import DRAIN_TIMEOUT_S, CompletionRing, Prep, open_completion_ring

__all__ = ["PROBE_TIMEOUT_S", "UringBackend", "open_uring_backend"]

# The read opcodes, looked up once (a class attribute of an enum per request costs more).
_READV = RingOp.READV
_READV_FIXED = RingOp.READV_FIXED

logger = logging.getLogger("kvtierd.io")

#: How long opening waits for a NOP to complete through the eventfd before giving up.
PROBE_TIMEOUT_S = 2.0


class UringBackend(IoBackend):
    """:class:`IoBackend` on io_uring; obtain one from :func:`open_uring_backend`."""

    kind = IoBackendKind.IO_URING

    def __init__(
        self, ring: CompletionRing, *, fixed_opcodes: bool, fixed_chunk_bytes: int
    ) -> None:
        self._ring = ring
        self.supports_fixed_buffers = fixed_opcodes
        self._fixed_chunk_bytes = fixed_chunk_bytes
        self._regions: FixedRegions | None = None
        self._counters = OpCounters()

    def register_buffer(self, buffer: memoryview) -> None:
        """Register ``buffer`` as fixed buffers 0..n-1 (one per GiB); see the module docstring.

        Raises :class:`StorageIOError` when the kernel refuses (``EFAULT`` for file-backed
        memory, ``ENOMEM`` past ``RLIMIT_MEMLOCK`` without ``CAP_IPC_LOCK``), when fixed buffers
        are unsupported, or when a buffer is already registered. The backend stays usable.
        """
        if not self.supports_fixed_buffers:
            raise StorageIOError("this kernel has no READV_FIXED/WRITEV_FIXED: not registered")
        if self._regions is not None:
            raise StorageIOError("a buffer is already registered")
        (view,) = check_request(0, 0, [buffer])
        regions = FixedRegions(buffer_address(view), view.nbytes, self._fixed_chunk_bytes)
        chunks = regions.chunks()
        try:
            self._ring.raw.register_buffers(chunks)
        except OSError as exc:
            err = exc.errno or errno.EIO
            why = f"the kernel refused to register them: [Errno {err}] {os.strerror(err)}"
            if err == errno.ENOMEM:
                why += " (RLIMIT_MEMLOCK: LimitMEMLOCK=infinity)"
            self.fixed_buffers_fallback = why
            raise os_error("register_buffers", -1, 0, err) from exc
        self._regions = regions
        self.fixed_buffers_fallback = ""

    def release_fixed_buffers(self) -> None:
        # The kernel keeps the registered pages pinned until the ring closes (no unregister
        # while requests may use them); what matters is that no later request names them.
        if self._regions is not None:
            self._regions = None
            self.fixed_buffers_fallback = "given up: the arena's pages changed under them"
            logger.warning("io_uring: fixed buffers no longer used (the arena's pages changed)")

    async def readv(self, fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
        done = await self._transfer("readv", fd, offset, buffers)
        self._counters.bytes_read += done
        return done

    async def readv_each(
        self, fd: int, requests: Sequence[tuple[int, Sequence[memoryview]]]
    ) -> list[int | StorageIOError]:
        """All queued from this task (:meth:`CompletionRing.run_many`): no task, no wake-up,
        no slot wait per request. A request the kernel completes partially (end of file)
        goes on alone, as :meth:`readv` would."""
        plans: list[tuple[int, list[Span], int, int | None]] = []
        preps: list[Prep] = []
        prep_rw = self._ring.raw.prep_rw
        regions = self._regions
        for offset, buffers in requests:
            views = check_request(fd, offset, buffers)
            spans: list[Span] = [(buffer_address(view), view.nbytes) for view in views]
            index = regions.index_for(spans) if regions is not None else None
            plans.append((offset, spans, sum(length for _, length in spans), index))
            if index is None:
                preps.append(partial(prep_rw, _READV, fd, spans, offset, -1))
            else:
                preps.append(partial(prep_rw, _READV_FIXED, fd, spans, offset, index))
        moved = await self._ring.run_many(preps)
        results: list[int | StorageIOError] = []
        read = 0
        for (offset, spans, total, index), first in zip(plans, moved, strict=True):
            if first == total:  # the common case: all of it in one request, no coroutine
                self._counters.fixed_ops += index is not None
                read += total
                results.append(total)
                continue
            try:
                done = await self._complete("readv", fd, offset, spans, total, index, first)
            except StorageIOError as exc:
                results.append(exc)
            else:
                read += done
                results.append(done)
        self._counters.bytes_read += read
        return results

    async def writev(self, fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
        done = await self._transfer("writev", fd, offset, buffers)
        self._counters.bytes_written += done
        return done

    async def fdatasync(self, fd: int) -> None:
        if fd < 0:
            raise os_error("fdatasync", fd, 0, errno.EBADF)
        result = await self._ring.run(partial(self._ring.raw.prep_fsync, fd, FSYNC_DATASYNC))
        if result < 0:
            raise os_error("fdatasync", fd, 0, -result) from OSError(-result, os.strerror(-result))
        self._counters.fsyncs += 1

    def statistics(self) -> IoStatistics:
        self._counters.submitted = self._ring.submitted
        self._counters.completed = self._ring.completed
        self._counters.submit_calls = self._ring.enters
        return self._counters.snapshot(self.kind, self._ring.entries, self._ring.latencies)

    async def _transfer(self, op: str, fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
        views = check_request(fd, offset, buffers)
        spans: list[Span] = [(buffer_address(view), view.nbytes) for view in views]
        total = sum(length for _, length in spans)
        index = self._regions.index_for(spans) if self._regions is not None else None
        first = await self._submit_once(op, fd, offset, spans, index)
        return await self._complete(op, fd, offset, spans, total, index, first)

    async def _complete(
        self,
        op: str,
        fd: int,
        offset: int,
        spans: list[Span],
        total: int,
        index: int | None,
        moved: int,
    ) -> int:
        """The transfer of ``spans`` whose first request returned ``moved`` (bytes, or
        ``-errno``), the rest resubmitted until done."""
        if moved < 0:
            raise os_error(op, fd, offset, -moved) from OSError(-moved, os.strerror(-moved))
        done = 0
        while True:
            if moved == 0:
                raise short_transfer_error(op, fd, offset, done, total)
            done += moved
            spans = advance_spans(spans, moved)
            if not spans:
                break
            moved = await self._submit_once(op, fd, offset + done, spans, index)
            if moved < 0:
                raise os_error(op, fd, offset + done, -moved) from OSError(
                    -moved, os.strerror(-moved)
                )
        if index is not None:
            self._counters.fixed_ops += 1
        return done

    async def _submit_once(
        self, op: str, fd: int, offset: int, spans: list[Span], index: int | None
    ) -> int:
        """One request for ``spans``: the bytes it moved, or ``-errno``."""
        if op == "readv":
            opcode = RingOp.READV if index is None else RingOp.READV_FIXED
        else:
            opcode = RingOp.WRITEV if index is None else RingOp.WRITEV_FIXED
        prep = partial(
            self._ring.raw.prep_rw, opcode, fd, spans, offset, -1 if index is None else index
        )
        return await self._ring.run(prep)


def _fixed_opcodes_supported(ring: CompletionRing) -> bool:
    return ring.raw.supports(RingOp.READV_FIXED) and ring.raw.supports(RingOp.WRITEV_FIXED)


@contextlib.asynccontextmanager
async def open_uring_backend(
    queue_depth: int = 64,
    *,
    binding: UringBinding | None = None,
    fixed_chunk_bytes: int = MAX_FIXED_CHUNK_BYTES,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> AsyncIterator[UringBackend]:
    """An io_uring backend proven to work (a NOP completed through the eventfd).

    ``binding`` drives the ring (default: :func:`kvtierd.io.binding.configured_binding`, loaded
    here: a caller that cannot afford to lose its process probes it first, as
    :func:`kvtierd.io.open_io_backend` does). ``fixed_chunk_bytes`` (at most 1 GiB, the
    kernel's limit) is how a registered buffer is split into fixed buffer indices; tests lower
    it. ``drain_timeout_s`` bounds how long closing waits
    for requests that do not finish (see :mod:`kvtierd.io.ring`). Raises :class:`StorageIOError`
    when io_uring is unavailable (``io_uring_disabled``, seccomp, old kernel) or does not
    complete requests. Leaving the context drains the in-flight requests and tears the ring
    down, whatever happened inside.
    """
    if not 0 < fixed_chunk_bytes <= MAX_FIXED_CHUNK_BYTES:
        raise ValueError(f"fixed_chunk_bytes must be in 1..{MAX_FIXED_CHUNK_BYTES}")
    if binding is None:
        try:
            binding = load_binding()
        except ImportError as exc:
            raise StorageIOError(f"the io_uring binding cannot be imported: {exc}") from exc
    async with open_completion_ring(binding, queue_depth, drain_timeout_s=drain_timeout_s) as ring:
        try:
            fixed_opcodes = _fixed_opcodes_supported(ring)
        except OSError as exc:
            raise StorageIOError(f"io_uring opcode probe failed: {exc}") from exc
        await ring.probe(PROBE_TIMEOUT_S)
        yield UringBackend(ring, fixed_opcodes=fixed_opcodes, fixed_chunk_bytes=fixed_chunk_bytes)
