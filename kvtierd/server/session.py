"""One client connection: read frames, run handlers concurrently, write replies in any order.

Theory of operation. The reader reads through :mod:`kvtierd.server.receiving` (on asyncio one
``recv`` per wake-up with the socket's reader left registered, and LOOKUPs that arrive while it
waits answered by that readiness callback itself: :meth:`Session._serve_now`, which leaves
whatever it cannot answer at once to the reader, in order), feeds the bytes to the sans-IO
:class:`ServerConnection` and starts one handler task per request in the session's task group,
after taking one of ``max_inflight`` permits: when all are taken the reader stops reading,
which is the back-pressure a pipelining client feels. Requests that never wait on I/O (LOOKUP,
RELEASE, STATFS...) are served inline by the reader instead, which saves a task and a wake-up
on the latency-critical path. Replies are
written under a lock as soon as each is ready (out of order, matched by unique id). A frame
whose header is broken ends the connection after a last error frame; a request
that is merely invalid gets its errno and the connection goes on. Whatever ends the session,
its leases are released and its uncommitted writes abandoned.

Draining (SIGTERM): :meth:`Session.stop_reading` cancels only the reader; handlers already
running finish and their replies are sent before the connection closes.

Timing. A connection must have INIT answered within ``handshake_timeout_s`` (a frame still
arriving counts as not done): a watchdog task closes it otherwise, with an ``ETIMEDOUT`` frame.
:attr:`Session.last_request_s` is when the last complete request frame arrived, which the daemon
reads to find idle connections; :meth:`Session.close_with` ends a session from outside. The last
frame goes out only when no reply is half-written (the send lock is free): on a Unix socket by
one non-blocking write, over TLS through the stream as the session ends, for at most
:data:`LAST_FRAME_S`, so closing never waits long on a peer that does not read.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import struct
import time
from typing import TYPE_CHECKING

import anyio
from anyio.abc import ByteStream, SocketAttribute, TaskGroup, UNIXSocketStream

from kvtierd.errors import (
    KvtierError,
    NotSupportedError,
    RemoteProtocolError,
    StorageIOError,
    TimedOutError,
)
from kvtierd.nixl.export import NixlReads
from kvtierd.printable import printable
from kvtierd.protocol import (
    NEED_DATA,
    ConnectionClosed,
    FrameFlags,
    InvalidRequest,
    NeedData,
    Opcode,
    RequestHeader,
    RequestReceived,
    ServerConnection,
    ServerState,
)
from kvtierd.protocol.messages import Message, ReadReply
from kvtierd.server.figures import NO_TENANT, tenant_label
from kvtierd.server.handlers import HANDLERS, NOW_HANDLERS, NOWAIT_HANDLERS
from kvtierd.server.receiving import Receiver, Taken, open_receiver
from kvtierd.server.remote import REMOTE_OPCODES
from kvtierd.store.index import Owner
from kvtierd.store.namespaces import PeerCredentials

if TYPE_CHECKING:
    from kvtierd.server.context import SessionHost
    from kvtierd.store.store import BlockStore

__all__ = ["Session", "peer_credentials", "throttle_key"]

log = logging.getLogger("kvtierd.session")
_RECEIVE_BYTES = 1 << 16
#: A reply the peer does not take within this long ends its connection (a peer that stops
#: reading must not hold its slot, its tasks and their frames for ever).
SEND_TIMEOUT_S = 30.0
#: How long the last frame of a connection closed from outside (over TLS) may take.
LAST_FRAME_S = 1.0
_PEERCRED = struct.Struct("3i")

#: Requests the reader's readiness callback answers itself, through their
#: :data:`NOW_HANDLERS` entry, without waking the reader (asyncio; :meth:`Session._serve_now`).
_SERVED_NOW = NOW_HANDLERS

#: Handlers that never wait on I/O run inline in the reader: no task, no hand-off, one less
#: wake-up on the latency-critical LOOKUP path.
_INLINE = frozenset(
    {
        Opcode.INIT,
        Opcode.LOOKUP,
        Opcode.RELEASE,
        Opcode.STATFS,
        Opcode.LIST_NS,
        Opcode.EVICT,
        Opcode.DESTROY,
        Opcode.POOL_STATUS,
        Opcode.READ_RESIDENT,
        Opcode.LIST_KEYS,
        Opcode.NIXL_GRANT,
    }
)


def throttle_key(peer: PeerCredentials) -> str:
    """Whose warnings one throttle key counts: a local peer's uid, a remote peer's host."""
    if peer.remote:
        return peer.remote.rpartition(":")[0] or peer.remote
    return f"uid {peer.uid}"


def peer_credentials(stream: UNIXSocketStream) -> PeerCredentials:
    raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
    pid, uid, gid = _PEERCRED.unpack(
        raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return PeerCredentials(pid, uid, gid)


class Session:
    """State of one connection; :meth:`serve` runs it to the end."""

    def __init__(
        self, daemon: SessionHost, stream: ByteStream, peer: PeerCredentials, *, direct: bool = True
    ) -> None:
        self.daemon = daemon
        self.stream = stream
        self.peer = peer
        self.conn = ServerConnection(daemon.config.daemon.max_frame_bytes)
        self.owner = Owner()
        self.namespaces: set[int] = set()
        #: Descriptors to pass with the reply to request ``unique``.
        self.reply_fds: dict[int, list[int]] = {}
        self.requests = 0
        self.closing = False
        self._permits = anyio.Semaphore(daemon.config.daemon.max_inflight)
        self._send_lock = anyio.Lock()
        #: The socket, written to directly on the fast path; ``None`` for a stream that must
        #: only be written through (TLS).
        self._raw: socket.socket | None = (
            stream.extra(SocketAttribute.raw_socket) if direct else None
        )
        #: :meth:`close_with`'s frame, for a stream that must be written through.
        self._last_frame = b""
        self._reader_scope = anyio.CancelScope()
        self._session_scope = anyio.CancelScope()
        self._handshake_scope = anyio.CancelScope()
        self._receiver: Receiver | None = None
        #: What :meth:`_serve_now` took from the connection and left to the reader: the first
        #: event it could not answer at once, or the protocol error that ended its look.
        self._stashed: RequestReceived | InvalidRequest | ConnectionClosed | None = None
        self._stashed_error: RemoteProtocolError | None = None
        #: The tail of a reply :meth:`_serve_now` could not write whole: sent before any
        #: other frame, under the send lock.
        self._unsent = b""
        #: ``time.monotonic()`` when the last request frame arrived (or the connection did).
        self.last_request_s = time.monotonic()

    # -- the RequestContext a handler sees (kvtierd.server.context) --------------------------

    @property
    def store(self) -> BlockStore:
        return self.daemon.store

    @property
    def reports(self) -> SessionHost:
        return self.daemon

    @property
    def nixl(self) -> NixlReads:
        return self.daemon.nixl

    @property
    def may_create_namespaces(self) -> bool:
        return not self.peer.remote or self.daemon.config.remote.allow_create

    @property
    def max_inflight(self) -> int:
        return self.daemon.config.daemon.max_inflight

    @property
    def max_frame_bytes(self) -> int:
        return self.conn.max_frame_bytes

    def negotiate(self, max_frame_bytes: int) -> None:
        self.conn.negotiate(max_frame_bytes)

    # -- the connection ------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Something of it is in flight, leased or being written: closing it now would take
        an engine's views from under it."""
        return bool(self.conn.in_flight or self.owner.leases or self.owner.writes)

    @property
    def departing(self) -> bool:
        """It said DESTROY (or was closed) and is not stuck writing a reply: its slot is free."""
        return self.closing and self._writer_idle

    def stop_reading(self) -> None:
        """Take no more requests; those in flight finish and are answered."""
        self._reader_scope.cancel()

    def close_with(self, error: KvtierError) -> None:
        """End the session now, requests in flight included; ``error`` is the last frame
        when the stream is between frames: written at once where the socket takes it without
        waiting, or, for a stream written through only (TLS), as the session ends, within
        :data:`LAST_FRAME_S`."""
        if not self.closing and self._writer_idle:
            frame = self.conn.fatal(error)
            if self._raw is None:
                self._last_frame = frame
            else:
                try:
                    self._raw.send(frame)
                except OSError as exc:  # BlockingIOError included: a peer that does not read
                    log.debug("no last frame for %s: %s", self.peer, exc)
        self.closing = True
        self._session_scope.cancel()

    async def serve(self) -> None:
        try:
            with self._session_scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._expire_handshake)
                    with self._reader_scope:
                        await self._read(tg)
                    self._handshake_scope.cancel()
        except* (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as group:
            log.debug("connection from %s ended: %s", self.peer, group.exceptions[0])
        finally:
            if self._receiver is not None:
                self._receiver.close()  # before the stream closes its socket
            self.daemon.store.drop_owner(self.owner)
            with anyio.CancelScope(shield=True):
                if self._last_frame:
                    await self._send_last_frame(self._last_frame)
                await self.stream.aclose()

    async def _send_last_frame(self, frame: bytes) -> None:
        """Write :meth:`close_with`'s frame through the stream, unless the peer does not take
        it within :data:`LAST_FRAME_S` or is gone."""
        with (
            anyio.move_on_after(LAST_FRAME_S),
            contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
        ):
            await self.stream.send(frame)

    async def _expire_handshake(self) -> None:
        timeout_s = self.daemon.config.daemon.handshake_timeout_s
        with self._handshake_scope:
            await anyio.sleep(timeout_s)
            if self.conn.state is not ServerState.AWAIT_INIT and not self._send_lock.locked():
                return  # INIT answered just now; the reader has not said so yet
            self.daemon.peer_warnings.report(
                log, logging.WARNING, throttle_key(self.peer), "%s sent no INIT in %g s",
                self.peer, timeout_s,
            )  # fmt: skip
            self.close_with(TimedOutError(f"no INIT within {timeout_s:g} s"))

    async def _read(self, tg: TaskGroup) -> None:
        handshaking = True
        serve_now = None if self.peer.remote else self._serve_now
        receiver = self._receiver = open_receiver(self.stream, self._raw, serve_now)
        receive = receiver.receive
        while not self.closing:
            data = await receive(_RECEIVE_BYTES)
            if data is not None:  # None: _serve_now took it and left the rest to us
                self.conn.receive_data(data)
            if self._unsent:
                await self._send(b"")
            if not await self._dispatch_buffered(tg):
                return
            if handshaking and self.conn.state is not ServerState.AWAIT_INIT:
                handshaking = False
                self._handshake_scope.cancel()

    async def _dispatch_buffered(self, tg: TaskGroup) -> bool:
        """Serve every complete frame; ``False`` once the connection is done."""
        while not self.closing:
            event: RequestReceived | InvalidRequest | ConnectionClosed | NeedData | None
            event, self._stashed = self._stashed, None
            error, self._stashed_error = self._stashed_error, None
            try:
                if error is not None:
                    raise error
                if event is None:
                    event = self.conn.next_event()
            except RemoteProtocolError as exc:
                self.daemon.peer_warnings.report(
                    log, logging.WARNING, f"protocol violations of {throttle_key(self.peer)}",
                    "protocol violation from %s: %s", self.peer, exc,
                )  # fmt: skip
                await self._send(self.conn.fatal(exc))
                return False
            if event is NEED_DATA:
                return True
            if isinstance(event, ConnectionClosed):
                return False
            self.last_request_s = time.monotonic()
            if isinstance(event, InvalidRequest):
                self._failed(event.header, event.error)
                await self._send(self.conn.reply_error(event.header, event.error))
            else:
                assert isinstance(event, RequestReceived)
                opcode = event.header.opcode
                if self.peer.remote and opcode not in REMOTE_OPCODES:
                    refusal = NotSupportedError(
                        f"{Opcode(opcode).name} is not served over TCP: a remote client reads "
                        "blocks with READ_NIXL (docs/remote.md)"
                    )
                    self._failed(event.header, refusal)
                    await self._send(self.conn.reply_error(event.header, refusal))
                elif opcode in _INLINE:
                    await self._handle(event)
                elif opcode in NOWAIT_HANDLERS and await self._handle(event, nowait=True):
                    pass  # served inline: nothing it needed had to be waited for
                else:
                    await self._permits.acquire()
                    tg.start_soon(self._handle, event, True)
            if self.conn.state is ServerState.CLOSED:  # DESTROY, or a refused INIT: answered
                self.closing = True
        return False

    def _serve_now(self, data: bytes) -> Taken:
        """The readiness callback's server (:mod:`kvtierd.server.receiving`): take ``data``
        and answer at once the requests that need no waiting (:data:`_SERVED_NOW`, through
        their :data:`NOW_HANDLERS` entry), as the reader would inline. ``SERVED`` when that was
        all of them and at least one (each reply written whole, else ``_unsent`` stops it: the
        peer was there), ``AWAITING`` when there was none (half a frame). Otherwise ``LEFT``:
        the first event it could not answer (or the protocol error) is left in ``_stashed``
        and the rest in the connection, for the reader, which goes on exactly as if it had
        read the bytes itself."""
        conn = self.conn
        conn.receive_data(data)
        answered = False
        while self._may_answer_now():
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                self._stashed_error = exc
                return Taken.LEFT
            if event is NEED_DATA:
                return Taken.SERVED if answered else Taken.AWAITING
            if type(event) is not RequestReceived or event.header.opcode not in _SERVED_NOW:
                self._stashed = event
                return Taken.LEFT
            self.last_request_s = time.monotonic()
            if not self._answer_now(event):
                self._stashed = event  # it would wait: the reader serves it in full
                return Taken.LEFT
            answered = True
        return Taken.LEFT

    def _may_answer_now(self) -> bool:
        """Nothing stands in the way of answering from the callback: the connection is READY
        and open, its reading not stopped (a drain), and no reply is being written (or left
        half-written)."""
        return (
            self.conn.state is ServerState.READY
            and not self.closing
            and not self._reader_scope.cancel_called
            and self._writer_idle
        )

    def _answer_now(self, event: RequestReceived) -> bool:
        """Run ``event``'s :data:`NOW_HANDLERS` entry and write its reply; ``False``, with
        nothing done, when it would have to wait."""
        header = event.header
        started = time.perf_counter() if self.daemon.timings is not None else 0.0
        outcome: Message | Exception
        try:
            outcome = _SERVED_NOW[header.opcode](self, header, event.message)
        except anyio.WouldBlock:
            return False
        except Exception as exc:
            outcome = exc
        frame, fds = self._reply_frame(header, outcome, started)
        assert not fds, "a request answered now passes no descriptor"
        self._write_now(frame)
        return True

    @property
    def _writer_idle(self) -> bool:
        """No reply is being written or left half-written: a frame may go to the socket now."""
        return not self._send_lock.locked() and not self._unsent

    def _write_now(self, frame: bytes) -> None:
        """The one direct writer, shared by the readiness callback's replies and :meth:`_send`'s
        fast path: offer ``frame`` to the non-blocking socket by one ``send``, when the writer is
        idle (the caller checked :attr:`_writer_idle`). What the socket does not take waits in
        ``_unsent``, which :meth:`_send` writes under the lock before any other frame, so frames
        never interleave and go out in the order they were offered. A broken socket stops the
        reading (the session then ends)."""
        assert self._raw is not None
        try:
            sent = self._raw.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            log.debug("cannot write to %s: %s", self.peer, exc)
            self.stop_reading()
            return
        if sent < len(frame):
            self._unsent = frame[sent:]

    async def _handle(
        self, event: RequestReceived, permit: bool = False, *, nowait: bool = False
    ) -> bool:
        """Serve ``event`` and send its reply; ``True``. With ``nowait``, its
        :data:`NOWAIT_HANDLERS` entry, and ``False`` (nothing done, nothing sent) when that
        would have to wait."""
        header = event.header
        started = time.perf_counter() if self.daemon.timings is not None else 0.0
        handlers = NOWAIT_HANDLERS if nowait else HANDLERS
        outcome: Message | Exception
        try:
            outcome = await handlers[header.opcode](self, header, event.message)
        except anyio.WouldBlock as exc:
            if nowait:
                return False
            outcome = exc
        except Exception as exc:
            outcome = exc
        except BaseException:
            self._count_request()
            if permit:
                self._permits.release()
            raise
        frame, fds = self._reply_frame(header, outcome, started)
        try:
            await self._send(frame, fds)
        finally:
            # after the reply went out: a peer that does not read its replies runs out of
            # permits, and its reader stops, instead of piling up tasks and frames
            if permit:
                self._permits.release()
        return True

    def _count_request(self) -> None:
        self.daemon.count_request()
        self.requests += 1

    def _reply_frame(
        self, header: RequestHeader, outcome: Message | Exception, started: float
    ) -> tuple[bytes, list[int] | None]:
        """The reply frame to ``header`` for what its handler returned or raised, and the
        descriptors to pass with it; the request counted and timed."""
        self._count_request()
        fds = self.reply_fds.pop(header.unique, None) if self.reply_fds else None
        reply = None if isinstance(outcome, Exception) else outcome
        try:
            if isinstance(outcome, Exception):
                raise outcome
            frame = self.conn.reply(
                header, outcome, FrameFlags.FD_ATTACHED if fds else FrameFlags.NONE
            )  # encoding can fail too
        except KvtierError as exc:
            fds = None  # a failed reply carries no descriptor
            frame = self.conn.reply_error(header, exc)
            self._failed(header, exc)
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("handler for %s failed", Opcode(header.opcode).name)
            fds = None
            internal = StorageIOError(f"internal error: {exc}")
            frame = self.conn.reply_error(header, internal)
            self._failed(header, internal)
        timings = self.daemon.timings
        if timings is not None:  # dispatch to reply ready, failures included
            elapsed = time.perf_counter() - started
            timings.observe(header.opcode, self._tier_of(header.opcode, reply), elapsed)
        return frame, fds

    def _failed(self, header: RequestHeader, exc: KvtierError) -> None:
        """Count a request answered with ``exc`` (by opcode, errno and tenant) and say so, at
        most once a minute per peer (:class:`~kvtierd.server.throttle.Throttle`), naming who
        sent it and on which namespace: a miss (``ENOENT``) at INFO, anything else a
        WARNING."""
        ns = self.store.registry.find(header.ns) if header.ns in self.namespaces else None
        if ns is None:
            tenant = NO_TENANT
        else:
            tenant = tenant_label(ns.region.tenant if ns.region is not None else None)
        if self.daemon.timings is not None:
            self.daemon.timings.failed(header.opcode, exc.errno, tenant)
        where = "" if ns is None else f", namespace {ns.spec.name!r} of tenant {ns.spec.tenant!r}"
        try:
            opname = Opcode(header.opcode).name
        except ValueError:
            opname = f"opcode {header.opcode}"
        self.daemon.peer_warnings.report(
            log,
            logging.INFO if exc.errno == errno.ENOENT else logging.WARNING,
            # misses apart: a routine READ miss must not use up the slot of an ENOSPC or EIO
            f"{'misses' if exc.errno == errno.ENOENT else 'failed requests'} of "
            f"{throttle_key(self.peer)}",
            "%s from %s (client %r%s) failed: %s: %s",
            opname, self.peer, self.owner.name, where,
            errno.errorcode.get(exc.errno, exc.errno), printable(str(exc)),
            extra={
                "opcode": opname,
                "errno": errno.errorcode.get(exc.errno, str(exc.errno)),
                "pid": self.peer.pid,
                "uid": self.peer.uid,
                "remote": self.peer.remote,
                "client": self.owner.name,
                "namespace": ns.spec.name if ns is not None else "",
                "tenant": ns.spec.tenant if ns is not None else "",
            },
        )  # fmt: skip

    def _tier_of(self, opcode: int, reply: Message | None) -> str:
        """The request-duration histogram's ``tier``: for READ the deepest tier its lease was
        loaded from ("none" when it failed), else empty."""
        if opcode != Opcode.READ:
            return ""
        lease = self.owner.leases.get(reply.lease) if isinstance(reply, ReadReply) else None
        return lease.source.name.lower() if lease is not None else "none"

    async def _send(self, frame: bytes, fds: list[int] | None = None) -> None:
        """Write one reply; replies of concurrent handlers go out whole, in completion order.

        Fast path: when the writer is idle, the frame goes through :meth:`_write_now` (the
        usual case for small replies, and one event-loop turn cheaper than the stream); whatever
        the kernel does not take (and the tail of a reply the readiness callback left) is sent
        by the stream under the lock, which later replies then wait for, so frames never
        interleave. A frame with descriptors always goes through the stream.
        """
        if not fds and self._raw is not None and self._writer_idle:
            self._write_now(frame)
            if not self._unsent:
                return
            frame = b""  # its tail is in _unsent now
        try:
            async with self._send_lock:
                with anyio.fail_after(SEND_TIMEOUT_S):
                    if self._unsent:  # the rest of a reply written directly: first
                        unsent, self._unsent = self._unsent, b""
                        await self.stream.send(unsent)
                    if fds:
                        assert isinstance(self.stream, UNIXSocketStream)
                        await self.stream.send_fds(frame, fds)
                    elif frame:
                        await self.stream.send(frame)
        except TimeoutError:
            log.warning(
                "%s read no reply for %g s: closing its connection", self.peer, SEND_TIMEOUT_S
            )
            self.closing = True
            self._session_scope.cancel()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            log.debug("cannot write to %s: %s", self.peer, exc)
            self.stop_reading()
