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
from collections.abc import Callable, Hashable, Iterator

import anyio

from kvtierd.config import LimitsConfig
from kvtierd.errors import BlockNotFoundError, KvtierError, NoSpaceError
from kvtierd.policy import PROMOTED_REQUEST, PROMOTION, AccessContext, CachePolicy
from kvtierd.store.adoption import adopt_recovered
from kvtierd.store.arena import Arena
from kvtierd.store.codec import checksum_off_loop
from kvtierd.store.counts import StoreCounts, zeroed
from kvtierd.store.index import Block, BlockIndex
from kvtierd.store.namespaces import Namespace, NamespaceRegistry, NamespaceSpec
from kvtierd.store.planner import reserve
from kvtierd.store.regions import Regions, TenantRegion
from kvtierd.store.runs import plan_runs
from kvtierd.store.slicing import Lane
from kvtierd.store.slots import Slot
from kvtierd.store.sparse import SparseRetrieval
from kvtierd.store.staging import StagedCopies
from kvtierd.store.tier import BlockRef, LowerTier, TierUnavailableError
from kvtierd.store.tracking import TierPolicy
from kvtierd.store.writeback import WriteBack

__all__ = ["Residency"]

log = logging.getLogger("kvtierd.store")
_EVICT_BATCH = 16
#: Promotions a READ runs at once: the disk wants queue depth, but a task per block of an
#: 8192-block READ cost the loop tens of ms to start.
_READ_DEPTH = 32
#: A READ's local copies are promoted in batches of at most ``nvme.read_batch_bytes`` and
#: ``nvme.read_batch_blocks`` (:mod:`.runs`), each batch by one task with all its reads in
#: flight at once, those that follow one another in one request, and its payloads hashed in
#: one pass: at 448 KiB blocks a task, a request and a hash call per block cost more loop
#: time than the disk took to read it. So a READ holds at most :data:`_READ_DEPTH` batches'
#: bytes in flight, and the disk at most ``nvme.queue_depth`` requests.


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

    def slot_view(self, slot: Slot) -> memoryview:
        return self.arena.view[slot.offset : slot.offset + slot.size]

    def adopt_recovered(self) -> int:
        """Index the blocks the local lower tier found when it opened; how many
        (:func:`~kvtierd.store.adoption.adopt_recovered`)."""
        return adopt_recovered(self)

    def cool(self, block: Block) -> None:
        """Let go of ``block``'s ``Block`` when it is on the local tier only and idle: no
        DRAM copy, no pins, not loading, dirty, staged or queued, no pool copy (and no shared
        tier, whose link holds blocks it has yet to copy). Its row stands for it again
        (:meth:`BlockIndex.cool`); nothing holds it, since everything that does is one of
        those."""
        if (
            block.dram is None
            and block.pins == 0
            and block.loading is None
            and not block.dirty
            and block.staged is None
            and not block.queued
            and not block.forgotten
            and self.shared is None
            and self.lower is not None
            and len(block.copies) == 1
            and self.lower.kind in block.copies
        ):
            self.index.cool(block)

    # -- promotion ---------------------------------------------------------------------------

    def _source(self, block: Block) -> tuple[LowerTier, Hashable] | None:
        """The nearest tier below DRAM holding ``block``, and where."""
        for tier in self.stack:
            location = block.copies.get(tier.kind)
            if location is not None:
                return tier, location
        return None

    async def make_resident(
        self, block: Block, *, wait: bool = False, context: AccessContext = PROMOTION
    ) -> None:
        """Promote ``block`` into DRAM. ``wait``: a demand read, which may wait (up to
        ``alloc_wait_s``) for write-back to free a slot rather than fail with ENOSPC.
        ``context``: the READ it is promoted for, told to the DRAM policy (by default it is
        not an access: a prefetch, or a copy the pool needs)."""
        while block.loading is not None:
            await block.loading.wait()
        if block.forgotten:
            raise BlockNotFoundError("block was forgotten")
        if block.resident:
            self.count(block.ns, "dram_hits")
            return
        found = self._source(block)
        if found is None:
            raise BlockNotFoundError("block has no copy left")
        source, location = found
        shared = source.capabilities.shared_across_hosts
        region = self.region(block.ns)
        block.loading = anyio.Event()
        block.pins += 1
        try:
            slot = await self.allocate_dram(region, block.ref.raw_bytes, wait=wait)
            try:
                await source.load(block.ref, location, self.slot_view(slot))
            except TierUnavailableError as exc:  # the pool went away: a miss, not an error
                region.allocator.free(slot)
                raise BlockNotFoundError(
                    f"block is only in the pool, now out of reach: {exc}"
                ) from None
            except BaseException as exc:
                region.allocator.free(slot)
                # A FORGET during the read has already dropped the copy (and tombstoned it).
                if isinstance(exc, BlockNotFoundError):
                    if shared and block.pool is not None:
                        self.drop_copy(block)
                        self.counters["lost"] += 1
                    elif not shared and block.lower is not None:
                        await self.drop_lower(block)
                        self.counters["lost"] += 1
                raise
            self._install(block, slot, context, time.monotonic())
            self._count_loaded(block.ns, 1, shared)
        finally:
            block.loading.set()
            block.loading = None
            self.unpin(block)

    def _install(self, block: Block, slot: Slot, context: AccessContext, now: float) -> None:
        """``block``'s bytes, loaded from a lower tier, are in ``slot`` now (counted by
        :meth:`_count_loaded`, once per batch)."""
        block.dram = slot
        block.ns.dram_blocks += 1
        self.dram_policy_of(block.ns).inserted(block, now, context)
        self._promoted([block], [context], now)

    def _promoted(self, blocks: list[Block], contexts: list[AccessContext], now: float) -> None:
        """A promotion that is no read (a prefetch, a reuse guess) is an access of the block's
        disk copy all the same (told for the batch at once); a read tells the disk's policy
        in :meth:`note_reads`."""
        guessed = [
            (block, context)
            for block, context in zip(blocks, contexts, strict=True)
            if context.request_id == PROMOTED_REQUEST and block.lower is not None
        ]
        if guessed:
            self.lower_policy.accessed_many(
                [block for block, _ in guessed],
                now,
                [context for _, context in guessed],
                [block.lower for block, _ in guessed],
            )

    def _installed(
        self, installed: dict[Namespace, list[tuple[Block, AccessContext]]], now: float
    ) -> None:
        """:meth:`_install` of a batch's blocks, their slots set already (grouped by namespace,
        in order): each DRAM policy told once for the batch, each namespace counted once."""
        told: dict[int, tuple[TierPolicy, list[Block], list[AccessContext]]] = {}
        for ns, done in installed.items():
            ns.dram_blocks += len(done)
            self._count_loaded(ns, len(done), shared=False)
            policy = self.dram_policy_of(ns)
            _, blocks, contexts = told.setdefault(id(policy), (policy, [], []))
            for block, context in done:
                blocks.append(block)
                contexts.append(context)
        for policy, blocks, contexts in told.values():
            policy.inserted_many(blocks, now, contexts)
            self._promoted(blocks, contexts, now)

    def _count_loaded(self, ns: Namespace, n: int, shared: bool) -> None:
        self.count(ns, "pool_hits" if shared else "lower_hits", n)
        self.count(ns, "promotions", n)

    async def make_all_resident(self, blocks: list[tuple[Block, AccessContext]]) -> None:
        """Promote concurrently, at most :data:`_READ_DEPTH` batches at a time, in order (the
        disk wants queue depth), local copies in batches (:func:`~kvtierd.store.runs.
        plan_runs`, :meth:`_promote_run`); raise the first failure."""
        runs = self._plan_runs(blocks)
        if len(runs) == 1:  # no task group for one batch: a small READ, or 4 MiB of blocks
            if len(runs[0]) == 1:
                await self.make_resident(blocks[0][0], wait=True, context=blocks[0][1])
            else:
                await self._promote_run(runs[0])
            return
        errors: list[KvtierError] = []
        pending = iter(runs)  # shared by the workers: each takes the next run

        async def worker() -> None:
            for run in pending:
                try:
                    if len(run) == 1:
                        await self.make_resident(run[0][0], wait=True, context=run[0][1])
                    else:
                        await self._promote_run(run)
                except KvtierError as exc:
                    errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(min(_READ_DEPTH, len(runs))):
                tg.start_soon(worker)
        if errors:
            raise errors[0]

    def _plan_runs(
        self, blocks: list[tuple[Block, AccessContext]]
    ) -> list[list[tuple[Block, AccessContext]]]:
        lower = self.lower
        if lower is None or len(blocks) == 1:
            return [[item] for item in blocks]

        # any two local copies share a batch: the tier reads those that follow one another in
        # one request, and the others beside it, all in flight at once (each block is asked
        # once, not once per neighbour)
        local = {id(block) for block, _ in blocks if self.runnable(block)}

        def together(a: tuple[Block, AccessContext], b: tuple[Block, AccessContext]) -> bool:
            return id(a[0]) in local and id(b[0]) in local

        return plan_runs(
            blocks,
            together,
            lambda item: item[0].ref.raw_bytes,
            max_bytes=self.read_batch[0],
            max_items=self.read_batch[1],
        )

    async def promote_batch(self, blocks: list[Block]) -> None:
        """Background promotion (a prefetch) of ``blocks``, from :meth:`BlockStore.prefetch`'s
        queue: :meth:`make_resident` of each, those with local copies read together as a
        READ's batch is (:meth:`_promote_run`), and like :meth:`make_resident` for a prefetch,
        with no waiting for write-back to free room. Raises the first failure, after every
        block was dealt with."""
        if len(blocks) == 1:
            await self.make_resident(blocks[0])
            return
        await self._promote_run([(block, PROMOTION) for block in blocks], wait=False)

    def runnable(self, block: Block) -> bool:
        """``block`` may join a run read from the local tier now (nothing else is promoting
        it, it is not in DRAM yet, and the local tier is the nearest copy)."""
        return (
            block.loading is None
            and not block.resident
            and not block.forgotten
            and self.lower is not None
            and block.lower is not None
        )

    async def _promote_run(
        self, run: list[tuple[Block, AccessContext]], *, wait: bool = True
    ) -> None:
        """:meth:`make_resident` of a batch of blocks with local copies, read together
        (:meth:`~kvtierd.store.tier.LowerTier.load_run`). A batch changed since it was
        planned (a block promoted, evicted or forgotten meanwhile) is promoted block by
        block. ``wait``: as :meth:`make_resident`'s. Raises the first failure, after every
        block was dealt with."""
        lower = self.lower
        if lower is None or not all(self.runnable(block) for block, _ in run):
            await self._promote_each(run, wait=wait)
            return
        loading = anyio.Event()  # one for the batch: its blocks are ready together
        for block, _ in run:
            block.loading = loading
            block.pins += 1
        slots: list[Slot] = []
        try:
            try:
                for block, _ in run:
                    region = self.region(block.ns)
                    slots.append(await self.allocate_dram(region, block.ref.raw_bytes, wait=wait))
                outcomes = await lower.load_run(
                    [
                        (block.ref, block.copies[lower.kind], self.slot_view(slot))
                        for (block, _), slot in zip(run, slots, strict=False)
                    ]
                )
            except BaseException:
                for (block, _), slot in zip(run, slots, strict=False):
                    self.region(block.ns).allocator.free(slot)
                raise
            failed: list[tuple[Block, BlockNotFoundError]] = []
            installed: dict[Namespace, list[tuple[Block, AccessContext]]] = {}  # one, usually
            for (block, context), slot, outcome in zip(run, slots, outcomes, strict=True):
                if outcome is None:
                    block.dram = slot
                    installed.setdefault(block.ns, []).append((block, context))
                else:
                    self.region(block.ns).allocator.free(slot)
                    failed.append((block, outcome))
            self._installed(installed, time.monotonic())
            for block, _ in failed:
                if block.lower is not None:  # else a FORGET during the read dropped it
                    await self.drop_lower(block)
                    self.counters["lost"] += 1
            if failed:
                raise failed[0][1]
        finally:
            loading.set()
            for block, _ in run:
                block.loading = None
                self.unpin(block)

    async def _promote_each(
        self, run: list[tuple[Block, AccessContext]], *, wait: bool = True
    ) -> None:
        """:meth:`make_resident` of each block of ``run`` at once (a prefetch that began
        promoting one of them since the run was planned must not make the others wait in
        turn); raise the first failure."""
        errors: list[KvtierError] = []

        async def one(block: Block, context: AccessContext) -> None:
            try:
                await self.make_resident(block, wait=wait, context=context)
            except KvtierError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for block, context in run:
                tg.start_soon(one, block, context)
        if errors:
            raise errors[0]

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

        plan = reserve(region.allocator, nbytes, victims, _dram_slot, batch=_EVICT_BATCH)
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
        await self.lower.discard(location)

    async def discard_shared(self, block: Block) -> None:
        """Drop ``block``'s pool copy, here and in the pool (a failure there is logged: the
        value stays until the pool evicts it, never restored, since nothing indexes it)."""
        assert self.shared is not None
        assert block.pool is not None
        location = block.pool
        self.drop_copy(block)
        await self.shared.discard_quietly(location)

    def drop_staged(self, block: Block) -> None:
        if block.staged is not None and self.staged is not None:
            self.staged.free(block.staged)
            block.staged = None

    async def evict_lower(self, slot_class: int) -> bool:
        """Drop a batch of the local lower tier's blocks of ``slot_class``; whether any went."""
        assert self.lower is not None
        lower = self.lower

        def same_class(candidate: Block) -> bool:
            return (
                candidate.lower is not None
                and candidate.loading is None
                and lower.slot_class(candidate.ref) == slot_class
            )

        await self.lower_policy.settle(self.lane)
        victims = self.lower_policy.victims(_EVICT_BATCH, same_class)
        for victim in victims:
            # dropped, forgotten or being promoted since it was chosen (an unpinned victim
            # may have been cooled while an earlier one's discard was written)
            if not same_class(victim) or not self.index.holds(victim):
                self.cool(victim)
                continue
            await self.drop_lower(victim)
            self.counters["lower_evictions"] += 1
        return bool(victims)

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
            await self.make_resident(block)
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
