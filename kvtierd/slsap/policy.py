"""SLSAP reuse policy: admission and eviction by expected hit density, as a ``CachePolicy``.

Theory of operation. The store (or the trace simulator) tells the policy what each request
names, in prefix order, with :meth:`SlsapPolicy.observe_request` (LOOKUP carries exactly this),
and which blocks enter, are read from and leave the tier through the ``CachePolicy`` methods.
The policy keeps a :class:`~kvtierd.slsap.blocktable.BlockTable` entry for residents and for a
bounded number of *ghosts* (blocks evicted or never admitted), so that a block's history (how
many requests named it, when) survives its eviction, and the
:class:`~kvtierd.slsap.reuse.ReuseModel` learns reuse times from every tracked block, cached or
not. Learning from ghosts too keeps admission from locking a class out: a class the cache
refuses is still observed.

Time is the *model clock*: the number of block references observed. ``now`` arguments are
accepted for the ``CachePolicy`` contract but not needed; the decisions depend only on the order
of calls, which makes a replay exactly reproducible.

Decisions:

- ``victims``: residents in increasing density, oldest first on ties. Densities are ranked in a
  batch (a *victim queue*) and re-ranked after an eighth of the residents' worth of references;
  a resident named since the ranking is skipped until the next one.
- Held residents (:meth:`SlsapPolicy.hold`: the store's dirty blocks, not written back yet) are
  kept out of the queue until released. Each queue entry is walked once: those the caller
  refused or was offered stay, in order, in a short *passed* list walked first next time, and
  held ones leave. When the queue runs out while blocks are held, only the residents left
  unranked since the ranking (inserted, named or released) are ranked, not all of them: a
  burst of puts into a DRAM full of dirty blocks then costs each allocation a constant number
  of steps, not a walk and a ranking of every resident.
- ``admit``: a missing block is admitted when its density at age zero is at least the density of
  the weakest resident it would displace, so a class whose blocks are rarely read again (the
  unique tail of a prompt, a one-off document) does not push out a shared prefix.
- Maintenance every ``refit_ratio`` of the tracked blocks' worth of references (at least
  ``min_refit_events``): ghosts beyond ``ghost_ratio`` times the peak resident count are dropped,
  oldest first, and recorded as censored ends; the density table is refitted, for residence
  horizons of at least ``horizon_turnovers`` times the cache's measured turnover time.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtierd.policy import PROMOTED_REQUEST, AccessContext, CachePolicy
from kvtierd.slsap.blocktable import VERSION_MASK, BlockTable
from kvtierd.slsap.reuse import ReuseModel, block_class_of, request_block_classes

__all__ = ["SlsapConfig", "SlsapPolicy", "SlsapStatistics"]


@dataclass(frozen=True, slots=True)
class SlsapConfig:
    """Structural parameters. None depends on a trace: they bound memory and set how quickly the
    model forgets, in units of the tier's own size."""

    ghost_ratio: float = 4.0
    """Ghosts kept per resident (peak): how far back admission can remember a block."""
    min_ghosts: int = 1024
    refit_ratio: float = 0.25
    """Refit after this fraction of the tracked blocks' count in references."""
    min_refit_events: int = 1024
    prior_events: float = 40.0
    """Pseudo-observations a class borrows from its parent: one per octave of age, so a class
    needs about one observation per age scale before its own shape dominates."""
    decay: float = 0.9
    """Histogram weight kept at each refit (LHD's EWMA): memory of a few tracking turnovers."""
    horizon_turnovers: float = 2.0
    """The shortest residence a density may assume, in cache turnovers (residents over
    insertions per reference, measured between refits). With no floor the best horizon chases
    the noise of sparsely observed buckets. Over the traces of docs/slsap-reuse.md a lower
    floor gains on the modelled workloads and loses on the real Mooncake trace; two turnovers
    keeps the real trace within 0.005 of densities without horizons at every size."""

    def __post_init__(self) -> None:
        if self.ghost_ratio < 0 or self.min_ghosts < 0:
            raise ValueError("ghost limits must be >= 0")
        if self.refit_ratio <= 0 or self.min_refit_events < 1:
            raise ValueError("refit period must be positive")
        if not 0 <= self.horizon_turnovers < math.inf:
            raise ValueError("horizon_turnovers must be finite and >= 0")


