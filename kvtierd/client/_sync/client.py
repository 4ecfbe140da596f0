# Generated from kvtierd/client/_async/client.py by `python -m tools.unasync_client`:
# do not edit by hand (CI fails when it is not what the tool makes).
"""The client's API, written once: namespaces, admin calls and blocks, over a transport.

It is written as the async face, ``kvtierd/client/_async/client.py`` (``AsyncClient`` and
``AsyncNamespace`` over ``AsyncConnection``); the blocking face, ``kvtierd/client/_sync/client.py``
(``Client`` and ``Namespace`` over ``SyncConnection``), is generated from it by ``python -m
tools.unasync_client``, which drops ``async`` and ``await`` and renames the async names. CI
checks that the generated file is current: edit the async one, then run the tool.

Every method may raise the :class:`~kvtierd.errors.KvtierError` subclass that matches the
daemon's errno, :class:`~kvtierd.errors.BrokenConnectionError` when the daemon goes away and
:class:`~kvtierd.errors.ClosedError` once the client's own close ran. What each call means is in
``docs/client.md``; the transports, and how each face takes turns or pipelines, are in their
``connection`` modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from kvtierd.client import ops
from kvtierd.client._sync.connection import Exchange, SyncConnection
from kvtierd.client.arena import ClientArena
from kvtierd.client.base import (
    NamespaceBase,
    NamespaceHandle,
    Regions,
    as_dict,
    close_all,
    closed_error,
    handle_of,
    in_flight_error,
    namespace_request,
)
from kvtierd.client.blocks import BlockLease, BlockWrite
from kvtierd.client.reconnect import RECONNECTABLE, Reconnect, gave_up, reopen_namespaces
from kvtierd.errors import (
    BrokenConnectionError,
    CorruptBlockError,
    InvalidRequestError,
    KvtierError,
)
from kvtierd.protocol.messages import (
    ConfigReply,
    ConfigRequest,
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
    StatfsReply,
    StatfsRequest,
)

__all__ = ["Client", "Namespace"]

T = TypeVar("T")


class Client(SyncConnection):
    """A connection to the daemon. Construct with ``kvtierd.client.connect()`` or
    ``connect_tcp()`` (the blocking face), ``connect_async()`` or ``connect_tcp_async()`` (the
    async one)."""

    def region(self, region: int) -> ClientArena:
        """The mapping of tenant region ``region`` (passed at OPEN_NS)."""
        if self._closed:
            raise closed_error()
        return self._regions.get(region)

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
        # Mapped inside the call too: two callers never map one region twice, close misses none.
        handle = self._retrying(lambda: self._open_namespace(request), retry=True)
        namespace = Namespace(self, handle)
        self._namespaces.add(namespace)
        return namespace

    def _open_namespace(self, request: OpenNsRequest) -> NamespaceHandle:
        """OPEN_NS and map the region its reply passes."""
        fds: list[int] = []
        try:
            reply = self._exchange(request, 0, fds)
            handle = handle_of(request, reply)  # raises unless the reply is OPEN_NS's
        except BaseException:
            close_all(fds)
            raise
        assert isinstance(reply, OpenNsReply)
        self._regions.adopt(reply, fds)  # takes the descriptors, even when it raises
        return handle

    def _request(self, message: Message, *, retry: bool = True) -> Message:
        """One request and its reply, reconnecting as the policy allows (see ``_retrying``)."""
        return self._run_op(lambda: ops.request(message), retry=retry)

    def fsync(self) -> int:
        """Wait until every block committed so far is durable; returns durable blocks. Never
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
        """The daemon's namespaces (LIST_NS), one dict each."""
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

    def configuration(self) -> dict[str, Any]:
        """The configuration the daemon runs (admin; CONFIG, minor 12): ``source``, ``digest``
        (SHA-256 hex), ``toml`` (every field, as a configuration file that loads back to it)
        and ``changed`` (the fields that differ from the daemon's defaults). Raises
        :class:`~kvtierd.errors.NotSupportedError` on an older daemon."""
        ops.require_minor(self.daemon_minor, ops.CONFIG_MINOR, "its configuration needs")
        reply = self._request(ConfigRequest())
        assert isinstance(reply, ConfigReply)
        return {
            "source": reply.source,
            "digest": reply.digest,
            "toml": reply.toml,
            "changed": list(reply.changed),
        }

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

    # -- reconnecting ------------------------------------------------------------------------

    def _recover(self, policy: Reconnect) -> None:
        """Replace the broken connection, as ``policy`` allows. Raises what the last attempt
        met."""
        assert self._broken is not None
        made = 0
        try:
            for attempt in policy.retrying():
                with attempt:
                    made = attempt.retry_state.attempt_number
                    if self._closed:
                        raise closed_error()
                    self._reopen()
        except RECONNECTABLE as exc:
            raise gave_up(exc, made) from exc

    def _reopen_namespaces(
        self, exchange: Exchange, regions: Regions
    ) -> list[tuple[Any, NamespaceHandle]]:
        """Drive :func:`~kvtierd.client.reconnect.reopen_namespaces` through ``exchange``, on
        the connection being opened."""
        op = reopen_namespaces(self._namespaces, regions)
        try:
            request = next(op)
            while True:
                fds: list[int] = []
                try:
                    reply = exchange(request, fds)
                except KvtierError as exc:
                    close_all(fds)
                    request = op.throw(exc)
                else:
                    request = op.send((reply, fds))
        except StopIteration as stop:
            handles: list[tuple[Any, NamespaceHandle]] = stop.value
            return handles


