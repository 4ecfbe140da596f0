"""Client operations written once, sans-IO, for both the sync and the async client.

Each operation is a generator: it yields ``(request, namespace id)`` pairs and is sent each
reply (or thrown the :class:`~kvtierd.errors.KvtierError` the reply carried); its return value
is the operation's result. A driver (:mod:`kvtierd.client.sync` with a blocking socket,
:mod:`kvtierd.client.aio` with anyio) only moves requests and replies. So ``put``, ``get`` and
the rest have one implementation and the same semantics in both clients.

Copies between caller buffers and the arena happen inside the operations: they are plain
memory copies, not I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from operator import countOf
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvtierd.client.arena import (
    ClientArena,
    as_bytes_view,
    copy_verified,
    scatter_views,
    target_bytes,
)
from kvtierd.errors import (
    CorruptBlockError,
    InvalidRequestError,
    NotSupportedError,
    RemoteProtocolError,
)
from kvtierd.protocol.frames import MAX_KEYS_PER_REQUEST
from kvtierd.protocol.messages import (
    MAX_SELECTED_BYTES,
    AllocReply,
    AllocRequest,
    CommitReply,
    CommitRequest,
    Extent,
    ForgetReply,
    ForgetRequest,
    HintReply,
    HintRequest,
    ListKeysReply,
    ListKeysRequest,
    LookupReply,
    LookupRequest,
    Message,
    NixlGrantReply,
    NixlGrantRequest,
    ReadNixlReply,
    ReadNixlRequest,
    ReadReply,
    ReadRequest,
    ReadResidentReply,
    ReadResidentRequest,
    ReleaseRequest,
)

__all__ = [
    "MAX_QUEUE_CHAINS",
    "Call",
    "NoWait",
    "Op",
    "alloc",
    "check_keys",
    "commit",
    "forget",
    "hint",
    "list_keys",
    "lookup",
    "lookup_count",
    "nixl_grant",
    "put",
    "read",
    "read_into",
    "read_nixl",
    "release",
    "request",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NoWait:
    """A request whose reply nobody waits for (RELEASE: harmless if it fails, and not waiting
    saves a round trip on every ``get``). Requests on a connection are served in order, so it
    takes effect before any later request."""

    message: Message
    ns: int = 0


Call = tuple[Message, int] | NoWait
Op = Generator[Call, Any, T]


def check_keys(keys: Sequence[bytes], what: str = "keys") -> None:
    """Refuse, before anything is sent, what is not a sequence of keys: a single key (a
    common slip: ``put(keys[0], block)``) or an element that is not bytes."""
    if isinstance(keys, _SINGLE):
        raise InvalidRequestError(
            f"{what} must be a list of keys, not a single {type(keys).__name__}: pass [key]"
        )
    if countOf(map(type, keys), bytes) == len(keys):  # the usual case: no Python loop per key
        return
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise InvalidRequestError(
                f"{what} are bytes (from chain_keys), got {type(key).__name__} at index {i}"
            )


#: What is one key (or one string), not a list of keys: a tuple, not a ``bytes | str`` union
#: built again on every call.
_SINGLE = (bytes, bytearray, memoryview, str)


def _chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    if len(items) <= size:  # one request: its keys are copied into it once, not twice
        return [items]
    return [items[i : i + size] for i in range(0, len(items), size)]


def request(message: Message, ns: int = 0) -> Op[Message]:
    """One request and its reply, as an operation (what a retrying client can send again)."""
    reply: Message = yield message, ns
    return reply


def lookup_count(ns: int, keys: Sequence[bytes], max_keys: int, promote: bool = True) -> Op[int]:
    """How many leading ``keys`` are stored (:func:`lookup` without naming the tiers)."""
    check_keys(keys)
    hits = 0
    for chunk in _chunks(keys, max_keys) if keys else []:
        reply: LookupReply = yield LookupRequest(list(chunk), promote), ns
        hits += reply.hits
        if reply.hits < len(chunk):
            break
    return hits


#: LOOKUP's tier codes, by name.
TIER_NAMES = ("dram", "nvme", "pool")


def lookup(ns: int, keys: Sequence[bytes], max_keys: int, promote: bool = True) -> Op[list[str]]:
    """The tier of each leading stored key (the hit count is the length; for the whole TP
    group). With ``promote`` the daemon starts moving the hits up to DRAM at once."""
    check_keys(keys)
    tiers: list[str] = []
    if not keys:
        return tiers
    for chunk in _chunks(keys, max_keys):
        reply: LookupReply = yield LookupRequest(list(chunk), promote), ns
        tiers.extend(TIER_NAMES[t] if t < len(TIER_NAMES) else "other" for t in reply.tiers)
        tiers.extend("?" for _ in range(reply.hits - len(reply.tiers)))
        if reply.hits < len(chunk):
            break
    return tiers


#: The first protocol minor whose daemons answer LOOKUP for each key.
LOOKUP_EACH_MINOR = 10
#: The first protocol minor whose STATFS reports each tenant.
TENANTS_MINOR = 11
#: The first protocol minor whose daemons answer CONFIG.
CONFIG_MINOR = 12
#: LOOKUP's code, with ``each``, of a key that is not stored (``ServedBy.MISS``).
_MISS = len(TIER_NAMES)


def require_minor(daemon_minor: int, needed: int, what: str, hint: str = "upgrade kvtierd") -> None:
    """Ask nothing of a daemon older than ``what`` needs: raise
    :class:`~kvtierd.errors.NotSupportedError` (``what`` says what needs minor ``needed``:
    "NIXL reads need", and ``hint`` what to do) when ``daemon_minor`` is older."""
    if daemon_minor < needed:
        raise NotSupportedError(
            f"the daemon speaks protocol minor {daemon_minor}; {what} minor {needed} ({hint})"
        )


def lookup_each(
    ns: int, keys: Sequence[bytes], max_keys: int, daemon_minor: int, promote: bool = True
) -> Op[list[str | None]]:
    """The tier of every key, ``None`` for one not stored (for the whole TP group, on the
    daemon's host). With ``promote`` the daemon starts moving every hit up to DRAM at once.

    Raises:
        NotSupportedError: the daemon is older than the request (``daemon_minor``).
    """
    check_keys(keys)
    require_minor(daemon_minor, LOOKUP_EACH_MINOR, "a LOOKUP of each key needs")
    tiers: list[str | None] = []
    for chunk in _chunks(keys, max_keys) if keys else []:
        reply: LookupReply = yield LookupRequest(list(chunk), promote, each=True), ns
        if len(reply.tiers) != len(chunk):
            raise RemoteProtocolError(f"LOOKUP answered {len(reply.tiers)} of {len(chunk)} keys")
        tiers.extend(
            None if t == _MISS else TIER_NAMES[t] if t < _MISS else "other" for t in reply.tiers
        )
    return tiers


def present(
    ns: int, keys: Sequence[bytes], max_keys: int, daemon_minor: int, promote: bool = True
) -> Op[list[bool]]:
    """Whether each of ``keys`` is stored, in order: one LOOKUP of every key
    (:func:`lookup_each`), or, from a daemon older than minor 10, one LOOKUP per run of hits
    (the key after a run is a miss)."""
    if daemon_minor >= LOOKUP_EACH_MINOR:
        tiers = yield from lookup_each(ns, keys, max_keys, daemon_minor, promote)
        return [tier is not None for tier in tiers]
    check_keys(keys)
    found = [False] * len(keys)
    at = 0
    while at < len(keys):
        hits = yield from lookup_count(ns, keys[at:], max_keys, promote)
        found[at : at + hits] = [True] * hits
        at += hits + 1
    return found


def _grants(
    ns: int,
    keys: Sequence[bytes],
    max_keys: int,
    request: Callable[[list[bytes]], Message],
    undo: Callable[[list[int]], Op[object]],
) -> Op[tuple[list[int], list[Extent]]]:
    """Send ``request`` per chunk of keys; collect each reply's grant id (lease or write) and
    extents. If a later chunk fails, ``undo`` gives back what the earlier ones were granted."""
    check_keys(keys)
    grants: list[int] = []
    extents: list[Extent] = []
    try:
        for chunk in _chunks(keys, max_keys):
            reply: ReadReply | AllocReply = yield request(list(chunk)), ns
            grants.append(reply.lease if isinstance(reply, ReadReply) else reply.write)
            extents.extend(reply.extents)
    except BaseException:
        if grants:
            yield from undo(grants)
        raise
    return grants, extents


def read(ns: int, keys: Sequence[bytes], max_keys: int) -> Op[tuple[list[int], list[Extent]]]:
    """Lease the blocks of ``keys``: ``(lease ids, extents)``."""
    return (yield from _grants(ns, keys, max_keys, ReadRequest, release))


#: The first protocol minor whose daemons know READ_RESIDENT.
RESIDENT_ONLY_MINOR = 4


def read_resident(
    ns: int, keys: Sequence[bytes], max_keys: int, daemon_minor: int
) -> Op[tuple[list[int], list[Extent]]]:
    """Lease the leading ``keys`` that are in DRAM now (READ_RESIDENT): never waits on a lower
    tier, never fails on a miss; the extents may be fewer than the keys. A daemon older than
    the opcode (``daemon_minor``) is asked nothing: no lease."""
    check_keys(keys)
    leases: list[int] = []
    extents: list[Extent] = []
    if daemon_minor < RESIDENT_ONLY_MINOR:
        return leases, extents
    try:
        for chunk in _chunks(keys, max_keys) if keys else []:
            reply: ReadResidentReply = yield ReadResidentRequest(list(chunk)), ns
            if reply.extents:
                leases.append(reply.lease)
                extents.extend(reply.extents)
            if len(reply.extents) < len(chunk):
                break
    except BaseException:
        if leases:
            yield from release(leases)
        raise
    return leases, extents


def lease(
    ns: int, keys: Sequence[bytes], max_keys: int, *, resident_only: bool, daemon_minor: int
) -> Op[tuple[list[int], list[Extent]]]:
    """:func:`read`, or with ``resident_only`` :func:`read_resident`: what both clients'
    ``lease`` calls."""
    if resident_only:
        return (yield from read_resident(ns, keys, max_keys, daemon_minor))
    return (yield from read(ns, keys, max_keys))


#: The first protocol minor whose daemons know NIXL_GRANT and READ_NIXL.
NIXL_MINOR = 8


def nixl_grant(ns: int) -> Op[NixlGrantReply]:
    """The NIXL metadata of namespace ``ns``'s region (NIXL_GRANT)."""
    reply: NixlGrantReply = yield NixlGrantRequest(), ns
    return reply


def read_nixl(ns: int, keys: Sequence[bytes], max_keys: int) -> Op[list[ReadNixlReply]]:
    """Lease the blocks of ``keys`` with their NIXL descriptors (READ_NIXL): one reply per
    chunk of ``max_keys``. If a later chunk fails, the earlier leases are given back."""
    check_keys(keys)
    replies: list[ReadNixlReply] = []
    try:
        for chunk in _chunks(keys, max_keys):
            reply: ReadNixlReply = yield ReadNixlRequest(list(chunk)), ns
            replies.append(reply)
    except BaseException:
        if replies:
            yield from release([r.lease for r in replies])
        raise
    return replies


def release(leases: list[int]) -> Op[None]:
    yield NoWait(ReleaseRequest(leases))


def put(
    ns: int,
    keys: Sequence[bytes],
    blocks: Sequence[Any],
    block_bytes: int,
    arena: ClientArena,
    max_keys: int,
) -> Op[int]:
    """Store ``blocks`` under ``keys`` (two-phase: ALLOC, copy, COMMIT). Returns how many are
    stored, counting those that already were. Nothing becomes visible if the copy fails."""
    check_keys(keys)
    if isinstance(blocks, bytes | bytearray | memoryview) or getattr(blocks, "ndim", 0) == 1:
        raise InvalidRequestError(
            f"blocks must be a list of blocks, not a single {type(blocks).__name__}: "
            "put([key], [block]) stores one"
        )
    if len(keys) != len(blocks):
        raise InvalidRequestError(f"{len(keys)} keys but {len(blocks)} blocks")
    views = [as_bytes_view(b) for b in blocks]
    for i, view in enumerate(views):
        if len(view) != block_bytes:
            raise InvalidRequestError(
                f"block {i} has {len(view)} bytes, the namespace {block_bytes}"
            )
    stored = 0
    for start in range(0, len(keys), max_keys):
        # One chunk at a time: each is all or nothing, and the arena holds one chunk's slots.
        writes, extents = yield from alloc(ns, keys[start : start + max_keys], max_keys)
        try:
            for extent, view in zip(extents, views[start : start + max_keys], strict=True):
                if extent.length:
                    arena.write(extent.offset, view)
        except BaseException:
            yield from commit(ns, writes, abort=True)
            raise
        stored += yield from commit(ns, writes)
    return stored


def alloc(ns: int, keys: Sequence[bytes], max_keys: int) -> Op[tuple[list[int], list[Extent]]]:
    """ALLOC slots for ``keys``: ``(write ids, extents)``."""

    def abort(writes: list[int]) -> Op[int]:
        return commit(ns, writes, abort=True)

    return (yield from _grants(ns, keys, max_keys, AllocRequest, abort))


def commit(ns: int, writes: Sequence[int], *, abort: bool = False) -> Op[int]:
    """COMMIT (or abort) every write; returns the keys now stored. Interrupted, it aborts the
    writes it had not reached (a write is all or nothing, and none is left pending)."""
    stored = 0
    for i, write in enumerate(writes):
        try:
            reply: CommitReply = yield CommitRequest(write, abort=abort), ns
        except BaseException:
            for rest in writes[i + 1 :]:
                yield CommitRequest(rest, abort=True), ns
            raise
        stored += reply.committed
    return stored


def forget(ns: int, keys: Sequence[bytes], max_keys: int) -> Op[int]:
    check_keys(keys)
    forgotten = 0
    for chunk in _chunks(keys, max_keys):
        reply: ForgetReply = yield ForgetRequest(list(chunk)), ns
        forgotten += reply.forgotten
    return forgotten


#: The first protocol minor whose daemons know LIST_KEYS.
LIST_KEYS_MINOR = 7


def list_keys(ns: int, after: bytes, limit: int, daemon_minor: int) -> Op[ListKeysReply]:
    """One page of LIST_KEYS: up to ``limit`` (1..8192) keys of namespace ``ns`` (its LIST_NS
    id) sorting after ``after``; pass the last key of a page as the next ``after`` while
    ``more``. A daemon older than the opcode raises ``InvalidRequestError`` without being
    asked."""
    if daemon_minor < LIST_KEYS_MINOR:
        raise InvalidRequestError(
            f"the daemon speaks protocol minor {daemon_minor}; listing keys needs "
            f"{LIST_KEYS_MINOR} (upgrade kvtierd)"
        )
    reply: ListKeysReply = yield ListKeysRequest(ns, after, limit), 0
    return reply


#: Queued chains per HINT (``HintRequest.queue``'s bound).
MAX_QUEUE_CHAINS = 256


def hint(ns: int, queue: Sequence[Sequence[bytes]], session: bytes, max_keys: int) -> Op[int]:
    """Tell the daemon the engine's queued requests (key chains, first to start first); how
    many promotions it started. A HINT carries at most ``max_keys`` keys in all its chains
    (:data:`~kvtierd.protocol.messages.MAX_QUEUE_KEYS`, lowered like every request's keys by
    the negotiated frame limit): a longer queue goes as several HINTs, in queue order, each of
    whole chains. A single chain longer than ``max_keys`` raises ``InvalidRequestError``
    before anything is sent (hint its first ``max_keys`` keys: prefetch serves a chain from
    its head)."""
    chains = [list(chain) for chain in queue]
    for i, chain in enumerate(chains):
        check_keys(chain, "each chain's keys")
        if not chain:
            raise InvalidRequestError(f"queued chain {i} has no keys")
        if len(chain) > max_keys:
            raise InvalidRequestError(
                f"queued chain {i} has {len(chain)} keys; a HINT carries at most {max_keys} "
                f"(hint its first {max_keys}: prefetch serves a chain from its head)"
            )
    planned = 0
    for batch in _queue_batches(chains, max_keys):
        reply: HintReply = yield HintRequest(session, batch), ns
        planned += reply.planned
    return planned


def _queue_batches(chains: list[list[bytes]], max_keys: int) -> list[list[list[bytes]]]:
    """``chains`` in order, cut into runs of at most ``max_keys`` keys and
    :data:`MAX_QUEUE_CHAINS` chains each (a chain is never cut)."""
    batches: list[list[list[bytes]]] = [[]]
    keys = 0
    for chain in chains:
        if batches[-1] and (keys + len(chain) > max_keys or len(batches[-1]) >= MAX_QUEUE_CHAINS):
            batches.append([])
            keys = 0
        batches[-1].append(chain)
        keys += len(chain)
    return batches


def hint_attention(
    ns: int,
    chain: Sequence[bytes],
    queries: Any,
    query_layers: Sequence[int],
    budget_blocks: int,
    session: bytes,
) -> Op[tuple[list[bytes], list[bytes]]]:
    """Sparse attention: ``(ranked, predicted)`` keys of ``chain`` for the step's ``queries``
    (float32 ``[len(query_layers), q_heads, head_dim]``); the daemon starts promoting both."""
    reply: HintReply = yield from _sparse_hint(
        ns, chain, queries, query_layers, budget_blocks, session
    )
    return reply.ranked, reply.predicted


#: The first protocol minor whose daemons send a sparse HINT's selection per layer and head.
SELECTION_MINOR = 14


@dataclass(frozen=True)
class SparseHint:
    """A sparse HINT's answer: the keys to keep (``ranked``, best first) and to have on their
    way for the next step (``predicted``), and ``selected``, the selection per query layer and
    KV head as chain positions: int32 ``[len(query_layers), kv_heads, budget]``, forced blocks
    (sink, newest) first, then best first, -1 padding a row when the chain is shorter."""

    ranked: list[bytes]
    predicted: list[bytes]
    selected: npt.NDArray[np.int32]
    #: Promotions the daemon started for the HINT.
    planned: int = 0


def hint_selection(
    ns: int,
    chain: Sequence[bytes],
    queries: Any,
    query_layers: Sequence[int],
    budget_blocks: int,
    session: bytes,
    kv_heads: int,
    daemon_minor: int,
    promote_blocks: int = 0,
) -> Op[SparseHint]:
    """:func:`hint_attention` with the selection per layer and KV head (``kv_heads``: the
    namespace layout's), the daemon promoting at most ``promote_blocks`` of the ranked and
    predicted blocks (0: all of them; the chain's unsummarised blocks are asked for besides);
    a daemon older than :data:`SELECTION_MINOR` is asked nothing."""
    require_minor(daemon_minor, SELECTION_MINOR, "the selection per layer and KV head needs")
    budget = min(budget_blocks, len(chain))
    if 4 * len(query_layers) * kv_heads * budget > MAX_SELECTED_BYTES:
        raise InvalidRequestError(
            f"a selection of {budget} blocks for {len(query_layers)} layers and {kv_heads} KV "
            f"heads exceeds the {MAX_SELECTED_BYTES}-byte reply bound: ask for fewer query "
            "layers or a smaller budget"
        )
    reply: HintReply = yield from _sparse_hint(
        ns, chain, queries, query_layers, budget_blocks, session, promote_blocks
    )
    shape = (len(query_layers), kv_heads, budget)
    if len(reply.selected) != 4 * shape[0] * shape[1] * shape[2]:
        raise RemoteProtocolError(
            f"the daemon's selection is {len(reply.selected)} bytes, not int32 {shape}"
        )
    selected = np.frombuffer(reply.selected, "<i4")
    if selected.size and (selected.min() < -1 or selected.max() >= len(chain)):
        raise RemoteProtocolError("the daemon's selection names a position outside the chain")
    return SparseHint(
        reply.ranked, reply.predicted, selected.astype(np.int32).reshape(shape), reply.planned
    )


def _sparse_hint(
    ns: int,
    chain: Sequence[bytes],
    queries: Any,
    query_layers: Sequence[int],
    budget_blocks: int,
    session: bytes,
    promote_blocks: int = 0,
) -> Op[HintReply]:
    check_keys(chain, "chain")
    if len(chain) > MAX_KEYS_PER_REQUEST:
        raise InvalidRequestError(
            f"the chain has {len(chain)} keys; a HINT ranks at most {MAX_KEYS_PER_REQUEST}"
        )
    array = np.ascontiguousarray(queries, dtype=np.float32)
    request = HintRequest(
        session,
        [],
        list(chain),
        array.tobytes(),
        list(array.shape),
        list(query_layers),
        budget_blocks,
        promote_blocks,
    )
    reply: HintReply = yield request, ns
    return reply


def read_into(
    ns: int, keys: Sequence[bytes], buffers: Sequence[Any], arena: ClientArena, max_keys: int
) -> Op[int]:
    """Copy the blocks of ``keys`` into ``buffers`` and release them; returns bytes copied.
    A buffer is one writable buffer or a list of them that the block fills in order. Each copy
    is verified against its committed checksum as it is made (``CorruptBlockError`` naming the
    block that failed: a miss); a buffer too small is refused before anything is copied."""
    check_keys(keys)
    if len(keys) != len(buffers):
        raise InvalidRequestError(f"{len(keys)} keys but {len(buffers)} buffers")
    targets = [scatter_views(b) for b in buffers]
    leases, extents = yield from read(ns, keys, max_keys)
    try:
        sources: list[memoryview] = []
        for extent, target in zip(extents, targets, strict=True):
            room = target_bytes(target)
            if room < extent.length:
                raise InvalidRequestError(f"a buffer of {room} bytes cannot hold {extent.length}")
            sources.append(arena.view(extent.offset, extent.length))
        for key, source, target, extent in zip(keys, sources, targets, extents, strict=True):
            if not copy_verified(source, target, extent.checksum):
                raise CorruptBlockError(
                    f"block {key.hex()} failed its checksum in DRAM (changed after commit by a "
                    "client of its tenant): a miss"
                )
    finally:
        yield from release(leases)
    return sum(extent.length for extent in extents)
