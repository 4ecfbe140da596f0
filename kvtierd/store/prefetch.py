"""Prefetch in the daemon: telemetry to the reuse model, and promotions planned under a budget.

The store calls :meth:`Prefetcher.on_lookup` for every LOOKUP: the request's whole key chain
goes to the policies that observe requests (the SLSAP reuse model learns from hits and misses
alike), and each block remembers the request that named it, so that its READ is told to the
policies as part of that request (:meth:`Prefetcher.read_contexts`): one request is counted once.
Promotions are not accesses (the store inserts them with ``PROMOTION``): only requests and READs
count as references. HINT's queue goes through the pure
:class:`~kvtierd.slsap.planner.PrefetchPlanner`:
requests earliest first, each head first, within ``prefetch_bytes_per_s`` for the next second.

The prefetcher only reads the store (:class:`~kvtierd.store.residency.Residency`) and says
which blocks it wants promoted; the store promotes them. While no demand promotion is running,
the ticks :func:`open_prefetcher` runs ask the DRAM policy for blocks it
expects to be read again soon (ghosts denser than its weakest resident) and promotes those that
the NVMe tier holds, at most ``prefetch_bytes_per_s`` per second and only into free arena room:
demand reads always go first, and a guess never displaces a resident block (measured on the
Mooncake replay, displacing residents for reuse guesses cost more disk time than it saved).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Sequence

import anyio

from kvtierd.policy import AccessContext
from kvtierd.slsap.planner import PrefetchPlanner, QueuedRequest
from kvtierd.store.index import Block
from kvtierd.store.namespaces import Namespace
from kvtierd.store.residency import Residency

__all__ = ["Prefetcher", "open_prefetcher"]

#: Blocks named by LOOKUPs whose READs are remembered (the oldest are forgotten first).
_NAMED_BLOCKS = 1 << 16
_TICK_S = 0.1
#: Deferred policy events the tick applies per turn of the loop. One per turn cost a
#: checkpoint (a turn of the loop) per event: at 448 KiB cold reads, three or four events per
#: block, about a tenth of the daemon's CPU; eight keep a turn to some tens of microseconds.
_EVENTS_PER_TURN = 8
#: A HINT's queued requests are assumed to start this far apart (the engine gives no times).
_QUEUE_SPACING_S = 0.05


class Prefetcher:
    """Owned by the store; its ticks run under :func:`open_prefetcher`."""

    def __init__(self, store: Residency, prefetch_bytes_per_s: int) -> None:
        self._store = store
        self.prefetch_bytes_per_s = prefetch_bytes_per_s
        self._ids = itertools.count(1)
        #: (namespace digest, key) -> (request id, position, READs still expected) of the
        #: latest request that named the block.
        self._named: OrderedDict[tuple[bytes, bytes], tuple[int, int, int]] = OrderedDict()
        self._planners: dict[int, PrefetchPlanner] = {}
        #: Set by EVICT: the room it made stays free until requests come again (else the idle
        #: disk would promote the evicted blocks straight back as reuse candidates).
        self.reuse_paused = False

    def on_lookup(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """Report a LOOKUP's (or a queued request's) chain to the policies, and remember which
        request named each of its blocks, for the READs to come."""
        self.reuse_paused = False
        request_id = self._observe(ns, keys)
        if request_id < 0:
            return
        for position, key in enumerate(keys):
            self._name(ns, key, request_id, position)
        self._forget_oldest()

    def _name(self, ns: Namespace, key: bytes, request_id: int, position: int) -> None:
        """``key`` was named by request ``request_id`` at ``position``: one READ more expected."""
        named = self._named
        entry = named.pop((ns.digest, key), None)
        reads = entry[2] + 1 if entry is not None else 1
        named[(ns.digest, key)] = (request_id, position, reads)

    def _forget_oldest(self) -> None:
        named = self._named
        while len(named) > _NAMED_BLOCKS:
            named.popitem(last=False)

    def _observe(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Give the chain to the policies as one request; its id, or -1 if every policy's
        sampler turned it away (a LOOKUP storm)."""
        store = self._store
        lower = store.lower_policy
        dram = store.dram_policies[ns.region.id] if ns.region is not None else None
        # spelt out, not any() over a generator: under a LOOKUP storm every LOOKUP stops here
        if not keys or not (lower.wants_request or (dram is not None and dram.wants_request)):
            return -1
        policies = [lower] if dram is None else [lower, dram]
        request_id = next(self._ids)
        ids = [(ns.digest, key) for key in keys]
        now = time.monotonic()
        for policy in policies:
            policy.observe_request(ids, now, request_id)
        return request_id

    def read_contexts(self, ns: Namespace, keys: Sequence[bytes]) -> list[AccessContext]:
        """The telemetry of a READ of ``keys``: a block a LOOKUP named (and no READ has taken
        since) is read as part of that request, which the policies counted already; the others
        are observed now, together, as one request of their own. So a request is counted once
        however its READs are cut (batches, READ_RESIDENT then READ) and whatever other
        requests named the same blocks meanwhile."""
        entries = [self._take_read(ns, key) for key in keys]
        return [*map(self._contexts_of(ns, keys, entries), entries)]

    async def read_contexts_in_slices(
        self, ns: Namespace, keys: Sequence[bytes]
    ) -> list[AccessContext]:
        """:meth:`read_contexts`, its walks over the keys in slices on the store's lane."""
        lane = self._store.lane
        entries = await lane.map(keys, lambda key: self._take_read(ns, key))
        return await lane.map(entries, self._contexts_of(ns, keys, entries))

    def _contexts_of(
        self, ns: Namespace, keys: Sequence[bytes], entries: list[tuple[int, int, int] | None]
    ) -> Callable[[tuple[int, int, int] | None], AccessContext]:
        """The step that turns each key's entry into its context, in key order; the keys no
        LOOKUP named are observed first, as one request."""
        unnamed = [key for key, entry in zip(keys, entries, strict=True) if entry is None]
        fresh = self._observe(ns, unnamed) if unnamed else -1
        positions = itertools.count()

        def context(entry: tuple[int, int, int] | None) -> AccessContext:
            if entry is None:
                return AccessContext(fresh, position=next(positions))
            return AccessContext(entry[0], position=entry[1])

        return context

    def _take_read(self, ns: Namespace, key: bytes) -> tuple[int, int, int] | None:
        """The (request id, position, READs expected) of the request that named ``key``, with
        one READ taken from it; None when no LOOKUP named it since its last READ."""
        entry = self._named.pop((ns.digest, key), None)
        if entry is not None and entry[2] > 1:  # other LOOKUPs named it too: READs to come
            self._named[(ns.digest, key)] = (entry[0], entry[1], entry[2] - 1)
        return entry

    async def plan_queue(self, ns: Namespace, queue: Sequence[Sequence[bytes]]) -> list[Block]:
        """The blocks to promote for an engine's queue (HINT), in the order to promote them.

        The walk over the queue's keys (naming them, as LOOKUP does, and finding the blocks a
        lower tier holds and DRAM does not) runs in slices on the store's lane; the pure
        planner then sees only those candidates, which is what it would have kept of the whole
        queue. A block that changed between the walk and the promotion is handled there (a
        resident one is skipped, a forgotten one is a miss)."""
        store = self._store
        index = store.index
        planner = self._planners.setdefault(
            ns.spec.block_bytes, PrefetchPlanner(ns.spec.block_bytes)
        )
        now = time.monotonic()
        queued: list[QueuedRequest] = []
        async with store.lane.walk(sum(len(keys) for keys in queue)) as walk:
            for i, keys in enumerate(queue):
                self.reuse_paused = False
                request_id = self._observe(ns, keys)  # each queued request once, as LOOKUP
                candidates: list[Hashable] = []
                stored = index.contains_many(ns, list(keys))  # the rows probed together
                for position, key in enumerate(keys):
                    await walk.pause()
                    if request_id >= 0:
                        self._name(ns, key, request_id, position)
                    block = index.live(ns, key)
                    if block is None:  # idle on NVMe only, or absent
                        if stored[position]:
                            candidates.append((ns.digest, key))
                    elif not block.resident and block.lower is not None:
                        candidates.append(block.id)
                self._forget_oldest()
                queued.append(QueuedRequest(i, candidates, now + i * _QUEUE_SPACING_S))
        plan = planner.plan(
            now,
            queued,
            prefetch_bytes_per_s=self.prefetch_bytes_per_s or float("inf"),
            horizon_s=1.0,
            in_dram=self._in_dram,
            in_lower_tier=self._in_lower,
        )
        blocks = (index.by_id(p.block) for p in plan.promotions)
        return [b for b in blocks if b is not None]

    def _in_dram(self, block_id: Hashable) -> bool:
        block = self._store.index.peek_id(block_id)
        return block is not None and block.resident

    def _in_lower(self, block_id: Hashable) -> bool:
        block = self._store.index.peek_id(block_id)
        return block is not None and block.lower is not None

    async def tick_forever(self, promote: Callable[[list[Block]], object]) -> None:
        """Between requests: apply the policies' deferred telemetry and, while the disk is
        idle, ``promote`` reuse candidates."""
        store = self._store
        while True:
            await anyio.sleep(_TICK_S)
            policies = [*store.dram_policies.values(), store.lower_policy]
            for policy in policies:
                policy.new_period()
            for policy in policies:
                await policy.flush_gradually(_EVENTS_PER_TURN)
            idle = not store.demand_promotions and not self.reuse_paused
            if self.prefetch_bytes_per_s and store.lower is not None and idle:
                promote(await self._reuse_candidates())

    async def _reuse_candidates(self) -> list[Block]:
        # Reuse promotions only fill free arena room: a guess never displaces a resident
        # (demand and prefix promotions evict by the policy as usual).
        store = self._store
        budget = self.prefetch_bytes_per_s * _TICK_S
        chosen: list[Hashable] = []
        for region in store.regions:  # each region's guesses fill that region's free room only
            policy = store.dram_policies[region.id]
            # candidates() applies the journal first: a long one in slices, not all at once
            # (three READs of 8192 blocks leave 24,576 events, some 200 ms of bookkeeping)
            await policy.settle(store.lane)
            room = region.allocator.free_bytes
            for block_id in policy.candidates(64):
                block = store.index.peek_id(block_id)  # a cold one is made live once chosen
                if block is None or block.resident or block.lower is None:
                    continue
                if budget < block.ref.raw_bytes or room < block.ref.raw_bytes:
                    break
                budget -= block.ref.raw_bytes
                room -= block.ref.raw_bytes
                chosen.append(block_id)
        return [b for b in map(store.index.by_id, chosen) if b is not None]


@contextlib.asynccontextmanager
async def open_prefetcher(
    prefetcher: Prefetcher, promote: Callable[[list[Block]], object]
) -> AsyncIterator[Prefetcher]:
    """Run ``prefetcher``'s ticks in a task group of their own until the block exits;
    ``promote`` carries out the promotions it asks for."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(prefetcher.tick_forever, promote)
        try:
            yield prefetcher
        finally:
            tg.cancel_scope.cancel()
