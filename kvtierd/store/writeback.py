"""Background write-back of committed blocks to the lower tier, and FSYNC.

Committed blocks enter a queue in commit order (``seq``). A fixed set of workers, owned by
:func:`open_writeback`, writes each one through the lower tier while it is pinned in DRAM
(:class:`kvtierd.store.writer.LowerWriter`), then marks it clean. FSYNC waits until every block
committed before it was written (or forgotten), then asks the tier to make the writes durable,
and only then answers: so a block whose FSYNC returned survives ``kill -9``.

A write that fails (the tier is full of other size classes, the device errs) leaves the block
dirty in DRAM and in the ``failed`` set; the next FSYNC retries those blocks once and raises the
error if they still cannot be written, so the caller learns that its data is not durable.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

from kvtierd.errors import KvtierError
from kvtierd.store.index import Block

__all__ = ["WriteBack", "open_writeback"]

log = logging.getLogger("kvtierd.writeback")


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

    @property
    def backlog(self) -> int:
        return len(self._pending)

    @property
    def failed(self) -> int:
        return len(self._failed)

    def close(self) -> None:
        """No more blocks will be queued; workers finish the queue and exit."""
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
                    log.warning("write-back of a block failed: %s", exc)
                    self._failed[block.ref.seq] = (block, exc)
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
        retry = [b for seq, (b, _) in sorted(self._failed.items()) if seq <= up_to_seq]
        for block in retry:
            del self._failed[block.ref.seq]
            if not block.forgotten and block.dirty:
                self.enqueue(block)
        async with self._progress:
            while any(seq <= up_to_seq for seq in self._pending):
                await self._progress.wait()
        for seq, (block, exc) in sorted(self._failed.items()):
            if seq <= up_to_seq and not block.forgotten and concerns(block):
                raise type(exc)(f"a committed block could not be made durable: {exc}")

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
