"""The blocking client: one request at a time over a Unix socket (or, to another host's
daemon, over TCP: :mod:`kvtierd.client.endpoint`), thread-safe.

Use :func:`kvtierd.client.connect` (or :func:`connect_tcp`). Every method may raise the
:class:`~kvtierd.errors.KvtierError` subclass that matches the daemon's errno,
:class:`~kvtierd.errors.BrokenConnectionError` when the daemon goes away and
:class:`~kvtierd.errors.ClosedError` once the client's own :meth:`Client.close` ran.

Threads take turns. Replies carry the unique id of their request, but a blocking reader has
nowhere to put a reply that is not its own, so it drops it (the RELEASEs nobody waits for); a
thread reading while another waits would drop that thread's reply and leave it waiting for
ever. So every exchange, from a call's first request to its last reply, happens in a turn
(:meth:`Client._turn`: the connection's lock, the closed check, the queued RELEASEs), and
everything that talks to the daemon, ``run`` for the operations of :mod:`kvtierd.client.ops`
and ``_call`` for single requests, takes one. The exception is :meth:`Client.release_soon`,
which a finalizer may call inside a turn on its own thread: it never waits for the lock, and
the turn in progress sends what it queued.

With a :class:`~kvtierd.client.reconnect.Reconnect` policy, a turn that finds the connection
broken replaces it before its call runs (INIT, then OPEN_NS of every namespace still held, on
the new socket: :func:`~kvtierd.client.reconnect.reopen_namespaces`), so the call is made with
the new namespace ids; leases and queued RELEASEs of the old connection are dropped, never sent.
The module is past 600 lines for the same reason as the async one: transport and API share one
connection's state.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from kvtierd.client import ops
from kvtierd.client.arena import ClientArena
from kvtierd.client.base import (
    NamespaceBase,
    NamespaceHandle,
    Regions,
    as_dict,
    broken_error,
    check_init,
    close_all,
    closed_error,
    handle_of,
    in_flight_error,
    init_request,
    message_of,
    namespace_request,
    resolve_socket,
)
from kvtierd.client.blocks import BlockLease, BlockWrite, HeldBlocks, release_views
from kvtierd.client.endpoint import Endpoint, TcpEndpoint, UnixEndpoint
from kvtierd.client.reconnect import (
    RECONNECTABLE,
    Reconnect,
    gave_up,
    lost_lease_error,
    reopen_namespaces,
    replaced_region_error,
)
from kvtierd.errors import (
    AccessDeniedError,
    BrokenConnectionError,
    ClosedError,
    CorruptBlockError,
    KvtierError,
    RemoteProtocolError,
    TimedOutError,
)
from kvtierd.protocol import NEED_DATA, ClientConnection, ConnectionClosed, ReplyReceived
from kvtierd.protocol.messages import (
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
    OpenNsRequest,
    PoolStatusReply,
    PoolStatusRequest,
    ReleaseRequest,
    StatfsReply,
    StatfsRequest,
)

__all__ = ["Client", "Namespace", "connect", "connect_endpoint", "connect_tcp"]

T = TypeVar("T")
_RECEIVE_BYTES = 1 << 16
_NO_WAIT = ops.NoWait


class Client:
    """A connection to the daemon; a context manager that closes it. Construct with
    :func:`connect`."""

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
        self._namespaces: weakref.WeakSet[Namespace] = weakref.WeakSet()
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
            f"<Client {self._endpoint} {state}, daemon {self.daemon_version or '?'}, "
            f"reconnect {'on' if self.reconnect else 'off'}>"
        )

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
        self, make_op: Callable[[], ops.Op[T]], *, retry: bool, ns: Namespace | None = None
    ) -> T:
        """Drive ``make_op()`` (made in the turn, after any reconnect: it names the new
        connection's namespace ids) as :meth:`_retrying` does."""
        return self._retrying(lambda: self._drive(make_op()), retry=retry, ns=ns)

    def _retrying(self, call: Callable[[], T], *, retry: bool, ns: Namespace | None = None) -> T:
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

    def _recover(self, policy: Reconnect) -> None:
        """Replace the broken connection (the lock held): up to ``policy.attempts``
        connections, backing off between them. Raises what the last attempt met."""
        assert self._broken is not None
        last: KvtierError = self._broken
        for delay in policy.delays():
            time.sleep(delay)
            try:
                self._reopen()
                return
            except RECONNECTABLE as exc:
                last = exc
        raise gave_up(last, policy)

    def _reopen(self) -> None:
        """Connect and INIT again, reopen every namespace still held, and only then take the
        new connection; leases and queued RELEASEs of the old one are dropped."""
        sock = self._endpoint.open(self._timeout_s)
        old = self._sock, self._conn
        self._sock, self._conn = sock, ClientConnection()
        regions = Regions(maps=self._endpoint.passes_descriptors)
        try:
            self._handshake(self._client_name)
            handles = self._reopen_namespaces(regions)
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

    def _reopen_namespaces(self, regions: Regions) -> list[tuple[Namespace, NamespaceHandle]]:
        """Drive :func:`~kvtierd.client.reconnect.reopen_namespaces` on the new connection."""
        op = reopen_namespaces(self._namespaces, regions)
        try:
            request = next(op)
            while True:
                fds: list[int] = []
                try:
                    reply = self._exchange(request, fds=fds)
                except KvtierError as exc:
                    close_all(fds)
                    request = op.throw(exc)
                else:
                    request = op.send((reply, fds))
        except StopIteration as stop:
            handles: list[tuple[Namespace, NamespaceHandle]] = stop.value
            return handles

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

    def _handshake(self, client_name: str) -> None:
        unique, frame = self._conn.request(init_request(client_name))
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

    def region(self, region: int) -> ClientArena:
        """The mapping of tenant region ``region`` (passed at OPEN_NS)."""
        if self._closed:
            raise closed_error()
        return self._regions.get(region)

    def connected(self) -> bool:
        """Whether the connection is still open at both ends, without reading from it (a
        ``poll`` for hang-up, which sees the daemon's close even behind unread replies). Leases
        last as long as the connection: an engine that keeps views across calls checks this
        before it trusts them."""
        fd = self._sock.fileno()  # once: another thread may close the socket meanwhile
        if fd < 0 or self._broken is not None:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP)
        return not any(
            events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL)
            for _, events in poller.poll(0)
        )

    # -- API ---------------------------------------------------------------------------------

    def namespace(
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
    ) -> Namespace:
        """Open a namespace, creating it unless ``create`` is false (then an unknown one
        raises ``BlockNotFoundError``); ``block_bytes`` defaults to what ``layout`` gives. See
        ``docs/client.md``."""
        request = namespace_request(
            name, block_bytes, layout, rank, world_size, tenant, compression, create, sparse
        )
        # Mapped in the turn too: two threads never map one region twice, close() misses none.
        handle = self._retrying(lambda: self._open_namespace(request), retry=True)
        namespace = Namespace(self, handle)
        self._namespaces.add(namespace)
        return namespace

    def _open_namespace(self, request: OpenNsRequest) -> NamespaceHandle:
        """OPEN_NS and map the region its reply passes (in a turn)."""
        fds: list[int] = []
        try:
            reply = self._exchange(request, fds=fds)
            handle = handle_of(request, reply)
        except BaseException:
            close_all(fds)
            raise
        self._regions.adopt(_open_ns_reply(reply), fds)  # takes the descriptors, even on error
        return handle

    def _request(self, message: Message, *, retry: bool = True) -> Message:
        """One request and its reply, reconnecting as the policy allows (see ``_retrying``)."""
        return self._run_op(lambda: ops.request(message), retry=retry)

    def fsync(self) -> int:
        """Block until every block committed so far is durable; returns durable blocks. Never
        retried: a connection that breaks under it raises (see "Reconnecting")."""
        reply = self._request(FsyncRequest(), retry=False)
        assert isinstance(reply, FsyncReply)
        return reply.durable_blocks

    def stats(self) -> dict[str, Any]:
        """The daemon's STATFS record as a dict (see ``docs/protocol.md``)."""
        reply = self._request(StatfsRequest())
        assert isinstance(reply, StatfsReply)
        result: dict[str, Any] = as_dict(reply)
        return result

    def namespaces(self) -> list[dict[str, Any]]:
        reply = self._request(ListNsRequest())
        assert isinstance(reply, ListNsReply)
        return [as_dict(info) for info in reply.namespaces]

    def doctor(self) -> list[dict[str, str]]:
        """The daemon's report on its host (admin): one ``{subject, status, detail}`` per check,
        ``status`` ok, fallback or fail."""
        reply = self._request(DoctorRequest())
        assert isinstance(reply, DoctorReply)
        return [
            {"subject": c.subject, "status": c.status, "detail": c.detail} for c in reply.checks
        ]

    def pool_status(self) -> dict[str, Any]:
        """Where the daemon stands with the shared pool (``state`` "none" without one)."""
        reply = self._request(PoolStatusRequest())
        assert isinstance(reply, PoolStatusReply)
        result: dict[str, Any] = as_dict(reply)
        return result

    def list_keys(self, ns: int, *, after: bytes = b"", limit: int = 1024) -> dict[str, Any]:
        """A page of LIST_KEYS: up to ``limit`` (1..8192) keys of namespace ``ns`` (its ``ns`` in
        :meth:`namespaces`) in byte order after ``after``, as ``{"keys": [{"key", "dram",
        "nvme", "pool", "raw_bytes", "dirty"}, ...], "more", "blocks"}``. While ``more``, the
        last key is the next page's ``after``; see ``docs/protocol.md`` for what a pager sees
        when keys change meanwhile. It never reconnects: ``ns`` is an id of the daemon it was
        listed from, which a restarted daemon may give another namespace (list them again)."""
        reply = self.run(ops.list_keys(ns, after, limit, self.daemon_minor))
        result: dict[str, Any] = as_dict(reply)
        return result

    def evict(self) -> int:
        """Drop every clean, unleased block from DRAM (admin)."""
        reply = self._request(EvictRequest(all_namespaces=True))
        assert isinstance(reply, EvictReply)
        return reply.evicted

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

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Namespace(NamespaceBase[Client]):
    """Blocks of one namespace, through a :class:`Client`."""

    def _run(self, make_op: Callable[[], ops.Op[T]], *, retry: bool = True) -> T:
        """Drive ``make_op()`` on the client (made after any reconnect, so it names this
        namespace's id on the connection it goes out on)."""
        c = self.client
        return c._retrying(lambda: c._drive(make_op()), retry=retry, ns=self)

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        """Store ``blocks[i]`` under ``keys[i]`` (lists: ``put([key], [block])`` for one)."""
        c = self.client
        return self._run(
            lambda: ops.put(self.handle.ns, keys, blocks, self.block_bytes, self.arena, c.max_keys)
        )

    def lookup(self, keys: Sequence[bytes], *, promote: bool = True) -> int:
        """How many leading ``keys`` are stored (for the whole TP group); with ``promote`` the
        daemon starts moving those hits up to DRAM now."""
        c = self.client
        return self._run(lambda: ops.lookup_count(self.handle.ns, keys, c.max_keys, promote))

    def lookup_tiers(self, keys: Sequence[bytes], *, promote: bool = True) -> list[str]:
        """Like :meth:`lookup`, with the tier (``"dram"``, ``"nvme"``...) of each hit."""
        c = self.client
        return self._run(lambda: ops.lookup(self.handle.ns, keys, c.max_keys, promote))

    @contextlib.contextmanager
    def get(self, keys: Sequence[bytes]) -> Iterator[list[memoryview]]:
        """Read-only views of the blocks, valid inside the ``with`` block."""
        with self.lease(keys) as lease:
            yield lease.views

    @contextlib.contextmanager
    def lease(
        self, keys: Sequence[bytes], *, resident_only: bool = False, verify_on_copy: bool = False
    ) -> Iterator[BlockLease]:
        """Lease the blocks: views and extents (offsets into :meth:`arena_buffer`), verified
        against their checksums and valid until the ``with`` block ends or ``release()`` is
        called. ``resident_only`` and ``verify_on_copy``: see :meth:`acquire`."""
        lease = self.acquire(keys, resident_only=resident_only, verify_on_copy=verify_on_copy)
        try:
            yield lease
        finally:
            lease.release()

    def acquire(
        self, keys: Sequence[bytes], *, resident_only: bool = False, verify_on_copy: bool = False
    ) -> BlockLease:
        """:meth:`lease` for a lease that outlives one block of code (an engine that hands the
        views to another component): call ``release()`` when done, or use it in ``with``.

        ``resident_only`` leases just the leading keys that are in DRAM now (``lease.keys`` is
        that prefix, possibly empty) and never waits or fails on a miss: called right after
        :meth:`lookup`, it holds the DRAM hits so that reading them later costs no round trip
        and no eviction can take them. A daemon older than protocol minor 4 leases nothing.

        ``verify_on_copy``, for an engine that copies every block out of the arena: the blocks
        are not hashed now; :meth:`BlockLease.copy_into` hashes each copy as it makes it and
        raises on a block changed after COMMIT (the views themselves are then unverified)."""
        c = self.client

        def take() -> BlockLease:
            leases, extents = c._drive(self._lease_op(keys, resident_only))
            reconnects = c.reconnects
            release = (lambda: c.release_soon(leases, reconnects)) if leases else None
            lease = self._block_lease(
                keys, extents, release, partial=resident_only, verify_on_copy=verify_on_copy
            )
            return c._held.track(lease)

        return c._retrying(take, retry=True, ns=self)

    @contextlib.contextmanager
    def write(self, keys: Sequence[bytes]) -> Iterator[BlockWrite]:
        """Writable arena slots for the keys not stored yet (``None`` for the others): fill
        them in place, and they are committed when the ``with`` block ends (abandoned, never
        visible, if it raises). The zero-copy form of :meth:`put`."""
        c = self.client
        writes, extents = self._run(lambda: ops.alloc(self.handle.ns, keys, c.max_keys))
        reconnects = c.reconnects
        views = [self.arena.writable(e.offset, e.length) if e.length else None for e in extents]
        block = c._held.track(BlockWrite(list(keys), views))
        try:
            yield block
        except BaseException:
            release_views(views)
            if c.reconnects == reconnects:  # else the daemon dropped the write already
                with contextlib.suppress(BrokenConnectionError):
                    c.run(ops.commit(self.handle.ns, writes, abort=True))
            raise
        release_views(views)
        try:
            if c.reconnects != reconnects:
                raise BrokenConnectionError("the client reconnected")
            c.run(ops.commit(self.handle.ns, writes))
        except BrokenConnectionError as exc:
            raise in_flight_error(len(keys)) from exc

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        """Copy the blocks into ``buffers`` (each verified: ``CorruptBlockError`` is a miss)."""
        c = self.client
        try:
            return self._run(
                lambda: ops.read_into(self.handle.ns, keys, buffers, self.arena, c.max_keys)
            )
        except CorruptBlockError:
            c.corrupt_reads += 1
            raise

    def forget(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda: ops.forget(self.handle.ns, keys, self.client.max_keys))

    def hint_attention(
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
        return self._run(
            lambda: ops.hint_attention(
                self.handle.ns, chain, queries, query_layers, budget_blocks, session
            )
        )

    def hint(self, queue: Sequence[Sequence[bytes]], *, session: bytes = b"") -> int:
        """Tell the daemon which key chains are queued; it promotes their hits."""
        return self._run(lambda: ops.hint(self.handle.ns, queue, session, self.client.max_keys))


class _Turn:
    """:meth:`Client._turn`: a context manager written out, because every call takes one and
    a generator-based one costs several times as much to enter and leave."""

    __slots__ = ("_client", "_closing", "_reconnect")

    def __init__(self, client: Client, reconnect: bool, closing: bool) -> None:
        self._client = client
        self._reconnect = reconnect
        self._closing = closing

    def __enter__(self) -> None:
        self._client._begin_turn(self._reconnect, self._closing)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._client._end_turn()


def connect(
    socket_path: str | os.PathLike[str] | None = None,
    *,
    client_name: str = "",
    timeout_s: float | None = None,
    reconnect: Reconnect | None = None,
) -> Client:
    """Connect to the daemon (default socket: ``$KVTIERD_SOCKET`` or the configured path).
    With ``reconnect`` the client connects again, as that policy allows, when the connection
    breaks (a daemon restart); see ``docs/client.md`` ("Reconnecting")."""
    endpoint = UnixEndpoint(resolve_socket(socket_path))
    return connect_endpoint(
        endpoint, client_name=client_name, timeout_s=timeout_s, reconnect=reconnect
    )


def connect_tcp(
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None,
    server_hostname: str | None = None,
    client_name: str = "",
    timeout_s: float | None = None,
    reconnect: Reconnect | None = None,
) -> Client:
    """Connect to the daemon of another host over TCP (its ``remote.listen``), with ``tls``
    from :func:`kvtierd.client.endpoint.client_tls_context`, or in plaintext with ``None``
    where the daemon allows it. Such a client reads over NIXL
    (:class:`kvtierd.client.nixl.NixlReader`) and cannot write (``docs/remote.md``)."""
    endpoint = TcpEndpoint(host, port, tls, server_hostname)
    return connect_endpoint(
        endpoint, client_name=client_name, timeout_s=timeout_s, reconnect=reconnect
    )


def connect_endpoint(
    endpoint: Endpoint,
    *,
    client_name: str = "",
    timeout_s: float | None = None,
    reconnect: Reconnect | None = None,
) -> Client:
    """Connect to ``endpoint`` (:func:`connect` and :func:`connect_tcp` name one)."""
    sock = endpoint.open(timeout_s)
    client = Client(
        sock,
        ClientConnection(),
        endpoint=endpoint,
        client_name=client_name,
        timeout_s=timeout_s,
        reconnect=reconnect,
    )
    try:
        client._handshake(client_name)
    except BaseException:
        sock.close()
        raise
    return client


def _open_ns_reply(reply: Message) -> OpenNsReply:
    if not isinstance(reply, OpenNsReply):
        raise RemoteProtocolError("OPEN_NS was not answered with OPEN_NS")
    return reply
