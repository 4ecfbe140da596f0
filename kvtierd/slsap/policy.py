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

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        """Up to ``count`` residents, lowest density first, all satisfying ``evictable``."""
        t = self._table
        chosen: list[Hashable] = []
        taken: set[int] = set()
        if count <= 0 or t.resident_count == 0:
            return chosen
        self._refresh_queue()
        resident, version, keys = t.resident_cells, t.version_cells, t.keys
        queue, versions = self._queue, self._queue_versions
        rebuilt = False
        i = self._cursor
        while len(chosen) < count:
            if i >= len(queue):
                if rebuilt:
                    break
                self._build_queue()
                queue, versions = self._queue, self._queue_versions
                rebuilt, i = True, 0
                continue
            slot = queue[i]
            valid = resident[slot] and version[slot] == versions[i]
            if not valid or slot in taken:
                if i == self._cursor and not valid:
                    self._cursor += 1
                i += 1
                continue
            key = keys[slot]
            if evictable(key):
                chosen.append(key)
                taken.add(slot)
            i += 1
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
        """The density of the resident :meth:`victims` would offer first (None when empty)."""
        return self._weakest_density()

    def statistics(self) -> SlsapStatistics:
        t = self._table
        return SlsapStatistics(
            resident=t.resident_count,
            ghosts=t.ghost_count,
            references=self._references,
            refits=self._model.refits,
            memory_bytes=t.nbytes() + self._queue.nbytes + self._queue_versions.nbytes,
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
        t = self._table
        res = t.resident_slots()
        dens = self._model.density(t.klass[res], self._clock - t.last[res])
        queue = res[np.lexsort((t.last[res], dens))]
        self._queue = queue.data
        self._queue_versions = t.version[queue].data
        self._cursor = 0
        self._queue_built_at = self._references

    def _weakest_density(self) -> float | None:
        # The first queued slot still resident and unchanged since the ranking; the queue is
        # re-ranked once if it runs out. Called for every admission: locals instead of attribute
        # lookups in the loop.
        t = self._table
        if t.resident_count == 0:
            return None
        self._refresh_queue()
        resident, version = t.resident_cells, t.version_cells
        queue, versions, cursor = self._queue, self._queue_versions, self._cursor
        rebuilt = False
        while True:
            if cursor < len(queue):
                slot = queue[cursor]
                if resident[slot] and version[slot] == versions[cursor]:
                    self._cursor = cursor
                    age = self._clock - t.last_cells[slot]
                    return self._model.density_of(t.klass_cells[slot], age)
                cursor += 1
            elif rebuilt:
                self._cursor = cursor
                return None
            else:
                self._build_queue()
                queue, versions, cursor = self._queue, self._queue_versions, 0
                rebuilt = True
