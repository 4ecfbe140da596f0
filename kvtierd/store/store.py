"""The block store: carries out LOOKUP, READ, ALLOC/COMMIT, FORGET, FSYNC and eviction.

What it is made of (each a module of its own, opened in order by :func:`kvtierd.store.open_store`):

* :class:`~kvtierd.store.residency.Residency`: the index, the DRAM slots and the tiers below;
  the only code that adds or drops a copy of a block, and where the invariants below hold;
* :class:`~kvtierd.store.writes.Writes`: ALLOC and COMMIT;
* the write-back queue and :class:`~kvtierd.store.writer.LowerWriter`, which writes one block;
* :class:`~kvtierd.store.prefetch.Prefetcher`, which reads the store and names the blocks it
  wants promoted; this class promotes them;
* a replica link, when configured, behind the ports of :mod:`kvtierd.store.ports`.

This class answers the requests: the reads (LOOKUP, READ, READ_RESIDENT, RELEASE), and FORGET,
EVICT and FSYNC, which cross the components.

Invariants the tests check:

* a key is visible only after COMMIT, and an abandoned ALLOC is never visible;
* a leased or dirty block keeps its DRAM slot; a block with no copy left leaves the index;
* a copy that fails its checksum is dropped, and the request sees a miss, never its bytes;
* a block's DRAM slot lies in its tenant's region: allocation, eviction and quotas for one
  tenant never touch another tenant's blocks;
* what is written to a lower tier is a private copy that hashes to the checksum taken at
  COMMIT; a block its tenant changed before write-back could copy it is dropped, never written.

Background promotions (started by LOOKUP, HINT and the prefetcher) run in the task group the
store is constructed with, which :func:`kvtierd.store.open_store` owns: never detached.

The module is past 600 lines because it is the store's whole request surface (LOOKUP's three
forms with their TP-group walks, READ, the two-phase write, FORGET, promotions); everything it
acts through is a module of its own (the index, residency, writes, write-back, the tiers).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TypeVar

import anyio
from anyio.abc import TaskGroup

from kvtierd.errors import BlockNotFoundError, InvalidRequestError, KvtierError
from kvtierd.io import IoBackend
from kvtierd.policy import AccessContext, ServedBy
from kvtierd.store.counts import StoreStatistics
from kvtierd.store.diskwatch import DiskWatch
from kvtierd.store.index import Block, ColdKey, Lease, Owner, PendingWrite
from kvtierd.store.namespaces import Namespace, PeerCredentials
from kvtierd.store.ports import ReplicaLink
from kvtierd.store.prefetch import Prefetcher
from kvtierd.store.quota import check_lease_quota
from kvtierd.store.reports import TenantFigures, store_statistics, tenant_figures
from kvtierd.store.residency import Residency
from kvtierd.store.tier import TierUnavailableError
from kvtierd.store.tracking import TierPolicy
from kvtierd.store.writes import Writes

__all__ = ["BlockStore"]

log = logging.getLogger("kvtierd.store")
T = TypeVar("T")
#: Background promotions running at once.
_PROMOTERS = 8
#: Background promotions of a region, all promoters together, read at most this share of its
#: capacity at once beyond one block each: a batch holds its slots until all of it is read
#: and verified, and a READ that comes next must find room (a 16 MiB region's READ after a
#: 200-key LOOKUP got ENOSPC when 8 batches of 4 MiB could be loading).
_BACKGROUND_SHARE = 4
#: :meth:`BlockStore.lease_resident` found nothing to lease.
_NOT_RESIDENT = "the first key is not in DRAM now"


class BlockStore:
    """Construct through :func:`kvtierd.store.open_store`."""

    def __init__(
        self,
        residency: Residency,
        background: TaskGroup,
        *,
        link: ReplicaLink | None = None,
        prefetch_bytes_per_s: int = 0,
        io_backend: IoBackend | None = None,
        disk: DiskWatch | None = None,
    ) -> None:
        self.residency = r = residency
        self._tg = background
        #: A background summary of resident blocks is running (:meth:`summarise_resident`).
        self._summarising = False
        # sparse indices make their clusters in jobs this store owns
        r.sparse.spawn = lambda job: background.start_soon(job)
        #: The replica link (the shared pool), when configured.
        self.pool = link
        #: The I/O backend the tiers use (reported by STATFS).
        self.io_backend = io_backend
        #: The disk tier's health (with an NVMe tier): FSYNC syncs through it.
        self.disk = disk
        self.writes = Writes(residency, link)
        self.prefetcher = Prefetcher(residency, prefetch_bytes_per_s)
        # What the daemon and the tests read, by the names they had.
        self.arena, self.regions, self.registry = r.arena, r.regions, r.registry
        self.index, self.sparse, self.limits = r.index, r.sparse, r.limits
        self.lower, self.lower_policy, self.dram_policies = r.lower, r.lower_policy, r.dram_policies
        self.staged, self.writeback, self.counters = r.staged, r.writeback, r.counters
        #: Large requests' work on the loop takes turns in slices (:mod:`.slicing`).
        self.lane = r.lane
        # Background promotions wait here for one of _PROMOTERS tasks: few at a time share the
        # disk with demand reads, so a READ that arrives behind them waits for few (a task per
        # block instead cost a LOOKUP or HINT of 8192 blocks 250 ms of loop to start).
        self._promotions: deque[Block] = deque()
        self._promoters = 0
        #: Bytes each region's background batches are loading now (by region id).
        self._loading_bytes: dict[int, int] = {}

    def statistics(self, peer: PeerCredentials | None = None) -> StoreStatistics:
        """What the store reports: the host's (``peer`` None) or ``peer``'s tenants' only
        (:func:`~kvtierd.store.reports.store_statistics`)."""
        backend = self.io_backend.kind.value if self.io_backend else "none"
        return store_statistics(self.residency, backend, peer)

    @property
    def queued_promotions(self) -> int:
        """Blocks queued for promotion into DRAM that no promoter has taken yet."""
        return len(self._promotions)

    def tenant_statistics(self) -> tuple[TenantFigures, ...]:
        """Each DRAM region's tenant and what it holds and did
        (:func:`~kvtierd.store.reports.tenant_figures`)."""
        return tenant_figures(self.residency)

    def dram_policy_of(self, ns: Namespace) -> TierPolicy:
        """The DRAM policy of ``ns``'s region."""
        return self.residency.dram_policy_of(ns)

    # -- reads -------------------------------------------------------------------------------

    def lookup(
        self, ns: Namespace, keys: list[bytes], *, promote: bool = True
    ) -> tuple[int, bytes]:
        """Hits for ``ns``'s whole TP group, and the tier of each hit of ``ns``'s own share."""
        return _run_steps(self._lookup_steps(ns, keys, promote))

    def lookup_each(
        self, ns: Namespace, keys: list[bytes], *, promote: bool = True
    ) -> tuple[int, bytes]:
        """LOOKUP with ``each``: the leading hits, and a tier code for every key
        (``ServedBy.MISS`` for one not stored) in this host's tiers, for ``ns``'s whole TP
        group; with ``promote``, every hit not in DRAM starts moving up."""
        return _run_steps(self._lookup_each_steps(ns, keys, promote))

    def lookup_work(self, ns: Namespace, keys: list[bytes]) -> int:
        """What a LOOKUP of ``keys`` on ``ns`` may probe at most: every key on every rank of
        its TP group (the caller decides from it whether to answer at once)."""
        return len(keys) * ns.spec.world_size

    async def lookup_in_turn(
        self, ns: Namespace, keys: list[bytes], *, promote: bool = True, each: bool = False
    ) -> tuple[int, bytes]:
        """:meth:`lookup` (:meth:`lookup_each` with ``each``) in its turn on the lane, when it
        may probe more than the lane's ``inline_items`` (keys times the TP group's ranks): it
        waits for the bulk work before it, and pauses between the ranks it asks, so that a
        LOOKUP on a wide group is many short steps, not one long one; a few are answered at
        once."""
        steps = (self._lookup_each_steps if each else self._lookup_steps)(ns, keys, promote)
        work = self.lookup_work(ns, keys)
        if work <= self.lane.inline_items:  # the lane would not slice it
            return _run_steps(steps)
        async with self.lane.walk(work) as walk:
            await walk.pause()
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    answer: tuple[int, bytes] = done.value
                    return answer
                await walk.pause()

    def _lookup_steps(
        self, ns: Namespace, keys: list[bytes], promote: bool
    ) -> Generator[None, None, tuple[int, bytes]]:
        """:meth:`lookup`, yielding between the ranks of the TP group it asks (the keys still
        hit only); the answer is taken fresh after the last one."""
        self.prefetcher.on_lookup(ns, keys)
        own, cold = self._leading_usable(ns, keys)
        if ns.spec.world_size == 1:
            return self._answer(ns, keys, own, cold, promote)
        hits = len(own)
        for member in self.registry.group(ns):
            if member is None:
                return 0, b""
            if member is not ns and hits:
                yield
                hits = min(hits, len(self._leading_usable(member, keys[:hits])[0]))
        own, cold = self._leading_usable(ns, keys[:hits])  # fresh: blocks may have gone since
        return self._answer(ns, keys, own, cold, promote)

    def _lookup_each_steps(
        self, ns: Namespace, keys: list[bytes], promote: bool
    ) -> Generator[None, None, tuple[int, bytes]]:
        """:meth:`lookup_each`, yielding between the ranks of the TP group it asks (each asked
        only for the keys still found); the answer is taken fresh after the last one."""
        self.prefetcher.on_lookup(ns, keys)
        found = self._usable_each(ns, keys)
        if ns.spec.world_size > 1:
            still = [i for i, b in enumerate(found) if b is not False]
            for member in self.registry.group(ns):
                if member is None:
                    still = []
                    break
                if member is not ns and still:
                    yield
                    theirs = self._usable_each(member, [keys[i] for i in still])
                    still = [i for i, t in zip(still, theirs, strict=True) if t is not False]
            found = [False] * len(keys)
            fresh = self._usable_each(ns, [keys[i] for i in still])  # blocks may have gone since
            for i, b in zip(still, fresh, strict=True):
                found[i] = b
        codes = bytes(
            ServedBy.MISS if b is False else ServedBy.NVME if b is True else b.nearest
            for b in found
        )
        if promote:
            get = self.index.get
            hits_made = (get(ns, k) if b is True else b for k, b in zip(keys, found, strict=True))
            self.prefetch([b for b in hits_made if isinstance(b, Block) and b.dram is None])
        hits = next((i for i, b in enumerate(found) if b is False), len(found))
        return hits, codes

    def _usable_each(self, ns: Namespace, keys: list[bytes]) -> list[Block | bool]:
        """:meth:`BlockIndex.each`, less what :meth:`_leading_usable` leaves out (a pool-only
        copy while the pool is detached)."""
        found = self.index.each(ns, keys)
        if self.pool is None or self.pool.attached:
            return found
        return [
            False if isinstance(b, Block) and b.dram is None and b.lower is None else b
            for b in found
        ]

    async def lookup_group(
        self, ns: Namespace, keys: list[bytes], *, promote: bool = True
    ) -> tuple[int, bytes]:
        """:meth:`lookup` for a TP group attached to the pool: a block counts only when every
        rank's share of it is in the pool, so every rank answers the same. Falls back to the
        local answer when the pool fails."""
        assert self.pool is not None
        try:
            group_hits = await self.pool.group_hits(ns, keys)
        except TierUnavailableError as exc:
            log.debug("group lookup fell back to the local tiers: %s", exc)
            return self.lookup(ns, keys, promote=promote)
        self.prefetcher.on_lookup(ns, keys)
        own, cold = self._leading_usable(ns, keys[:group_hits])
        return self._answer(ns, keys, own, cold, promote)

    def needs_group_lookup(self, ns: Namespace) -> bool:
        return self.pool is not None and self.pool.group_lookup(ns)

    def _leading_usable(self, ns: Namespace, keys: list[bytes]) -> tuple[list[Block | None], bool]:
        """The live blocks of the leading stored ``keys``, ``None`` for one idle on NVMe
        only, and whether there is such a ``None`` (:meth:`BlockIndex.leading`: counted, not
        made)."""
        found, cold = self.index.leading(ns, keys)
        if self.pool is None or self.pool.attached:
            return found, cold
        for i, block in enumerate(found):  # a pool-only copy is out of reach while detached
            if block is not None and block.dram is None and block.lower is None:
                return found[:i], cold
        return found, cold

    def _answer(
        self, ns: Namespace, keys: list[bytes], own: list[Block | None], cold: bool, promote: bool
    ) -> tuple[int, bytes]:
        """LOOKUP's answer for the leading stored blocks ``own`` (``cold``: some are ``None``,
        idle on NVMe only), promoting those not in DRAM when ``promote``."""
        if cold:
            return self._answer_cold(ns, keys, own, promote)
        live: list[Block] = own  # type: ignore[assignment]  # (no cast call on the hot path)
        # One comprehension finds the blocks not in DRAM; when there are none (the hot case)
        # every tier code is DRAM's 0 and nothing is promoted, with no second pass.
        elsewhere = [block for block in live if block.dram is None]
        if not elsewhere:
            return len(live), bytes(len(live))
        if promote:
            self.prefetch(elsewhere)
        return len(live), bytes([block.nearest for block in live])

    def _answer_cold(
        self, ns: Namespace, keys: list[bytes], own: list[Block | None], promote: bool
    ) -> tuple[int, bytes]:
        """:meth:`_answer` when some blocks are cold: the ones it promotes are made now (and
        queued), the others stay rows."""
        codes = bytes([ServedBy.NVME if block is None else block.nearest for block in own])
        if promote:
            get = self.index.get
            made = (b if b is not None else get(ns, keys[i]) for i, b in enumerate(own))
            self.prefetch([b for b in made if b is not None and b.dram is None])
        return len(own), codes

    def prefetch(self, blocks: list[Block]) -> int:
        """Queue the non-resident ``blocks`` for promotion into DRAM, first block first; how
        many were queued."""
        started = 0
        for block in blocks:
            if block.resident or block.loading is not None or block.queued:
                continue
            block.prefetched = True
            block.queued = True
            self._promotions.append(block)
            started += 1
        self.counters["prefetch_promoted"] += started
        while self._promoters < min(_PROMOTERS, len(self._promotions)):
            self._promoters += 1
            self._tg.start_soon(self._promote_queued)
        return started

    async def hint(self, ns: Namespace, queue: Sequence[Sequence[bytes]]) -> int:
        """HINT: promote what the engine's queued requests will read, as the prefetcher plans
        it (in slices); how many promotions started."""
        return self.prefetch(await self.prefetcher.plan_queue(ns, queue))

    def prefetch_keys(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """:meth:`prefetch` the stored blocks of ``keys`` (unknown keys are skipped)."""
        return self.prefetch([b for k in keys if (b := self.index.get(ns, k)) is not None])

    def summarise_resident(self, ns: Namespace, keys: Sequence[bytes]) -> bool:
        """Start summarising, in the background, those blocks of ``keys`` that are in DRAM
        without a summary (the summaries' bound let theirs go): promotion summarises what it
        loads but skips what is resident, so without this such a block would never be ranked
        again. The blocks stay pinned while a worker thread reads them. One such job runs at a
        time: a call while one runs starts nothing (its blocks stay pending in their sessions,
        and the next HINT names them again), so a flood of HINTs holds one thread and one
        batch of pins. Returns whether a job started."""
        if self._summarising:
            return False
        sparse = self.residency.sparse
        blocks = [
            b
            for k in keys
            if (b := self.index.live(ns, k)) is not None  # a resident block is live
            and b.dram is not None
            and not b.forgotten
            and not sparse.summarised(b.id)
        ]
        if not blocks:
            return False
        for block in blocks:
            block.pins += 1  # its slot stays while a worker thread reads it
        self._summarising = True
        self._tg.start_soon(self._summarise_pinned, blocks)
        return True

    async def _summarise_pinned(self, blocks: list[Block]) -> None:
        try:
            await self.residency.summarise_missing(blocks)
        except KvtierError as exc:
            log.warning("sparse: summarising %d resident blocks failed: %s", len(blocks), exc)
        finally:
            self._summarising = False
            for block in blocks:
                self.residency.unpin(block)

    def page(self, ns: Namespace, after: bytes, limit: int) -> tuple[list[Block | ColdKey], bool]:
        """A page of ``ns``'s blocks by key, after ``after``; whether more follow."""
        return self.index.page(ns, after, limit)

    async def _promote_queued(self) -> None:
        """One of the promoters: promote queued blocks, oldest first, until none is left; the
        next queued blocks with local copies together, in a batch as a READ's are
        (:meth:`Promotions.promote_batch <kvtierd.store.promotion.Promotions.promote_batch>`),
        as far as :meth:`_next_batch` allows: a LOOKUP of blocks on disk then costs a request
        and a hash call per batch, not per block."""
        try:
            while self._promotions:
                batch, region_id, nbytes = self._next_batch()
                loading = self._loading_bytes
                loading[region_id] = loading.get(region_id, 0) + nbytes
                try:
                    await self.residency.promotions.promote_batch(batch)
                except KvtierError as exc:
                    log.debug("prefetch of a block failed: %s", exc)
                finally:
                    loading[region_id] -= nbytes
                    for block in batch:
                        block.queued = False
                        self.residency.cool(block)  # a failed promotion leaves it idle
        finally:
            self._promoters -= 1

    def _next_batch(self) -> tuple[list[Block], int, int]:
        """The next queued block and those after it that may be read with it (local copies
        to read, of the same region, within ``nvme.read_batch_bytes``/``_blocks``), while
        the batch fits the region's free room and, with the region's other background
        loads, :data:`_BACKGROUND_SHARE` of its capacity; the region's id and the batch's
        bytes. The first block goes whatever its size, as a promotion one at a time did."""
        r = self.residency
        first = self._promotions.popleft()
        batch = [first]
        region = first.ns.region
        if region is None:
            return batch, -1, 0
        nbytes = first.ref.raw_bytes
        if not r.promotions.runnable(first):
            return batch, region.id, nbytes
        allocator = region.allocator
        room = min(
            r.read_batch[0],
            allocator.free_bytes,
            allocator.capacity // _BACKGROUND_SHARE - self._loading_bytes.get(region.id, 0),
        )
        while self._promotions and len(batch) < r.read_batch[1]:
            block = self._promotions[0]
            if (
                block.ns.region is not region
                or nbytes + block.ref.raw_bytes > room
                or not r.promotions.runnable(block)
            ):
                break
            batch.append(self._promotions.popleft())
            nbytes += block.ref.raw_bytes
        return batch, region.id, nbytes

    async def read(self, owner: Owner, ns: Namespace, keys: list[bytes]) -> Lease:
        """Make every block of ``keys`` resident, lease them to ``owner``. The walk over many
        keys runs in slices; each block is pinned as it is found, so what a later slice does
        cannot take it away."""
        held = check_lease_quota(self.limits, owner, ns, len(keys))
        blocks: list[Block] = []
        try:
            async with self.lane.walk(len(keys)) as walk:
                for key in keys:
                    await walk.pause()
                    block = self.index.get(ns, key)
                    if block is None:
                        self.residency.count(ns, "misses")
                        self.residency.count(ns, "miss_bytes", ns.spec.block_bytes)
                        raise BlockNotFoundError(f"block {key.hex()} is not stored")
                    block.pins += 1
                    blocks.append(block)
            contexts = await self.prefetcher.read_contexts_in_slices(ns, keys)
            missing = [(b, c) for b, c in zip(blocks, contexts, strict=True) if not b.resident]
            self.residency.count(ns, "dram_hits", len(blocks) - len(missing))
            if len(missing) > 1:
                missing = _each_once(missing)
            # Where the slowest block comes from, decided before loading moves it to DRAM.
            source = max((b.nearest for b, _ in missing), default=ServedBy.DRAM)
            if missing:  # DRAM hits need no task: the common case stays cheap
                self.residency.demand_promotions += 1
                try:
                    await self.residency.promotions.make_all_resident(missing)
                finally:
                    self.residency.demand_promotions -= 1
            return await self._lease_in_slices(owner, blocks, contexts, source)
        except BaseException:
            owner.hold(ns.region, -held)
            for block in blocks:
                self.residency.unpin(block)
            raise

    def _resident_prefix(self, ns: Namespace, keys: list[bytes]) -> list[Block]:
        """The blocks of the leading ``keys`` that are in DRAM and not loading."""
        blocks: list[Block] = []
        for key in keys:
            block = self.index.live(ns, key)
            if block is None or block.dram is None or block.loading is not None:
                break
            blocks.append(block)
        return blocks

    def read_nowait(self, owner: Owner, ns: Namespace, keys: list[bytes]) -> Lease:
        """:meth:`read` of a few keys (at most the lane's ``inline_items``) all in DRAM now:
        the lease, with no wait. Raises :class:`anyio.WouldBlock`, having done nothing, when
        one is not (missing, on a lower tier only, or still loading), or when there are more
        keys (their walk is sliced): the caller then awaits :meth:`read`."""
        if len(keys) > self.lane.inline_items:
            raise anyio.WouldBlock
        blocks = self._resident_prefix(ns, keys)
        if len(blocks) != len(keys) or not blocks:
            raise anyio.WouldBlock
        return self._lease_in_dram(owner, ns, keys, blocks)

    async def lease_resident(self, owner: Owner, ns: Namespace, keys: list[bytes]) -> Lease:
        """Lease the leading ``keys`` that are in DRAM now, stopping at the first that is not
        (missing, on a lower tier only, or still loading): never waits on I/O. Raises
        :class:`BlockNotFoundError` when the first key is not resident (nothing is leased).
        What an engine calls right after LOOKUP to hold its DRAM hits, so that reading them
        later costs no round trip."""
        if len(keys) <= self.lane.inline_items:
            found = self._resident_prefix(ns, keys)
            if not found:
                raise BlockNotFoundError(_NOT_RESIDENT)
            return self._lease_in_dram(owner, ns, keys, found)

        blocks: list[Block] = []
        held = 0
        try:
            async with self.lane.walk(len(keys)) as walk:
                for key in keys:
                    await walk.pause()
                    block = self.index.live(ns, key)
                    if block is None or block.dram is None or block.loading is not None:
                        break
                    block.pins += 1  # found in one slice, kept through the next
                    blocks.append(block)
            if not blocks:
                raise BlockNotFoundError(_NOT_RESIDENT)
            held = check_lease_quota(self.limits, owner, ns, len(blocks))
            self.residency.count(ns, "dram_hits", len(blocks))
            contexts = await self.prefetcher.read_contexts_in_slices(ns, keys[: len(blocks)])
            return await self._lease_in_slices(owner, blocks, contexts)
        except BaseException:
            owner.hold(ns.region, -held)
            for block in blocks:
                self.residency.unpin(block)
            raise

    def _lease_in_dram(
        self, owner: Owner, ns: Namespace, keys: list[bytes], blocks: list[Block]
    ) -> Lease:
        """Lease ``blocks``, the resident leading blocks of ``keys`` (quota checked first)."""
        check_lease_quota(self.limits, owner, ns, len(blocks))
        for block in blocks:
            block.pins += 1
        self.residency.count(ns, "dram_hits", len(blocks))
        contexts = self.prefetcher.read_contexts(ns, keys[: len(blocks)])
        return self._lease(owner, blocks, contexts)

    def _lease(
        self,
        owner: Owner,
        blocks: list[Block],
        contexts: list[AccessContext],
        source: ServedBy = ServedBy.DRAM,
    ) -> Lease:
        """Note the (pinned) ``blocks`` read (``contexts``: as part of which requests) and
        lease them to ``owner`` (``source``: the deepest tier they were served from)."""
        if blocks:
            self.residency.note_reads(blocks[0].ns, blocks, time.monotonic(), contexts)
        return self._grant(owner, blocks, source)

    async def _lease_in_slices(
        self,
        owner: Owner,
        blocks: list[Block],
        contexts: list[AccessContext],
        source: ServedBy = ServedBy.DRAM,
    ) -> Lease:
        """:meth:`_lease`, its walk over the blocks in slices (a batch of the lane's
        ``inline_items`` a step: one namespace's, as a READ's are)."""
        now = time.monotonic()
        step = self.lane.inline_items
        async with self.lane.walk(len(blocks)) as walk:
            for first in range(0, len(blocks), step):
                await walk.pause()
                end = first + step
                self.residency.note_reads(blocks[0].ns, blocks[first:end], now, contexts[first:end])
        return self._grant(owner, blocks, source)

    @staticmethod
    def _grant(owner: Owner, blocks: list[Block], source: ServedBy) -> Lease:
        lease = Lease(Owner.next_id(), blocks, source)
        owner.leases[lease.id] = lease
        return lease

    def release(self, owner: Owner, lease_ids: list[int]) -> int:
        released = 0
        for lease_id in lease_ids:
            lease = owner.leases.pop(lease_id, None)
            if lease is None:
                continue
            if lease.blocks:
                held = sum(b.ns.spec.block_bytes for b in lease.blocks)
                owner.hold(lease.blocks[0].ns.region, -held)
            for block in lease.blocks:
                self.residency.unpin(block)
            released += 1
        return released

    async def release_in_slices(self, owner: Owner, lease_ids: list[int]) -> int:
        """:meth:`release` (RELEASE), pausing between leases once their blocks are many: a
        lease is released whole, so one cut short leaves the rest with ``owner``, whose
        connection's end releases them."""
        blocks = sum(len(owner.leases[i].blocks) for i in lease_ids if i in owner.leases)
        released = 0
        async with self.lane.walk(blocks) as walk:
            for lease_id in lease_ids:
                await walk.pause()
                released += self.release(owner, [lease_id])
        return released

    # -- writes (kvtierd.store.writes) -------------------------------------------------------

    async def alloc(self, owner: Owner, ns: Namespace, keys: list[bytes]) -> PendingWrite:
        """Arena slots for the keys not stored yet (``None`` for those already stored)."""
        return await self.writes.alloc(owner, ns, keys)

    async def commit(self, owner: Owner, write_id: int, checksums: list[int], abort: bool) -> int:
        """Publish the blocks of ALLOC ``write_id`` (or drop them with ``abort``)."""
        return await self.writes.commit(owner, write_id, checksums, abort)

    def drop_owner(self, owner: Owner) -> None:
        """A connection ended: release its leases, abandon its writes."""
        self.release(owner, list(owner.leases))
        for write in owner.writes.values():
            self.writes.abandon(write)
        owner.writes.clear()
        owner.pinned.clear()

    async def fsync(self, scope: Callable[[Namespace], bool] = lambda ns: True) -> int:
        """Return once every block committed so far is durable; the count of durable blocks
        of the namespaces in ``scope`` (the caller's tenants). A block that could not be made
        durable raises only for a caller whose scope holds it; a data file that is no longer
        the one the tier writes (or an earlier failed sync) raises ``StorageIOError`` for
        every caller: nothing is acknowledged onto it."""
        if self.lower is None:
            raise InvalidRequestError("no durable tier is configured (nvme.size = 0)")
        seq = self.residency.seq  # later commits are the next FSYNC's: they must not starve it
        await self.writeback.drain(seq, concerns=lambda block: scope(block.ns))
        await (self.disk.sync() if self.disk is not None else self.lower.sync())
        if self.pool is not None and self.pool.fsync_waits:
            await self.pool.drain(up_to_seq=seq)
        return sum(ns.nvme_blocks for ns in self.registry if scope(ns))

    # -- removal -----------------------------------------------------------------------------

    async def forget(self, ns: Namespace, keys: list[bytes]) -> int:
        """Drop every copy of the stored ``keys``; how many were stored. Many keys are walked
        in slices, and the lane is let go while a copy's discard waits on its tier."""
        r = self.residency
        forgotten = 0
        async with self.lane.walk(len(keys)) as walk:
            for key in keys:
                await walk.pause()
                block = self.index.get(ns, key)
                if block is None:
                    continue
                self.index.remove(block)  # its sparse summary goes with it
                if block.pins == 0:  # else write-back is writing it and frees the copy after
                    r.drop_staged(block)
                if self.pool is not None:
                    self.pool.forgotten(block)
                if block.dram is not None and block.pins == 0:
                    r.drop_dram(block)
                if block.lower is not None or block.pool is not None:
                    walk.release()
                if block.lower is not None:
                    await r.drop_lower(block)
                if block.pool is not None:
                    await r.discard_shared(block)
                forgotten += 1
        return forgotten

    async def evict_dram(self, ns: Namespace | None) -> int:
        """Drop the DRAM copy of every clean, unleased block (of ``ns``, or all): a walk over
        the whole index, in slices (each block checked when its turn comes)."""
        r = self.residency
        evicted = 0
        blocks = self.index.blocks()  # those in DRAM are live
        async with self.lane.walk(len(blocks)) as walk:
            for block in blocks:
                await walk.pause()
                if (ns is None or block.ns is ns) and r.dram_evictable(block):
                    r.drop_dram(block)
                    r.count(block.ns, "dram_evictions")
                    evicted += 1
        self.prefetcher.reuse_paused = True
        return evicted


def _each_once(
    items: list[tuple[Block, AccessContext]],
) -> list[tuple[Block, AccessContext]]:
    """``items`` with each block at its first place only. A READ may name a block more than
    once (each name is pinned and leased); promoting it once per name would read it into a slot
    per name, install each over the last (the earlier slots lost to the region for good), and
    trip over its own loading flag: a client could take its tenant's DRAM away a READ at a
    time."""
    first: dict[int, tuple[Block, AccessContext]] = {}
    for item in items:
        first.setdefault(id(item[0]), item)
    return list(first.values())


def _run_steps(steps: Generator[None, None, T]) -> T:
    """Run a generator of steps to its end, at once; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result
