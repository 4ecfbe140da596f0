"""The store's side of a cache policy: blocks in, block ids out, and back.

Policies key their state by a block id, ``(namespace digest, key)``, not by the store's
:class:`~kvtierd.store.index.Block` objects: an id exists before a block is stored and after it
is evicted, which is what lets a reuse model keep ghosts and learn from misses. This adapter
translates between the two so the store can speak in blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Protocol, runtime_checkable

import anyio.lowlevel

from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.store.index import Block, BlockIndex
from kvtierd.store.slicing import Lane

__all__ = [
    "BatchEvents",
    "ClassedVictims",
    "PlacedAccesses",
    "RequestObserver",
    "ReuseCandidates",
    "TierPolicy",
]


@runtime_checkable
class RequestObserver(Protocol):
    """A policy that wants each LOOKUP's whole key chain, hits and misses, in prefix order."""

    def observe_request(
        self, blocks: Sequence[Hashable], now: float = 0.0, request_id: int = -1
    ) -> None: ...


@runtime_checkable
class ReuseCandidates(Protocol):
    """A policy that can name blocks worth promoting while the disk is idle."""

    def promotion_candidates(self, limit: int) -> list[Hashable]: ...


@runtime_checkable
class BatchEvents(Protocol):
    """A policy that takes a batch of insertions or removals in one call, leaving the state
    the calls one at a time would (:class:`~kvtierd.slsap.SlsapPolicy`)."""

    def inserted_many(
        self, blocks: Sequence[Hashable], contexts: Sequence[AccessContext | None]
    ) -> None: ...

    def removed_many(self, blocks: Sequence[Hashable]) -> None: ...


@runtime_checkable
class ClassedVictims(Protocol):
    """A policy that can look for victims among the blocks of one lower-tier slot class
    alone (:class:`~kvtierd.store.clock.ClockPolicy`), rather than ask about every block."""

    def victims_in_class(
        self, count: int, slot_class: int, evictable: Callable[[Hashable], bool]
    ) -> list[Hashable]: ...


@runtime_checkable
class PlacedAccesses(Protocol):
    """A policy over a tier's own records that is told of reads by where their copies are,
    at once (:meth:`ClockPolicy.accessed_at <kvtierd.store.clock.ClockPolicy.accessed_at>`:
    a byte set per row, which no other event's order changes)."""

    def accessed_at(self, locations: Sequence[Hashable]) -> None: ...


_MAX_DEFERRED = 65536
#: Request chains admitted per period (the prefetcher's 100 ms tick): about 320 LOOKUPs/s are
#: modelled in full, far above an engine's request rate; beyond that, chains are sampled.
_MAX_PENDING_REQUESTS = 32


