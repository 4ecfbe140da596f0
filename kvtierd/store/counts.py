"""What the store counts, as typed frozen records read by STATFS, the metrics and ``kvtierctl``.

The store counts in plain dicts on its hot paths (one ``+=`` per event, keyed by these records'
field names, so a misspelt name is a ``KeyError`` at once); whoever reports reads a snapshot,
:meth:`Residency.statistics() <kvtierd.store.residency.Residency.statistics>` (the host's) or
:meth:`TenantRegion.statistics() <kvtierd.store.regions.TenantRegion.statistics>` (one tenant's),
never the dicts. :meth:`BlockStore.statistics() <kvtierd.store.store.BlockStore.statistics>`
puts them together in one :class:`StoreStatistics`, each tier's as a :class:`TierFigures`: the
daemon writes STATFS from it, the metrics export it, ``kvtierctl`` formats STATFS; none of them
reaches into the store for more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

__all__ = [
    "CheckpointFigures",
    "StoreCounts",
    "StoreStatistics",
    "TierFigures",
    "TrafficCounts",
    "zeroed",
]


@dataclass(frozen=True, slots=True)
class TrafficCounts:
    """One tenant's traffic (or the host's), since the daemon started."""

    dram_hits: int = 0
    lower_hits: int = 0
    pool_hits: int = 0
    misses: int = 0
    dram_evictions: int = 0
    promotions: int = 0
    bytes_read: int = 0
    bytes_committed: int = 0
    #: Blocks dropped because their tenant changed them after COMMIT.
    corrupt_writebacks: int = 0
    #: Bytes of the blocks counted in ``lower_hits``, ``pool_hits`` and ``misses``: what DRAM
    #: did not have when it was asked.
    miss_bytes: int = 0

    @classmethod
    def of(cls, counters: Mapping[str, int]) -> Self:
        """The record of the counter dict ``counters`` (which holds at least its fields)."""
        return cls(**{f.name: counters[f.name] for f in dataclasses.fields(cls)})

    def __add__(self, other: Self) -> Self:
        """Field by field; both of the same record type."""
        if type(other) is not type(self):
            return NotImplemented
        return type(self)(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )


@dataclass(frozen=True, slots=True)
class StoreCounts(TrafficCounts):
    """The host's traffic plus what only the host counts."""

    lower_evictions: int = 0
    prefetch_promoted: int = 0
    prefetch_used: int = 0
    prefetch_wasted_bytes: int = 0
    #: Committed blocks gone everywhere (a torn copy, a change after COMMIT).
    lost: int = 0
    written_back: int = 0


def zeroed(record: type[Any]) -> dict[str, int]:
    """A counter dict for the fields of the dataclass ``record``, all zero."""
    return dict.fromkeys((f.name for f in dataclasses.fields(record)), 0)


@dataclass(frozen=True, slots=True)
class TierFigures:
    """One tier's figures (STATFS's ``tiers``): blocks and bytes held, traffic since start."""

    name: str
    blocks: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    bytes_read: int
    bytes_written: int
    #: Bytes of the blocks counted in ``misses``.
    miss_bytes: int = 0


@dataclass(frozen=True, slots=True)
class CheckpointFigures:
    """The disk tier's index checkpoints (:mod:`kvtierd.store.checkpoint`) in this run."""

    #: ``"on"``, ``"off"`` (by configuration) or ``"given up: <why>"`` for the rest of the run.
    state: str
    written: int
    #: Seconds since the last was written; ``None`` when none was in this run.
    age_s: float | None
    #: Bytes written to the tier since the last one was begun.
    bytes_since: int
    #: The longest one slice of a checkpoint's copy held the event loop, in seconds.
    longest_slice_s: float

    @property
    def on(self) -> bool:
        return self.state == "on"


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """Everything the store reports, for the host (``scope`` ``"host"``) or for the tenants one
    peer is admitted to (``"tenant"``: their namespaces, regions and traffic; host-wide
    figures 0, no checkpoints)."""

    scope: str
    io_backend: str
    namespaces: int
    #: DRAM first, then the disk tier and the pool, where the store has them.
    tiers: tuple[TierFigures, ...]
    dirty_blocks: int
    dirty_bytes: int
    durable_blocks: int
    promotions: int
    prefetch_promoted: int
    prefetch_used: int
    prefetch_wasted_bytes: int
    corrupt_writebacks: int
    sparse_summaries: int
    sparse_summary_bytes: int
    sparse_summaries_dropped: int
    #: Sparse indices being clustered in the background now.
    sparse_fits: int
    #: ``None``: no disk tier, or the tenant's scope.
    checkpoints: CheckpointFigures | None
    #: The counts the figures above were made of: the host's (:class:`StoreCounts`) or the
    #: tenants' regions' (:class:`TrafficCounts`).
    counts: TrafficCounts

    def tier(self, name: str) -> TierFigures | None:
        """The figures of tier ``name`` (``"dram"``, ``"nvme"``, ``"pool"``), if the store has
        that tier."""
        return next((t for t in self.tiers if t.name == name), None)
