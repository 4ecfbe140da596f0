"""Restoring from peer daemons: a block only the pool holds here is pulled from another host's
daemon over NIXL first, and from the pool's GET only when no peer has it (``docs/pool.md``,
"Restoring from a peer daemon instead of the pool").

Theory of operation
-------------------
A rank whose disk was wiped (or that moved host) indexes its manifest from the pool: every block
is a pool copy, read on demand with one GET each. Where another daemon still holds some of
those blocks (``remote.peers``: the daemons of other hosts that share this one's key secret,
such as the rank's previous host), :class:`PeerReads` asks them first, as a remote client of
each (``docs/remote.md``): over a TCP connection with this daemon's own client certificate it
opens the block's namespace there (the same spec, hence the same digest and keys), leases the
block with READ_NIXL and has the NIXL exporter of the region the arena slot being filled lies
in (:mod:`kvtierd.nixl.export`: this daemon's process loads no NIXL) pull its bytes into that
exporter's landing buffer (the exporter maps the region read-only); the daemon copies them into
the slot, hashing the copy as it makes it. The bytes are
kept only when the copy hashes to the checksum this rank's own manifest recorded: a peer's copy is
used only if it is exactly the block asked for. Anything else (the peer lacks the block, is
down, refuses, or sends other bytes) is a peer miss and the pool's GET follows, so a peer can
make a restore faster, never wrong and never fail.

Where the work runs. The peer connections are the async client, on the event loop, each held
by a task of its own (the daemon's, under :func:`kvtierd.server.assembly.open_peer_reads`), one
lease at a time per peer (the pulls of several blocks overlap); RELEASEs are queued without
waiting. The pull is a control message to the exporter, awaited on
the event loop (:meth:`~kvtierd.nixl.export.RegionExport.pull_into`), with the peer agent's
metadata: the exporter loads it the first time. A peer whose exporter was restarted names a new
agent in its descriptors; its grant is then asked again. A peer that failed is skipped for
:data:`RETRY_AFTER_S`.

Where it sits. The composition root (:mod:`kvtierd.server.assembly`) wraps the pool tier in a
:class:`PeerFirstTier` before the store is put together: the store promotes pool-only copies
through it like through any lower tier, and its :meth:`~PeerFirstTier.load` asks
:meth:`PeerReads.load` first (``BlockNotFoundError`` when no peer had the block), then the pool.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup, TaskStatus

from kvtierd.client import ops
from kvtierd.client.aio import AsyncClient, AsyncNamespace, connect_endpoint_async
from kvtierd.client.endpoint import TcpEndpoint, client_tls_context
from kvtierd.config import RemoteConfig
from kvtierd.errors import BlockNotFoundError, ConfigError, RemoteProtocolError
from kvtierd.nixl import descriptors
from kvtierd.nixl.export import RegionExport
from kvtierd.pool.tier import PoolTier
from kvtierd.protocol.messages import ReadNixlReply
from kvtierd.store.coldrefs import ColdRows
from kvtierd.store.counts import CheckpointFigures, TierFigures
from kvtierd.store.namespaces import NamespaceSpec
from kvtierd.store.refs import Recovered
from kvtierd.store.tier import BlockRef, LowerTier

__all__ = ["PeerFirstTier", "PeerReads", "peer_endpoints"]

log = logging.getLogger("kvtierd.peers")

#: A peer that failed (down, refusing, too slow) is not asked again for this long.
RETRY_AFTER_S = 10.0
#: The longest one peer's lease and pull may take before the pool is asked instead.
PEER_TIMEOUT_S = 5.0


def peer_endpoints(config: RemoteConfig) -> list[TcpEndpoint]:
    """The endpoints of ``config.peers``, with this daemon's client certificate (TLS unless
    ``peer_cert_file`` is empty, which the configuration allows only with ``allow_plaintext``).
    Raises :class:`ConfigError` for certificate files that cannot be loaded."""
    tls: ssl.SSLContext | None = None
    if config.peer_cert_file:
        try:
            tls = client_tls_context(config.peer_ca, config.peer_cert_file, config.peer_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"remote.peer_cert_file/key_file/ca_file: {exc}") from None
    return [TcpEndpoint(*p.host_port(), tls, p.server_name or None) for p in config.peers]


@dataclass(eq=False)
class _Peer:
    """One peer daemon: its connection (made when first needed, held by a task of its own) and
    what was set up on it."""

    endpoint: TcpEndpoint
    client: AsyncClient | None = None
    #: Set to end the task that holds the connection.
    done: anyio.Event | None = None
    #: Counts the connections made: what was set up on an earlier one is not this one's.
    connection: int = 0
    #: Namespace digest -> the namespace opened on the peer (on this connection).
    namespaces: dict[bytes, AsyncNamespace] = field(default_factory=dict)
    #: (connection, region) -> the peer's agent there and its metadata (NIXL_GRANT's).
    grants: dict[tuple[int, int], tuple[str, bytes]] = field(default_factory=dict)
    skip_until: float = 0.0
    lock: anyio.Lock = field(default_factory=anyio.Lock)

    def release(self, lease: _Lease) -> None:
        """RELEASE ``lease`` without waiting, unless its connection is gone (the peer released
        it then, and its id may name a lease of the new connection)."""
        if self.client is not None and self.connection == lease.where[0]:
            self.client.release_soon([r.lease for r in lease.replies])

    def close(self) -> None:
        """End the connection (its task sends DESTROY) and what was set up on it."""
        self.namespaces.clear()
        self.grants.clear()
        self.client = None
        if self.done is not None:
            self.done.set()
            self.done = None


@dataclass(frozen=True, slots=True)
class _Lease:
    replies: list[ReadNixlReply]
    #: (connection, region): where on the peer the lease was granted.
    where: tuple[int, int]
    #: The peer's agent (of the lease's region) and its metadata.
    agent: str
    metadata: bytes


class PeerReads:
    """The peers this daemon asks first for blocks only the pool holds (module docstring).
    Their connections are tasks of ``tg``."""

    def __init__(
        self,
        endpoints: Sequence[TcpEndpoint],
        export: RegionExport,
        spec_of: Callable[[bytes], NamespaceSpec | None],
        tg: TaskGroup,
    ) -> None:
        self._peers = [_Peer(e) for e in endpoints]
        self._export = export
        self._spec_of = spec_of
        self._tg = tg
        #: Set by :meth:`aclose`: no peer is asked, and no connection made, any more.
        self._closed = False
        #: Blocks pulled from a peer, asked of peers and not found there, and peer failures.
        self.counters = {"hits": 0, "misses": 0, "failures": 0, "bytes": 0}

    async def load(self, ref: BlockRef, dest: memoryview) -> None:
        """Fill ``dest`` with ``ref``'s bytes from a peer that has them intact; raises
        ``BlockNotFoundError`` when none has (the pool must be asked: ``dest`` then holds
        nothing to rely on)."""
        spec = self._spec_of(ref.ns_digest)
        if spec is None:
            raise BlockNotFoundError("not a namespace of this daemon's")
        target = dest[: ref.raw_bytes]
        for peer in self._peers:
            if time.monotonic() < peer.skip_until or self._closed:
                continue
            try:
                await self._pull(peer, spec, ref, target)
            except BlockNotFoundError:
                continue  # this peer lacks it (or is being skipped): the next one
            except Exception as exc:  # whatever a peer makes go wrong is that peer's failure
                self.counters["failures"] += 1
                if time.monotonic() >= peer.skip_until:  # once per failure, not per block
                    log.warning(
                        "peer %s failed (%s): the pool serves, the peer is skipped for %g s",
                        peer.endpoint,
                        exc,
                        RETRY_AFTER_S,
                    )
                peer.skip_until = time.monotonic() + RETRY_AFTER_S
                peer.close()
            else:
                self.counters["hits"] += 1
                self.counters["bytes"] += ref.raw_bytes
                return
        self.counters["misses"] += 1
        raise BlockNotFoundError("no peer holds an intact copy")

    async def _lease(self, peer: _Peer, spec: NamespaceSpec, digest: bytes, key: bytes) -> _Lease:
        """Lease ``key`` of ``spec``'s namespace on the peer (its lock held), with the agent
        its descriptors name and that agent's metadata (asked once per agent)."""
        client = await self._client(peer)
        if client.daemon_minor < ops.NIXL_MINOR:
            raise BlockNotFoundError(f"{peer.endpoint} speaks minor {client.daemon_minor}")
        ns = peer.namespaces.get(digest)
        if ns is None:
            ns = peer.namespaces[digest] = await client.namespace(
                spec.name,
                block_bytes=spec.block_bytes,
                layout=spec.layout,
                rank=spec.rank,
                world_size=spec.world_size,
                tenant=spec.tenant,
                compression=spec.compression.value,
                sparse=spec.sparse,
                create=False,
            )
        replies = await client.run(ops.read_nixl(ns.handle.ns, [key], client.max_keys))
        where = (peer.connection, ns.handle.region)
        try:
            named = descriptors.agent_of(replies[0].descriptors)
            grant = peer.grants.get(where)
            if grant is None or grant[0] != named:  # new, or the peer's exporter restarted
                reply = await client.run(ops.nixl_grant(ns.handle.ns))
                grant = peer.grants[where] = (reply.agent, reply.metadata)
        except BaseException:
            client.release_soon([r.lease for r in replies])
            raise
        return _Lease(replies, where, *grant)

    async def _client(self, peer: _Peer) -> AsyncClient:
        """The peer's connection, made (by a task of its own) if it has none that is open."""
        if self._closed:  # its task group may be gone: no connection outlives aclose()
            raise BlockNotFoundError("the peers are closed")
        if peer.client is None or not peer.client.connected():
            peer.close()
            peer.client = await self._tg.start(self._hold, peer)
            peer.connection += 1
        return peer.client

    async def _hold(self, peer: _Peer, *, task_status: TaskStatus[AsyncClient]) -> None:
        """Connect to ``peer`` and hold the connection until :meth:`_Peer.close`. A failure to
        connect is the caller's (:meth:`_client`); one at the end only ends this task."""
        done = anyio.Event()
        started = False
        if self._closed:  # asked for while closing: end at once
            raise BlockNotFoundError("the peers are closed")
        try:
            async with connect_endpoint_async(peer.endpoint, client_name="kvtierd-peer") as client:
                peer.done = done
                task_status.started(client)
                started = True
                if not self._closed:  # closed while it connected: DESTROY at once
                    await done.wait()
        except Exception as exc:
            if not started:
                raise
            log.debug("peer %s: the connection ended with %r", peer.endpoint, exc)

    async def _pull(
        self, peer: _Peer, spec: NamespaceSpec, ref: BlockRef, target: memoryview
    ) -> None:
        """Fill ``target`` with ``ref``'s bytes from ``peer``; ``BlockNotFoundError`` when the
        peer does not hold that very block, any other error when the peer failed."""
        deadline = anyio.current_time() + PEER_TIMEOUT_S  # the lease and the pull, together
        with anyio.fail_after(PEER_TIMEOUT_S):
            async with peer.lock:  # one control call at a time; pulls overlap
                if time.monotonic() < peer.skip_until:  # failed while this one waited
                    raise BlockNotFoundError(f"{peer.endpoint} is skipped")
                lease = await self._lease(peer, spec, ref.ns_digest, ref.key)
        try:
            extents = [e for reply in lease.replies for e in reply.extents]
            if len(extents) != 1 or extents[0].length != ref.raw_bytes:
                raise BlockNotFoundError(f"{peer.endpoint} leased other extents")
            if extents[0].checksum != ref.checksum:  # another version of the block
                raise BlockNotFoundError(f"{peer.endpoint} holds another version")
            # The exporter's own deadline bounds the pull (it is killed if it overruns). The
            # exporter pulls into its landing buffer (it maps the region read-only); the copy
            # into ``target`` is hashed as it is made, and only that hash counts: the landing
            # buffer is NIXL-registered memory, which a peer could write after the pull.
            copied = await self._export.pull_into(
                target,
                agent=lease.agent,
                metadata=lease.metadata,
                remote=lease.replies[0].descriptors,
                timeout_s=max(0.1, deadline - anyio.current_time()),
            )
        finally:
            peer.release(lease)  # queued when a control call holds the connection
        # The bytes in the slot must be exactly the manifest's block: anything else is a miss,
        # and a peer that sends other bytes than its lease's checksum promised has failed.
        if copied != ref.checksum:
            raise RemoteProtocolError(f"{peer.endpoint} sent bytes that are not the block's")

    async def aclose(self) -> None:
        """Close every peer connection (their tasks send DESTROY and end); the exporters stay
        (they forget peer agents by themselves)."""
        c = self.counters
        log.info(
            "peers served %d block(s), %d bytes; %d asked of them in vain; %d failure(s)",
            c["hits"],
            c["bytes"],
            c["misses"],
            c["failures"],
        )
        self._closed = True
        for peer in self._peers:
            peer.close()


