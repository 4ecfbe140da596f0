"""The async client (anyio: asyncio or trio): pipelined requests over one connection.

Use ``async with kvtierd.client.connect_async() as client``. Any number of tasks may call it at
once; requests are written in turn and the replies, which may come back in any order, are
matched to their callers by unique id by a reader task that the context manager owns.

A caller cancelled while it waits does not leak what the daemon already granted: if the reply
it abandoned carried a lease or an allocation, the reader hands it to a janitor task that
releases the lease or aborts the write.

With a :class:`~kvtierd.client.reconnect.Reconnect` policy a broken connection is replaced by the
first call that meets it (the others wait on a lock): a new stream is connected, INIT and the
OPEN_NS of every namespace still held (:func:`~kvtierd.client.reconnect.reopen_namespaces`)
are exchanged on it before any reader task runs, and only
then does it become the client's, so no request ever carries an old namespace id. Everything
granted on a connection (leases, writes, janitor work) is tagged with its number
(``reconnects``) and dropped, never sent, once that connection is gone.

The module is past 600 lines because the transport (pipelining, cancellation, reconnecting)
and the API methods share one connection's state; the sans-IO half lives in ``ops``, ``base`` and
``reconnect``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
from anyio.abc import SocketAttribute, TaskGroup, UNIXSocketStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvtierd.client import ops
from kvtierd.client.arena import ClientArena
from kvtierd.client.base import (
    NamespaceBase,
    NamespaceHandle,
    Regions,
    as_dict,
    check_init,
    check_socket_path,
    close_all,
    closed_error,
    connect_error,
    handle_of,
    in_flight_error,
    init_request,
    message_of,
    namespace_request,
    resolve_socket,
)
from kvtierd.client.blocks import BlockLease, BlockWrite, HeldBlocks, release_views
from kvtierd.client.reconnect import (
    RECONNECTABLE,
    Reconnect,
    gave_up,
    lost_lease_error,
    reopen_namespaces,
    replaced_region_error,
)
from kvtierd.errors import (
    BrokenConnectionError,
    CorruptBlockError,
    KvtierError,
)
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
    Extent,
    FsyncReply,
    FsyncRequest,
    Layout,
    ListNsReply,
    ListNsRequest,
    Message,
    OpenNsReply,
    OpenNsRequest,
    PoolStatusReply,
    PoolStatusRequest,
    ReadReply,
    ReleaseRequest,
    StatfsReply,
    StatfsRequest,
)
from kvtierd.transport.receiving import Receiver, Taken, open_receiver

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

    def __init__(
        self,
        stream: UNIXSocketStream,
        conn: ClientConnection,
        *,
        path: Path | None = None,
        client_name: str = "",
        reconnect: Reconnect | None = None,
    ) -> None:
        self._stream = stream
        #: The stream's socket, for sends offered at once (anyio's ``extra`` builds a mapping
        #: per call: a tenth of a LOOKUP's client CPU).
        self._raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
        self._conn = conn
        self._path = path
        self._client_name = client_name
        self.reconnect = reconnect
        self._reconnect_lock = anyio.Lock()
        self._tg: TaskGroup | None = None
        #: Namespaces opened on this client and leases taken: a reconnect reopens the
        #: namespaces and invalidates the leases.
        self._namespaces: weakref.WeakSet[AsyncNamespace] = weakref.WeakSet()
        self._held = HeldBlocks()
        #: How many times the client reconnected.
        self.reconnects = 0
        self._send_lock = anyio.Lock()
        self._waiters: dict[int, _Waiter] = {}
        self._broken: KvtierError | None = None
        self._regions = Regions()
        self._closed = False
        #: What reads the current connection's replies (closed before its socket is).
        self._receiver: Receiver | None = None
        self.max_keys = 1
        self.corrupt_reads = 0
        self.daemon_version = ""
        self.daemon_minor = 0
        # What to give back, tagged with the connection (``reconnects``) that granted it.
        janitor_send, janitor_receive = anyio.create_memory_object_stream[tuple[int, Message]](1024)
        self._janitor_send: MemoryObjectSendStream[tuple[int, Message]] = janitor_send
        self._janitor_receive: MemoryObjectReceiveStream[tuple[int, Message]] = janitor_receive

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "connected"
        return (
            f"<AsyncClient {self._path} {state}, daemon {self.daemon_version or '?'}, "
            f"reconnect {'on' if self.reconnect else 'off'}>"
        )

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
            await self._send_request(message, ns, waiter)
            sent = True
            await waiter.done.wait()
        except BaseException:
            # Cancelled while sending or waiting: whatever the daemon grants (a lease, an
            # allocation) must still be given back, now if the reply is here, else on arrival;
            # and a COMMIT that never left must not leave its write pending.
            waiter.abandoned = True
            close_all(waiter.fds)  # a region descriptor nobody will map
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
            close_all(waiter.fds)
        return message_of(waiter.event)

    async def _send_request(self, message: Message, ns: int, waiter: _Waiter) -> None:
        """Number ``message``, register ``waiter`` for its reply and send it, whole, with no
        other frame in between. When nobody else is sending, the frame is offered to the
        non-blocking socket at once (the usual case: no wait for the lock, no checkpoint, two
        turns of the loop less per request), and only what the socket does not take goes
        through the stream."""
        lock = self._send_lock
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()  # taken before any await: no frame can start in between
        try:
            unique, frame = self._conn.request(message, ns)
            self._waiters[unique] = waiter
            try:
                sent = _send_nowait(self._raw, frame)
                if sent < len(frame):
                    await self._stream.send(frame[sent:])
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise self._send_failed(exc) from exc
        finally:
            lock.release()

    async def _send_only(self, message: Message, ns: int) -> None:
        self._check_open()
        sent = False
        try:
            async with self._send_lock:
                _, frame = self._conn.request(message, ns)
                try:
                    await self._stream.send(frame)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                    raise self._send_failed(exc) from exc
                sent = True
        finally:
            if not sent:  # cancelled before it left: a RELEASE must still go out
                self._unsent(message)

    async def run(self, op: ops.Op[T]) -> T:
        """Drive a sans-IO operation to its result. It never reconnects: ``op`` names
        namespace ids of the connection it was made for."""
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
        fds: list[int] = []
        event = await _exchange_unread(self._stream, self._conn, init_request(client_name), fds)
        close_all(fds)  # INIT passes no memory (protocol minor 6)
        reply = check_init(message_of(event))
        self.max_keys = reply.max_keys
        self.daemon_version = reply.daemon_version
        self.daemon_minor = reply.minor

    async def _ensure_connected(self) -> None:
        """Raise ``ClosedError`` after :meth:`aclose`; replace a broken connection as the
        policy allows (one task reconnects, the others wait for it), else raise what broke."""
        if self._closed:
            raise closed_error()
        if self._broken is None:
            return
        if self.reconnect is None:
            raise self._broken
        async with self._reconnect_lock:
            if self._broken is not None:  # not replaced meanwhile by another task
                await self._recover(self.reconnect)

    async def _recover(self, policy: Reconnect) -> None:
        assert self._broken is not None
        last: KvtierError = self._broken
        for delay in policy.delays():
            await anyio.sleep(delay)
            if self._closed:
                raise closed_error()
            try:
                await self._reopen()
                return
            except RECONNECTABLE as exc:
                last = exc
        raise gave_up(last, policy)

    async def _reopen(self) -> None:
        """Connect, INIT and reopen every namespace still held on the new stream before any
        other request uses it (no reader task yet), then take it in one step: no task ever
        sends an old namespace id on the new connection."""
        path = self._path or resolve_socket(None)
        stream = await _connect(path)
        conn = ClientConnection()
        regions = Regions()
        try:
            fds: list[int] = []
            init = check_init(
                message_of(
                    await _exchange_unread(stream, conn, init_request(self._client_name), fds)
                )
            )
            close_all(fds)
            handles = await self._reopen_namespaces(stream, conn, regions)
        except BaseException:
            regions.close()
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        old = self._stream
        self._stream, self._conn = stream, conn
        self._raw = stream.extra(SocketAttribute.raw_socket)
        self._regions.close(replaced_region_error())
        self._regions = regions
        for ns, handle in handles:
            ns.handle = handle
        self._held.lose_all(lost_lease_error())
        self.max_keys, self.daemon_version, self.daemon_minor = (
            init.max_keys,
            init.daemon_version,
            init.minor,
        )
        self._waiters = {}
        self.reconnects += 1
        self._broken = None
        old_receiver = self._receiver
        self._start_reader(stream, conn)
        if old_receiver is not None:  # stop watching the old socket before it closes
            old_receiver.close()
        with (
            anyio.CancelScope(shield=True),
            contextlib.suppress(OSError, anyio.BrokenResourceError),
        ):
            await old.aclose()

    async def _reopen_namespaces(
        self, stream: UNIXSocketStream, conn: ClientConnection, regions: Regions
    ) -> list[tuple[AsyncNamespace, NamespaceHandle]]:
        """Drive :func:`~kvtierd.client.reconnect.reopen_namespaces` on the new ``stream``."""
        op = reopen_namespaces(self._namespaces, regions)
        try:
            request = next(op)
            while True:
                fds: list[int] = []
                try:
                    reply = message_of(await _exchange_unread(stream, conn, request, fds))
                except KvtierError as exc:
                    close_all(fds)
                    request = op.throw(exc)
                else:
                    request = op.send((reply, fds))
        except StopIteration as stop:
            handles: list[tuple[AsyncNamespace, NamespaceHandle]] = stop.value
            return handles

    async def _retrying(
        self,
        call: Callable[[], Awaitable[T]],
        *,
        retry: bool,
        ns: AsyncNamespace | None = None,
    ) -> T:
        """``await call()``, reconnecting first if the connection broke and the policy allows;
        with ``retry`` (an idempotent call) a connection that breaks under it is replaced and
        ``call()`` made once more."""
        again = retry and self.reconnect is not None
        while True:
            await self._ensure_connected()
            if ns is not None and ns.lost is not None:
                raise type(ns.lost)(*ns.lost.args)
            try:
                return await call()
            except RECONNECTABLE:
                if not again or self._broken is None or self._closed:
                    raise
                again = False

    async def _run_op(
        self, make_op: Callable[[], ops.Op[T]], *, retry: bool, ns: AsyncNamespace | None = None
    ) -> T:
        """Drive ``make_op()`` (made after any reconnect) as :meth:`_retrying` does."""
        return await self._retrying(lambda: self.run(make_op()), retry=retry, ns=ns)

    async def _request(self, message: Message, *, retry: bool = True) -> Message:
        return await self._run_op(lambda: ops.request(message), retry=retry)

    async def release_leases(self, leases: list[int], reconnects: int) -> None:
        """RELEASE ``leases``, granted on connection number ``reconnects``: nothing once that
        connection is gone (the daemon released them with it)."""
        if leases and reconnects == self.reconnects and self._broken is None and not self._closed:
            with anyio.CancelScope(shield=True), contextlib.suppress(BrokenConnectionError):
                await self.run(ops.release(leases))

    def _start_reader(self, stream: UNIXSocketStream, conn: ClientConnection) -> None:
        """Start reading the replies of ``stream`` (connection number ``reconnects``). On
        asyncio the socket's readiness callback reads and hands each reply to its waiter
        itself (:mod:`kvtierd.transport.receiving`), so a reply costs one wake-up, the
        caller's; the reader task only waits for the end. Descriptors passed with a reply (a
        region) are read with it: a plain read would let the kernel drop them."""
        reconnects = self.reconnects
        pending: collections.deque[int] = collections.deque()

        def serve_now(data: bytes) -> Taken:
            if not self._take(conn, reconnects, pending, data):
                return Taken.LEFT
            # with no reply owed, a daemon gone is found by the next request's send
            return Taken.AWAITING if self._waiters else Taken.SERVED

        raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
        receiver = open_receiver(stream, raw, serve_now, fds=pending)
        self._receiver = receiver
        assert self._tg is not None
        self._tg.start_soon(self._read_replies, receiver, conn, reconnects, pending)

    async def _read_replies(
        self,
        receiver: Receiver,
        conn: ClientConnection,
        reconnects: int,
        pending: collections.deque[int],
    ) -> None:
        """Match the replies of connection number ``reconnects`` to their waiters, until it
        ends; ``pending`` holds descriptors received and not yet matched to their reply."""
        try:
            while True:
                data = await receiver.receive(_RECEIVE_BYTES)
                if data is None or not self._take(conn, reconnects, pending, data):
                    return  # None: the callback took the bytes, and with them the end
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, KvtierError) as exc:
            error = exc if isinstance(exc, KvtierError) else BrokenConnectionError(str(exc))
            self._fail(error, reconnects)
        finally:
            receiver.close()
            close_all(list(pending))
            pending.clear()
            self._fail(BrokenConnectionError("kvtierd closed the connection"), reconnects)

    def _take(
        self,
        conn: ClientConnection,
        reconnects: int,
        pending: collections.deque[int],
        data: bytes,
    ) -> bool:
        """Hand the replies in ``data`` (``b""``: the end) to their waiters; False once the
        connection ended or was replaced (nobody waits for its replies then)."""
        if reconnects != self.reconnects:
            return False
        conn.receive_data(data)
        return self._dispatch(conn, reconnects, pending)

    def _dispatch(
        self, conn: ClientConnection, reconnects: int, pending: collections.deque[int]
    ) -> bool:
        while True:
            event = conn.next_event()
            if event is NEED_DATA:
                return True
            if isinstance(event, ConnectionClosed):
                return False
            assert isinstance(event, ReplyReceived)
            if event.header.unique == 0:
                error = event.error or BrokenConnectionError("kvtierd closed the connection")
                self._fail(error, reconnects)
                return False
            fds = (
                [pending.popleft()]
                if event.header.flags & FrameFlags.FD_ATTACHED and pending
                else []
            )
            waiter = self._waiters.pop(event.header.unique, None)
            if waiter is None:
                close_all(fds)
                continue
            if waiter.abandoned:
                close_all(fds)
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
                self._janitor_send.send_nowait((self.reconnects, message))
            elif isinstance(message, CommitRequest):
                abort = CommitRequest(message.write, abort=True)
                self._janitor_send.send_nowait((self.reconnects, abort))

    def _clean_up(self, event: ReplyReceived) -> None:
        message = event.message
        with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
            if isinstance(message, ReadReply) and message.lease:  # READ_RESIDENT's too
                release = ReleaseRequest([message.lease])
                self._janitor_send.send_nowait((self.reconnects, release))
            elif isinstance(message, AllocReply):
                abort = CommitRequest(message.write, abort=True)
                self._janitor_send.send_nowait((self.reconnects, abort))

    async def _janitor(self) -> None:
        async with self._janitor_receive:
            async for reconnects, message in self._janitor_receive:
                if reconnects != self.reconnects:  # its connection took it along
                    continue
                with contextlib.suppress(KvtierError):
                    await self._call(message)

    def _send_failed(self, exc: BaseException) -> KvtierError:
        """What a failed send (``exc``) raises: ``ClosedError`` when :meth:`aclose` closed the
        stream (under a task that was waiting to send), else the current connection broke."""
        if self._closed:
            return closed_error()
        error = BrokenConnectionError(f"connection to kvtierd lost: {exc}")
        self._fail(error, self.reconnects)
        return error

    def _fail(self, exc: KvtierError, reconnects: int) -> None:
        """Connection number ``reconnects`` broke with ``exc`` (ignored once replaced)."""
        if reconnects != self.reconnects:
            return
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
        block_bytes: int | None = None,
        layout: Layout | dict[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        tenant: str = "default",
        compression: str = "none",
        create: bool = True,
        sparse: bool = False,
    ) -> AsyncNamespace:
        """As :meth:`Client.namespace`."""
        request = namespace_request(
            name, block_bytes, layout, rank, world_size, tenant, compression, create, sparse
        )
        handle = await self._retrying(lambda: self._open_namespace(request), retry=True)
        namespace = AsyncNamespace(self, handle)
        self._namespaces.add(namespace)
        return namespace

    async def _open_namespace(self, request: OpenNsRequest) -> NamespaceHandle:
        fds: list[int] = []
        try:
            reply = await self._call(request, fds=fds)
            handle = handle_of(request, reply)
            assert isinstance(reply, OpenNsReply)
        except BaseException:
            close_all(fds)
            raise
        self._regions.adopt(reply, fds)  # takes the descriptors, even when it raises
        return handle

    async def fsync(self) -> int:
        """As :meth:`Client.fsync`: never retried."""
        reply = await self._request(FsyncRequest(), retry=False)
        assert isinstance(reply, FsyncReply)
        return reply.durable_blocks

    async def stats(self) -> dict[str, Any]:
        reply = await self._request(StatfsRequest())
        assert isinstance(reply, StatfsReply)
        result: dict[str, Any] = as_dict(reply)
        return result

    async def namespaces(self) -> list[dict[str, Any]]:
        reply = await self._request(ListNsRequest())
        assert isinstance(reply, ListNsReply)
        return [as_dict(info) for info in reply.namespaces]

    async def doctor(self) -> list[dict[str, str]]:
        """The daemon's report on its host (admin): one ``{subject, status, detail}`` per check,
        ``status`` ok, fallback or fail."""
        reply = await self._request(DoctorRequest())
        assert isinstance(reply, DoctorReply)
        return [
            {"subject": c.subject, "status": c.status, "detail": c.detail} for c in reply.checks
        ]

    async def pool_status(self) -> dict[str, Any]:
        """Where the daemon stands with the shared pool (``state`` "none" without one)."""
        reply = await self._request(PoolStatusRequest())
        assert isinstance(reply, PoolStatusReply)
        result: dict[str, Any] = as_dict(reply)
        return result

    async def list_keys(self, ns: int, *, after: bytes = b"", limit: int = 1024) -> dict[str, Any]:
        """A page of LIST_KEYS: up to ``limit`` (1..8192) keys of namespace ``ns`` (its ``ns`` in
        :meth:`namespaces`) in byte order after ``after``, as ``{"keys": [{"key", "dram",
        "nvme", "pool", "raw_bytes", "dirty"}, ...], "more", "blocks"}``. While ``more``, the
        last key is the next page's ``after``; see ``docs/protocol.md`` for what a pager sees
        when keys change meanwhile. It never reconnects: ``ns`` is an id of the daemon it was
        listed from, which a restarted daemon may give another namespace (list them again)."""
        reply = await self.run(ops.list_keys(ns, after, limit, self.daemon_minor))
        result: dict[str, Any] = as_dict(reply)
        return result

    async def evict(self) -> int:
        reply = await self._request(EvictRequest(all_namespaces=True))
        assert isinstance(reply, EvictReply)
        return reply.evicted

    def _start(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._start_reader(self._stream, self._conn)
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
        if self._receiver is not None:  # stop watching the socket before it closes
            self._receiver.close()
        await self._stream.aclose()
        self._held.lose_all(closed_error())
        self._regions.close()


class AsyncNamespace(NamespaceBase[AsyncClient]):
    """Blocks of one namespace, through an :class:`AsyncClient`."""

    async def _run(self, make_op: Callable[[], ops.Op[T]], *, retry: bool = True) -> T:
        """Drive ``make_op()`` on the client (made after any reconnect)."""
        return await self.client._run_op(make_op, retry=retry, ns=self)

    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        """As :meth:`Namespace.put`."""
        c = self.client
        return await self._run(
            lambda: ops.put(self.handle.ns, keys, blocks, self.block_bytes, self.arena, c.max_keys)
        )

    async def lookup(self, keys: Sequence[bytes], *, promote: bool = True) -> int:
        """How many leading ``keys`` are stored (for the whole TP group); with ``promote`` the
        daemon starts moving those hits up to DRAM now."""
        c = self.client
        return await self._run(lambda: ops.lookup_count(self.handle.ns, keys, c.max_keys, promote))

    async def lookup_tiers(self, keys: Sequence[bytes], *, promote: bool = True) -> list[str]:
        """Like :meth:`lookup`, with the tier (``"dram"``, ``"nvme"``...) of each hit."""
        c = self.client
        return await self._run(lambda: ops.lookup(self.handle.ns, keys, c.max_keys, promote))

    @contextlib.asynccontextmanager
    async def get(self, keys: Sequence[bytes]) -> AsyncIterator[list[memoryview]]:
        async with self.lease(keys) as lease:
            yield lease.views

    @contextlib.asynccontextmanager
    async def lease(
        self, keys: Sequence[bytes], *, resident_only: bool = False, verify_on_copy: bool = False
    ) -> AsyncIterator[BlockLease]:
        """As :meth:`Namespace.lease` (``resident_only`` and ``verify_on_copy`` as in
        :meth:`Namespace.acquire`); the lease ends when the ``async with`` block does."""
        c = self.client

        async def take() -> tuple[list[int], list[Extent], int]:
            leases, extents = await c.run(self._lease_op(keys, resident_only))
            return leases, extents, c.reconnects

        leases, extents, reconnects = await c._retrying(take, retry=True, ns=self)
        try:
            lease = c._held.track(
                self._block_lease(
                    keys, extents, partial=resident_only, verify_on_copy=verify_on_copy
                )
            )
        except BaseException:
            await c.release_leases(leases, reconnects)
            raise
        try:
            yield lease
        finally:
            lease.release()
            await c.release_leases(leases, reconnects)

    @contextlib.asynccontextmanager
    async def write(self, keys: Sequence[bytes]) -> AsyncIterator[BlockWrite]:
        """As :meth:`Namespace.write`: fill the slots in place; committed on a normal exit."""
        c = self.client
        writes, extents = await self._run(lambda: ops.alloc(self.handle.ns, keys, c.max_keys))
        reconnects = c.reconnects
        views = [self.arena.writable(e.offset, e.length) if e.length else None for e in extents]
        try:
            yield c._held.track(BlockWrite(list(keys), views))
        except BaseException:
            release_views(views)
            if c.reconnects == reconnects:  # else the daemon dropped the write already
                with anyio.CancelScope(shield=True), contextlib.suppress(BrokenConnectionError):
                    await c.run(ops.commit(self.handle.ns, writes, abort=True))
            raise
        release_views(views)
        try:
            if c.reconnects != reconnects:
                raise BrokenConnectionError("the client reconnected")
            await c.run(ops.commit(self.handle.ns, writes))
        except BrokenConnectionError as exc:
            raise in_flight_error(len(keys)) from exc

    async def read_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        c = self.client
        try:
            return await self._run(
                lambda: ops.read_into(self.handle.ns, keys, buffers, self.arena, c.max_keys)
            )
        except CorruptBlockError:
            c.corrupt_reads += 1
            raise

    async def forget(self, keys: Sequence[bytes]) -> int:
        return await self._run(lambda: ops.forget(self.handle.ns, keys, self.client.max_keys))

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
        return await self._run(
            lambda: ops.hint_attention(
                self.handle.ns, chain, queries, query_layers, budget_blocks, session
            )
        )

    async def hint(self, queue: Sequence[Sequence[bytes]], *, session: bytes = b"") -> int:
        return await self._run(
            lambda: ops.hint(self.handle.ns, queue, session, self.client.max_keys)
        )


@contextlib.asynccontextmanager
async def connect_async(
    socket_path: str | os.PathLike[str] | None = None,
    *,
    client_name: str = "",
    reconnect: Reconnect | None = None,
) -> AsyncIterator[AsyncClient]:
    """Connect and yield a client; closes everything on exit. With ``reconnect`` the client
    connects again, as that policy allows, when the connection breaks (a daemon restart); see
    ``docs/client.md`` ("Reconnecting")."""
    path = resolve_socket(socket_path)
    stream = await _connect(path)
    client = AsyncClient(
        stream, ClientConnection(), path=path, client_name=client_name, reconnect=reconnect
    )
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


async def _connect(path: Path) -> UNIXSocketStream:
    """A stream connected to ``path``, or the error that says why not."""
    check_socket_path(path)
    try:
        return await anyio.connect_unix(path)
    except OSError as exc:
        raise connect_error(path, exc) from None


def _send_nowait(raw: socket.socket, frame: bytes) -> int:
    """How much of ``frame`` the stream's non-blocking socket ``raw`` took at once (0 when
    full)."""
    try:
        return raw.send(frame)
    except BlockingIOError:
        return 0


async def _exchange_unread(
    stream: UNIXSocketStream, conn: ClientConnection, message: Message, fds: list[int]
) -> ReplyReceived:
    """Send ``message`` on a stream no reader task reads yet (INIT, a reconnect's OPEN_NS)
    and wait for its reply, or the daemon's last frame; descriptors go to ``fds``."""
    unique, frame = conn.request(message)
    with contextlib.suppress(anyio.BrokenResourceError, OSError):
        await stream.send(frame)  # if refused, the daemon's last frame says why
    while True:
        event = conn.next_event()
        if isinstance(event, ReplyReceived) and event.header.unique in (unique, 0):
            return event
        if isinstance(event, ConnectionClosed):
            raise BrokenConnectionError("kvtierd closed the connection")
        if event is not NEED_DATA:
            continue
        try:
            data, received = await stream.receive_fds(_RECEIVE_BYTES, 4)
        except (anyio.BrokenResourceError, anyio.EndOfStream, OSError) as exc:
            raise BrokenConnectionError(f"kvtierd closed the connection: {exc}") from exc
        fds.extend(received)
        if not data:
            raise BrokenConnectionError("kvtierd closed the connection")
        conn.receive_data(data)
