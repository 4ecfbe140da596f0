"""Request handlers on a real store, with no socket: each handler sees only its
:class:`~kvtierd.server.context.RequestContext` (issue 18), so a test gives it one."""

from __future__ import annotations

import mmap
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from kvtierd.config import Config, load_config
from kvtierd.errors import InvalidRequestError
from kvtierd.protocol import PROTOCOL_VERSION, Opcode, RequestHeader
from kvtierd.protocol.frames import MIN_MAX_FRAME_BYTES, PROTOCOL_MINOR
from kvtierd.protocol.messages import (
    AllocReply,
    AllocRequest,
    CommitReply,
    CommitRequest,
    DestroyReply,
    InitReply,
    InitRequest,
    ListKeysReply,
    ListKeysRequest,
    LookupReply,
    LookupRequest,
    Message,
    OpenNsReply,
    OpenNsRequest,
    ReadReply,
    ReadRequest,
    ReleaseReply,
    ReleaseRequest,
)
from kvtierd.server.daemon import Daemon
from kvtierd.server.handlers import HANDLERS, NOWAIT_HANDLERS
from kvtierd.store.index import Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import PeerCredentials
from kvtierd.store.records import checksum
from kvtierd.store.store import BlockStore

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10
ROOT = PeerCredentials(pid=1, uid=0, gid=0)


@dataclass
class Context:
    """A :class:`RequestContext` over a real store and daemon, without a connection."""

    store: BlockStore
    reports: Daemon
    peer: PeerCredentials = ROOT
    owner: Owner = field(default_factory=Owner)
    namespaces: set[int] = field(default_factory=set)
    reply_fds: dict[int, list[int]] = field(default_factory=dict)
    max_inflight: int = 8
    max_frame_bytes: int = 1 << 20
    may_create_namespaces: bool = True
    negotiated: int | None = None

    def negotiate(self, max_frame_bytes: int) -> None:
        self.negotiated = max_frame_bytes

    async def call(self, opcode: Opcode, msg: Message, ns: int = 0) -> Message:
        self.unique = getattr(self, "unique", 0) + 1
        header = RequestHeader(int(opcode), 0, self.unique, ns)
        return await HANDLERS[opcode](self, header, msg)


def _config(directory: Path) -> Config:
    return load_config(
        None,
        {
            "daemon": {"data_dir": str(directory)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "0"},
        },
    )


@pytest.fixture
async def ctx(tmp_path: Path) -> AsyncIterator[Context]:
    config = _config(tmp_path)
    async with open_store(config) as store:
        yield Context(store, Daemon(config, store))


async def test_init_negotiates_the_frame_limit_down(ctx: Context) -> None:
    reply = await ctx.call(Opcode.INIT, InitRequest(PROTOCOL_VERSION, PROTOCOL_MINOR, 1 << 30))
    assert isinstance(reply, InitReply)
    assert reply.max_frame_bytes == ctx.max_frame_bytes == ctx.negotiated
    tiny = await ctx.call(Opcode.INIT, InitRequest(PROTOCOL_VERSION, PROTOCOL_MINOR, 1))
    assert isinstance(tiny, InitReply)
    assert tiny.max_frame_bytes == MIN_MAX_FRAME_BYTES


async def test_destroy_is_answered(ctx: Context) -> None:
    # (closing the connection is the protocol's transition: tests/protocol)
    assert isinstance(await ctx.call(Opcode.DESTROY, Message()), DestroyReply)


async def test_a_namespace_must_be_opened_on_the_connection(ctx: Context) -> None:
    with pytest.raises(InvalidRequestError, match="not open"):
        await ctx.call(Opcode.LOOKUP, LookupRequest([b"k" * 16]), ns=1)


async def test_blocks_round_trip_through_the_handlers(ctx: Context) -> None:
    opened = await ctx.call(Opcode.OPEN_NS, OpenNsRequest("m", BLOCK))
    assert isinstance(opened, OpenNsReply)
    assert ctx.namespaces == {opened.ns}
    (fd,) = ctx.reply_fds[ctx.unique]  # the tenant's region goes with the reply
    region = mmap.mmap(fd, opened.region_bytes)
    try:
        keys = [b"%016d" % i for i in range(3)]
        data = [bytes([i + 1]) * BLOCK for i in range(3)]
        alloc = await ctx.call(Opcode.ALLOC, AllocRequest(keys), opened.ns)
        assert isinstance(alloc, AllocReply)
        for extent, payload in zip(alloc.extents, data, strict=True):
            region[extent.offset : extent.offset + BLOCK] = payload
        sums = [checksum(payload) for payload in data]
        commit = await ctx.call(Opcode.COMMIT, CommitRequest(alloc.write, sums), opened.ns)
        assert commit == CommitReply(3)
        lookup = await ctx.call(Opcode.LOOKUP, LookupRequest([*keys, b"x" * 16]), opened.ns)
        assert isinstance(lookup, LookupReply)
        assert lookup.hits == 3
        read = await ctx.call(Opcode.READ, ReadRequest(keys), opened.ns)
        assert isinstance(read, ReadReply)
        got = [bytes(region[e.offset : e.offset + e.length]) for e in read.extents]
        assert got == data
        assert [e.checksum for e in read.extents] == sums
        listed = await ctx.call(Opcode.LIST_KEYS, ListKeysRequest(opened.ns))
        assert isinstance(listed, ListKeysReply)
        assert [r.key for r in listed.keys] == keys
        released = await ctx.call(Opcode.RELEASE, ReleaseRequest([read.lease]), opened.ns)
        assert released == ReleaseReply(1)
        assert not ctx.owner.leases
    finally:
        region.close()


async def test_a_torn_write_is_refused_and_stores_nothing(ctx: Context) -> None:
    opened = await ctx.call(Opcode.OPEN_NS, OpenNsRequest("m", BLOCK))
    assert isinstance(opened, OpenNsReply)
    alloc = await ctx.call(Opcode.ALLOC, AllocRequest([b"t" * 16]), opened.ns)
    assert isinstance(alloc, AllocReply)
    with pytest.raises(InvalidRequestError, match="checksum mismatch"):
        await ctx.call(Opcode.COMMIT, CommitRequest(alloc.write, [12345]), opened.ns)
    lookup = await ctx.call(Opcode.LOOKUP, LookupRequest([b"t" * 16]), opened.ns)
    assert lookup == LookupReply(0, b"")


async def test_a_nowait_read_leases_all_in_dram_or_does_nothing(ctx: Context) -> None:
    opened = await ctx.call(Opcode.OPEN_NS, OpenNsRequest("m", BLOCK))
    assert isinstance(opened, OpenNsReply)
    key = b"r" * 16
    alloc = await ctx.call(Opcode.ALLOC, AllocRequest([key]), opened.ns)
    assert isinstance(alloc, AllocReply)
    await ctx.call(Opcode.COMMIT, CommitRequest(alloc.write), opened.ns)
    nowait = NOWAIT_HANDLERS[Opcode.READ]
    header = RequestHeader(int(Opcode.READ), 0, 99, opened.ns)
    with pytest.raises(anyio.WouldBlock):  # one block is not stored: the waiting path says so
        await nowait(ctx, header, ReadRequest([key, b"m" * 16]))
    assert not ctx.owner.leases
    assert ctx.store.residency.statistics().dram_hits == 0
    reply = await nowait(ctx, header, ReadRequest([key]))
    assert isinstance(reply, ReadReply)
    assert list(ctx.owner.leases) == [reply.lease]
