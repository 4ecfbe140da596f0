"""Request handlers: one function per opcode, from a decoded request to a reply message.

Handlers translate between wire messages and store calls and do nothing else; they raise
:class:`~kvtierd.errors.KvtierError` subclasses, which the session turns into errno replies.
Every handler receives the request's context (:class:`~kvtierd.server.context.RequestContext`:
the store's request methods, the connection's peer credentials, owner record and open
namespaces, the daemon's reports; nothing deeper) and the request header (for its namespace
id). Memory is handed out here and only
here: a tenant's region descriptor goes with each OPEN_NS reply that admitted the peer
to that tenant (with every OPEN_NS reply), and extents are offsets inside that region.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import numpy as np

from kvtierd import __version__
from kvtierd.errors import (
    AccessDeniedError,
    BlockNotFoundError,
    InvalidRequestError,
    NoSpaceError,
)
from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.policy import ServedBy
from kvtierd.protocol import MAX_KEYS_PER_REQUEST, PROTOCOL_VERSION, Opcode, RequestHeader
from kvtierd.protocol.frames import MIN_CLIENT_MINOR, MIN_MAX_FRAME_BYTES, PROTOCOL_MINOR
from kvtierd.protocol.messages import (
    MAX_SELECTED_BYTES,
    AllocReply,
    AllocRequest,
    CommitReply,
    CommitRequest,
    DestroyReply,
    DoctorReply,
    EvictReply,
    EvictRequest,
    Extent,
    ForgetReply,
    ForgetRequest,
    FsyncReply,
    HintReply,
    HintRequest,
    HostCheckRecord,
    InitReply,
    InitRequest,
    KeyRecord,
    ListKeysReply,
    ListKeysRequest,
    ListNsReply,
    LookupReply,
    LookupRequest,
    Message,
    NamespaceInfo,
    NixlGrantReply,
    OpenNsReply,
    OpenNsRequest,
    PoolStatusReply,
    ReadNixlReply,
    ReadNixlRequest,
    ReadReply,
    ReadRequest,
    ReadResidentReply,
    ReadResidentRequest,
    ReleaseReply,
    ReleaseRequest,
)
from kvtierd.server.context import RequestContext
from kvtierd.store.index import Block, ColdKey, Lease
from kvtierd.store.namespaces import Compression, Namespace, NamespaceSpec

__all__ = ["HANDLERS", "NOWAIT_HANDLERS", "NOW_HANDLERS", "Handler", "NowHandler"]

Handler = Callable[[RequestContext, RequestHeader, Any], Coroutine[Any, Any, Message]]
NowHandler = Callable[[RequestContext, RequestHeader, Any], Message]


def _namespace(ctx: RequestContext, header: RequestHeader) -> Namespace:
    if header.ns not in ctx.namespaces:
        raise InvalidRequestError(f"namespace {header.ns} is not open on this connection")
    return ctx.store.registry.get(header.ns)


def is_admin(ctx: RequestContext) -> bool:
    """Root and the daemon's own user see and may do everything."""
    return ctx.peer.uid in (0, os.getuid())


def _require_admin(ctx: RequestContext, what: str) -> None:
    if not is_admin(ctx):
        raise AccessDeniedError(f"{what} is for the daemon's user or root")


