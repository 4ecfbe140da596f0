"""The block index and the per-connection records that pin parts of it.

A :class:`Block` is one committed key of one namespace, with its copies: an arena slot (DRAM),
a lower-tier location (NVMe), a pool location, or several; it leaves the index with its last
copy. Blocks are compared by identity and serve directly as the policies' keys. ``pins`` counts
leases and in-flight I/O on the DRAM copy: a pinned slot is never evicted or reused. ``dirty``
marks a committed block whose lower-tier copy is not written yet; it cannot leave DRAM until it
is.

Two levels (docs/architecture.md, "The index at scale"): a :class:`Block` exists only for a
block something is doing something with (in DRAM, pinned or leased, loading, dirty or staged,
queued, with a pool copy); every other block, idle and on NVMe only, is a row of the NVMe
tier's records (:class:`~kvtierd.store.coldrefs.ColdRows`). :class:`BlockIndex` looks in its
dict of live blocks first, then in the rows: :meth:`BlockIndex.get` and
:meth:`BlockIndex.by_id` *materialise* a ``Block`` from a row (and it is live, "hot", until the
store :meth:`cools <BlockIndex.cool>` it again when idle), :meth:`BlockIndex.leading` and
:meth:`BlockIndex.contains` only look, :meth:`BlockIndex.peek` makes a ``Block`` nobody may
keep. The live dict is the hot set: a key with a live ``Block`` is never looked up in the rows,
so it is never two things. Only an idle block is cooled, so nothing holds its ``Block`` then:
holders compare blocks by identity and check ``forgotten``, and one that holds an unpinned
block across an ``await`` checks :meth:`BlockIndex.holds` too.

An :class:`Owner` is one client connection: its leases and its uncommitted writes die with it.

Listing (LIST_KEYS) pages through a namespace in key byte order: the index keeps each
namespace's keys in a :class:`~kvtierd.store.keyorder.KeyOrder` (33 bytes a key in numpy
chunks, O(log n) per add and remove), so a page costs O(log n + page) however large the
namespace, and the cursor is simply the last key seen. A restart adopts the keys in bulk
(:meth:`BlockIndex.adopt_keys`); a key stays listed while its block is a row, and a page
reports such a key as a :class:`ColdKey` read from its row, no ``Block`` made.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol, cast

import anyio
import numpy as np
import numpy.typing as npt

from kvtierd.policy import ServedBy
from kvtierd.store.keyorder import KeyOrder
from kvtierd.store.namespaces import Namespace
from kvtierd.store.regions import TenantRegion
from kvtierd.store.slots import Slot
from kvtierd.store.tier import BlockRef, Recovered

__all__ = ["Block", "BlockIndex", "ColdKey", "ColdSource", "Lease", "Owner", "PendingWrite"]

#: From this many keys LOOKUP's probe of the live dict (:meth:`BlockIndex.leading`) is one
#: ``map()`` over them; below, its set-up (a bound method, the map, ``all()``) costs more than
#: the loop it saves (in-process, resident keys: 1 key 0.49 us mapped against 0.22 looped,
#: 16 keys about even, 64 keys 3.3 against 3.7-4.2).
_MAPPED_FROM = 16


@dataclass(eq=False, slots=True)
class Block:
    ns: Namespace
    ref: BlockRef
    dram: Slot | None = None
    #: Its copy in each tier below DRAM that holds one (``ServedBy.NVME``, ``ServedBy.POOL``):
    #: the location that tier gave back.
    copies: dict[ServedBy, Hashable] = field(default_factory=dict)
    dirty: bool = False
    pins: int = 0
    loading: anyio.Event | None = None
    forgotten: bool = False
    prefetched: bool = False
    #: A promotion task is queued for it (at most one, however many LOOKUPs name it).
    queued: bool = False
    #: Its private copy, made at COMMIT, that write-back writes (``None``: copied there).
    staged: Slot | None = None
    id: tuple[bytes, bytes] = field(init=False)
    """``(namespace digest, key)``: what policies know the block by."""

    def __post_init__(self) -> None:
        self.id = (self.ns.digest, self.ref.key)

    @property
    def key(self) -> bytes:
        return self.ref.key

    @property
    def resident(self) -> bool:
        return self.dram is not None

    @property
    def lower(self) -> Hashable | None:
        """Its copy in the local lower tier (NVMe)."""
        return self.copies.get(ServedBy.NVME)

    @property
    def pool(self) -> Hashable | None:
        """Its copy in the shared pool."""
        return self.copies.get(ServedBy.POOL)

    @property
    def has_copy(self) -> bool:
        return self.dram is not None or bool(self.copies)

    @property
    def nearest(self) -> ServedBy:
        """The nearest tier holding a copy, where a read of it is served from (a block is
        indexed only while some tier holds it, so never ``MISS``)."""
        if self.dram is not None:
            return ServedBy.DRAM
        return min(self.copies, default=ServedBy.POOL)


@dataclass(frozen=True, slots=True)
class ColdKey:
    """A listed key idle on the cold tier only (no live ``Block``): what LIST_KEYS reports of
    it, read from its row, with no ``Block`` made (:meth:`BlockIndex.page`)."""

    key: bytes
    raw_bytes: int


@dataclass(eq=False, slots=True, weakref_slot=True)
class Lease:
    id: int
    blocks: list[Block]
    #: The deepest tier a block of it was served from (DRAM when all were resident): what the
    #: request-duration histogram labels a READ by.
    source: ServedBy = ServedBy.DRAM


@dataclass(eq=False, slots=True)
class PendingWrite:
    """An ALLOC not yet committed: ``slots[i]`` is ``None`` where the key was already stored."""

    id: int
    ns: Namespace
    keys: list[bytes]
    slots: list[Slot | None]


_ids = itertools.count(1)


@dataclass(eq=False)
class Owner:
    """A client connection's holdings."""

    name: str = ""
    leases: dict[int, Lease] = field(default_factory=dict)
    writes: dict[int, PendingWrite] = field(default_factory=dict)
    #: Bytes held in leases and pending writes, by DRAM region id (its quota).
    pinned: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def next_id() -> int:
        return next(_ids)

    def hold(self, region: TenantRegion | None, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer, when negative) held in ``region``."""
        if region is not None:
            self.pinned[region.id] = self.pinned.get(region.id, 0) + nbytes


class ColdSource(Protocol):
    """Where a block with no live ``Block`` is found (:class:`~kvtierd.store.coldrefs.
    ColdRows`)."""

    def contains(self, digest: bytes, key: bytes) -> bool: ...

    def contains_many(self, digest: bytes, keys: list[bytes]) -> list[bool]: ...

    def find(self, digest: bytes, key: bytes) -> Recovered | None: ...

    def raw_sizes(self, digest: bytes, keys: list[bytes]) -> list[int]: ...

    def stands_for(self, digest: bytes, key: bytes, seq: int, location: Hashable) -> bool: ...


class BlockIndex:
    """``(namespace digest, key) -> Block``, with per-namespace counts: the live blocks, then
    the rows of the cold source (:meth:`attach_cold`).

    The live blocks are one dict per namespace keyed by the key alone (the key is the block's
    own bytes object): a LOOKUP probes it once per key with no ``(digest, key)`` tuple built
    and hashed, which cost about as much again as the probe itself."""

    def __init__(self, on_remove: Callable[[Block], object] = lambda block: None) -> None:
        """``on_remove`` is told of every block that leaves the index (its last copy went)."""
        #: namespace digest -> key -> live block.
        self._by_ns: dict[bytes, dict[bytes, Block]] = {}
        #: Blocks indexed, live or cold.
        self._count = 0
        #: Each namespace's keys (by digest), sorted, for :meth:`page`.
        self._sorted: dict[bytes, KeyOrder] = {}
        self._on_remove = on_remove
        self._cold: ColdSource | None = None
        self._cold_kind: Hashable = None
        self._namespace_of: Callable[[bytes], Namespace | None] = lambda digest: None
        #: Digests of namespaces whose rows were not adopted (no catalog entry at start-up):
        #: never looked up in the rows, and their blocks never cooled.
        self._unadopted: frozenset[bytes] = frozenset()
        #: Blocks let go so far (:meth:`cool`): only that makes a key cold that was not, so a
        #: caller that probed the rows before an ``await`` needs to probe again only when it
        #: changed.
        self.cooled = 0

    def __len__(self) -> int:
        return self._count

    def attach_cold(
        self,
        cold: ColdSource,
        kind: Hashable,
        namespace_of: Callable[[bytes], Namespace | None],
        *,
        adopted: int = 0,
        unadopted: frozenset[bytes] = frozenset(),
    ) -> None:
        """Look up blocks without a live ``Block`` in ``cold`` from now on, as copies of tier
        ``kind``; ``adopted`` of its blocks (counted in their namespaces by the caller) are
        indexed now; those of the namespace digests ``unadopted`` are never looked up."""
        self._cold = cold
        self._cold_kind = kind
        self._namespace_of = namespace_of
        self._count += adopted
        self._unadopted = unadopted

    def _cold_block(self, ns: Namespace, key: bytes) -> Block | None:
        """A ``Block`` of ``key``'s row, or ``None``; not made live."""
        if self._cold is None or ns.digest in self._unadopted:
            return None
        found = self._cold.find(ns.digest, key)
        if found is None:
            return None
        return Block(ns, found.ref, copies={cast(ServedBy, self._cold_kind): found.location})

    def get(self, ns: Namespace, key: bytes) -> Block | None:
        """``key``'s block, materialised from its row (and live from now on) when it had no
        live ``Block``: for a caller that acts on it (pins, queues, reads, drops it)."""
        blocks = self._by_ns.get(ns.digest)
        block = blocks.get(key) if blocks is not None else None
        if block is None and self._cold is not None:
            block = self._cold_block(ns, key)
            if block is not None:
                self._by_ns.setdefault(ns.digest, {})[key] = block
        return block

    def live(self, ns: Namespace, key: bytes) -> Block | None:
        """``key``'s live ``Block``, or ``None`` (absent, or idle on NVMe only)."""
        blocks = self._by_ns.get(ns.digest)
        return blocks.get(key) if blocks is not None else None

    def peek(self, ns: Namespace, key: bytes) -> Block | None:
        """:meth:`get` for a caller that only looks: a cold block's ``Block`` is made and not
        kept (nothing may pin, queue or hold it)."""
        return self.live(ns, key) or self._cold_block(ns, key)

    def contains(self, ns: Namespace, key: bytes) -> bool:
        """Whether ``key`` is stored in ``ns`` (nothing made)."""
        blocks = self._by_ns.get(ns.digest)
        if blocks is not None and key in blocks:
            return True
        cold = self._cold
        return (
            cold is not None and ns.digest not in self._unadopted and cold.contains(ns.digest, key)
        )

    def contains_many(self, ns: Namespace, keys: list[bytes]) -> list[bool]:
        """:meth:`contains` of each of ``keys``, the keys not live looked up in the rows
        together (an ALLOC or COMMIT of thousands of new keys)."""
        blocks = self._by_ns.get(ns.digest)
        stored = [key in blocks for key in keys] if blocks is not None else [False] * len(keys)
        cold = self._cold
        if cold is None or ns.digest in self._unadopted:
            return stored
        rest = [i for i, live in enumerate(stored) if not live]
        if rest:
            found = cold.contains_many(ns.digest, [keys[i] for i in rest])
            for i, present in zip(rest, found, strict=True):
                stored[i] = present
        return stored

    def by_id(self, block_id: Hashable) -> Block | None:
        """The block a policy knows by ``block_id`` (see ``Block.id``), if it is stored, as
        :meth:`get` gives it."""
        return self._by_id(block_id, self.get)

    def peek_id(self, block_id: Hashable) -> Block | None:
        """:meth:`by_id` for a caller that only looks (as :meth:`peek`)."""
        return self._by_id(block_id, self._cold_block)

    def _by_id(
        self, block_id: Hashable, cold: Callable[[Namespace, bytes], Block | None]
    ) -> Block | None:
        """The live block of ``block_id``, else what ``cold`` gives for its namespace and key."""
        digest, key = cast(tuple[bytes, bytes], block_id)
        blocks = self._by_ns.get(digest)
        block = blocks.get(key) if blocks is not None else None
        if block is not None or self._cold is None:
            return block
        ns = self._namespace_of(digest)
        return None if ns is None else cold(ns, key)

    def holds(self, block: Block) -> bool:
        """Whether ``block`` is its key's live ``Block`` (not forgotten, not cooled)."""
        blocks = self._by_ns.get(block.ns.digest)
        return blocks is not None and blocks.get(block.ref.key) is block

    def cool(self, block: Block) -> bool:
        """Let go of ``block``, idle and on the cold tier only (the caller checked): its row
        stands for it again, counts unchanged. Whether it went (not for a block of an
        unadopted namespace, or one not live)."""
        digest, key = block.id
        blocks = self._by_ns.get(digest)
        if blocks is None or blocks.get(key) is not block or digest in self._unadopted:
            return False
        location = block.copies.get(cast(ServedBy, self._cold_kind))
        if self._cold is None or not self._cold.stands_for(digest, key, block.ref.seq, location):
            return False  # its row is not (or no longer) what stands for it
        del blocks[key]
        if not blocks:
            del self._by_ns[digest]
        self.cooled += 1
        return True

    def add(self, block: Block) -> None:
        """Index a new block: its key enters the listing order. Only for a key not stored (the
        callers check): a ``Block`` made from a row is live without this (its key is listed
        since the restart adopted it), and one let go (:meth:`cool`) stays listed."""
        digest, key = block.id
        blocks = self._by_ns.get(digest)
        if blocks is None:
            blocks = self._by_ns[digest] = {}
        if key not in blocks:
            order = self._sorted.get(digest)
            if order is None:
                order = self._sorted[digest] = KeyOrder()
            order.add(key)
            self._count += 1
        blocks[key] = block
        block.ns.blocks += 1

    def remove(self, block: Block) -> None:
        """``block``'s last copy went (a FORGET, a discard, an eviction): it leaves the index
        and the listing order."""
        digest, key = block.id
        blocks = self._by_ns.get(digest)
        if blocks is not None and blocks.get(key) is block:
            del blocks[key]
            self._count -= 1
            if not blocks:
                del self._by_ns[digest]
            keys = self._sorted[digest]
            keys.remove(key)
            if not keys:
                del self._sorted[digest]
            block.ns.blocks -= 1
            block.forgotten = True
            self._on_remove(block)

    def leading(self, ns: Namespace, keys: list[bytes]) -> tuple[list[Block | None], bool]:
        """The longest prefix of ``keys`` present in some tier, nothing made: each key's live
        ``Block``, or ``None`` for one idle on the cold tier only; and whether any is such a
        ``None`` (when none is, a caller need not look). Keys all live cost what a dict probe
        each costs; the rows are looked in only from the first key not live, together."""
        found: list[Block | None] = []
        blocks = self._by_ns.get(ns.digest)
        if blocks is not None and len(keys) >= _MAPPED_FROM:
            # Every key probed by one map() (no bytecode per key), then cut at the first miss:
            # a chain is mostly all hits, and a miss costs only the probes past it. all() reads
            # a Block as true (it has no __bool__ or __len__), a miss (None) as false.
            found = [*map(blocks.get, keys)]
            if all(found):
                return found, False
            del found[found.index(None) :]
        elif blocks is not None:  # a short chain: map()'s set-up costs more than the loop
            for key in keys:
                block = blocks.get(key)
                if block is None:
                    break
                found.append(block)
            else:
                return found, False
        cold = self._cold
        digest = ns.digest
        if cold is None or digest in self._unadopted:
            return found, False
        live = len(found)
        rest = keys[live:]
        for key, stored in zip(rest, cold.contains_many(digest, rest), strict=True):
            block = blocks.get(key) if blocks is not None else None
            if block is None and not stored:
                break
            found.append(block)
        return found, len(found) > live

    def each(self, ns: Namespace, keys: list[bytes]) -> list[Block | bool]:
        """Every key's presence, nothing made: its live ``Block``, ``True`` for one idle on the
        cold tier only, ``False`` for one not stored (:meth:`leading` past the first miss)."""
        blocks = self._by_ns.get(ns.digest) or {}
        found: list[Block | bool] = [blocks.get(key) or False for key in keys]
        cold = self._cold
        if cold is None or ns.digest in self._unadopted:
            return found
        missing = [i for i, block in enumerate(found) if block is False]
        if missing:
            stored = cold.contains_many(ns.digest, [keys[i] for i in missing])
            for i, is_stored in zip(missing, stored, strict=True):
                found[i] = is_stored
        return found

    def blocks(self) -> list[Block]:
        """The live blocks: every block something is doing something with (in DRAM, with a
        pool copy, pinned, loading, dirty, queued); never one idle on the cold tier only."""
        return [block for blocks in self._by_ns.values() for block in blocks.values()]

    def page(self, ns: Namespace, after: bytes, limit: int) -> tuple[list[Block | ColdKey], bool]:
        """Up to ``limit`` blocks of ``ns`` whose keys sort after ``after`` (byte order; ``b""``:
        from the first), and whether more follow; O(log n + limit). A block with a live
        ``Block`` is given as it, one idle on the cold tier only as a :class:`ColdKey`.

        What a pager that passes each page's last key as the next ``after`` gets while keys
        change: every key stored from its first page to its last is listed exactly once, none
        twice, in order; a key stored or forgotten meanwhile is listed or not by where it sorts
        (after the cursor or before)."""
        order = self._sorted.get(ns.digest)
        if order is None:
            return [], False
        keys, more = order.page(after, limit)
        blocks = self._by_ns.get(ns.digest, {})
        stored: list[Block | ColdKey | None] = [blocks.get(key) for key in keys]
        cold = [key for key, block in zip(keys, stored, strict=True) if block is None]
        if cold and self._cold is not None and ns.digest not in self._unadopted:
            # Keys idle on NVMe: their rows probed together, their sizes read from a column.
            sizes = iter(self._cold.raw_sizes(ns.digest, cold))
            for i, block in enumerate(stored):
                if block is None and (size := next(sizes)) >= 0:
                    stored[i] = ColdKey(keys[i], size)
        return [block for block in stored if block is not None], more

    def adopt_keys(
        self, ns: Namespace, words: npt.NDArray[np.uint64], klen: npt.NDArray[np.integer]
    ) -> None:
        """Put a namespace's keys into its listing order in bulk, from columns as the cold
        index holds them (:meth:`KeyOrder.from_columns`: one sort, no Python step per key):
        for a restart, in place of :meth:`add`'s one key at a time. Only the order: the
        caller accounts for the blocks. Keys it already lists stay listed once."""
        adopted = KeyOrder.from_columns(words, klen)
        order = self._sorted.get(ns.digest)
        if order is not None and len(order):
            # Not at a restart (nothing is listed then): held again with the ones listed.
            held, _ = order.page(b"", len(order))
            adopted = KeyOrder.of(held + adopted.page(b"", len(adopted))[0])
        if len(adopted):
            self._sorted[ns.digest] = adopted
