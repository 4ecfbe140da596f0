"""Where each block's copies are: the index, the DRAM slots, and the only code that adds or drops
a copy.

Theory of operation. All state lives on the event loop thread and changes only between
``await`` points, so no lock guards the index; what must not change across an ``await`` is
pinned instead (``Block.pins``; a pinned DRAM slot is never evicted). Policies choose victims
(:class:`~kvtierd.policy.CachePolicy`, one per tenant region for DRAM); this class drops them.

Below DRAM lies an ordered stack of tiers: the local one (NVMe, ``lower``) and the shared pool
(``shared``), each behind the :class:`~kvtierd.store.tier.LowerTier` port. A block is promoted
from the nearest tier that holds it, and a copy that fails its checksum there is dropped: the
request sees a miss, never its bytes. A block with no copy left leaves the index.

The components above this one (:class:`~kvtierd.store.store.BlockStore` for reads,
:class:`~kvtierd.store.writes.Writes` for ALLOC/COMMIT, :class:`~kvtierd.store.writeback.
LowerWriter` for write-back) act through it; a replica link (:mod:`kvtierd.store.ports`) reaches
it only through the :class:`~kvtierd.store.ports.StoreForReplica` methods at the end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from functools import partial

import anyio

from kvtierd.config import LimitsConfig
from kvtierd.errors import BlockNotFoundError, NoSpaceError
from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.store.adoption import adopt_recovered
from kvtierd.store.arena import Arena
from kvtierd.store.codec import checksum_off_loop
from kvtierd.store.counts import StoreCounts, zeroed
from kvtierd.store.index import Block, BlockIndex
from kvtierd.store.namespaces import Namespace, NamespaceRegistry, NamespaceSpec
from kvtierd.store.planner import reserve
from kvtierd.store.ports import ReplicaLink
from kvtierd.store.promotion import Promotions
from kvtierd.store.regions import Regions, TenantRegion
from kvtierd.store.slicing import Lane
from kvtierd.store.slots import Slot
from kvtierd.store.sparse import SparseRetrieval
from kvtierd.store.staging import StagedCopies
from kvtierd.store.tier import BlockRef, LowerTier
from kvtierd.store.tracking import TierPolicy
from kvtierd.store.writeback import WriteBack

__all__ = ["Residency"]

log = logging.getLogger("kvtierd.store")
#: How many victims one eviction takes at most (a tier's scan is paid once per batch).
EVICT_BATCH = 16


class Residency:
    """Constructed by :func:`kvtierd.store.open_store`; shared by the store's components."""

    def __init__(
        self,
        arena: Arena,
        regions: Regions,
        registry: NamespaceRegistry,
        dram_policy: Callable[[], CachePolicy],
        lower: LowerTier | None,
        lower_policy: CachePolicy,
        *,
        writeback: WriteBack,
        staged: StagedCopies | None = None,
        shared: LowerTier | None = None,
        limits: LimitsConfig | None = None,
        read_batch: tuple[int, int] = (4 << 20, 16),
        alloc_wait_s: float = 10.0,
    ) -> None:
        if lower is not None and staged is None:
            raise ValueError("a lower tier needs private staging memory for write-back")
        self.arena = arena
        self.regions = regions
        self.registry = registry
        self.limits = limits or LimitsConfig()
        self.sparse = SparseRetrieval(max_summary_bytes=self.limits.sparse_summary_bytes)
        self.index = BlockIndex(on_remove=self.sparse.forget)
        #: One DRAM policy per region: choosing a victim in one tenant's region never walks
        #: another tenant's blocks.
        self.dram_policies = {r.id: TierPolicy(dram_policy(), self.index) for r in regions}
        self.lower = lower
        self.lower_policy = TierPolicy(lower_policy, self.index)
        self.shared = shared
        #: The shared tier's link, once open (:func:`kvtierd.store.open_store`).
        self.link: ReplicaLink | None = None
        #: The tiers below DRAM, nearest first: a block is promoted from the first that holds it.
        self.stack = [tier for tier in (lower, shared) if tier is not None]
        self.staged = staged
        self.writeback = writeback
        self.alloc_wait_s = alloc_wait_s
        #: (bytes, blocks): the bounds of one batch of a READ's promotions from the local tier.
        self.read_batch = read_batch
        #: The newest commit sequence number seen (``BlockRef.seq``).
        self.seq = 0
        #: READs promoting blocks now (reuse prefetch waits while any runs).
        self.demand_promotions = 0
        #: The host's counters (:class:`~kvtierd.store.counts.StoreCounts` names them).
        self.counters = zeroed(StoreCounts)
        #: Large requests' work on the loop takes turns in slices (:mod:`.slicing`).
        self.lane = Lane()
        #: Copies into DRAM from the tiers below (:mod:`.promotion`).
        self.promotions = Promotions(self)
        #: One eviction of the local lower tier at a time, and how many of each slot class have
        #: dropped blocks: a writer whose class had room made since it tried its write tries
        #: again before evicting more (16 writers finding the tier full at once evicted 16
        #: batches where one made room).
        self._lower_eviction = anyio.Lock()
        self._lower_evictions_made: dict[int, int] = {}

    def statistics(self) -> StoreCounts:
        """The host's counts so far."""
        return StoreCounts.of(self.counters)

    def dram_policy_of(self, ns: Namespace) -> TierPolicy:
        """The DRAM policy of ``ns``'s region."""
        return self.dram_policies[self.region(ns).id]

    def count(self, ns: Namespace, name: str, n: int = 1) -> None:
        """Count ``n`` of ``name`` in total and for ``ns``'s tenant."""
        self.counters[name] += n
        if ns.region is not None:
            ns.region.counters[name] += n  # a name outside regions.COUNTERS is a bug: KeyError

    def region(self, ns: Namespace) -> TenantRegion:
        if ns.region is None:
            raise NoSpaceError(f"tenant {ns.spec.tenant!r} has no DRAM region")
        return ns.region

    def saw_seq(self, seq: int) -> None:
        self.seq = max(self.seq, seq)

    async def summarise_missing(self, blocks: Sequence[Block]) -> None:
        """Summarise the DRAM copies of those of ``blocks`` in sparse namespaces that have no
        summary (the caller keeps them pinned): summaries live in memory, made at COMMIT, so
        after a restart a block is ranked again once it was read back or kept."""
        by_ns: dict[int, list[Block]] = {}
        for block in blocks:
            if (
                block.ns.spec.sparse
                and block.dram is not None
                and not self.sparse.summarised(block.id)
            ):
                by_ns.setdefault(id(block.ns), []).append(block)
        for group in by_ns.values():
            ns = group[0].ns
            by_key = {block.key: block for block in group}
            await self.sparse.summarise(
                ns,
                [
                    (block.key, self.slot_view(block.dram)[: ns.spec.block_bytes])
                    for block in group
                    if block.dram is not None
                ],
                keep=partial(_not_forgotten, by_key),  # a FORGET may come meanwhile
            )

    def slot_view(self, slot: Slot) -> memoryview:
        return self.arena.view[slot.offset : slot.offset + slot.size]

    def adopt_recovered(self) -> int:
        """Index the blocks the local lower tier found when it opened; how many
        (:func:`~kvtierd.store.adoption.adopt_recovered`)."""
        if self.lower is None:
            return 0
        return adopt_recovered(
            self.lower, self.registry, self.index, self.lower_policy, self.saw_seq
        )

    def cool(self, block: Block) -> None:
        """Let go of ``block``'s ``Block`` when it is on the local tier only and idle: no
        DRAM copy, no pins, not loading, dirty, staged or queued, no pool copy, not held by the
        replica link (queued for the pool or being written there; the link calls this when it
        lets go). Its row stands for it again (:meth:`BlockIndex.cool`); nothing holds it,
        since everything that does is one of those."""
        if (
            block.dram is None
            and block.pins == 0
            and block.loading is None
            and not block.dirty
            and block.staged is None
            and not block.queued
            and not block.forgotten
            and self.lower is not None
            and len(block.copies) == 1
            and self.lower.kind in block.copies
            and (self.link is None or not self.link.holds(block))
        ):
            self.index.cool(block)

    def unpin(self, block: Block) -> None:
        block.pins -= 1
        if block.pins == 0:
            if block.forgotten:
                self.drop_staged(block)
                if block.dram is not None:
                    self.drop_dram(block)
            elif block.dram is None:  # a failed promotion, or a READ that missed
                self.cool(block)

    def note_reads(
        self, ns: Namespace, blocks: list[Block], now: float, contexts: list[AccessContext]
    ) -> None:
        """``blocks`` of ``ns`` were read (leased): counted once, each policy told once for
        them all, the disk's with the slots of those on it (their copies are worth keeping
        too)."""
        nbytes = 0
        on_disk: list[Block] = []
        disk_contexts: list[AccessContext] = []
        locations: list[Hashable] = []
        for block, context in zip(blocks, contexts, strict=True):
            if block.prefetched:
                block.prefetched = False
                self.counters["prefetch_used"] += 1
            nbytes += block.ref.raw_bytes
            location = block.lower
            if location is not None:
                on_disk.append(block)
                disk_contexts.append(context)
                locations.append(location)
        self.count(ns, "bytes_read", nbytes)
        self.dram_policy_of(ns).accessed_many(blocks, now, contexts)
        if on_disk:
            self.lower_policy.accessed_many(on_disk, now, disk_contexts, locations)

    # -- DRAM slots --------------------------------------------------------------------------

    async def allocate_dram(self, region: TenantRegion, nbytes: int, *, wait: bool = False) -> Slot:
        """A slot in ``region`` (evicting that region's blocks only)."""
        slot = region.allocator.allocate(nbytes)
        if slot is not None:  # a free slot: no policy decision, nothing to settle first
            return slot
        await self.dram_policies[region.id].settle(self.lane)
        deadline = time.monotonic() + self.alloc_wait_s
        while True:
            slot = self.allocate_dram_nowait(region, nbytes)
            if slot is not None:
                return slot
            if not wait or not self.writeback.backlog or time.monotonic() >= deadline:
                raise NoSpaceError(
                    f"the tenant's DRAM region has no room for a {nbytes}-byte block: every "
                    "slot is leased, pending or awaiting write-back"
                )
            await self.writeback.wait_progress(deadline - time.monotonic())

    def allocate_dram_nowait(self, region: TenantRegion, nbytes: int) -> Slot | None:
        """A slot in ``region`` now, evicting what :func:`~kvtierd.store.planner.reserve`
        chose (clean, unleased blocks of that region only)."""
        slot = region.allocator.allocate(nbytes)
        if slot is not None:  # what reserve takes first: no plan needed (one per block read)
            return slot
        policy = self.dram_policies[region.id]

        def victims(n: int, eligible: Callable[[Block], bool]) -> list[Block]:
            return policy.victims(
                n, lambda b: b.ns.region is region and self.dram_evictable(b) and eligible(b)
            )

        plan = reserve(region.allocator, nbytes, victims, _dram_slot, batch=EVICT_BATCH)
        if plan.evictions:
            policy.removed_many(plan.evictions)  # one event for the batch
        for victim in plan.evictions:  # their slots are free already
            self._forget_dram(victim, policy_told=True)
            self.count(victim.ns, "dram_evictions")
        return plan.slot

    def dram_evictable(self, block: Block) -> bool:
        return block.dram is not None and block.pins == 0 and not block.dirty

    # -- dropping copies ---------------------------------------------------------------------

    def drop_dram(self, block: Block) -> None:
        assert block.dram is not None
        self.region(block.ns).allocator.free(block.dram)
        self._forget_dram(block)

    def _forget_dram(self, block: Block, *, policy_told: bool = False) -> None:
        """``block`` no longer has its DRAM slot (freed already); ``policy_told``: its DRAM
        policy knows (a batch of evictions is told at once)."""
        block.dram = None
        block.ns.dram_blocks -= 1
        if not policy_told:
            self.dram_policy_of(block.ns).removed(block)
        if block.prefetched:
            block.prefetched = False
            self.counters["prefetch_wasted_bytes"] += block.ref.raw_bytes
        if not block.has_copy:
            self.index.remove(block)
        else:
            self.cool(block)

    async def drop_lower(self, block: Block) -> None:
        assert self.lower is not None
        location = block.copies.pop(self.lower.kind)
        block.ns.nvme_blocks -= 1
        self.lower_policy.removed(block)
        if not block.has_copy:
            self.index.remove(block)
        await self.lower.discard(block.ref, location)

    async def discard_shared(self, block: Block) -> None:
        """Drop ``block``'s pool copy, here and in the pool (a failure there is logged: the
        value stays until the pool evicts it, never restored, since nothing indexes it)."""
        assert self.shared is not None
        assert block.pool is not None
        location = block.pool
        self.drop_copy(block)
        await self.shared.discard_quietly(block.ref, location)

    def drop_staged(self, block: Block) -> None:
        if block.staged is not None and self.staged is not None:
            self.staged.free(block.staged)
            block.staged = None

    def lower_evictions_made(self, slot_class: int) -> int:
        """How many evictions have dropped blocks of ``slot_class`` so far: read before a write,
        handed to :meth:`evict_lower` when the write found no room."""
        return self._lower_evictions_made.get(slot_class, 0)

    async def evict_lower(self, slot_class: int, seen: int | None = None) -> bool:
        """Drop a batch of the local lower tier's blocks of ``slot_class``; whether the caller
        should try its write again (victims were chosen, or room of that class was made since
        the caller read :meth:`lower_evictions_made` as ``seen``, before its write failed)."""
        assert self.lower is not None
        async with self._lower_eviction:
            if seen is not None and self.lower_evictions_made(slot_class) != seen:
                return True
            chosen, dropped = await self._evict_lower_batch(slot_class)
            if dropped:
                self._lower_evictions_made[slot_class] = self.lower_evictions_made(slot_class) + 1
            return chosen

    async def _evict_lower_batch(self, slot_class: int) -> tuple[bool, bool]:
        """(whether the policy chose victims, whether any was dropped)."""
        assert self.lower is not None
        lower = self.lower

        def same_class(candidate: Block) -> bool:
            return (
                candidate.lower is not None
                and candidate.loading is None
                and lower.stored_class(candidate.ref, candidate.lower) == slot_class
            )

        await self.lower_policy.settle(self.lane)
        victims = self.lower_policy.victims(EVICT_BATCH, same_class, slot_class=slot_class)
        dropped = False
        for victim in victims:
            # dropped, forgotten or being promoted since it was chosen (an unpinned victim
            # may have been cooled while an earlier one's discard was written)
            if not same_class(victim) or not self.index.holds(victim):
                self.cool(victim)
                continue
            await self.drop_lower(victim)
            self.counters["lower_evictions"] += 1
            dropped = True
        return bool(victims), dropped

    # -- what a replica link may ask (kvtierd.store.ports.StoreForReplica) -------------------

    def _shared(self) -> LowerTier:
        if self.shared is None:
            raise ValueError("no shared tier is configured")
        return self.shared

    def block_by_id(self, ns_digest: bytes, key: bytes) -> Block | None:
        ns = self.registry.by_digest(ns_digest)
        return None if ns is None else self.index.get(ns, key)

    def namespace_of(self, block: Block) -> NamespaceSpec:
        return block.ns.spec

    def has_local_copy(self, block: Block) -> bool:
        return block.dram is not None or block.lower is not None

    def replicated(self) -> Iterator[Block]:
        """The indexed blocks that have a copy in the shared tier."""
        return (b for b in self.index.blocks() if b.pool is not None)

    def adopt_copy(self, ref: BlockRef, location: Hashable) -> bool:
        """Note that the shared tier holds ``ref``; ``True`` when the block was not indexed
        before."""
        ns = self.registry.by_digest(ref.ns_digest)
        if ns is None:
            return False
        block = self.index.get(ns, ref.key)
        if block is not None:
            if block.ref.checksum == ref.checksum:
                self.record_copy(block, location)
            return False
        self.index.add(Block(ns, ref, copies={self._shared().kind: location}))
        self.saw_seq(ref.seq)
        return True

    def record_copy(self, block: Block, location: Hashable) -> None:
        """The shared tier now holds ``block`` at ``location``."""
        block.copies[self._shared().kind] = location

    def drop_copy(self, block: Block) -> None:
        """The shared tier no longer holds ``block``: forget the location (and the block, if it
        was its last copy)."""
        block.copies.pop(self._shared().kind, None)
        if not block.has_copy:
            self.index.remove(block)

    async def pin_resident(self, block: Block) -> None:
        """Pin ``block`` in DRAM, promoting it if needed; the caller unpins it. Raises
        :class:`BlockNotFoundError` when it has no copy left (forgotten, or the promotion found
        none), and what else stops the promotion (no free slot now, a disk error)."""
        if block.forgotten:
            raise BlockNotFoundError("block was forgotten")
        block.pins += 1
        try:
            await self.promotions.make_resident(block)
        except BaseException:
            self.unpin(block)
            raise

    def view(self, block: Block) -> memoryview:
        assert block.dram is not None
        return self.slot_view(block.dram)

    async def committed_bytes(self, block: Block) -> bytes | memoryview | None:
        """``block``'s committed bytes from memory no client can change: its private copy, or
        a copy of its (pinned) slot that still hashes to its checksum; ``None`` when the slot
        changed after COMMIT."""
        if block.staged is not None and self.staged is not None:
            return self.staged.view(block.staged, block.ref.raw_bytes)[: block.ref.raw_bytes]
        data = bytes(self.view(block)[: block.ref.raw_bytes])
        return data if await checksum_off_loop(data) == block.ref.checksum else None


def _dram_slot(block: Block) -> Slot:
    assert block.dram is not None  # an eviction candidate holds its slot
    return block.dram


def _not_forgotten(blocks: dict[bytes, Block], key: bytes) -> bool:
    return not blocks[key].forgotten
