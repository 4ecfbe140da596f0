"""The block index and the per-connection records that pin parts of it.

A :class:`Block` is one committed key of one namespace, with its copies: an arena slot (DRAM),
a lower-tier location (NVMe), a pool location, or several; it leaves the index with its last
copy. Blocks are compared by identity and serve directly as the policies' keys. ``pins`` counts
leases and in-flight I/O on the DRAM copy: a pinned slot is never evicted or reused. ``dirty``
marks a committed block whose lower-tier copy is not written yet; it cannot leave DRAM until it
is.

An :class:`Owner` is one client connection: its leases and its uncommitted writes die with it.

Listing (LIST_KEYS) pages through a namespace in key byte order: the index keeps each
namespace's keys in a :class:`~kvtierd.store.keyorder.KeyOrder` (33 bytes a key in numpy
chunks, O(log n) per add and remove), so a page costs O(log n + page) however large the
namespace, and the cursor is simply the last key seen.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import cast

import anyio
import numpy as np
import numpy.typing as npt

from kvtierd.policy import ServedBy
from kvtierd.store.keyorder import KeyOrder
from kvtierd.store.namespaces import Namespace
from kvtierd.store.regions import TenantRegion
from kvtierd.store.slots import Slot
from kvtierd.store.tier import BlockRef

__all__ = ["Block", "BlockIndex", "Lease", "Owner", "PendingWrite"]


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


class BlockIndex:
    """``(namespace digest, key) -> Block``, with per-namespace counts.

    Held as one dict per namespace keyed by the key alone (the key is the block's own bytes
    object): a LOOKUP probes it once per key with no ``(digest, key)`` tuple built and hashed,
    which cost about as much again as the probe itself."""

    def __init__(self, on_remove: Callable[[Block], object] = lambda block: None) -> None:
        """``on_remove`` is told of every block that leaves the index (its last copy went)."""
        #: namespace digest -> key -> block.
        self._by_ns: dict[bytes, dict[bytes, Block]] = {}
        self._count = 0
        #: Each namespace's keys (by digest), sorted, for :meth:`page`.
        self._sorted: dict[bytes, KeyOrder] = {}
        self._on_remove = on_remove

    def __len__(self) -> int:
        return self._count

    def get(self, ns: Namespace, key: bytes) -> Block | None:
        blocks = self._by_ns.get(ns.digest)
        return blocks.get(key) if blocks is not None else None

    def by_id(self, block_id: Hashable) -> Block | None:
        """The block a policy knows by ``block_id`` (see ``Block.id``), if it is stored."""
        digest, key = cast(tuple[bytes, bytes], block_id)
        blocks = self._by_ns.get(digest)
        return blocks.get(key) if blocks is not None else None

    def add(self, block: Block) -> None:
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

    def leading_present(self, ns: Namespace, keys: list[bytes]) -> list[Block]:
        """The blocks of the longest prefix of ``keys`` present in some tier."""
        found: list[Block] = []
        blocks = self._by_ns.get(ns.digest)
        if blocks is None:
            return found
        for key in keys:
            block = blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def blocks(self) -> list[Block]:
        return [block for blocks in self._by_ns.values() for block in blocks.values()]

    def page(self, ns: Namespace, after: bytes, limit: int) -> tuple[list[Block], bool]:
        """Up to ``limit`` blocks of ``ns`` whose keys sort after ``after`` (byte order; ``b""``:
        from the first), and whether more follow; O(log n + limit).

        What a pager that passes each page's last key as the next ``after`` gets while keys
        change: every key stored from its first page to its last is listed exactly once, none
        twice, in order; a key stored or forgotten meanwhile is listed or not by where it sorts
        (after the cursor or before)."""
        order = self._sorted.get(ns.digest)
        if order is None:
            return [], False
        keys, more = order.page(after, limit)
        stored = self._by_ns[ns.digest]
        return [stored[key] for key in keys], more

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
