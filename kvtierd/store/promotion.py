"""Promotion: copying blocks from the tiers below DRAM into it, one at a time or a READ's
batch read together, and telling the policies of what came in.

Apart from :class:`~kvtierd.store.residency.Residency`, which holds the index and the slots and
drops copies, because promotion is the one part of it that awaits reads from the lower tiers
(tasks, batches of disk requests, queue depth): it reaches the rest through
:class:`PromotionHost`, the few members of the residency it needs.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Protocol

import anyio

from kvtierd.errors import BlockNotFoundError, KvtierError
from kvtierd.policy import PROMOTED_REQUEST, PROMOTION, AccessContext
from kvtierd.store.index import Block
from kvtierd.store.namespaces import Namespace
from kvtierd.store.regions import TenantRegion
from kvtierd.store.runs import plan_runs
from kvtierd.store.slots import Slot
from kvtierd.store.tier import LowerTier, TierUnavailableError
from kvtierd.store.tracking import TierPolicy

__all__ = ["PromotionHost", "Promotions"]

#: Promotions a READ runs at once: the disk wants queue depth, but a task per block of an
#: 8192-block READ cost the loop tens of ms to start.
_READ_DEPTH = 32
#: A READ's local copies are promoted in batches of at most ``nvme.read_batch_bytes`` and
#: ``nvme.read_batch_blocks`` (:mod:`.runs`), each batch by one task with all its reads in
#: flight at once, those that follow one another in one request, and its payloads hashed in
#: one pass: at 448 KiB blocks a task, a request and a hash call per block cost more loop
#: time than the disk took to read it. So a READ holds at most :data:`_READ_DEPTH` batches'
#: bytes in flight, and the disk at most ``nvme.queue_depth`` requests.


class PromotionHost(Protocol):
    """What promotion needs of the residency: its tiers, policies and counters, DRAM slots,
    and the dropping of copies found gone."""

    lower: LowerTier | None
    #: The tiers below DRAM, nearest first.
    stack: list[LowerTier]
    lower_policy: TierPolicy
    counters: dict[str, int]
    #: (bytes, blocks): the bounds of one batch of a READ's promotions from the local tier.
    read_batch: tuple[int, int]

    def count(self, ns: Namespace, name: str, n: int = 1) -> None: ...

    def region(self, ns: Namespace) -> TenantRegion: ...

    def dram_policy_of(self, ns: Namespace) -> TierPolicy: ...

    def slot_view(self, slot: Slot) -> memoryview: ...

    async def allocate_dram(
        self, region: TenantRegion, nbytes: int, *, wait: bool = False
    ) -> Slot: ...

    def drop_copy(self, block: Block) -> None: ...

    async def drop_lower(self, block: Block) -> None: ...

    def unpin(self, block: Block) -> None: ...

    async def summarise_missing(self, blocks: Sequence[Block]) -> None: ...


class Promotions:
    """The residency's promotions (``Residency.promotions``)."""

    def __init__(self, host: PromotionHost) -> None:
        self._r = host

    def _source(self, block: Block) -> tuple[LowerTier, Hashable] | None:
        """The nearest tier below DRAM holding ``block``, and where."""
        for tier in self._r.stack:
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
            self._r.count(block.ns, "dram_hits")
            return
        found = self._source(block)
        if found is None:
            raise BlockNotFoundError("block has no copy left")
        source, location = found
        shared = source.capabilities.shared_across_hosts
        region = self._r.region(block.ns)
        block.loading = anyio.Event()
        block.pins += 1
        try:
            slot = await self._r.allocate_dram(region, block.ref.raw_bytes, wait=wait)
            try:
                await source.load(block.ref, location, self._r.slot_view(slot))
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
                        self._r.drop_copy(block)
                        self._r.counters["lost"] += 1
                    elif not shared and block.lower is not None:
                        await self._r.drop_lower(block)
                        self._r.counters["lost"] += 1
                raise
            self._install(block, slot, context, time.monotonic())
            self._count_loaded(block.ns, 1, shared)
            if block.ns.spec.sparse:
                await self._r.summarise_missing([block])
        finally:
            block.loading.set()
            block.loading = None
            self._r.unpin(block)

    def _install(self, block: Block, slot: Slot, context: AccessContext, now: float) -> None:
        """``block``'s bytes, loaded from a lower tier, are in ``slot`` now (counted by
        :meth:`_count_loaded`, once per batch)."""
        block.dram = slot
        block.ns.dram_blocks += 1
        self._r.dram_policy_of(block.ns).inserted(block, now, context)
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
            self._r.lower_policy.accessed_many(
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
            policy = self._r.dram_policy_of(ns)
            _, blocks, contexts = told.setdefault(id(policy), (policy, [], []))
            for block, context in done:
                blocks.append(block)
                contexts.append(context)
        for policy, blocks, contexts in told.values():
            policy.inserted_many(blocks, now, contexts)
            self._promoted(blocks, contexts, now)

    def _count_loaded(self, ns: Namespace, n: int, shared: bool) -> None:
        self._r.count(ns, "pool_hits" if shared else "lower_hits", n)
        self._r.count(ns, "miss_bytes", n * ns.spec.block_bytes)
        self._r.count(ns, "promotions", n)

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
        lower = self._r.lower
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
            max_bytes=self._r.read_batch[0],
            max_items=self._r.read_batch[1],
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
            and self._r.lower is not None
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
        lower = self._r.lower
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
                    region = self._r.region(block.ns)
                    slots.append(
                        await self._r.allocate_dram(region, block.ref.raw_bytes, wait=wait)
                    )
                outcomes = await lower.load_run(
                    [
                        (block.ref, block.copies[lower.kind], self._r.slot_view(slot))
                        for (block, _), slot in zip(run, slots, strict=False)
                    ]
                )
            except BaseException:
                for (block, _), slot in zip(run, slots, strict=False):
                    self._r.region(block.ns).allocator.free(slot)
                raise
            failed: list[tuple[Block, BlockNotFoundError]] = []
            installed: dict[Namespace, list[tuple[Block, AccessContext]]] = {}  # one, usually
            for (block, context), slot, outcome in zip(run, slots, outcomes, strict=True):
                if outcome is None:
                    block.dram = slot
                    installed.setdefault(block.ns, []).append((block, context))
                else:
                    self._r.region(block.ns).allocator.free(slot)
                    failed.append((block, outcome))
            self._installed(installed, time.monotonic())
            sparse = [b for ns, done in installed.items() if ns.spec.sparse for b, _ in done]
            if sparse:  # no step per block for the other namespaces
                await self._r.summarise_missing(sparse)
            for block, _ in failed:
                if block.lower is not None:  # else a FORGET during the read dropped it
                    await self._r.drop_lower(block)
                    self._r.counters["lost"] += 1
            if failed:
                raise failed[0][1]
        finally:
            loading.set()
            for block, _ in run:
                block.loading = None
                self._r.unpin(block)

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