class TierPolicy:
    """A :class:`CachePolicy` seen through :class:`Block` objects, with deferred telemetry.

    Telemetry (a request's chain, reads, insertions, removals) is only appended to a journal on
    the request path; the policy replays it, in order, just before it is asked to decide
    (``victims``, ``candidates``) or when :meth:`flush` runs between requests. A reuse model's
    bookkeeping (numpy work, tens of microseconds a call) therefore never sits on the LOOKUP or
    READ latency, and the policy still sees every event in the order it happened.
    """

    def __init__(self, policy: CachePolicy, index: BlockIndex) -> None:
        self.policy = policy
        self._index = index
        self._journal: deque[Callable[[], object]] = deque()
        self._observer = policy if isinstance(policy, RequestObserver) else None
        self._reuse = policy if isinstance(policy, ReuseCandidates) else None
        self._batch = policy if isinstance(policy, BatchEvents) else None
        self._classed = policy if isinstance(policy, ClassedVictims) else None
        self._placed = policy if isinstance(policy, PlacedAccesses) else None
        self.observes_requests = self._observer is not None
        self._pending_requests = 0
        self.sampled_out = 0

    def _defer(self, event: Callable[[], object]) -> None:
        journal = self._journal
        journal.append(event)
        if len(journal) >= _MAX_DEFERRED:  # nobody flushed for long: stay bounded
            # two old events for each new one, never all at once (that held the loop 0.5 s)
            journal.popleft()()
            journal.popleft()()

    def flush(self) -> None:
        """Apply the deferred telemetry, all of it, now (before a decision)."""
        journal = self._journal
        while journal:
            journal.popleft()()

    async def flush_gradually(self, events_per_slice: int = 1) -> None:
        """Apply the deferred telemetry a few events at a time, letting requests in between,
        so no request waits behind more than a slice of bookkeeping."""
        journal = self._journal
        while journal:
            for _ in range(min(events_per_slice, len(journal))):
                journal.popleft()()
            await anyio.lowlevel.checkpoint()

    async def settle(self, lane: Lane) -> None:
        """Apply the deferred telemetry before a decision, in slices on ``lane`` when there is
        much of it: a decision (:meth:`victims`) applies what is left at once, and the 8192
        insertions of one large COMMIT are some 50 ms of a reuse model's bookkeeping."""
        journal = self._journal
        if len(journal) <= lane.inline_items:
            return
        async with lane.walk(len(journal)) as walk:
            while True:
                await walk.pause()
                if not journal:  # another settler (or the tick) applied the rest meanwhile
                    break
                journal.popleft()()

    @property
    def backlog(self) -> int:
        """Events deferred, not applied yet."""
        return len(self._journal)

    def new_period(self) -> None:
        """Start a sampling period: :data:`_MAX_PENDING_REQUESTS` more chains may be queued.
        (Counting chains until they are *applied* instead bounded only the queue, not the rate:
        under a LOOKUP storm the flusher drained and refilled it without pause, a third of the
        daemon's CPU.)"""
        self._pending_requests = 0

    def observe_request(self, ids: Sequence[Hashable], now: float, request_id: int) -> None:
        """Queue a request's chain for the model. Under a LOOKUP storm (more than
        :data:`_MAX_PENDING_REQUESTS` in one period) further chains are sampled out: they only
        teach the model, and bookkeeping must not become the daemon's bottleneck."""
        if self._observer is None:  # isinstance on a Protocol costs ~20 us: checked once
            return
        if self._pending_requests >= _MAX_PENDING_REQUESTS:
            self.sampled_out += 1
            return
        self._pending_requests += 1
        self._defer(partial(self._observe, ids, now, request_id))

    @property
    def wants_request(self) -> bool:
        """Whether :meth:`observe_request` would queue a chain now (not sampled out)."""
        return self._observer is not None and self._pending_requests < _MAX_PENDING_REQUESTS

    def _observe(self, ids: Sequence[Hashable], now: float, request_id: int) -> None:
        if self._observer is not None:
            self._observer.observe_request(ids, now, request_id)

    def candidates(self, limit: int) -> list[Hashable]:
        if self._reuse is None:
            return []
        self.flush()
        return self._reuse.promotion_candidates(limit)

    def inserted(self, block: Block, now: float, context: AccessContext | None = None) -> None:
        """``block`` entered the tier; a dirty one is held (:meth:`CachePolicy.hold`) until
        :meth:`release`, so that the policy keeps it out of its candidates meanwhile."""
        self._defer(partial(self.policy.inserted, block.id, now, context))
        if block.dirty:
            self._defer(partial(self.policy.hold, block.id))

    def inserted_many(
        self, blocks: Sequence[Block], now: float, contexts: Sequence[AccessContext]
    ) -> None:
        """:meth:`inserted` of each of ``blocks`` (a READ batch's promotions): one journal
        event for them all where the policy takes batches and none is dirty (a dirty block's
        hold follows its own insertion)."""
        if self._batch is None or any(block.dirty for block in blocks):
            for block, context in zip(blocks, contexts, strict=True):
                self.inserted(block, now, context)
            return
        ids = [block.id for block in blocks]
        self._defer(partial(self._batch.inserted_many, ids, contexts))

    def removed_many(self, blocks: Sequence[Block]) -> None:
        """:meth:`removed` of each of ``blocks`` (a batch of evictions), one journal event
        where the policy takes batches."""
        if self._batch is None:
            for block in blocks:
                self.removed(block)
            return
        self._defer(partial(self._batch.removed_many, [block.id for block in blocks]))

    def release(self, block: Block) -> None:
        """``block`` was written back: the policy may offer it as a victim again."""
        self._defer(partial(self.policy.release, block.id))

    def accessed(self, block: Block, now: float, context: AccessContext | None = None) -> None:
        self._defer(partial(self.policy.accessed, block.id, now, context))

    def accessed_many(
        self,
        blocks: Sequence[Block],
        now: float,
        contexts: Sequence[AccessContext],
        locations: Sequence[Hashable] = (),
    ) -> None:
        """:meth:`accessed` of each of ``blocks`` (a READ's, in order), ``locations`` their
        copies in this policy's tier: a policy that marks reads by place is told at once
        (nothing deferred, no id looked up), any other in one journal event for the batch."""
        if self._placed is not None:
            self._placed.accessed_at(locations)
        elif blocks:
            ids = [block.id for block in blocks]
            self._defer(partial(self._accessed_each, ids, now, contexts))

    def _accessed_each(
        self, ids: Sequence[Hashable], now: float, contexts: Sequence[AccessContext]
    ) -> None:
        accessed = self.policy.accessed
        for block_id, context in zip(ids, contexts, strict=True):
            accessed(block_id, now, context)

    def removed(self, block: Block) -> None:
        self._defer(partial(self.policy.removed, block.id))

    def victims(
        self, count: int, evictable: Callable[[Block], bool], *, slot_class: int | None = None
    ) -> list[Block]:
        """``count`` victims at most; ``slot_class``: only blocks that free a lower-tier slot
        of that class will do (a policy that knows the classes looks among those alone;
        ``evictable`` must check it either way)."""
        self.flush()

        def by_id(block_id: Hashable) -> bool:
            block = self._index.peek_id(block_id)  # a cold block: only looked at, not kept
            return block is not None and evictable(block)

        if slot_class is not None and self._classed is not None:
            ids = self._classed.victims_in_class(count, slot_class, by_id)
        else:
            ids = self.policy.victims(count, by_id)
        found = (self._index.by_id(i) for i in ids)
        return [b for b in found if b is not None]

    def __len__(self) -> int:
        self.flush()
        return len(self.policy)
