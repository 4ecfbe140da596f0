"""The async client's transport (anyio: asyncio or trio): pipelined requests over one connection.

Any number of tasks may call the client at once; requests are written in turn and the
replies, which may come back in any order, are matched to their callers by unique id by a
reader task that :func:`kvtierd.client.connect_async` owns.

A caller cancelled while it waits does not leak what the daemon already granted: if the reply
it abandoned carried a lease or an allocation, the reader hands it to a janitor task that
releases the lease or aborts the write. The janitor also sends the RELEASEs that
:meth:`AsyncConnection.release_soon` queued from synchronous code (a lease's ``release()``).

With a :class:`~kvtierd.client.reconnect.Reconnect` policy a broken connection is replaced by the
first call that meets it (the others wait on a lock): a new stream is connected, INIT and the
OPEN_NS of every namespace still held (the API half's ``_reopen_namespaces``) are exchanged on
it before any reader task runs, and only then does it become the client's, so no request ever
carries an old namespace id. Everything granted on a connection (leases, writes, janitor work)
is tagged with its number (``reconnects``) and dropped, never sent, once that connection is
gone.

The API (namespaces, admin calls, blocks) is written once, in :mod:`kvtierd.client._async.client`,
over this class and over :class:`kvtierd.client._sync.connection.SyncConnection`; what the two
transports offer it has the same names: ``_exchange``, ``_drive``, ``run``, ``_retrying``,
``_run_op``, ``_give_back``, ``_flush_releases``, ``release_soon``, ``_reopen``.

The module is past 600 lines because pipelining, cancellation, giving back and reconnecting
share one connection's state (the waiters, the reader, the janitor, the connection's number);
the sans-IO half lives in ``ops``, ``base`` and ``reconnect``, the API in ``client``.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import socket
import ssl
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio import sleep
from anyio.abc import ByteStream, SocketAttribute, TaskGroup, UNIXSocketStream
from anyio.lowlevel import EventLoopToken
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from anyio.streams.tls import TLSAttribute

from kvtierd.client import ops
from kvtierd.client.base import (
    NamespaceBase,
    NamespaceHandle,
    Regions,
    check_init,
    close_all,
    closed_error,
    init_request,
    message_of,
    peer_open,
)
from kvtierd.client.blocks import HeldBlocks
from kvtierd.client.endpoint import Endpoint
from kvtierd.client.reconnect import (
    RECONNECTABLE,
    Reconnect,
    lost_lease_error,
    replaced_region_error,
)
from kvtierd.errors import AccessDeniedError, BrokenConnectionError, KvtierError
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
    Message,
    ReadNixlReply,
    ReadReply,
    ReleaseRequest,
)
from kvtierd.transport.receiving import Receiver, Taken, open_receiver

__all__ = ["AsyncConnection", "Exchange", "sleep"]

T = TypeVar("T")
#: One request and its reply on a connection being opened (INIT, a reconnect's OPEN_NS); the
#: descriptors passed with the reply go to the list.
Exchange = Callable[[Message, list[int]], Awaitable[Message]]
_RECEIVE_BYTES = 1 << 16
#: How long a cancelled operation may take to give back what it was granted.
_UNWIND_S = 5.0
#: Janitor work that is not a message: send the RELEASEs :meth:`release_soon` queued.
_FLUSH = None


class _Waiter:
    __slots__ = ("abandoned", "done", "event", "fds")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.event: ReplyReceived | None = None
        self.abandoned = False
        #: Descriptors passed with the reply (an OPEN_NS reply's region).
        self.fds: list[int] = []


class AsyncConnection(abc.ABC):
    """The transport under :class:`~kvtierd.client.AsyncClient`."""

    def __init__(
        self,
        stream: ByteStream,
        conn: ClientConnection,
        *,
        endpoint: Endpoint,
        client_name: str = "",
        reconnect: Reconnect | None = None,
    ) -> None:
        self._stream = stream
        self._sock, self._raw = _sockets_of(stream)
        self._conn = conn
        self._endpoint = endpoint
        self._client_name = client_name
        self.reconnect = reconnect
        self._reconnect_lock = anyio.Lock()
        self._tg: TaskGroup | None = None
        #: Namespaces opened on this client and leases taken: a reconnect reopens the
        #: namespaces and invalidates the leases.
        self._namespaces: weakref.WeakSet[NamespaceBase[Any]] = weakref.WeakSet()
        self._held = HeldBlocks()
        #: How many times the client reconnected.
        self.reconnects = 0
        self._send_lock = anyio.Lock()
        self._waiters: dict[int, _Waiter] = {}
        self._broken: KvtierError | None = None
        self._regions = Regions(maps=endpoint.passes_descriptors)
        self._closed = False
        #: Leases given back from synchronous code (:meth:`release_soon`), not sent yet, and
        #: one event per RELEASE being sent (set once it is).
        self._releases: collections.deque[int] = collections.deque()
        self._releasing: set[anyio.Event] = set()
        #: Whether a wake-up for the janitor to send them is queued already.
        self._flush_queued = False
        #: The event loop's thread and token (set by :meth:`_start`), for a release from
        #: another thread.
        self._loop_thread: int | None = None
        self._token: EventLoopToken | None = None
        #: What reads the current connection's replies (closed before its socket is).
        self._receiver: Receiver | None = None
        self.max_keys = 1
        self.corrupt_reads = 0
        self.daemon_version = ""
        self.daemon_minor = 0
        # What to give back, tagged with the connection (``reconnects``) that granted it.
        janitor_send, janitor_receive = anyio.create_memory_object_stream[
            tuple[int, Message | None]
        ](1024)
        self._janitor_send: MemoryObjectSendStream[tuple[int, Message | None]] = janitor_send
        self._janitor_receive: MemoryObjectReceiveStream[tuple[int, Message | None]] = (
            janitor_receive
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "connected"
        return (
            f"<{type(self).__name__} {self._endpoint} {state}, daemon "
            f"{self.daemon_version or '?'}, reconnect {'on' if self.reconnect else 'off'}>"
        )

    # -- what the API half provides ----------------------------------------------------------

    @abc.abstractmethod
    async def _recover(self, policy: Reconnect) -> None:
        """Replace the broken connection as ``policy`` allows, or raise what the last attempt
        met."""

    @abc.abstractmethod
    async def _reopen_namespaces(
        self, exchange: Exchange, regions: Regions
    ) -> list[tuple[Any, NamespaceHandle]]:
        """Open every namespace still held again through ``exchange``, mapping into
        ``regions``; returns each with its new handle."""

    # -- requests ----------------------------------------------------------------------------

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

    async def _exchange(
        self, message: Message, ns: int = 0, fds: list[int] | None = None
    ) -> Message:
        """:meth:`_call` without the closed check (inside a call that made it, and
        ``aclose``'s DESTROY)."""
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
        return await self._drive(op)

    async def _drive(self, op: ops.Op[T]) -> T:
        """:meth:`run`, inside a call (the API half drives with this name on both faces)."""
        try:
            call = next(op)
        except StopIteration as stop:
            result: T = stop.value
            return result
        return await self._drive_from(op, call)

    async def _drive_from(self, op: ops.Op[T], call: ops.Call, *, unwinding: bool = False) -> T:
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
            await self._drive_from(op, op.throw(exc), unwinding=True)
        op.close()

    async def _give_back(self, op: ops.Op[Any]) -> None:
        """Run ``op``, which gives back what the daemon granted (an abort, a RELEASE), even
        under a cancellation; a connection gone meanwhile gave it back already."""
        with anyio.CancelScope(shield=True), contextlib.suppress(BrokenConnectionError):
            await self.run(op)

    # -- connecting --------------------------------------------------------------------------

    async def _handshake(self) -> None:
        request = init_request(self._client_name)
        fds: list[int] = []
        try:
            reply = await _exchange_unread(self._stream, self._conn, self._endpoint, request, fds)
        finally:
            close_all(fds)  # INIT passes no memory (protocol minor 6)
        init = check_init(reply)
        self.max_keys = init.max_keys
        self.daemon_version = init.daemon_version
        self.daemon_minor = init.minor

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

    async def _reopen(self) -> None:
        """Connect, INIT and reopen every namespace still held on the new stream before any
        other request uses it (no reader task yet), then take it in one step: no task ever
        sends an old namespace id on the new connection."""
        stream = await self._endpoint.open_async()
        sock, raw = _sockets_of(stream)
        conn = ClientConnection()
        regions = Regions(maps=self._endpoint.passes_descriptors)

        async def exchange(message: Message, fds: list[int]) -> Message:
            return await _exchange_unread(stream, conn, self._endpoint, message, fds)

        try:
            init_fds: list[int] = []
            try:
                init = check_init(await exchange(init_request(self._client_name), init_fds))
            finally:
                close_all(init_fds)  # INIT passes no memory
            handles = await self._reopen_namespaces(exchange, regions)
        except BaseException:
            regions.close()
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        old = self._stream
        self._stream, self._sock, self._raw, self._conn = stream, sock, raw, conn
        self._regions.close(replaced_region_error())
        self._regions = regions
        for ns, handle in handles:
            ns.handle = handle
        self._releases.clear()
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
        self._start_reader(stream, raw, conn)
        if old_receiver is not None:  # stop watching the old socket before it closes
            old_receiver.close()
        with (
            anyio.CancelScope(shield=True),
            contextlib.suppress(OSError, anyio.BrokenResourceError),
        ):
            await old.aclose()

    async def _retrying(
        self,
        call: Callable[[], Awaitable[T]],
        *,
        retry: bool,
        ns: NamespaceBase[Any] | None = None,
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
        self,
        make_op: Callable[[], ops.Op[T]],
        *,
        retry: bool,
        ns: NamespaceBase[Any] | None = None,
    ) -> T:
        """Drive ``make_op()`` (made after any reconnect) as :meth:`_retrying` does."""
        return await self._retrying(lambda: self.run(make_op()), retry=retry, ns=ns)

    # -- giving back -------------------------------------------------------------------------

    def release_soon(self, leases: Sequence[int], reconnects: int | None = None) -> None:
        """RELEASE ``leases`` without waiting, from synchronous code (a lease's ``release()``),
        on the event loop's thread or any other: the janitor sends them, unless
        :meth:`_flush_releases` does first. Leases granted before reconnect number
        ``reconnects`` are dropped: the daemon released them with their connection, and their
        ids may name a new connection's leases."""
        if self._closed or (reconnects is not None and reconnects != self.reconnects):
            return
        self._releases.extend(leases)  # a deque: safe from any thread
        if threading.get_ident() == self._loop_thread:
            self._wake_janitor()
        elif self._token is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: so is the connection
                anyio.from_thread.run_sync(self._wake_janitor, token=self._token)

    def _wake_janitor(self) -> None:
        """Have the janitor send the queued RELEASEs: one wake-up queued at a time, so the
        janitor's queue keeps its room for the clean-up of cancelled requests."""
        if self._flush_queued or self._closed:
            return
        with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
            self._janitor_send.send_nowait((self.reconnects, _FLUSH))
            self._flush_queued = True

    async def _flush_releases(self) -> None:
        """Send the queued RELEASEs, a frame of up to ``max_keys`` at a time, shielded from
        cancellation, without waiting for their replies (as every RELEASE goes), and wait until
        those another task took first are sent too: a lease ended by an ``async with`` is
        given back before any later request of this client."""
        pending = self._releases
        while pending and not self._closed and self._broken is None:
            batch = [pending.popleft() for _ in range(min(len(pending), self.max_keys))]
            sent = anyio.Event()
            self._releasing.add(sent)
            try:
                with anyio.CancelScope(shield=True), contextlib.suppress(KvtierError):
                    await self._send_only(ReleaseRequest(batch), 0)
            finally:
                self._releasing.discard(sent)
                sent.set()
        for sent in list(self._releasing):
            with anyio.CancelScope(shield=True):
                await sent.wait()

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
            if (
                isinstance(message, ReadReply | ReadNixlReply) and message.lease
            ):  # and READ_RESIDENT's
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
                if message is _FLUSH:
                    self._flush_queued = False
                    await self._flush_releases()
                    continue
                with contextlib.suppress(KvtierError):
                    await self._call(message)

    # -- the reader --------------------------------------------------------------------------

    def _start_reader(
        self, stream: ByteStream, raw: socket.socket | None, conn: ClientConnection
    ) -> None:
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

        fds = pending if raw is not None and self._endpoint.passes_descriptors else None
        receiver = open_receiver(stream, raw, serve_now, fds=fds)
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

    # -- the connection's life ---------------------------------------------------------------

    def connected(self) -> bool:
        """Whether the connection is still open at both ends, without reading from it (see
        :func:`~kvtierd.client.base.peer_open`)."""
        return not self._closed and self._broken is None and peer_open(self._sock.fileno())

    def _abandon(self) -> None:
        """Drop a client whose handshake failed: it never started, so only its janitor's
        streams are open."""
        self._closed = True
        self._janitor_send.close()
        self._janitor_receive.close()

    def _start(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._loop_thread = threading.get_ident()
        self._token = anyio.lowlevel.current_token()
        self._start_reader(self._stream, self._raw, self._conn)
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


def _sockets_of(stream: ByteStream) -> tuple[socket.socket, socket.socket | None]:
    """The socket beneath ``stream``, and the same again where the client may read and write
    it directly (sends offered at once, reads on readiness), that is unless the stream is TLS.
    Looked up once: anyio's ``extra`` builds a mapping per call, a tenth of a LOOKUP's client
    CPU."""
    sock: socket.socket = stream.extra(SocketAttribute.raw_socket)
    tls = stream.extra(TLSAttribute.ssl_object, None) is not None
    # anyio's TCP stream on asyncio gives the transport's socket wrapper, which neither sends
    # nor receives: only a real socket is used directly
    direct = isinstance(sock, socket.socket) and not tls
    return sock, sock if direct else None


def _send_nowait(raw: socket.socket | None, frame: bytes) -> int:
    """How much of ``frame`` the stream's non-blocking socket ``raw`` took at once (0 when
    full, or when the stream must do the sending: TLS)."""
    if raw is None:
        return 0
    try:
        return raw.send(frame)
    except BlockingIOError:
        return 0


async def _exchange_unread(
    stream: ByteStream,
    conn: ClientConnection,
    endpoint: Endpoint,
    message: Message,
    fds: list[int],
) -> Message:
    """Send ``message`` on a stream no reader task reads yet (INIT, a reconnect's OPEN_NS)
    and return its reply, or raise what the daemon's last frame says; descriptors go to
    ``fds``."""
    unique, frame = conn.request(message)
    with contextlib.suppress(anyio.BrokenResourceError, OSError):
        await stream.send(frame)  # if refused, the daemon's last frame says why
    while True:
        event = conn.next_event()
        if isinstance(event, ReplyReceived) and event.header.unique in (unique, 0):
            return message_of(event)
        if isinstance(event, ConnectionClosed):
            raise BrokenConnectionError(f"kvtierd closed the connection{endpoint.refusal_hint}")
        if event is not NEED_DATA:
            continue
        try:
            data = await _receive(stream, fds)
        except ssl.SSLError as exc:  # TLS 1.3: the daemon judges the certificate after
            raise AccessDeniedError(  # the client's side of the handshake is done
                f"kvtierd at {endpoint} refused this client's TLS certificate: {exc}"
            ) from None
        except (anyio.BrokenResourceError, anyio.EndOfStream, OSError) as exc:
            raise BrokenConnectionError(
                f"kvtierd closed the connection{endpoint.refusal_hint}: {exc}"
            ) from exc
        if not data:
            raise BrokenConnectionError(f"kvtierd closed the connection{endpoint.refusal_hint}")
        conn.receive_data(data)


async def _receive(stream: ByteStream, fds: list[int]) -> bytes:
    """Bytes of a stream no reader task reads yet, with the descriptors they carry."""
    if isinstance(stream, UNIXSocketStream):
        data, received = await stream.receive_fds(_RECEIVE_BYTES, 4)
        fds.extend(received)
        return data
    try:
        return await stream.receive(_RECEIVE_BYTES)
    except anyio.EndOfStream:
        return b""
