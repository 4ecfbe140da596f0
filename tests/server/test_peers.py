"""The daemon as a client of hostile peers (``kvtierd.server.peers``): what a peer answers never
escapes as anything but a peer miss, a lease granted to a cancelled restore is given back,
nothing outlives ``aclose``, and the peer-first tier asks the pool after a peer miss.

The peer here is an attacker: a real TCP listener speaking the real protocol
(:class:`~kvtierd.protocol.ServerConnection`) with answers chosen to hurt. The restores it
refuses never reach a NIXL pull (``tests/nixl/test_peer_restore.py`` runs the real one), so the
region export is an object nothing may call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import anyio
import anyio.abc
import pytest

from kvtierd.client.endpoint import TcpEndpoint
from kvtierd.config import PoolConfig
from kvtierd.errors import BlockNotFoundError, NotSupportedError
from kvtierd.nixl import descriptors
from kvtierd.nixl.export import RegionExport
from kvtierd.pool.connect import PoolUnavailableError
from kvtierd.pool.tier import PoolTier
from kvtierd.pool.values import PoolNames
from kvtierd.protocol import ServerConnection
from kvtierd.protocol.connection import RequestReceived
from kvtierd.protocol.messages import (
    Extent,
    InitReply,
    InitRequest,
    Message,
    OpenNsReply,
    OpenNsRequest,
    ReadNixlReply,
    ReadNixlRequest,
    ReleaseReply,
    ReleaseRequest,
)
from kvtierd.server.peers import PeerFirstTier, PeerReads
from kvtierd.store.namespaces import NamespaceSpec
from kvtierd.store.refs import BlockRef
from kvtierd.store.tier import LowerTier

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

RAW = 4096
SPEC = NamespaceSpec("ns", "default", RAW, None, 0, 1)
REF = BlockRef(b"d" * 32, b"k" * 16, RAW, 1234, 1)
DESCRIPTORS = descriptors.encode("peer-agent", [(0x10000, RAW)], [(0x10000, RAW)])


class HostilePeer:
    """Answers INIT with ``max_keys`` and READ_NIXL after ``read_delay_s``; records requests."""

    def __init__(self, *, max_keys: int = 64, read_delay_s: float = 0.0) -> None:
        self.max_keys = max_keys
        self.read_delay_s = read_delay_s
        self.seen: list[Message] = []
        self.connections = 0
        self.released = anyio.Event()

    async def serve(self, stream: anyio.abc.ByteStream) -> None:
        self.connections += 1
        conn = ServerConnection()
        async with stream:
            while True:
                try:
                    conn.receive_data(await stream.receive(65536))
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                while isinstance(event := conn.next_event(), RequestReceived):
                    self.seen.append(event.message)
                    reply = await self._answer(event.message)
                    if reply is None:  # DESTROY, NIXL_GRANT: not this peer's business
                        refusal = NotSupportedError(f"{type(event.message).__name__}: no")
                        await stream.send(conn.reply_error(event.header, refusal))
                    else:
                        await stream.send(conn.reply(event.header, reply))

    async def _answer(self, message: Message) -> Message | None:
        if isinstance(message, InitRequest):
            return InitReply(1, 9, 1 << 20, 64, self.max_keys, 0, "hostile")
        if isinstance(message, OpenNsRequest):
            return OpenNsReply(7, b"s" * 16, b"d" * 32, 3, 1 << 20)
        if isinstance(message, ReadNixlRequest):
            await anyio.sleep(self.read_delay_s)
            return ReadNixlReply(11, [Extent(0, RAW, REF.checksum)], DESCRIPTORS)
        if isinstance(message, ReleaseRequest):
            self.released.set()
            return ReleaseReply(len(message.leases))
        return None


@asynccontextmanager
async def peer_reads(peer: HostilePeer) -> AsyncIterator[PeerReads]:
    """PeerReads of one plaintext peer, its connections in a task group of their own, closed
    as ``open_peer_reads`` closes them."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    never_pulls = cast(RegionExport, object())  # a pull would fail loudly: AttributeError
    async with listener, anyio.create_task_group() as servers:
        servers.start_soon(listener.serve, peer.serve)
        async with anyio.create_task_group() as tg:
            reads = PeerReads([TcpEndpoint("127.0.0.1", port)], never_pulls, lambda _: SPEC, tg)
            try:
                yield reads
            finally:
                await reads.aclose()
                tg.cancel_scope.cancel()
        servers.cancel_scope.cancel()


async def test_a_peer_allowing_no_key_per_request_is_a_peer_miss() -> None:
    peer = HostilePeer(max_keys=0)
    async with peer_reads(peer) as reads:
        with pytest.raises(BlockNotFoundError):
            await reads.load(REF, memoryview(bytearray(RAW)))
        assert reads.counters["failures"] == 1
        with pytest.raises(BlockNotFoundError):  # skipped now: not asked again
            await reads.load(REF, memoryview(bytearray(RAW)))
    assert peer.connections == 1


async def test_a_lease_granted_to_a_cancelled_restore_is_given_back() -> None:
    """The restore is cancelled while READ_NIXL waits for its reply; the connection stays, and
    the lease the peer grants afterwards is released on it."""
    peer = HostilePeer(read_delay_s=0.5)
    async with peer_reads(peer) as reads:
        with anyio.move_on_after(0.2):
            await reads.load(REF, memoryview(bytearray(RAW)))
        with anyio.fail_after(10):
            await peer.released.wait()
    released = [m for m in peer.seen if isinstance(m, ReleaseRequest)]
    assert released[0].leases == [11]


async def test_no_peer_is_asked_or_connected_after_aclose() -> None:
    peer = HostilePeer()
    async with peer_reads(peer) as reads:
        await reads.aclose()
        with pytest.raises(BlockNotFoundError):
            await reads.load(REF, memoryview(bytearray(RAW)))
    assert peer.connections == 0


async def test_the_peer_first_tier_reads_the_pool_after_a_peer_miss() -> None:
    """The peer refuses (a miss), so the load goes on to the pool tier, which here has no
    connection: its own error shows that it was asked. The rest is the pool tier's."""
    config = PoolConfig(url="redis://127.0.0.1:1", allow_plaintext=True)
    pool = PoolTier(config, PoolNames(config.key_prefix, "g", 0))
    peer = HostilePeer(max_keys=0)
    async with peer_reads(peer) as reads:
        tier = PeerFirstTier(pool, reads)
        with pytest.raises(PoolUnavailableError, match="not attached"):
            await tier.load(REF, pool.location(REF), memoryview(bytearray(RAW)))
        assert reads.counters["failures"] == 1  # the peer was asked first
        assert tier.slot_class(REF) == pool.slot_class(REF)
        assert tier.statistics() == pool.statistics()
    assert peer.connections == 1


def test_the_peer_first_tier_overrides_all_that_the_pool_tier_does() -> None:
    """A method of the tier port that the pool tier makes its own must be the wrapper's too
    (delegated), else the store would get the port's default around the pool."""
    port = {
        name
        for name, member in vars(LowerTier).items()
        if callable(member) and not name.startswith("__")
    }
    pools = {name for name in port if getattr(PoolTier, name) is not getattr(LowerTier, name)}
    wrapped = {
        name for name in port if getattr(PeerFirstTier, name) is not getattr(LowerTier, name)
    }
    assert "load" in pools
    assert pools <= wrapped, f"PeerFirstTier lacks {sorted(pools - wrapped)}"
