"""The tenants' DRAM regions as the store uses them: where each tenant's blocks may live.

Every namespace belongs to one region, chosen by its tenant (the default region holds the
namespaces of tenants that are not listed). A region has its own slot allocator, so one
tenant's allocations, evictions and refusals never touch another tenant's bytes, and its own
counters, so a tenant's STATFS shows its own traffic and nobody else's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvtierd.store.arena import Region
from kvtierd.store.counts import TrafficCounts, zeroed
from kvtierd.store.slots import SlotAllocator

__all__ = ["COUNTERS", "Regions", "TenantRegion"]

#: What the store counts per region (and in total): the names of ``BlockStore.counters``
#: that belong to one tenant's traffic.
COUNTERS = tuple(zeroed(TrafficCounts))


@dataclass(eq=False)
class TenantRegion:
    """One region: its place in the arena, its allocator and its tenant's counters."""

    mapping: Region
    allocator: SlotAllocator
    counters: dict[str, int] = field(default_factory=lambda: zeroed(TrafficCounts))

    def statistics(self) -> TrafficCounts:
        """This tenant's traffic so far."""
        return TrafficCounts.of(self.counters)

    @property
    def id(self) -> int:
        return self.mapping.id

    @property
    def tenant(self) -> str | None:
        return self.mapping.tenant

    @property
    def fd(self) -> int:
        return self.mapping.fd

    @property
    def size_bytes(self) -> int:
        return self.mapping.size_bytes

    def relative(self, offset: int) -> int:
        """An arena offset as the client sees it: from the start of its region."""
        return offset - self.mapping.base


class Regions:
    """Every region, by tenant; the default region (if any) for tenants not listed."""

    def __init__(self, mappings: Sequence[Region], *, boundary: int | None = None) -> None:
        """``boundary``: no slot crosses a multiple of it (io_uring's fixed-buffer chunks)."""
        self._all = [
            TenantRegion(m, SlotAllocator(m.base, m.size_bytes, boundary=boundary))
            for m in mappings
        ]
        self._by_tenant = {r.tenant: r for r in self._all if r.tenant is not None}
        self._default = next((r for r in self._all if r.tenant is None), None)

    def __iter__(self) -> Iterator[TenantRegion]:
        return iter(self._all)

    def for_tenant(self, tenant: str) -> TenantRegion | None:
        """The region of ``tenant``'s namespaces; ``None`` when it has none (every byte of
        DRAM went to listed tenants and ``tenant`` is not one of them)."""
        return self._by_tenant.get(tenant, self._default)

    @property
    def used_bytes(self) -> int:
        return sum(r.allocator.used_bytes for r in self._all)