class PeerFirstTier(LowerTier):
    """The pool tier with the peers asked first: :meth:`load` (and so :meth:`load_run`) tries
    ``peers`` and reads the pool only when no peer had the block; everything else is the pool
    tier's own."""

    kind = PoolTier.kind
    capabilities = PoolTier.capabilities

    def __init__(self, pool: PoolTier, peers: PeerReads) -> None:
        self.pool = pool
        self.peers = peers

    async def load(self, ref: BlockRef, location: Hashable, dest: memoryview) -> None:
        try:
            await self.peers.load(ref, dest)
        except BlockNotFoundError:
            await self.pool.load(ref, location, dest)  # no peer has it: the pool's GET

    def slot_class(self, ref: BlockRef) -> int:
        return self.pool.slot_class(ref)

    def stored_class(self, ref: BlockRef, location: Hashable) -> int:
        return self.pool.stored_class(ref, location)

    async def store(self, ref: BlockRef, payload: memoryview) -> Hashable:
        return await self.pool.store(ref, payload)

    async def discard(self, ref: BlockRef, location: Hashable) -> None:
        await self.pool.discard(ref, location)

    async def sync(self) -> None:
        await self.pool.sync()

    def recovered(self) -> Iterable[Recovered]:
        return self.pool.recovered()

    def cold_rows(self) -> ColdRows | None:
        return self.pool.cold_rows()

    def statistics(self) -> TierFigures:
        return self.pool.statistics()

    def checkpoint_figures(self) -> CheckpointFigures | None:
        return self.pool.checkpoint_figures()
