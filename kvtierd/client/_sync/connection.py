"""The blocking client's transport: one request at a time over a Unix socket (or, to another
host's daemon, over TCP: :mod:`kvtierd.client.endpoint`), thread-safe.

Threads take turns. Replies carry the unique id of their request, but a blocking reader has
nowhere to put a reply that is not its own, so it drops it (the RELEASEs nobody waits for); a
thread reading while another waits would drop that thread's reply and leave it waiting for
ever. So every exchange, from a call's first request to its last reply, happens in a turn
(:meth:`SyncConnection._turn`: the connection's lock, the closed check, the queued RELEASEs),
and everything that talks to the daemon, ``run`` for the operations of
:mod:`kvtierd.client.ops` and ``_call`` for single requests, takes one. The exception is
:meth:`SyncConnection.release_soon`, which a finalizer may call inside a turn on its own
thread: it never waits for the lock, and the turn in progress sends what it queued.

With a :class:`~kvtierd.client.reconnect.Reconnect` policy, a turn that finds the connection
broken replaces it before its call runs (INIT, then OPEN_NS of every namespace still held, on
the new socket: the API half's ``_reopen_namespaces``), so the call is made with the new
namespace ids; leases and queued RELEASEs of the old connection are dropped, never sent.

The API is written once, in :mod:`kvtierd.client._async.client`, and generated from it into
:mod:`kvtierd.client._sync.client` over this class; see
:mod:`kvtierd.client._async.connection` for the names both transports give it.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import os
import socket
import ssl
import threading
import weakref
from collections.abc import Callable, Sequence
from time import sleep
from types import TracebackType
from typing import Any, Self, TypeVar

from kvtierd.client import ops
from kvtierd.client.base import (
    NamespaceBase,
    NamespaceHandle,
    Regions,
    broken_error,
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
from kvtierd.errors import (
    AccessDeniedError,
    BrokenConnectionError,
    ClosedError,
    KvtierError,
    TimedOutError,
)
from kvtierd.protocol import NEED_DATA, ClientConnection, ConnectionClosed, ReplyReceived
from kvtierd.protocol.messages import DestroyRequest, Message, ReleaseRequest

__all__ = ["Exchange", "SyncConnection", "sleep"]

T = TypeVar("T")
#: One request and its reply on a connection being opened (a reconnect's OPEN_NS); the
#: descriptors passed with the reply go to the list.
Exchange = Callable[[Message, list[int]], Message]
_RECEIVE_BYTES = 1 << 16
_NO_WAIT = ops.NoWait


class SyncConnection(abc.ABC):
    """The transport under :class:`~kvtierd.client.Client`; a context manager that closes it."""

    def __init__(
        self,
        sock: socket.socket,
        conn: ClientConnection,
        *,
        endpoint: Endpoint,
        client_name: str = "",
        timeout_s: float | None = None,
        reconnect: Reconnect | None = None,
    ) -> None:
        self._sock = sock
        self._conn = conn
        self._lock = threading.Lock()
        self._releases: collections.deque[int] = collections.deque()
        self._regions = Regions(maps=endpoint.passes_descriptors)
        self._closed = False
        #: What broke the connection (then every call raises it, or reconnects).
        self._broken: KvtierError | None = None
        self._endpoint = endpoint
        self._client_name = client_name
        self._timeout_s = timeout_s
        self.reconnect = reconnect
        #: Namespaces opened on this client: a reconnect opens them again.
        self._namespaces: weakref.WeakSet[NamespaceBase[Any]] = weakref.WeakSet()
        self._held = HeldBlocks()
        #: How many times the client reconnected (a new daemon run each time, maybe).
        self.reconnects = 0
        self.max_keys = 1
        self.corrupt_reads = 0
        self.daemon_version = ""
        self.daemon_minor = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "connected"
        return (
            f"<{type(self).__name__} {self._endpoint} {state}, daemon "
            f"{self.daemon_version or '?'}, reconnect {'on' if self.reconnect else 'off'}>"
        )

    # -- what the API half provides ----------------------------------------------------------

    @abc.abstractmethod
    def _recover(self, policy: Reconnect) -> None:
        """Replace the broken connection as ``policy`` allows (the lock held), or raise what
        the last attempt met."""

    @abc.abstractmethod
    def _reopen_namespaces(
        self, exchange: Exchange, regions: Regions
    ) -> list[tuple[Any, NamespaceHandle]]:
        """Open every namespace still held again through ``exchange``, mapping into
        ``regions``; returns each with its new handle."""

    # -- transport ---------------------------------------------------------------------------

    def _turn(self, *, reconnect: bool = False, closing: bool = False) -> _Turn:
        """Hold the connection for one call, its requests and their replies, with no other
        thread's in between (``with self._turn(): ...``). Raises ``ClosedError`` once the
        client is closed, and what broke the connection unless ``reconnect`` (and a policy)
        lets it reconnect. Queued RELEASEs (:meth:`release_soon`) go out before the call's
        first request and, those queued meanwhile, as the turn ends."""
        return _Turn(self, reconnect, closing)

    def _begin_turn(self, reconnect: bool, closing: bool) -> None:
        """:meth:`_turn`'s entry: the lock taken, or an error raised without it."""
        self._lock.acquire()
        try:
            if self._closed:
                raise closed_error()
            if self._broken is not None and not closing:
                if not reconnect or self.reconnect is None:
                    raise type(self._broken)(*self._broken.args)
                self._recover(self.reconnect)
            if self._releases:  # queued by a turn that has not flushed them yet
                self._send_releases()
        except BaseException:
            self._lock.release()
            self._flush_releases()
            raise

    def _end_turn(self) -> None:
        """:meth:`_turn`'s exit: the RELEASEs queued meanwhile sent, the lock given back."""
        try:
            if self._releases:
                self._send_releases()
        finally:
            self._lock.release()
            if self._releases:
                self._flush_releases()

    def _call(self, message: Message, ns: int = 0, fds: list[int] | None = None) -> Message:
        """One request and its reply, in a turn of its own (see :meth:`_exchange`)."""
        with self._turn():
            return self._exchange(message, ns, fds)

    def _exchange(self, message: Message, ns: int = 0, fds: list[int] | None = None) -> Message:
        """Send ``message`` and wait for its reply (in a turn); descriptors passed with the
        reply are appended to ``fds`` (when given)."""
        unique, frame = self._conn.request(message, ns)
        try:
            self._sock.sendall(frame)
            event = self._receive(unique, fds)
        except BaseException as exc:
            # Interrupted between request and reply (timeout, Ctrl-C, a dead daemon): the reply
            # may grant a lease nobody will release, so drop the connection; the daemon then
            # releases everything this client held.
            self._sock.close()
            if isinstance(exc, TimeoutError):
                self._broken = BrokenConnectionError(
                    "the connection was closed when an earlier call timed out"
                )
                raise TimedOutError("the daemon did not answer in time") from exc
            if isinstance(exc, OSError):
                self._broken = broken_error(exc)
                raise broken_error(exc) from exc
            self._broken = exc if isinstance(exc, KvtierError) else broken_error(exc)
            raise
        if event.header.unique == 0:  # the daemon's last frame: the connection is over
            self._sock.close()
            self._broken = event.error or BrokenConnectionError("kvtierd closed the connection")
        return message_of(event)

    def _send_only(self, message: Message, ns: int) -> None:
        _, frame = self._conn.request(message, ns)
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            self._sock.close()
            self._broken = broken_error(exc)
            raise broken_error(exc) from exc

    def _receive(self, unique: int, fds: list[int] | None = None) -> ReplyReceived:
        """The reply to ``unique`` (or the daemon's last frame); replies to requests nobody
        waits for (RELEASE) are dropped."""
        conn = self._conn
        while True:
            event = conn.next_event()
            if event is NEED_DATA:  # first: the usual answer to the first look
                if fds is None or not self._endpoint.passes_descriptors:
                    data = self._sock.recv(_RECEIVE_BYTES)
                else:
                    data, received, _, _ = socket.recv_fds(self._sock, _RECEIVE_BYTES, 4)
                    fds.extend(received)
                conn.receive_data(data)
            elif isinstance(event, ReplyReceived):
                if event.header.unique in (unique, 0):
                    return event
            else:
                assert isinstance(event, ConnectionClosed)
                raise BrokenConnectionError("kvtierd closed the connection")

    def release_soon(self, leases: Sequence[int], reconnects: int | None = None) -> None:
        """RELEASE ``leases`` without waiting, from any thread and from a finalizer: sent now
        when no call is in progress, else by the call in progress as it ends (a finalizer can
        run inside a call on its own thread, which must not wait for the connection it holds).
        Leases granted before reconnect number ``reconnects`` are dropped: the daemon released
        them with their connection, and their ids may name a new connection's leases."""
        if reconnects is not None and reconnects != self.reconnects:
            return
        self._releases.extend(leases)
        self._flush_releases()

    def _flush_releases(self) -> None:
        """Send the queued RELEASEs unless another turn holds the connection: that one sends
        them as it ends, and then comes back here for those queued after it had looked."""
        while self._releases and self._lock.acquire(blocking=False):
            try:
                self._send_releases()
            finally:
                self._lock.release()

    def _send_releases(self) -> None:
        """Send the queued RELEASEs (the lock held), a frame of up to ``max_keys`` at a time.
        A closed client drops them: the daemon released everything with the connection."""
        pending = self._releases
        if self._closed:
            pending.clear()
        while pending:
            batch = [pending.popleft() for _ in range(min(len(pending), self.max_keys))]
            with contextlib.suppress(KvtierError):  # a broken connection released them
                self._send_only(ReleaseRequest(batch), 0)

    def run(self, op: ops.Op[T]) -> T:
        """Drive a sans-IO operation to its result, in one turn. It never reconnects: ``op``
        names namespace ids of the connection it was made for."""
        with self._turn():
            return self._drive(op)

    def _run_op(
        self,
        make_op: Callable[[], ops.Op[T]],
        *,
        retry: bool,
        ns: NamespaceBase[Any] | None = None,
    ) -> T:
        """Drive ``make_op()`` (made in the turn, after any reconnect: it names the new
        connection's namespace ids) as :meth:`_retrying` does."""
        return self._retrying(lambda: self._drive(make_op()), retry=retry, ns=ns)

    def _retrying(
        self, call: Callable[[], T], *, retry: bool, ns: NamespaceBase[Any] | None = None
    ) -> T:
        """``call()`` in a turn, reconnecting first if the connection broke and the policy
        allows; with ``retry`` (an idempotent call) a connection that breaks under it is
        replaced and ``call()`` made once more."""
        again = retry and self.reconnect is not None
        while True:
            self._begin_turn(True, False)  # the turn written out: every call comes here
            try:
                if ns is not None and ns.lost is not None:
                    raise type(ns.lost)(*ns.lost.args)
                try:
                    return call()
                except RECONNECTABLE:
                    if not again or self._broken is None:
                        raise
                    again = False
            finally:
                self._end_turn()

    def _reopen(self) -> None:
        """Connect and INIT again, reopen every namespace still held, and only then take the
        new connection; leases and queued RELEASEs of the old one are dropped."""
        sock = self._endpoint.open(self._timeout_s)
        old = self._sock, self._conn
        self._sock, self._conn = sock, ClientConnection()
        regions = Regions(maps=self._endpoint.passes_descriptors)
        try:
            self._handshake()
            handles = self._reopen_namespaces(
                lambda message, fds: self._exchange(message, 0, fds), regions
            )
        except BaseException:
            sock.close()
            regions.close()
            self._sock, self._conn = old
            raise
        old[0].close()
        self._regions.close(replaced_region_error())
        self._regions = regions
        for ns, handle in handles:
            ns.handle = handle
        self._releases.clear()
        self._held.lose_all(lost_lease_error())
        self._broken = None
        self.reconnects += 1

    def _drive(self, op: ops.Op[T]) -> T:
        try:
            call = next(op)
            while True:
                if isinstance(call, _NO_WAIT):
                    self._send_only(call.message, call.ns)
                    call = op.send(None)
                    continue
                try:
                    reply = self._exchange(*call)
                except KvtierError as exc:
                    call = op.throw(exc)
                else:
                    call = op.send(reply)
        except StopIteration as stop:
            result: T = stop.value
            return result

    def _give_back(self, op: ops.Op[Any]) -> None:
        """Run ``op``, which gives back what the daemon granted (an abort, a RELEASE); a
        connection gone meanwhile gave it back already."""
        with contextlib.suppress(BrokenConnectionError):
            self.run(op)

    def _handshake(self) -> None:
        unique, frame = self._conn.request(init_request(self._client_name))
        fds: list[int] = []
        try:
            self._sock.sendall(frame)
        except OSError as exc:  # refused at once: the daemon's last frame says why
            with contextlib.suppress(OSError):
                message_of(self._receive(unique, fds))
            raise BrokenConnectionError(f"kvtierd closed the connection: {exc}") from exc
        except BaseException:
            close_all(fds)
            raise
        try:
            reply = check_init(message_of(self._receive(unique, fds)))
        except BrokenConnectionError as exc:
            raise BrokenConnectionError(f"{exc}{self._endpoint.refusal_hint}") from None
        except KvtierError:  # the daemon's answer (an OSError too: it has an errno)
            raise
        except ssl.SSLError as exc:  # TLS 1.3: the daemon judges the certificate after
            raise AccessDeniedError(  # the client's side of the handshake is done
                f"kvtierd at {self._endpoint} refused this client's TLS certificate: {exc}"
            ) from None
        except OSError as exc:
            raise broken_error(exc) from exc
        finally:
            for fd in fds:  # INIT passes no memory (protocol minor 6)
                os.close(fd)
        self.max_keys = reply.max_keys
        self.daemon_version = reply.daemon_version
        self.daemon_minor = reply.minor

    def connected(self) -> bool:
        """Whether the connection is still open at both ends, without reading from it (see
        :func:`~kvtierd.client.base.peer_open`)."""
        return not self._closed and self._broken is None and peer_open(self._sock.fileno())

    def close(self) -> None:
        """Send DESTROY, close the socket and unmap the regions. Idempotent and thread-safe: it
        waits for the call in progress, and every call after it raises ``ClosedError``."""
        with contextlib.suppress(ClosedError), self._turn(closing=True):
            self._closed = True
            try:
                if self._broken is None:
                    with contextlib.suppress(KvtierError, OSError):
                        self._exchange(DestroyRequest())
            finally:
                self._sock.close()
                self._held.lose_all(closed_error())
                self._regions.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Turn:
    """:meth:`SyncConnection._turn`: a context manager written out, because every call takes one and
    a generator-based one costs several times as much to enter and leave."""

    __slots__ = ("_client", "_closing", "_reconnect")

    def __init__(self, client: SyncConnection, reconnect: bool, closing: bool) -> None:
        self._client = client
        self._reconnect = reconnect
        self._closing = closing

    def __enter__(self) -> None:
        self._client._begin_turn(self._reconnect, self._closing)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._client._end_turn()