async def init(ctx: RequestContext, header: RequestHeader, msg: InitRequest) -> Message:
    # A refused INIT ends the connection after its error reply: the protocol's transition.
    if msg.major != PROTOCOL_VERSION:
        raise InvalidRequestError(
            f"protocol major version {msg.major} is not supported ({PROTOCOL_VERSION})"
        )
    if msg.minor < MIN_CLIENT_MINOR:
        raise InvalidRequestError(
            f"client protocol minor {msg.minor} is too old: this daemon hands memory out per "
            f"tenant at OPEN_NS (minor {MIN_CLIENT_MINOR}); upgrade the kvtierd client library"
        )
    # int(): the daemon's own limit is a config ByteSize, which msgspec cannot encode
    limit = int(max(MIN_MAX_FRAME_BYTES, min(msg.max_frame_bytes, ctx.max_frame_bytes)))
    ctx.negotiate(limit)
    ctx.owner.name = msg.client_name
    # Bound the key count so that a request of max_keys maximal keys fits in a frame.
    max_keys = min(MAX_KEYS_PER_REQUEST, (limit - 64) // (MAX_KEY_BYTES + 3))
    return InitReply(
        PROTOCOL_VERSION,
        PROTOCOL_MINOR,
        limit,
        ctx.max_inflight,
        max_keys,
        0,
        __version__,
    )


async def open_ns(ctx: RequestContext, header: RequestHeader, msg: OpenNsRequest) -> Message:
    try:
        compression = Compression(msg.compression)
    except ValueError:
        raise InvalidRequestError(f"unknown compression {msg.compression!r}") from None
    if msg.sparse and msg.layout is None:
        raise InvalidRequestError("a sparse namespace needs a layout")
    spec = NamespaceSpec(
        msg.name,
        msg.tenant,
        msg.block_bytes,
        msg.layout,
        msg.rank,
        msg.world_size,
        compression,
        msg.sparse,
    )
    registry = ctx.store.registry
    create = msg.create and ctx.may_create_namespaces
    try:
        ns, _ = registry.open(spec, ctx.peer, create=create)
    except BlockNotFoundError:
        if create == msg.create:
            raise
        raise AccessDeniedError(
            f"namespace {spec.name!r} does not exist, and a client over TCP may not create "
            "one (remote.allow_create)"
        ) from None
    if registry.needs_save(ns):  # durable before anyone may write to it
        await anyio.to_thread.run_sync(registry.save)
    region = ns.region
    if region is None:
        raise NoSpaceError(f"tenant {spec.tenant!r} has no DRAM region")
    ctx.namespaces.add(ns.id)
    # Every OPEN_NS reply carries its region (OPEN_NS is rare, and replies of concurrent opens
    # may arrive in any order): a client keeps the first and closes the others.
    if not ctx.peer.remote:  # a TCP connection passes no descriptors: it reads over NIXL
        ctx.reply_fds[header.unique] = [region.fd]
    return OpenNsReply(ns.id, ns.key_salt, ns.digest, region.id, region.size_bytes)


async def lookup(ctx: RequestContext, header: RequestHeader, msg: LookupRequest) -> Message:
    store = ctx.store
    ns = _namespace(ctx, header)
    # A TP group on the pool: ask the pool (one round trip); ``each`` answers from this host.
    if store.needs_group_lookup(ns) and not msg.each:
        hits, tiers = await store.lookup_group(ns, msg.keys, promote=msg.promote)
    else:
        hits, tiers = await store.lookup_in_turn(ns, msg.keys, promote=msg.promote, each=msg.each)
    return _lookup_reply(ns, msg, hits, tiers)


def lookup_now(ctx: RequestContext, header: RequestHeader, msg: LookupRequest) -> Message:
    """LOOKUP answered at once: a few keys (no more than the lane answers inline, counted once per
    rank of the namespace's TP group) on this host's tiers, which the session answers from the
    socket's readiness callback; raises :class:`anyio.WouldBlock`, having done nothing, for one that
    would wait (a TP group's on the pool, or a long chain that takes its turn on the lane):
    :func:`lookup` serves those. A plain function, not a coroutine: the callback calls it for every
    LOOKUP it answers."""
    store = ctx.store
    ns = _namespace(ctx, header)
    if store.lookup_work(ns, msg.keys) > store.lane.inline_items:  # keys times ranks
        raise anyio.WouldBlock
    if msg.each:
        hits, tiers = store.lookup_each(ns, msg.keys, promote=msg.promote)
    elif not store.needs_group_lookup(ns):
        hits, tiers = store.lookup(ns, msg.keys, promote=msg.promote)
    else:
        raise anyio.WouldBlock
    return _lookup_reply(ns, msg, hits, tiers)


async def lookup_nowait(ctx: RequestContext, header: RequestHeader, msg: LookupRequest) -> Message:
    """:func:`lookup_now` for the reader's inline path (:data:`NOWAIT_HANDLERS`)."""
    return lookup_now(ctx, header, msg)


def _lookup_reply(ns: Namespace, msg: LookupRequest, hits: int, tiers: bytes) -> LookupReply:
    ns.counters.lookup_blocks += len(msg.keys)
    ns.counters.hit_blocks += len(tiers) - tiers.count(ServedBy.MISS) if msg.each else hits
    return LookupReply(hits, tiers)


async def read(ctx: RequestContext, header: RequestHeader, msg: ReadRequest) -> Message:
    ns = _namespace(ctx, header)
    lease = await _lease(ctx, ns, msg.keys)
    _count_read(ns, lease)
    return ReadReply(lease.id, await _extents_in_slices(ctx, lease))


async def _lease(ctx: RequestContext, ns: Namespace, keys: list[bytes]) -> Lease:
    """READ's lease: at once when every block is in DRAM, else once they are."""
    try:
        return ctx.store.read_nowait(ctx.owner, ns, keys)
    except anyio.WouldBlock:
        return await ctx.store.read(ctx.owner, ns, keys)


async def read_nowait(ctx: RequestContext, header: RequestHeader, msg: ReadRequest) -> Message:
    """READ of blocks all in DRAM now, which the session serves inline (no task, no permit);
    raises :class:`anyio.WouldBlock`, having done nothing, when one is not: the session then
    runs :func:`read` in a task."""
    ns = _namespace(ctx, header)
    lease = ctx.store.read_nowait(ctx.owner, ns, msg.keys)
    _count_read(ns, lease)
    return ReadReply(lease.id, _extents(lease))


async def read_resident(
    ctx: RequestContext, header: RequestHeader, msg: ReadResidentRequest
) -> Message:
    store = ctx.store
    ns = _namespace(ctx, header)
    try:
        lease = await store.lease_resident(ctx.owner, ns, msg.keys)
    except BlockNotFoundError:
        return ReadResidentReply(0, [])  # the wire's "nothing leased": no extents, lease 0
    _count_read(ns, lease)
    return ReadResidentReply(lease.id, await _extents_in_slices(ctx, lease))


def _count_read(ns: Namespace, lease: Lease) -> None:
    ns.counters.read_blocks += len(lease.blocks)
    ns.counters.read_bytes += len(lease.blocks) * ns.spec.block_bytes


def _extents(lease: Lease) -> list[Extent]:
    return [extent for b in lease.blocks if (extent := _extent(b)) is not None]


def _extent(b: Block) -> Extent | None:
    if b.dram is None or b.ns.region is None:
        return None
    return Extent(b.ns.region.relative(b.dram.offset), b.ref.raw_bytes, b.ref.checksum)


async def _extents_in_slices(ctx: RequestContext, lease: Lease) -> list[Extent]:
    """:func:`_extents` of a large lease, built in slices on the store's lane."""
    extents = await ctx.store.lane.map(lease.blocks, _extent)
    return [extent for extent in extents if extent is not None]


async def nixl_grant(ctx: RequestContext, header: RequestHeader, msg: Message) -> Message:
    """The metadata of the NIXL agent of the header's namespace's region: what a client of that
    tenant loads to pull from it. The agent runs in that region's exporter process, which maps
    nothing of another tenant's."""
    export = ctx.nixl.require()
    region = _namespace(ctx, header).region
    assert region is not None  # OPEN_NS admits no namespace without one
    grant = export.grant(region)
    return NixlGrantReply(grant.agent, grant.region_id, grant.metadata)


async def read_nixl(ctx: RequestContext, header: RequestHeader, msg: ReadNixlRequest) -> Message:
    """READ, and the descriptors of the leased blocks' bytes for a NIXL pull: described within
    the namespace's region only, handed out with the lease that keeps their slots."""
    export = ctx.nixl.require()
    ns = _namespace(ctx, header)
    region = ns.region
    assert region is not None
    lease = await _lease(ctx, ns, msg.keys)
    try:
        extents = _extents(lease)
        descriptors = export.describe(
            region, [(b.dram.offset, b.ref.raw_bytes) for b in lease.blocks if b.dram is not None]
        )
    except BaseException:
        ctx.store.release(ctx.owner, [lease.id])
        raise
    export.hold(region, lease)
    _count_read(ns, lease)
    return ReadNixlReply(lease.id, extents, descriptors)


async def release(ctx: RequestContext, header: RequestHeader, msg: ReleaseRequest) -> Message:
    return ReleaseReply(await ctx.store.release_in_slices(ctx.owner, msg.leases))


async def alloc(ctx: RequestContext, header: RequestHeader, msg: AllocRequest) -> Message:
    ns = _namespace(ctx, header)
    write = await ctx.store.alloc(ctx.owner, ns, msg.keys)
    region = ns.region
    assert region is not None  # the store allocated in it
    extents = [
        Extent(region.relative(slot.offset), ns.spec.block_bytes)
        if slot is not None
        else Extent(0, 0)
        for slot in write.slots
    ]
    return AllocReply(write.id, extents)


async def commit(ctx: RequestContext, header: RequestHeader, msg: CommitRequest) -> Message:
    write = ctx.owner.writes.get(msg.write)
    committed = await ctx.store.commit(ctx.owner, msg.write, msg.checksums, msg.abort)
    if write is not None and not msg.abort:  # the blocks this COMMIT wrote (not those stored)
        written = sum(slot is not None for slot in write.slots)
        write.ns.counters.committed_blocks += written
        write.ns.counters.committed_bytes += written * write.ns.spec.block_bytes
    return CommitReply(committed)


async def forget(ctx: RequestContext, header: RequestHeader, msg: ForgetRequest) -> Message:
    ns = _namespace(ctx, header)
    return ForgetReply(await ctx.store.forget(ns, msg.keys))


async def evict(ctx: RequestContext, header: RequestHeader, msg: EvictRequest) -> Message:
    if msg.all_namespaces:
        _require_admin(ctx, "evicting every namespace")
        return EvictReply(await ctx.store.evict_dram(None))
    return EvictReply(await ctx.store.evict_dram(_namespace(ctx, header)))


async def fsync(ctx: RequestContext, header: RequestHeader, msg: Message) -> Message:
    store = ctx.store
    if is_admin(ctx):
        return FsyncReply(await store.fsync())
    if not ctx.namespaces:
        raise InvalidRequestError("FSYNC needs a namespace open on this connection")
    registry, peer = store.registry, ctx.peer
    return FsyncReply(await store.fsync(lambda ns: registry.may_use(ns.spec.tenant, peer)))


async def hint(ctx: RequestContext, header: RequestHeader, msg: HintRequest) -> Message:
    ns = _namespace(ctx, header)
    store = ctx.store
    planned = await store.hint(ns, msg.queue)
    if not msg.queries:
        return HintReply(planned)
    if not ns.spec.sparse:
        raise InvalidRequestError("HINT with queries needs a namespace opened with sparse=True")
    try:
        queries = np.frombuffer(msg.queries, np.float32).reshape(msg.query_shape)
    except ValueError as exc:
        raise InvalidRequestError(f"queries do not have shape {msg.query_shape}: {exc}") from None
    if msg.budget_blocks < 1:
        raise InvalidRequestError("a sparse HINT needs budget_blocks >= 1")
    layout = ns.spec.layout
    budget = min(msg.budget_blocks, len(msg.chain))
    # The selection goes back only within its bound (the library refuses to ask for more);
    # past it the reply is the ranked keys alone, as before minor 14, so a HINT an older
    # client could make is still answered.
    sends_selection = layout is not None and (
        4 * len(msg.query_layers) * layout.kv_heads * budget <= MAX_SELECTED_BYTES
    )
    selection = await store.sparse.select(
        ns, msg.session, msg.chain, queries, msg.query_layers, msg.budget_blocks
    )
    wanted = [*selection.ranked, *selection.predicted]
    if msg.promote_blocks:
        wanted = wanted[: msg.promote_blocks]
    for keys in (wanted, selection.unsummarised):
        planned += store.prefetch_keys(ns, keys)  # a promoted block gets its summary again
    # the resident ones of the chain's unsummarised blocks, which promotion skips, are
    # summarised in the background, for a later HINT to rank
    store.summarise_resident(ns, selection.unsummarised)
    return HintReply(
        planned,
        selection.ranked,
        selection.predicted,
        selection.selected.astype("<i4", copy=False).tobytes() if sends_selection else b"",
    )


async def pool_status(ctx: RequestContext, header: RequestHeader, msg: Message) -> Message:
    report = ctx.reports.pool_status()
    if not is_admin(ctx):  # the pool's traffic is every tenant's: its state only
        return PoolStatusReply(report.state, report.reason)
    return report


async def doctor(ctx: RequestContext, header: RequestHeader, msg: Message) -> Message:
    _require_admin(ctx, "the host report")
    checks = await ctx.reports.doctor()
    return DoctorReply([HostCheckRecord(c.subject, c.status.value, c.detail) for c in checks])


async def configuration(ctx: RequestContext, header: RequestHeader, msg: Message) -> Message:
    _require_admin(ctx, "the running configuration")
    return ctx.reports.configuration()


async def statfs(ctx: RequestContext, header: RequestHeader, msg: Message) -> Message:
    if is_admin(ctx):
        return ctx.reports.statistics()
    return ctx.reports.statistics(ctx.peer)


async def list_ns(ctx: RequestContext, header: RequestHeader, msg: Message) -> Message:
    registry = ctx.store.registry
    infos = []
    for ns in registry:
        if not registry.may_use(ns.spec.tenant, ctx.peer):
            continue
        spec = ns.spec
        counters = ns.counters
        infos.append(
            NamespaceInfo(
                ns.id,
                spec.name,
                spec.tenant,
                spec.rank,
                spec.world_size,
                spec.block_bytes,
                ns.dram_blocks,
                ns.nvme_blocks,
                spec.layout,
                ns.blocks,
                counters.lookup_blocks,
                counters.hit_blocks,
                counters.read_blocks,
                counters.read_bytes,
                counters.committed_blocks,
                counters.committed_bytes,
            )
        )
    return ListNsReply(infos)


async def list_keys(ctx: RequestContext, header: RequestHeader, msg: ListKeysRequest) -> Message:
    """A page of one namespace's keys, for a peer that LIST_NS shows it to: O(log n + limit)
    on the event loop (``limit`` is bounded by the decoder), the records built in slices."""
    registry = ctx.store.registry
    try:
        ns = registry.get(msg.ns)
    except InvalidRequestError:
        raise BlockNotFoundError(f"no namespace {msg.ns} (see LIST_NS)") from None
    if not registry.may_use(ns.spec.tenant, ctx.peer):
        raise AccessDeniedError(f"uid {ctx.peer.uid} may not list namespace {msg.ns}")
    blocks, more = ctx.store.page(ns, msg.after, msg.limit)
    records = await ctx.store.lane.map(blocks, _key_record)  # a block's state when its turn came
    return ListKeysReply(records, more, ns.blocks)


def _key_record(b: Block | ColdKey) -> KeyRecord:
    if isinstance(b, ColdKey):  # idle on NVMe only
        return KeyRecord(b.key, False, True, False, b.raw_bytes, False)
    return KeyRecord(
        b.key, b.dram is not None, b.lower is not None, b.pool is not None, b.ref.raw_bytes, b.dirty
    )


async def destroy(ctx: RequestContext, header: RequestHeader, msg: Message) -> Message:
    return DestroyReply()  # the protocol's state machine is CLOSED since DESTROY arrived


#: By opcode number (an Opcode is its number: the session looks a header's up as it is).
HANDLERS: dict[int, Handler] = {
    Opcode.INIT: init,
    Opcode.OPEN_NS: open_ns,
    Opcode.LOOKUP: lookup,
    Opcode.READ: read,
    Opcode.RELEASE: release,
    Opcode.ALLOC: alloc,
    Opcode.COMMIT: commit,
    Opcode.FORGET: forget,
    Opcode.FSYNC: fsync,
    Opcode.HINT: hint,
    Opcode.STATFS: statfs,
    Opcode.DESTROY: destroy,
    Opcode.LIST_NS: list_ns,
    Opcode.EVICT: evict,
    Opcode.POOL_STATUS: pool_status,
    Opcode.READ_RESIDENT: read_resident,
    Opcode.DOCTOR: doctor,
    Opcode.CONFIG: configuration,
    Opcode.LIST_KEYS: list_keys,
    Opcode.NIXL_GRANT: nixl_grant,
    Opcode.READ_NIXL: read_nixl,
}

#: Handlers that either answer at once or raise :class:`anyio.WouldBlock` having done nothing.
NOWAIT_HANDLERS: dict[int, Handler] = {Opcode.READ: read_nowait, Opcode.LOOKUP: lookup_nowait}

#: What the session's readiness callback answers itself, as plain functions that return the
#: reply or raise (:class:`anyio.WouldBlock`: it would have to wait, nothing done).
NOW_HANDLERS: dict[int, NowHandler] = {Opcode.LOOKUP: lookup_now}
