"""The blocking client: one request at a time over a Unix socket, thread-safe.

Use :func:`kvtierd.client.connect`. Every method may raise the
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
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import threading
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

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
from kvtierd.errors import (
    BrokenConnectionError,
    ClosedError,
    CorruptBlockError,
    KvtierError,
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
    PoolStatusReply,
    PoolStatusRequest,
    ReleaseRequest,
    StatfsReply,
    StatfsRequest,
)

__all__ = ["Client", "Namespace", "connect"]

T = TypeVar("T")
_RECEIVE_BYTES = 1 << 16


class Client:
    """A connection to the daemon; a context manager that closes it."""

    def __init__(self, sock: socket.socket, conn: ClientConnection) -> None:
        self._sock = sock
        self._conn = conn
        self._lock = threading.Lock()
        self._releases: collections.deque[int] = collections.deque()
        self._regions = Regions()
        self._closed = False
        self.max_keys = 1
        self.corrupt_reads = 0
        self.daemon_version = ""
        self.daemon_minor = 0

    # -- transport ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """Hold the connection for one call, its requests and their replies, with no other
        thread's in between. Raises ``ClosedError`` once the client is closed. Queued RELEASEs
        (:meth:`release_soon`) go out before the call's first request and, those queued
        meanwhile, as the turn ends."""
        try:
            with self._lock:
                if self._closed:
                    raise closed_error()
                self._send_releases()  # queued by a turn that has not flushed them yet
                try:
                    yield
                finally:
                    self._send_releases()
        finally:
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
            return message_of(self._receive(unique, fds))
        except KvtierError:
            raise
        except BaseException as exc:
            # Interrupted between request and reply (timeout, Ctrl-C, a dead daemon): the reply
            # may grant a lease nobody will release, so drop the connection; the daemon then
            # releases everything this client held.
            self._sock.close()
            if isinstance(exc, TimeoutError):
                raise TimedOutError("the daemon did not answer in time") from exc
            if isinstance(exc, OSError):
                raise BrokenConnectionError(f"connection to kvtierd lost: {exc}") from exc
            raise

    def _send_only(self, message: Message, ns: int) -> None:
        _, frame = self._conn.request(message, ns)
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            raise BrokenConnectionError(f"connection to kvtierd lost: {exc}") from exc

    def _receive(self, unique: int, fds: list[int] | None = None) -> ReplyReceived:
        """The reply to ``unique`` (or the daemon's last frame); replies to requests nobody
        waits for (RELEASE) are dropped."""
        while True:
            event = self._conn.next_event()
            if isinstance(event, ReplyReceived):
                if event.header.unique in (unique, 0):
                    return event
                continue
            if isinstance(event, ConnectionClosed):
                raise BrokenConnectionError("kvtierd closed the connection")
            assert event is NEED_DATA
            if fds is None:
                data = self._sock.recv(_RECEIVE_BYTES)
            else:
                data, received, _, _ = socket.recv_fds(self._sock, _RECEIVE_BYTES, 4)
                fds.extend(received)
            self._conn.receive_data(data)

    def release_soon(self, leases: Sequence[int]) -> None:
        """RELEASE ``leases`` without waiting, from any thread and from a finalizer: sent now
        when no call is in progress, else by the call in progress as it ends (a finalizer can
        run inside a call on its own thread, which must not wait for the connection it holds)."""
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
        """Drive a sans-IO operation to its result, in one turn."""
        with self._turn():
            return self._drive(op)

    def _drive(self, op: ops.Op[T]) -> T:
        try:
            call = next(op)
            while True:
                if isinstance(call, ops.NoWait):
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
        try:
            reply = check_init(message_of(self._receive(unique, fds)))
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
        if fd < 0:
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
        block_bytes: int,
        layout: Layout | dict[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        tenant: str = "default",
        compression: str = "none",
        create: bool = True,
        sparse: bool = False,
    ) -> Namespace:
        """Open a namespace, creating it unless ``create`` is false (then an unknown one
        raises ``BlockNotFoundError``); see ``docs/client.md``."""
        request = namespace_request(
            name, block_bytes, layout, rank, world_size, tenant, compression, create, sparse
        )
        fds: list[int] = []
        # Mapped in the turn too: two threads never map one region twice, close() misses none.
        with self._turn():
            try:
                reply = self._exchange(request, fds=fds)
                handle = handle_of(request, reply)
                assert isinstance(reply, OpenNsReply)
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            self._regions.adopt(reply, fds)  # takes the descriptors, even when it raises
        return Namespace(self, handle)

    def fsync(self) -> int:
        """Block until every block committed so far is durable; returns durable blocks."""
        reply = self._call(FsyncRequest())
        assert isinstance(reply, FsyncReply)
        return reply.durable_blocks

    def stats(self) -> dict[str, Any]:
        """The daemon's STATFS record as a dict (see ``docs/protocol.md``)."""
        reply = self._call(StatfsRequest())
        assert isinstance(reply, StatfsReply)
        result: dict[str, Any] = as_dict(reply)
        return result

    def namespaces(self) -> list[dict[str, Any]]:
        reply = self._call(ListNsRequest())
        assert isinstance(reply, ListNsReply)
        return [as_dict(info) for info in reply.namespaces]

    def doctor(self) -> list[dict[str, str]]:
        """The daemon's report on its host (admin): one ``{subject, status, detail}`` per check,
        ``status`` ok, fallback or fail."""
        reply = self._call(DoctorRequest())
        assert isinstance(reply, DoctorReply)
        return [
            {"subject": c.subject, "status": c.status, "detail": c.detail} for c in reply.checks
        ]

    def pool_status(self) -> dict[str, Any]:
        """Where the daemon stands with the shared pool (``state`` "none" without one)."""
        reply = self._call(PoolStatusRequest())
        assert isinstance(reply, PoolStatusReply)
        result: dict[str, Any] = as_dict(reply)
        return result

    def evict(self) -> int:
        """Drop every clean, unleased block from DRAM (admin)."""
        reply = self._call(EvictRequest(all_namespaces=True))
        assert isinstance(reply, EvictReply)
        return reply.evicted

    def close(self) -> None:
        """Send DESTROY, close the socket and unmap the regions. Idempotent and thread-safe: it
        waits for the call in progress, and every call after it raises ``ClosedError``."""
        with contextlib.suppress(ClosedError), self._turn():
            self._closed = True
            try:
                with contextlib.suppress(KvtierError, OSError):
                    self._exchange(DestroyRequest())
            finally:
                self._sock.close()
                self._regions.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Namespace(NamespaceBase[Client]):
    """Blocks of one namespace, through a :class:`Client`."""

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> int:
        c = self.client
        return c.run(
            ops.put(self.handle.ns, keys, blocks, self.block_bytes, self.arena, c.max_keys)
        )

    def lookup(self, keys: Sequence[bytes], *, promote: bool = True) -> int:
        """How many leading ``keys`` are stored (for the whole TP group); with ``promote`` the
        daemon starts moving those hits up to DRAM now."""
        c = self.client
        return c.run(ops.lookup_count(self.handle.ns, keys, c.max_keys, promote))

    def lookup_tiers(self, keys: Sequence[bytes], *, promote: bool = True) -> list[str]:
        """Like :meth:`lookup`, with the tier (``"dram"``, ``"nvme"``...) of each hit."""
        c = self.client
        return c.run(ops.lookup(self.handle.ns, keys, c.max_keys, promote))

    @contextlib.contextmanager
    def get(self, keys: Sequence[bytes]) -> Iterator[list[memoryview]]:
        """Read-only views of the blocks, valid inside the ``with`` block."""
        with self.lease(keys) as lease:
            yield lease.views

    @contextlib.contextmanager
    def lease(self, keys: Sequence[bytes], *, resident_only: bool = False) -> Iterator[BlockLease]:
        """Lease the blocks: views and extents (offsets into :meth:`arena_buffer`), verified
        against their checksums and valid until the ``with`` block ends or ``release()`` is
        called. ``resident_only``: see :meth:`acquire`."""
        lease = self.acquire(keys, resident_only=resident_only)
        try:
            yield lease
        finally:
            lease.release()

    def acquire(self, keys: Sequence[bytes], *, resident_only: bool = False) -> BlockLease:
        """:meth:`lease` for a lease that outlives one block of code (an engine that hands the
        views to another component): call ``release()`` when done, or use it in ``with``.

        ``resident_only`` leases just the leading keys that are in DRAM now (``lease.keys`` is
        that prefix, possibly empty) and never waits or fails on a miss: called right after
        :meth:`lookup`, it holds the DRAM hits so that reading them later costs no round trip
        and no eviction can take them. A daemon older than protocol minor 4 leases nothing."""
        c = self.client
        leases, extents = c.run(self._lease_op(keys, resident_only))
        release = (lambda: c.release_soon(leases)) if leases else None
        return self._block_lease(keys, extents, release, partial=resident_only)

    @contextlib.contextmanager
    def write(self, keys: Sequence[bytes]) -> Iterator[BlockWrite]:
        """Writable arena slots for the keys not stored yet (``None`` for the others): fill
        them in place, and they are committed when the ``with`` block ends (abandoned, never
        visible, if it raises). The zero-copy form of :meth:`put`."""
        c = self.client
        writes, extents = c.run(ops.alloc(self.handle.ns, keys, c.max_keys))
        views = [self.arena.writable(e.offset, e.length) if e.length else None for e in extents]
        block = BlockWrite(list(keys), views)
        try:
            yield block
        except BaseException:
            release_views(views)
            c.run(ops.commit(self.handle.ns, writes, abort=True))
            raise
        release_views(views)
        c.run(ops.commit(self.handle.ns, writes))

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        """Copy the blocks into ``buffers`` (each verified: ``CorruptBlockError`` is a miss)."""
        c = self.client
        try:
            return c.run(ops.read_into(self.handle.ns, keys, buffers, self.arena, c.max_keys))
        except CorruptBlockError:
            c.corrupt_reads += 1
            raise

    def forget(self, keys: Sequence[bytes]) -> int:
        return self.client.run(ops.forget(self.handle.ns, keys, self.client.max_keys))

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
        return self.client.run(
            ops.hint_attention(self.handle.ns, chain, queries, query_layers, budget_blocks, session)
        )

    def hint(self, queue: Sequence[Sequence[bytes]], *, session: bytes = b"") -> int:
        """Tell the daemon which key chains are queued; it promotes their hits."""
        return self.client.run(ops.hint(self.handle.ns, queue, session))


def connect(
    socket_path: str | os.PathLike[str] | None = None,
    *,
    client_name: str = "",
    timeout_s: float | None = None,
) -> Client:
    """Connect to the daemon (default socket: ``$KVTIERD_SOCKET`` or the configured path)."""
    path = resolve_socket(socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise not_running(path, exc) from None
    client = Client(sock, ClientConnection())
    try:
        client._handshake(client_name)
    except BaseException:
        sock.close()
        raise
    return client