@dataclass(frozen=True, slots=True)
class SlsapStatistics:
    """A snapshot of the policy's bookkeeping (what ``kvtierctl stats`` prints)."""

    resident: int
    ghosts: int
    references: int
    refits: int
    memory_bytes: int


class SlsapPolicy(CachePolicy):
    """The reuse-model policy. Blocks are any hashable; all methods are synchronous and pure."""

    def __init__(self, config: SlsapConfig | None = None) -> None:
        self.config = config or SlsapConfig()
        self._table = BlockTable()
        self._model = ReuseModel(prior_events=self.config.prior_events, decay=self.config.decay)
        self._clock = 0.0
        self._references = 0
        self._next_maintenance = self.config.min_refit_events
        self._peak_resident = 0
        # Insertions and references since the last refit: the cache's turnover time.
        self._insertions = 0
        self._references_at_refit = 0
        # The victim queue: slots in eviction order and their versions when it was ranked. Kept
        # as memoryviews over the ranked arrays: only its head is read before the next ranking,
        # so converting the whole of it to lists would cost more than it saves.
        self._queue: memoryview[int] = np.zeros(0, dtype=np.int64).data
        self._queue_versions: memoryview[int] = np.zeros(0, dtype=np.uint32).data
        self._cursor = 0
        self._queue_built_at = -1
        # Queue entries walked and still valid (refused or offered, not evicted yet), in queue
        # order, as (slot, version): walked first, so that the cursor can pass them.
        self._passed: deque[tuple[int, int]] = deque()
        # Residents that cannot be evicted now (hold/release): never queued.
        self._held: set[int] = set()
        # Residents neither held nor validly queued: inserted, named or released since the
        # ranking. What is left to rank when the queue runs out with blocks held.
        self._unranked: set[int] = set()

    # -- telemetry ---------------------------------------------------------------------------

    def observe_request(
        self, blocks: Sequence[Hashable], now: float = 0.0, request_id: int = -1
    ) -> None:
        """A request named ``blocks`` (in prefix order, head first). Call once per request, at
        arrival, before the hits and misses of its blocks are reported. ``request_id`` (>= 0)
        lets later ``accessed``/``inserted`` calls with the same ``AccessContext.request_id``
        count as part of this observation rather than as new ones."""
        if not blocks:
            return
        unique = list(dict.fromkeys(blocks))
        n = len(unique)
        slots = self._table.slots_of(unique)
        fresh = self._table.request[slots] != request_id if request_id >= 0 else None
        # count_nonzero rather than fresh.all(), whose Python-level wrapper costs several times
        # more than the test on one request's blocks.
        if fresh is not None and np.count_nonzero(fresh) < n:
            keep = np.flatnonzero(fresh)
            slots, tails = slots[keep], (n - 1 - keep)
        else:
            tails = np.arange(n - 1, -1, -1, dtype=np.int64)
        self._observe(slots, tails, n, request_id)

    def _observe(
        self, slots: npt.NDArray[np.int64], tails: npt.NDArray[np.int64], length: int, rid: int
    ) -> None:
        t = self._table
        self._clock += len(slots)
        self._references += len(slots)
        counts = t.count[slots]
        seen = slots[counts > 0]
        if seen.size:
            self._model.record_reuse(t.klass[seen], self._clock - t.last[seen])
        counts += 1
        t.count[slots] = counts
        t.klass[slots] = request_block_classes(counts, tails, length)
        t.last[slots] = self._clock
        t.request[slots] = rid
        t.version[slots] += 1
        named = slots[t.resident[slots]]  # their queue entries are stale now
        if named.size:
            if self._held:
                self._unranked.update(s for s in named.tolist() if s not in self._held)
            else:
                self._unranked.update(named.tolist())
        if self._references >= self._next_maintenance:
            self._maintain()

    def _observe_one(self, block: Hashable, context: AccessContext | None) -> int:
        """The slot of ``block``, observing it as a one-block reference unless the request in
        ``context`` already named it through :meth:`observe_request`, or ``context`` is a
        promotion (``PROMOTED_REQUEST``: in the tier, not read). Scalar code throughout:
        this runs for every block a store inserts or reads, where numpy's per-call overhead
        would dominate."""
        rid = context.request_id if context is not None else -1
        t = self._table
        slot = t.find(block)
        if slot >= 0 and rid >= 0 and t.request_cells[slot] == rid:
            return slot
        if slot < 0:
            slot = t.slot_for(block)
        if rid == PROMOTED_REQUEST:  # promoted into the tier, not read: no reference
            return slot
        self._clock += 1
        self._references += 1
        count = t.count_cells[slot]
        if count > 0:
            self._model.record_reuse_of(t.klass_cells[slot], self._clock - t.last_cells[slot])
        count += 1
        t.count_cells[slot] = count
        t.klass_cells[slot] = block_class_of(count, -1, 0)
        t.last_cells[slot] = self._clock
        t.request_cells[slot] = -1
        t.version_cells[slot] = (t.version_cells[slot] + 1) & VERSION_MASK
        if t.resident_cells[slot] and slot not in self._held:  # its queue entry is stale
            self._unranked.add(slot)
        if self._references >= self._next_maintenance:
            self._maintain()
        return slot

    # -- CachePolicy -------------------------------------------------------------------------

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        """True when ``block``'s density is at least the weakest resident's (or none is cached).
        Observes ``block`` (as :meth:`accessed` would) if its request did not."""
        slot = self._observe_one(block, context)
        weakest = self._weakest_density()
        if weakest is None:
            return True
        mine = self._model.density_of(self._table.klass_cells[slot], 0.0)
        return mine >= weakest

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        slot = self._observe_one(block, context)
        t = self._table
        t.set_resident(slot, True)
        if self._held:
            self._held.discard(slot)
        self._unranked.add(slot)
        self._insertions += 1
        if t.resident_count > self._peak_resident:
            self._peak_resident = t.resident_count

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self._observe_one(block, context)

    def removed(self, block: Hashable) -> None:
        t = self._table
        slot = t.find(block)
        if slot >= 0 and t.resident_cells[slot]:
            t.set_resident(slot, False)
            if self._held:
                self._held.discard(slot)
            self._unranked.discard(slot)

    def inserted_many(
        self, blocks: Sequence[Hashable], contexts: Sequence[AccessContext | None]
    ) -> None:
        """:meth:`inserted` of each of ``blocks`` with its context, in order: the store's
        promotions of one READ batch, told at once. When none of them is a reference (each
        was named by its context's request already, or is a promotion) and none repeats, no
        clock moves and nothing between two of them reads what the others change, so the
        batch is one step over its slots (a plain loop over the cells: at a READ batch's
        16 blocks numpy's per-call cost makes a vectorised step no faster); otherwise the
        blocks go one by one. Either way the state
        is the one the calls one at a time leave (tests/slsap replays both)."""
        slots = self._unreferenced_slots(blocks, contexts)
        if slots is None:
            for block, context in zip(blocks, contexts, strict=True):
                self.inserted(block, 0.0, context)
            return
        t = self._table
        resident, version = t.resident_cells, t.version_cells  # bound after any allocation
        for slot in slots:
            if not resident[slot]:
                resident[slot] = True
                t.resident_count += 1
            version[slot] = (version[slot] + 1) & VERSION_MASK
        if self._held:
            self._held.difference_update(slots)
        self._unranked.update(slots)
        self._insertions += len(slots)
        if t.resident_count > self._peak_resident:  # it only grew along the batch
            self._peak_resident = t.resident_count

    def _unreferenced_slots(
        self, blocks: Sequence[Hashable], contexts: Sequence[AccessContext | None]
    ) -> list[int] | None:
        """The slots of ``blocks`` (allocated in order where untracked) when observing them
        (:meth:`_observe_one`) counts no reference for any and no block repeats; else None
        (no reference, so no maintenance: slots a repeat allocated here are the ones the
        calls one at a time allocate)."""
        if len(blocks) != len(contexts):
            raise ValueError("one context per block")
        t = self._table
        find, request = t.find, t.request_cells
        slots: list[int] = []
        for block, context in zip(blocks, contexts, strict=True):
            slot = find(block)
            rid = context.request_id if context is not None else -1
            if rid != PROMOTED_REQUEST and (slot < 0 or rid < 0 or request[slot] != rid):
                return None
            slots.append(slot)
        if -1 in slots:  # untracked promotions: allocated in order, as one at a time would
            slots = [s if s >= 0 else t.slot_for(b) for s, b in zip(slots, blocks, strict=True)]
        return slots if len(set(slots)) == len(slots) else None

    def removed_many(self, blocks: Sequence[Hashable]) -> None:
        """:meth:`removed` of each of ``blocks`` in one step over their slots (a batch of
        evictions): the state the calls one at a time leave."""
        t = self._table
        resident, find = t.resident_cells, t.find
        slots = [s for s in dict.fromkeys(map(find, blocks)) if s >= 0 and resident[s]]
        if not slots:
            return
        version = t.version_cells
        for slot in slots:
            resident[slot] = False
            version[slot] = (version[slot] + 1) & VERSION_MASK
        t.resident_count -= len(slots)
        if self._held:
            self._held.difference_update(slots)
        self._unranked.difference_update(slots)

    def hold(self, block: Hashable) -> None:
        """Keep resident ``block`` out of :meth:`victims` (and of the weakest density
        :meth:`admit` compares with) until :meth:`release` or a new insertion."""
        slot = self._table.find(block)
        if slot >= 0 and self._table.resident_cells[slot]:
            self._held.add(slot)
            self._unranked.discard(slot)

    def release(self, block: Hashable) -> None:
        slot = self._table.find(block)
        if slot in self._held:
            self._held.discard(slot)
            self._unranked.add(slot)

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        """Up to ``count`` residents, lowest density first, all satisfying ``evictable``, none
        held."""
        t = self._table
        chosen: list[Hashable] = []
        if count <= 0 or t.resident_count == 0:
            return chosen
        self._refresh_queue()
        taken: set[int] = set()
        resident, version, keys, held = t.resident_cells, t.version_cells, t.keys, self._held
        # The passed entries first: they precede the cursor in queue order. Those no longer
        # valid leave; the others stay, in order.
        passed = self._passed
        kept: list[tuple[int, int]] = []
        while passed and len(chosen) < count:
            entry = passed.popleft()
            slot = entry[0]
            if not resident[slot] or version[slot] != entry[1] or slot in held:
                continue
            kept.append(entry)
            if slot not in taken and evictable(keys[slot]):
                chosen.append(keys[slot])
                taken.add(slot)
        if kept:
            passed.extendleft(reversed(kept))
        queue, versions = self._queue, self._queue_versions
        reranked = False
        i = self._cursor
        while len(chosen) < count:
            if i >= len(queue):
                if reranked or not self._rerank():
                    break
                passed, queue, versions = self._passed, self._queue, self._queue_versions
                reranked, i = True, 0
                continue
            slot, ver = queue[i], versions[i]
            i += 1
            if not resident[slot] or version[slot] != ver or slot in held:
                continue
            passed.append((slot, ver))
            if slot in taken:
                continue
            key = keys[slot]
            if evictable(key):
                chosen.append(key)
                taken.add(slot)
        self._cursor = i
        return chosen

    def __len__(self) -> int:
        return self._table.resident_count

    # -- scores for the planner --------------------------------------------------------------

    def density(self, block: Hashable) -> float:
        """``block``'s current expected hits per reference of residence (0.0 when untracked)."""
        slot = self._table.find(block)
        if slot < 0:
            return 0.0
        t = self._table
        return self._model.density_of(t.klass_cells[slot], self._clock - t.last_cells[slot])

    def promotion_candidates(self, limit: int) -> list[Hashable]:
        """Up to ``limit`` ghosts (tracked, not resident) denser than the weakest resident,
        densest first: what is worth promoting into the tier when it has idle bandwidth."""
        t = self._table
        ghosts = t.ghost_slots()
        if limit <= 0 or ghosts.size == 0:
            return []
        dens = self._model.density(t.klass[ghosts], self._clock - t.last[ghosts])
        weakest = self._weakest_density()
        if weakest is not None:
            keep = dens > weakest
            ghosts, dens = ghosts[keep], dens[keep]
        order = np.lexsort((-t.last[ghosts], -dens))[:limit]
        return [t.keys[s] for s in ghosts[order].tolist()]

    def weakest_density(self) -> float | None:
        """The density of the resident :meth:`victims` would offer first (None when none is
        resident or every resident is held)."""
        return self._weakest_density()

    def statistics(self) -> SlsapStatistics:
        t = self._table
        return SlsapStatistics(
            resident=t.resident_count,
            ghosts=t.ghost_count,
            references=self._references,
            refits=self._model.refits,
            memory_bytes=t.nbytes()
            + self._queue.nbytes
            + self._queue_versions.nbytes
            + sum(map(sys.getsizeof, (self._passed, self._held, self._unranked))),
        )

    # -- internals ---------------------------------------------------------------------------

    def _maintain(self) -> None:
        t, cfg = self._table, self.config
        limit = max(cfg.min_ghosts, int(cfg.ghost_ratio * self._peak_resident))
        excess = t.ghost_count - limit
        if excess > 0:
            ghosts = t.ghost_slots()
            oldest = ghosts[np.argsort(t.last[ghosts], kind="stable")[:excess]]
            self._model.record_end(t.klass[oldest], self._clock - t.last[oldest])
            t.drop(oldest)
        tracked = t.tracked_slots()
        # Little's law: residents / (insertions per reference) is how long a block stays. With
        # no insertion since the last refit it is longer than that period: count one.
        since = self._references - self._references_at_refit
        turnover = t.resident_count * since / max(self._insertions, 1)
        self._insertions, self._references_at_refit = 0, self._references
        self._model.refit(
            t.klass[tracked],
            self._clock - t.last[tracked],
            min_horizon=cfg.horizon_turnovers * turnover,
        )
        self._queue_built_at = -1
        period = max(cfg.min_refit_events, int(cfg.refit_ratio * len(t)))
        self._next_maintenance = self._references + period

    def _refresh_queue(self) -> None:
        # Re-rank after max(64, residents / 8) references, without max()'s call: this runs for
        # every admission and eviction.
        built_at = self._queue_built_at
        since = self._references - built_at
        if built_at < 0 or (since > 64 and since > self._table.resident_count // 8):
            self._build_queue()

    def _build_queue(self) -> None:
        """Rank every resident not held: the queue starts afresh."""
        t = self._table
        res = t.resident_slots()
        if self._held:
            held = np.fromiter(self._held, dtype=np.int64, count=len(self._held))
            res = res[~np.isin(res, held)]
        self._set_queue(res)
        self._passed.clear()
        self._unranked.clear()
        self._queue_built_at = self._references

    def _rerank(self) -> bool:
        """The queue ran out: rank again, whether anything is left to walk. With no block held,
        every resident, as the policy always has. With blocks held, only the unranked ones:
        the other candidates are in the passed list already, and ranking every resident on
        each allocation while DRAM is full of dirty blocks is what made puts slow down with
        the number of blocks resident."""
        if not self._held:
            self._build_queue()
            return True
        if not self._unranked:
            return False
        res = np.fromiter(self._unranked, dtype=np.int64, count=len(self._unranked))
        self._unranked.clear()
        self._set_queue(np.sort(res))  # slot order, as resident_slots() gives, for ties
        return True

    def _set_queue(self, res: npt.NDArray[np.int64]) -> None:
        t = self._table
        dens = self._model.density(t.klass[res], self._clock - t.last[res])
        queue = res[np.lexsort((t.last[res], dens))]
        self._queue = queue.data
        self._queue_versions = t.version[queue].data
        self._cursor = 0

    def _weakest_density(self) -> float | None:
        # The first passed or queued entry still resident, unchanged since the ranking and not
        # held; re-ranked once if the queue runs out. Called for every admission: locals
        # instead of attribute lookups in the loop.
        t = self._table
        if t.resident_count == 0:
            return None
        self._refresh_queue()
        resident, version, held = t.resident_cells, t.version_cells, self._held
        passed = self._passed
        while passed:
            slot, ver = passed[0]
            if resident[slot] and version[slot] == ver and slot not in held:
                return self._density_at(slot)
            passed.popleft()
        queue, versions, cursor = self._queue, self._queue_versions, self._cursor
        reranked = False
        while True:
            if cursor < len(queue):
                slot = queue[cursor]
                if resident[slot] and version[slot] == versions[cursor] and slot not in held:
                    self._cursor = cursor
                    return self._density_at(slot)
                cursor += 1
            elif reranked or not self._rerank():
                self._cursor = cursor
                return None
            else:
                # a full re-ranking emptied the passed list; a partial one left it empty
                queue, versions, cursor = self._queue, self._queue_versions, 0
                reranked = True

    def _density_at(self, slot: int) -> float:
        t = self._table
        return self._model.density_of(t.klass_cells[slot], self._clock - t.last_cells[slot])
