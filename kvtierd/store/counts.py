"""What the store counts, as typed frozen records read by STATFS, the metrics and ``kvtierctl``.

The store counts in plain dicts on its hot paths (one ``+=`` per event, keyed by these records'
field names, so a misspelt name is a ``KeyError`` at once); whoever reports reads a snapshot,
:meth:`Residency.statistics() <kvtierd.store.residency.Residency.statistics>` (the host's) or
:meth:`TenantRegion.statistics() <kvtierd.store.regions.TenantRegion.statistics>` (one tenant's),
never the dicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

__all__ = ["StoreCounts", "TrafficCounts", "zeroed"]


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
