"""The async client (anyio: asyncio or trio): pipelined requests over one connection.

Use ``async with kvtierd.client.connect_async() as client``. Any number of tasks may call it at
once; requests are written in turn and the replies, which may come back in any order, are
matched to their callers by unique id by a reader task that the context manager owns.

A caller cancelled while it waits does not leak what the daemon already granted: if the reply
it abandoned carried a lease or an allocation, the reader hands it to a janitor task that
releases the lease or aborts the write.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup, UNIXSocketStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvtierd.client import ops
from kvtierd.client.arena import ClientArena
from kvtierd.client.base import (
    NamespaceBase,
    Regions,
    as_dict,
    check_init,
    closed_error,
    handle_of,
    init_request,
    message_of,
    namespace_request,
    not_running,
    resolve_socket,
)
from kvtierd.client.blocks import BlockLease, BlockWrite, release_views
from kvtierd.errors import BrokenConnectionError, CorruptBlockError, KvtierError
from kvtierd.protocol import (
    NEED_DATA,
    ClientConnection,
    ConnectionClosed,
    FrameFlags,
    ReplyReceived,
)
from kvtierd.protocol.messages import (
    AllocReply,
    CommitRequest,
    DestroyRequest,
    DoctorReply,
    DoctorRequest,
    EvictReply,
    EvictRequest,
    FsyncReply,
    FsyncRequest,
    Layout,
    ListNsReply,
    ListNsRequest,
    Message,
    OpenNsReply,
    PoolStatusReply,
    PoolStatusRequest,
    ReadReply,
    ReleaseRequest,
    StatfsReply,
    StatfsRequest,
)

__all__ = ["AsyncClient", "AsyncNamespace", "connect_async"]

T = TypeVar("T")
_RECEIVE_BYTES = 1 << 16
#: How long a cancelled operation may take to give back what it was granted.
_UNWIND_S = 5.0


class _Waiter:
    __slots__ = ("abandoned", "done", "event", "fds")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.event: ReplyReceived | None = None
        self.abandoned = False
        #: Descriptors passed with the reply (an OPEN_NS reply's region).
        self.fds: list[int] = []


class AsyncClient:
    """Construct with :func:`connect_async`."""

    def __init__(self, stream: UNIXSocketStream, conn: ClientConnection) -> None:
        self._stream = stream
        self._conn = conn
        self._send_lock = anyio.Lock()
        self._waiters: dict[int, _Waiter] = {}
        self._broken: KvtierError | None = None
        self._regions = Regions()
        self._closed = False
        #: Descriptors received and not yet matched to their reply frame, in arrival order.
        self._received_fds: collections.deque[int] = collections.deque()
        self.max_keys = 1
        self.corrupt_reads = 0
        self.daemon_version = ""
        self.daemon_minor = 0
        janitor_send, janitor_receive = anyio.create_memory_object_stream[Message](1024)
        self._janitor_send: MemoryObjectSendStream[Message] = janitor_send
        self._janitor_receive: MemoryObjectReceiveStream[Message] = janitor_receive

    def region(self, region: int) -> ClientArena:
        """The mapping of tenant region ``region`` (passed at OPEN_NS)."""
        if self._closed:
            raise closed_error()
        return self._regions.get(region)

    def _check_open(self) -> None:
        """Raise ``ClosedError`` after :meth:`aclose`, or what broke the connection."""
        if self._closed:
            raise closed_error()
        if self._broken is not None:
            raise self._broken

    async def _call(self, message: Message, ns: int = 0, fds: list[int] | None = None) -> Message:
        """Send ``message`` and wait for its reply; descriptors passed with the reply are
        appended to ``fds`` (when given; else closed)."""
        self._check_open()
        return await self._exchange(message, ns, fds)

    async def _exchange(self, message: Message, ns: int, fds: list[int] | None) -> Message:
        """:meth:`_call` without the closed check (``aclose``'s DESTROY)."""
        if self._broken is not None:
            raise self._broken
        waiter = _Waiter()
        sent = False
        try:
            async with self._send_lock:
                unique, frame = self._conn.request(message, ns)
                self._waiters[unique] = waiter
                try:
                    await self._stream.send(frame)
                except (anyio.BrokenResourceError, OSError) as exc:
                    raise BrokenConnectionError(f"connection to kvtierd lost: {exc}") from exc
                sent = True
            await waiter.done.wait()
        except BaseException:
            # Cancelled while sending or waiting: whatever the daemon grants (a lease, an
            # allocation) must still be given back, now if the reply is here, else on arrival;
            # and a COMMIT that never left must not leave its write pending.
            waiter.abandoned = True
            _close_all(waiter.fds)  # a region descriptor nobody will map
            waiter.fds = []
            if waiter.event is not None:
                self._clean_up(waiter.event)
            elif not sent:
                self._unsent(message)
            raise
        if waiter.event is None:  # woken by the end of the connection
            self._check_open()
            raise BrokenConnectionError("connection closed")
        if fds is not None:
            fds.extend(waiter.fds)
        else:
            _close_all(waiter.fds)
        return message_of(waiter.event)

    async def _send_only(self, message: Message, ns: int) -> None:
        self._check_open()
        sent = False
        try:
            async with self._send_lock:
                _, frame = self._conn.request(message, ns)
                try:
                    await self._stream.send(frame)
                except (anyio.BrokenResourceError, OSError) as exc:
                    raise BrokenConnectionError(f"connection to kvtierd lost: {exc}") from exc
                sent = True
        finally:
            if not sent:  # cancelled before it left: a RELEASE must still go out
                self._unsent(message)

    async def run(self, op: ops.Op[T]) -> T:
        """Drive a sans-IO operation to its result."""
        try:
            call = next(op)
        except StopIteration as stop:
            result: T = stop.value
            return result
        return await self._drive(op, call)

    async def _drive(self, op: ops.Op[T], call: ops.Call, *, unwinding: bool = False) -> T:
        try:
            while True:
                try:
                    if isinstance(call, ops.NoWait):
                        await self._send_only(call.message, call.ns)
                        reply = None
                    else:
                        reply = await self._call(*call)
                except KvtierError as exc:
                    call = op.throw(exc)
                except BaseException as exc:  # cancelled while sending or waiting
                    if not unwinding:
                        await self._unwind(op, exc)
                    raise
                else:
                    call = op.send(reply)
        except StopIteration as stop:
            result: T = stop.value
            return result

    async def _unwind(self, op: ops.Op[Any], exc: BaseException) -> None:
        """An operation interrupted while it waited: let its clean-up (giving back the leases
        and writes that earlier replies of a multi-request operation granted) run to its end,
        shielded from the cancellation and bounded in time. The interrupted request's own
        reply is given back when it arrives (``_clean_up``)."""
        with (
            anyio.move_on_after(_UNWIND_S, shield=True),
            contextlib.suppress(BaseException),  # the operation re-raised: clean-up done
        ):
            await self._drive(op, op.throw(exc), unwinding=True)
        op.close()

    async def _handshake(self, client_name: str) -> None:
        _, frame = self._conn.request(init_request(client_name))
        fds: list[int] = []
        with contextlib.suppress(anyio.BrokenResourceError, OSError):
            await self._stream.send(frame)  # if refused, the daemon's last frame says why
        while True:
            try:
                data, received = await self._stream.receive_fds(_RECEIVE_BYTES, 4)
            except (anyio.BrokenResourceError, OSError) as exc:
                raise BrokenConnectionError(f"kvtierd closed the connection: {exc}") from exc
            fds.extend(received)
            if not data:
                raise BrokenConnectionError("kvtierd closed the connection during INIT")
            self._conn.receive_data(data)
            event = self._conn.next_event()
            if isinstance(event, ReplyReceived):
                break
        _close_all(fds)  # INIT passes no memory (protocol minor 6)
        reply = check_init(message_of(event))
        self.max_keys = reply.max_keys
        self.daemon_version = reply.daemon_version
        self.daemon_minor = reply.minor

    async def _read_replies(self) -> None:
        try:
            while True:
                # With descriptors: a region passed with a reply must not be dropped by a
                # plain read (the kernel closes descriptors nobody asked for).
                try:
                    data, fds = await self._stream.receive_fds(_RECEIVE_BYTES, 4)
                except anyio.EndOfStream:
                    data, fds = b"", []
                self._received_fds.extend(fds)
                self._conn.receive_data(data)
                if not self._dispatch():
                    return
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, KvtierError) as exc:
            self._fail(exc if isinstance(exc, KvtierError) else BrokenConnectionError(str(exc)))
        finally:
            self._fail(BrokenConnectionError("kvtierd closed the connection"))

    def _dispatch(self) -> bool:
        while True:
            event = self._conn.next_event()
            if event is NEED_DATA:
                return True
            if isinstance(event, ConnectionClosed):
                return False
            assert isinstance(event, ReplyReceived)
            if event.header.unique == 0:
                self._fail(event.error or BrokenConnectionError("kvtierd closed the connection"))
                return False
            fds = (
                [self._received_fds.popleft()]
                if event.header.flags & FrameFlags.FD_ATTACHED and self._received_fds
                else []
            )
            waiter = self._waiters.pop(event.header.unique, None)
            if waiter is None:
                _close_all(fds)
                continue
            if waiter.abandoned:
                _close_all(fds)
            else:
                waiter.fds = fds
            if waiter.abandoned:
                self._clean_up(event)
            waiter.event = event
            waiter.done.set()

    def _unsent(self, message: Message) -> None:
        """A request cancelled before it was sent: what it would have given back (a RELEASE, a
        COMMIT's write) is given back by the janitor instead."""
        with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
            if isinstance(message, ReleaseRequest):
                self._janitor_send.send_nowait(message)
            elif isinstance(message, CommitRequest):
                self._janitor_send.send_nowait(CommitRequest(message.write, abort=True))

    def _clean_up(self, event: ReplyReceived) -> None:
        message = event.message
        with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
            if isinstance(message, ReadReply) and message.lease:  # READ_RESIDENT's too
                self._janitor_send.send_nowait(ReleaseRequest([message.lease]))
            elif isinstance(message, AllocReply):
                self._janitor_send.send_nowait(CommitRequest(message.write, abort=True))

    async def _janitor(self) -> None:
        async with self._janitor_receive:
            async for message in self._janitor_receive:
                with contextlib.suppress(KvtierError):
                    await self._call(message)

    def _fail(self, exc: KvtierError) -> None:
        if self._broken is None:
            self._broken = exc
        for waiter in self._waiters.values():
            waiter.done.set()
        self._waiters.clear()

    # -- API ---------------------------------------------------------------------------------

    async def namespace(
        self,
        name: str,
        *,
        block_bytes: int,
        layout: Layout | dict[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        tenant: str = "default",
        compression: str = "none",
        create: bool = True,
        sparse: bool = False,
    ) -> AsyncNamespace:
        request = namespace_request(
            name, block_bytes, layout, rank, world_size, tenant, compression, create, sparse
        )
        fds: list[int] = []
        try:
            reply = await self._call(request, fds=fds)
            handle = handle_of(request, reply)
            assert isinstance(reply, OpenNsReply)
        except BaseException:
            _close_all(fds)
            raise
        self._regions.adopt(reply, fds)  # takes the descriptors, even when it raises
        return AsyncNamespace(self, handle)

    async def fsync(self) -> int:
        reply = await self._call(FsyncRequest())
        assert isinstance(reply, FsyncReply)
        return reply.durable_blocks

    async def stats(self) -> dict[str, Any]:
        reply = await self._call(StatfsRequest())
        assert isinstance(reply, StatfsReply)
        result: dict[str, Any] = as_dict(reply)
        return result

    async def namespaces(self) -> list[dict[str, Any]]:
        reply = await self._call(ListNsRequest())
        assert isinstance(reply, ListNsReply)
        return [as_dict(info) for info in reply.namespaces]

    async def doctor(self) -> list[dict[str, str]]:
        """The daemon's report on its host (admin): one ``{subject, status, detail}`` per check,
        ``status`` ok, fallback or fail."""
        reply = await self._call(DoctorRequest())
        assert isinstance(reply, DoctorReply)
        return [
            {"subject": c.subject, "status": c.status, "detail": c.detail} for c in reply.checks
        ]

    async def pool_status(self) -> dict[str, Any]:
        """Where the daemon stands with the shared pool (``state`` "none" without one)."""
        reply = await self._call(PoolStatusRequest())
        assert isinstance(reply, PoolStatusReply)
        result: dict[str, Any] = as_dict(reply)
        return result

    async def evict(self) -> int:
        reply = await self._call(EvictRequest(all_namespaces=True))
        assert isinstance(reply, EvictReply)
        return reply.evicted

    def _start(self, tg: TaskGroup) -> None:
        tg.start_soon(self._read_replies)
        tg.start_soon(self._janitor)

    async def aclose(self) -> None:
        """Send DESTROY, close the connection and unmap the regions; idempotent. Every call
        after it, and every call still waiting for its reply, raises ``ClosedError``."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True), contextlib.suppress(KvtierError):
            with anyio.move_on_after(5):
                await self._exchange(DestroyRequest(), 0, None)
        self._janitor_send.close()
        await self._stream.aclose()
        self._regions.close()
        _close_all(list(self._received_fds))
        self._received_fds.clear()


class AsyncNamespace(NamespaceBase[AsyncClient]):
    """Blocks of one namespace, through an :class:`AsyncClient`."""

    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        c = self.client
        return await c.run(
            ops.put(self.handle.ns, keys, blocks, self.block_bytes, self.arena, c.max_keys)
        )

    async def lookup(self, keys: Sequence[bytes], *, promote: bool = True) -> int:
        """How many leading ``keys`` are stored (for the whole TP group); with ``promote`` the
        daemon starts moving those hits up to DRAM now."""
        c = self.client
        return await c.run(ops.lookup_count(self.handle.ns, keys, c.max_keys, promote))

    async def lookup_tiers(self, keys: Sequence[bytes], *, promote: bool = True) -> list[str]:
        """Like :meth:`lookup`, with the tier (``"dram"``, ``"nvme"``...) of each hit."""
        c = self.client
        return await c.run(ops.lookup(self.handle.ns, keys, c.max_keys, promote))

    @contextlib.asynccontextmanager
    async def get(self, keys: Sequence[bytes]) -> AsyncIterator[list[memoryview]]:
        async with self.lease(keys) as lease:
            yield lease.views

    @contextlib.asynccontextmanager
    async def lease(
        self, keys: Sequence[bytes], *, resident_only: bool = False
    ) -> AsyncIterator[BlockLease]:
        """As :meth:`Namespace.lease` (``resident_only`` as in :meth:`Namespace.acquire`); the
        lease ends when the ``async with`` block does."""
        c = self.client
        leases, extents = await c.run(self._lease_op(keys, resident_only))
        try:
            lease = self._block_lease(keys, extents, partial=resident_only)
        except BaseException:
            if leases:
                with anyio.CancelScope(shield=True):
                    await c.run(ops.release(leases))
            raise
        try:
            yield lease
        finally:
            lease.release()
            if leases:
                with anyio.CancelScope(shield=True):
                    await c.run(ops.release(leases))

    @contextlib.asynccontextmanager
    async def write(self, keys: Sequence[bytes]) -> AsyncIterator[BlockWrite]:
        """As :meth:`Namespace.write`: fill the slots in place; committed on a normal exit."""
        c = self.client
        writes, extents = await c.run(ops.alloc(self.handle.ns, keys, c.max_keys))
        views = [self.arena.writable(e.offset, e.length) if e.length else None for e in extents]
        try:
            yield BlockWrite(list(keys), views)
        except BaseException:
            release_views(views)
            with anyio.CancelScope(shield=True):
                await c.run(ops.commit(self.handle.ns, writes, abort=True))
            raise
        release_views(views)
        await c.run(ops.commit(self.handle.ns, writes))

    async def read_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        c = self.client
        try:
            return await c.run(ops.read_into(self.handle.ns, keys, buffers, self.arena, c.max_keys))
        except CorruptBlockError:
            c.corrupt_reads += 1
            raise

    async def forget(self, keys: Sequence[bytes]) -> int:
        return await self.client.run(ops.forget(self.handle.ns, keys, self.client.max_keys))

    async def hint_attention(
        self,
        chain: Sequence[bytes],
        queries: Any,
        *,
        query_layers: Sequence[int],
        budget_blocks: int,
        session: bytes = b"",
    ) -> tuple[list[bytes], list[bytes]]:
        """Sparse attention for a namespace opened with ``sparse=True``: the keys of ``chain``
        (the sequence's blocks in order) most likely to carry the attention mass of
        ``queries`` (float32 post-RoPE ``[len(query_layers), q_heads, head_dim]``), at most
        ``budget_blocks`` per (layer, KV head), best first, and the keys predicted for the next
        decode step. The daemon starts promoting both at once."""
        return await self.client.run(
            ops.hint_attention(self.handle.ns, chain, queries, query_layers, budget_blocks, session)
        )

    async def hint(self, queue: Sequence[Sequence[bytes]], *, session: bytes = b"") -> int:
        return await self.client.run(ops.hint(self.handle.ns, queue, session))


@contextlib.asynccontextmanager
async def connect_async(
    socket_path: str | os.PathLike[str] | None = None, *, client_name: str = ""
) -> AsyncIterator[AsyncClient]:
    """Connect, hand over the arena, and yield a client; closes everything on exit."""
    path = resolve_socket(socket_path)
    try:
        stream = await anyio.connect_unix(path)
    except OSError as exc:
        raise not_running(path, exc) from None
    client = AsyncClient(stream, ClientConnection())
    try:
        await client._handshake(client_name)
    except BaseException:
        await stream.aclose()
        raise
    try:
        async with anyio.create_task_group() as tg:
            client._start(tg)
            try:
                yield client
            finally:
                await client.aclose()
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The task group wraps what the caller's block raised; give the caller its exception.
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
