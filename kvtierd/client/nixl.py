"""Pulling leased blocks out of the daemon's arena over NIXL, into memory this process registered.

Theory of operation
-------------------
The shared-memory read (:meth:`kvtierd.client.Namespace.read_into`) copies out of the client's
own mapping of its tenant region. A NIXL read moves the same bytes with NIXL (UCX: RDMA where
the NIC has it, TCP otherwise) into memory registered with this process's agent, which may be
GPU memory on a GPU host or a process without the region mapped at all. The control stays on
the daemon's socket:

1. **Grant, once per region and agent.** NIXL_GRANT answers the metadata of the agent that
   exports the namespace's tenant region (a process of the daemon's that maps that region
   alone); the agent loads it (:meth:`~kvtierd.nixl.agent.NixlAgent.add_peer`). A daemon that
   restarted has new agents: grants are kept per connection
   (:attr:`~kvtierd.client.Client.reconnects`); and an exporter the daemon restarted has a new
   agent, which the descriptors of the next lease name: the grant is then asked again.
2. **Lease.** READ_NIXL leases the blocks, exactly as READ does (tenant checks, quotas, the
   lease pins each block's slot), and adds the descriptors of their bytes, described by the
   daemon within that region only (:class:`NixlLease`).
3. **Pull.** One NIXL READ per reply, from the descriptors into the caller's buffers
   (:meth:`NixlReader.pull`).
4. **Re-check on completion**, because NIXL is not an access check (``docs/nixl.md``): a
   descriptor stays usable after its lease ends, so a slot given to another block meanwhile
   would be read without complaint. After the transfer, the reader refuses the bytes unless
   the lease is still held (not released, and its connection not replaced: a daemon releases a
   lost connection's leases) and every block's bytes hash (xxh3-64) to the checksum its lease
   reported at commit. So a lease released or a connection lost mid-transfer, or a block
   scribbled by a client of its tenant, never yields bytes the engine takes for the block.
5. **Release**, without waiting for the reply, as every read does.

Only the blocks' bytes cross NIXL; the keys, leases and checksums stay on the socket.

A process that made a :class:`~kvtierd.nixl.agent.NixlAgent` ends through
:func:`~kvtierd.nixl.agent.exit_process` (NIXL's native objects crash in the interpreter's
shutdown). Use one reader from one thread: NIXL agents are used so (``kvtierd.nixl.agent``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtierd.client import ops
from kvtierd.client.arena import as_bytes_view
from kvtierd.client.sync import Client, Namespace
from kvtierd.errors import (
    BrokenConnectionError,
    CorruptBlockError,
    InvalidRequestError,
    KvtierError,
    RemoteProtocolError,
    StartingError,
)
from kvtierd.io.buffers import buffer_address
from kvtierd.nixl import descriptors
from kvtierd.nixl.agent import Extent, NixlAgent, Registration
from kvtierd.protocol.messages import ReadNixlReply
from kvtierd.store.records import checksum

__all__ = ["NixlLease", "NixlReader"]

#: How long one pull may take before it fails (the peer stopped answering).
PULL_TIMEOUT_S = 30.0


@dataclass(repr=False, eq=False)
class NixlLease:
    """Blocks leased with their NIXL descriptors (:meth:`NixlReader.lease`): ``keys[i]`` is
    ``replies``' ``i``-th extent. Valid for a pull until :meth:`release`; idempotent."""

    keys: Sequence[bytes]
    replies: list[ReadNixlReply]
    #: The region's exporter agent, as this process's agent knows it.
    peer: str
    _client: Client
    #: The connection the lease was granted on (``Client.reconnects`` then).
    _connection: int
    _ended: bool = field(default=False)

    def __repr__(self) -> str:
        return f"<NixlLease of {len(self.keys)} blocks, {'held' if self.held else 'ended'}>"

    @property
    def held(self) -> bool:
        """Neither released nor lost with its connection (the daemon released it then)."""
        return not self._ended and self._client.reconnects == self._connection

    @property
    def lengths(self) -> list[int]:
        return [e.length for reply in self.replies for e in reply.extents]

    def release(self) -> None:
        if self._ended:
            return
        self._ended = True
        self._client.release_soon([r.lease for r in self.replies], self._connection)

    def __enter__(self) -> NixlLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class NixlReader:
    """Reads of one :class:`~kvtierd.client.Client`'s namespaces over NIXL, through ``agent``
    (this process's, made with :func:`~kvtierd.nixl.agent.start_agent`), into buffers
    registered with :meth:`register`. :meth:`close` forgets the daemon's agents; the caller
    closes its own agent."""

    def __init__(
        self, client: Client, agent: NixlAgent, *, timeout_s: float = PULL_TIMEOUT_S
    ) -> None:
        self.client = client
        self.agent = agent
        self.timeout_s = timeout_s
        #: (connection, region) -> the region's exporter agent as loaded for its grant.
        self._peers: dict[tuple[int, int], str] = {}
        #: The buffers registered here, kept alive as long as NIXL may write into them.
        self._buffers: list[tuple[memoryview, Registration]] = []

    def register(self, buffer: Any) -> memoryview:
        """Register a writable, C-contiguous buffer (a numpy array, an ``mmap``, a
        ``bytearray``) that pulls may fill; returns its byte view. It is kept referenced until
        :meth:`close`."""
        view = as_bytes_view(buffer, writable=True)
        if not len(view):
            raise InvalidRequestError("cannot register an empty buffer")
        self._buffers.append((view, self.agent.register(buffer_address(view), len(view))))
        return view

    def read_into(self, ns: Namespace, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        """Pull the blocks of ``keys`` into ``buffers`` (``buffers[i]`` a contiguous part of a
        registered buffer, at least as long as block ``i``) and release them; returns the
        bytes pulled. Raises :class:`~kvtierd.errors.CorruptBlockError` for a block whose bytes
        fail their checksum (a miss) and
        :class:`~kvtierd.errors.BrokenConnectionError` when the connection holding the lease
        was lost meanwhile; the buffers' contents are then not the blocks'."""
        with self.lease(ns, keys) as lease:
            return self.pull(lease, buffers)

    def lease(self, ns: Namespace, keys: Sequence[bytes]) -> NixlLease:
        """Lease the blocks of ``keys`` with their descriptors, and load the grant of their
        region if this connection has not yet; the caller :meth:`pulls <pull>` and releases."""
        client = self.client
        if ns.client is not client:
            raise InvalidRequestError("the namespace belongs to another client")
        ops.require_minor(
            client.daemon_minor,
            ops.NIXL_MINOR,
            "NIXL reads need",
            f"kvtierd {ops.NIXL_MINOR}+ with nixl.enabled",
        )
        replies = ns._run(lambda: ops.read_nixl(ns.handle.ns, keys, client.max_keys))
        connection = client.reconnects
        try:
            peer = self._peer(ns, connection, descriptors.agent_of(replies[0].descriptors))
        except BaseException:
            client.release_soon([r.lease for r in replies], connection)
            raise
        return NixlLease(list(keys), replies, peer, client, connection)

    def pull(self, lease: NixlLease, buffers: Sequence[Any]) -> int:
        """Pull ``lease``'s blocks into ``buffers`` and re-check them (module docstring, step
        4); returns the bytes pulled. Does not release the lease."""
        lengths = lease.lengths
        if len(buffers) != len(lengths):
            raise InvalidRequestError(f"{len(lengths)} blocks but {len(buffers)} buffers")
        targets = [as_bytes_view(b, writable=True) for b in buffers]
        for target, length in zip(targets, lengths, strict=True):
            if len(target) < length:
                raise InvalidRequestError(f"a buffer of {len(target)} bytes cannot hold {length}")
        if not lease.held:
            raise InvalidRequestError(f"{lease!r} cannot be pulled")
        start = 0
        for reply in lease.replies:
            parts = targets[start : start + len(reply.extents)]
            local: list[Extent] = [
                (buffer_address(t), e.length) for t, e in zip(parts, reply.extents, strict=True)
            ]
            self.agent.pull(lease.peer, reply.descriptors, local, timeout_s=self.timeout_s)
            start += len(reply.extents)
        self.verify(lease, targets)
        return sum(lengths)

    def verify(self, lease: NixlLease, buffers: Sequence[Any]) -> None:
        """The re-check on completion (module docstring, step 4), which :meth:`pull` makes:
        raises unless ``lease`` is still held and every block's bytes in ``buffers`` hash to
        its committed checksum. For a caller that moved the bytes with its own transfer (one
        batched with others, say) from ``lease``'s descriptors."""
        targets = [as_bytes_view(b) for b in buffers]
        if not lease.held:
            if lease._client.reconnects != lease._connection:
                raise BrokenConnectionError(
                    "the connection holding the lease was lost during the pull: the daemon may "
                    "have given the slots to other blocks, so nothing pulled is used"
                )
            raise InvalidRequestError(
                "the lease was released during its pull: the daemon may have given the slots "
                "to other blocks, so nothing pulled is used"
            )
        extents = [e for reply in lease.replies for e in reply.extents]
        for key, target, extent in zip(lease.keys, targets, extents, strict=True):
            if checksum(target[: extent.length]) != extent.checksum:
                self.client.corrupt_reads += 1
                raise CorruptBlockError(
                    f"block {key.hex()} pulled over NIXL failed its checksum (changed after "
                    "commit by a client of its tenant): a miss"
                )

    def _peer(self, ns: Namespace, connection: int, named: str) -> str:
        """The daemon's agent for ``ns``'s region on connection ``connection``, loaded from a
        NIXL_GRANT the first time, and again when the descriptors name another (``named``: the
        daemon restarted that region's exporter)."""
        where = (connection, ns.handle.region)
        peer = self._peers.get(where)
        if peer != named:
            if peer is not None:
                del self._peers[where]
                if peer not in self._peers.values():
                    with contextlib.suppress(KvtierError):
                        self.agent.remove_peer(peer)
            grant = ns._run(lambda: ops.nixl_grant(ns.handle.ns))
            if grant.agent != named:
                raise StartingError(
                    f"the daemon restarted the NIXL exporter of region {ns.handle.region} "
                    "during the lease: try again"
                )
            if grant.region != ns.handle.region:
                raise RemoteProtocolError(
                    f"NIXL_GRANT named region {grant.region}, not the namespace's "
                    f"{ns.handle.region}"
                )
            peer = self.agent.add_peer(grant.metadata)
            if peer != grant.agent:
                raise RemoteProtocolError(
                    f"the NIXL metadata names agent {peer!r}, not {grant.agent!r}"
                )
            self._peers[where] = peer
        return peer

    def close(self) -> None:
        """Forget the daemon's agents and deregister the buffers (the agent stays open)."""
        for peer in set(self._peers.values()):
            with contextlib.suppress(KvtierError):
                self.agent.remove_peer(peer)
        self._peers.clear()
        while self._buffers:
            _, registration = self._buffers.pop()
            self.agent.deregister(registration)

    def __enter__(self) -> NixlReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
