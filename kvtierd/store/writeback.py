"""Background write-back of committed blocks to the lower tier, and FSYNC.

Committed blocks enter a queue in commit order (``seq``). A fixed set of workers, owned by
:func:`open_writeback`, writes each one through the lower tier while it is pinned in DRAM
(:class:`kvtierd.store.writer.LowerWriter`), then marks it clean. FSYNC waits until every block
committed before it was written (or forgotten), then asks the tier to make the writes durable,
and only then answers: so a block whose FSYNC returned survives ``kill -9``.

A write that fails (the tier is full of other size classes, the device errs) leaves the block
dirty in DRAM and in the ``failed`` set until a retry writes it: the next FSYNC retries those
blocks once and raises the error if they still cannot be written, so the caller learns that its
data is not durable; :meth:`WriteBack.retry` (the disk watch's timer) retries them meanwhile.
Failures and the moment none is left go to a :class:`WriteObserver` (the disk watch, which
judges the disk tier's health and logs once per change), not to the log block by block.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import anyio

from kvtierd.errors import KvtierError
from kvtierd.store.index import Block

__all__ = ["WriteBack", "WriteObserver", "open_writeback"]

log = logging.getLogger("kvtierd.writeback")


class WriteObserver(Protocol):
    """Told of each failed write, and when no failed block is left (on the event loop)."""

    def write_failed(self, exc: KvtierError) -> None: ...

    def writes_recovered(self) -> None: ...


class WriteBack:
    """The write-back queue; :func:`open_writeback` runs its workers."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        send, receive = anyio.create_memory_object_stream[Block](math.inf)
        self._send, self._receive = send, receive
        self._pending: dict[int, Block] = {}  # seq -> block queued or being written
        self._failed: dict[int, tuple[Block, KvtierError]] = {}
        self._progress = anyio.Condition()
        self.written = 0
        self.observer: WriteObserver | None = None
        self._closed = False

    @property
    def backlog(self) -> int:
        return len(self._pending)

    @property
    def failed(self) -> int:
        return len(self._failed)

    def close(self) -> None:
        """No more blocks will be queued; workers finish the queue and exit."""
        self._closed = True
        self._send.close()
        self._receive.close()  # the workers read from clones, which stay open until drained

    def enqueue(self, block: Block) -> None:
        self._pending[block.ref.seq] = block
        self._send.send_nowait(block)

    async def work(self, write: Callable[[Block], Awaitable[None]]) -> None:
        """One worker: ``write`` each queued block, until the queue is closed and empty."""
        async with self._receive.clone() as receive:
            async for block in receive:
                try:
                    if not block.forgotten:
                        await write(block)
                except KvtierError as exc:
                    log.debug("write-back of a block failed: %s", exc)
                    self._failed[block.ref.seq] = (block, exc)
                    if self.observer is not None:
                        self.observer.write_failed(exc)
                else:
                    if self._written(block.ref.seq) and self._failed:
                        self.retry()  # a failed block went through: the medium works again
                finally:
                    self._pending.pop(block.ref.seq, None)
                    self.written += 1
                    async with self._progress:
                        self._progress.notify_all()

    async def wait_progress(self, timeout_s: float) -> None:
        """Wait until some write finished, or ``timeout_s`` passed."""
        with anyio.move_on_after(timeout_s):
            async with self._progress:
                await self._progress.wait()

    async def drain(
        self, up_to_seq: int, concerns: Callable[[Block], bool] = lambda block: True
    ) -> None:
        """Return once every block with ``seq <= up_to_seq`` left the queue. Raises the first
        error of a block that could not be written (of those the caller ``concerns``), after
        retrying failed blocks once."""
        self.retry(up_to_seq)
        async with self._progress:
            while any(seq <= up_to_seq for seq in self._pending):
                await self._progress.wait()
        for seq, (block, exc) in sorted(self._failed.items()):
            if seq <= up_to_seq and not block.forgotten and concerns(block):
                raise type(exc)(f"a committed block could not be made durable: {exc}")

    def retry(self, up_to_seq: float = math.inf, limit: float = math.inf) -> int:
        """Queue again the failed blocks with ``seq <= up_to_seq`` that are not queued already,
        oldest first, at most ``limit`` of them (a block stays failed until written); forget
        those that need no write any more. Returns how many were queued (none once closed: the
        failed blocks stay dirty in DRAM, as at a crash)."""
        queued = 0
        for seq, (block, _) in sorted(self._failed.items()):
            if queued >= limit or self._closed:
                break
            if seq > up_to_seq or seq in self._pending:
                continue
            if block.forgotten or not block.dirty:
                self._written(seq)
            else:
                self.enqueue(block)
                queued += 1
        return queued

    def _written(self, seq: int) -> bool:
        """``seq`` needs no write any more; whether it had failed. Tells the observer when it
        was the last failed block."""
        if self._failed.pop(seq, None) is None:
            return False
        if not self._failed and self.observer is not None:
            self.observer.writes_recovered()
        return True

    def pending_bytes(self) -> int:
        return sum(b.ref.raw_bytes for b in self._pending.values())

    def queued(self) -> list[Block]:
        """The blocks queued or being written."""
        return list(self._pending.values())


@contextlib.asynccontextmanager
async def open_writeback(
    queue: WriteBack, write: Callable[[Block], Awaitable[None]]
) -> AsyncIterator[WriteBack]:
    """Run ``queue``'s workers (``write`` performs one block's write) in a task group of their
    own; on exit no more blocks are queued and the workers finish the queue first."""
    async with anyio.create_task_group() as tg:
        for _ in range(queue.workers):
            tg.start_soon(queue.work, write)
        try:
            yield queue
        finally:
            queue.close()