class Namespace(NamespaceBase[Client]):
    """Blocks of one namespace, through its client."""

    def _run(self, make_op: Callable[[], ops.Op[T]], *, retry: bool = True) -> T:
        """Drive ``make_op()`` on the client (made after any reconnect, so it names this
        namespace's id on the connection it goes out on)."""
        return self.client._run_op(make_op, retry=retry, ns=self)

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

    def lookup_each(self, keys: Sequence[bytes], *, promote: bool = True) -> list[str | None]:
        """The tier of every key, ``None`` for one not stored (one LOOKUP per 8192 keys, not
        one per miss); with ``promote`` the daemon starts moving every hit up to DRAM now.
        Raises :class:`~kvtierd.errors.NotSupportedError` on a daemon older than minor 10."""
        c = self.client
        return self._run(
            lambda: ops.lookup_each(self.handle.ns, keys, c.max_keys, c.daemon_minor, promote)
        )

    def present(self, keys: Sequence[bytes], *, promote: bool = True) -> list[bool]:
        """Whether each key is stored, in order (:meth:`lookup_each`'s answer as booleans; from
        a daemon older than minor 10, one LOOKUP per run of hits)."""
        c = self.client
        return self._run(
            lambda: ops.present(self.handle.ns, keys, c.max_keys, c.daemon_minor, promote)
        )

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
        called. The RELEASE is sent without waiting for its reply, before the next request
        of this client (on the blocking face, by the next call if another thread holds the
        connection).
        ``resident_only`` and ``verify_on_copy``: see :meth:`acquire`."""
        lease = self.acquire(keys, resident_only=resident_only, verify_on_copy=verify_on_copy)
        try:
            yield lease
        finally:
            lease.release()
            self.client._flush_releases()

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
        block = self.allocate(keys)
        try:
            yield block
        except BaseException:
            self.abort(block)
            raise
        self.commit(block)

    def allocate(self, keys: Sequence[bytes]) -> BlockWrite:
        """:meth:`write` for slots that outlive one block of code (an engine that fills them
        layer by layer over a step): fill them, then :meth:`commit` or :meth:`abort` the
        write, once."""
        c = self.client
        writes, extents = self._run(lambda: ops.alloc(self.handle.ns, keys, c.max_keys))
        views = [self.arena.writable(e.offset, e.length) if e.length else None for e in extents]
        return c._held.track(BlockWrite(list(keys), views, writes, c.reconnects))

    def commit(self, write: BlockWrite) -> None:
        """Make ``write``'s blocks visible (COMMIT); its views end. A connection lost since
        ALLOC raises ``BrokenConnectionError``: the blocks are not stored, write them again."""
        c = self.client
        write.end("committed")
        try:
            if c.reconnects != write.connection:
                raise BrokenConnectionError("the client reconnected")
            c.run(ops.commit(self.handle.ns, write.writes))
        except BrokenConnectionError as exc:
            raise in_flight_error(len(write.keys)) from exc

    def abort(self, write: BlockWrite) -> None:
        """Abandon ``write``: none of its blocks becomes visible; its views end. Idempotent
        with the loss of its connection (the daemon dropped the write then)."""
        c = self.client
        write.end("aborted")
        if c.reconnects == write.connection:  # else the daemon dropped the write already
            c._give_back(ops.commit(self.handle.ns, write.writes, abort=True))

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
        """Drop the blocks of ``keys`` from every tier; returns how many were stored."""
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

    def hint_selection(
        self,
        chain: Sequence[bytes],
        queries: Any,
        *,
        query_layers: Sequence[int],
        budget_blocks: int,
        session: bytes = b"",
        promote_blocks: int = 0,
    ) -> ops.SparseHint:
        """:meth:`hint_attention`, answered with the selection itself: for each query layer
        and KV head, the chain positions its attention should read (see
        :class:`~kvtierd.client.ops.SparseHint`). ``promote_blocks`` (> 0): the daemon starts
        promoting at most that many, the ranked blocks first. Raises
        :class:`~kvtierd.errors.NotSupportedError` on a daemon older than minor 14."""
        layout = self.handle.layout
        if layout is None:
            raise InvalidRequestError("a sparse HINT needs a namespace opened with a layout")
        c = self.client
        return self._run(
            lambda: ops.hint_selection(
                self.handle.ns,
                chain,
                queries,
                query_layers,
                budget_blocks,
                session,
                layout.kv_heads,
                c.daemon_minor,
                promote_blocks,
            )
        )

    def hint(self, queue: Sequence[Sequence[bytes]], *, session: bytes = b"") -> int:
        """Tell the daemon which key chains are queued; it promotes their hits."""
        return self._run(lambda: ops.hint(self.handle.ns, queue, session, self.client.max_keys))
