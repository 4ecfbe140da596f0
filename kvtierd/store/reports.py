"""The store's statistics, put together once: :func:`store_statistics` reads the counters of
:mod:`kvtierd.store.counts` and each tier's figures into one
:class:`~kvtierd.store.counts.StoreStatistics`, for the host or for one peer's tenants.

:meth:`BlockStore.statistics() <kvtierd.store.store.BlockStore.statistics>` is its caller; the
daemon writes STATFS from the record and the metrics export it, so neither reaches into the
residency, the tiers or write-back for figures of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvtierd.store.counts import StoreStatistics, TierFigures, TrafficCounts
from kvtierd.store.namespaces import Namespace, PeerCredentials
from kvtierd.store.regions import TenantRegion
from kvtierd.store.residency import Residency
from kvtierd.store.segments import slot_bytes_for

__all__ = ["TenantFigures", "store_statistics", "tenant_figures"]


@dataclasses.dataclass(frozen=True, slots=True)
class TenantFigures:
    """One DRAM region's tenant (``None``: the region of the tenants not listed) and what its
    namespaces hold in each tier and did, since the daemon started."""

    tenant: str | None
    namespaces: int
    dram_blocks: int
    dram_used_bytes: int
    dram_capacity_bytes: int
    nvme_blocks: int
    nvme_used_bytes: int
    counts: TrafficCounts


def tenant_figures(residency: Residency) -> tuple[TenantFigures, ...]:
    """Every region's :class:`TenantFigures`, in the regions' order (one walk over the
    namespaces: a region's blocks are its namespaces')."""
    by_region: dict[int, list[Namespace]] = {}
    for ns in residency.registry:
        if ns.region is not None:
            by_region.setdefault(ns.region.id, []).append(ns)
    figures = []
    for region in residency.regions:
        namespaces = by_region.get(region.id, [])
        figures.append(
            TenantFigures(
                tenant=region.tenant,
                namespaces=len(namespaces),
                dram_blocks=sum(ns.dram_blocks for ns in namespaces),
                dram_used_bytes=region.allocator.used_bytes,
                dram_capacity_bytes=region.allocator.capacity,
                nvme_blocks=sum(ns.nvme_blocks for ns in namespaces),
                nvme_used_bytes=sum(
                    ns.nvme_blocks * slot_bytes_for(ns.spec.block_bytes) for ns in namespaces
                ),
                counts=region.statistics(),
            )
        )
    return tuple(figures)


def store_statistics(
    residency: Residency, io_backend: str, peer: PeerCredentials | None = None
) -> StoreStatistics:
    """The host's figures (``peer`` None: for the admin), or only what belongs to the tenants
    ``peer`` is admitted to, so that no tenant sees another's traffic."""
    if peer is not None:
        return _tenant_statistics(residency, io_backend, peer)
    r = residency
    c = r.statistics()
    tiers = [_dram_figures(list(r.registry), list(r.regions), c)]
    if r.lower is not None:
        lower = r.lower.statistics()
        # the disk tier counts no evictions of its own: the residency does
        tiers.append(dataclasses.replace(lower, evictions=c.lower_evictions))
    if r.shared is not None:  # counted by the pool tier itself; blocks = its manifest
        tiers.append(r.shared.statistics())
    return StoreStatistics(
        scope="host",
        io_backend=io_backend,
        namespaces=len(r.registry),
        tiers=tuple(tiers),
        dirty_blocks=r.writeback.backlog,
        dirty_bytes=r.writeback.pending_bytes(),
        durable_blocks=sum(ns.nvme_blocks for ns in r.registry),
        promotions=c.promotions,
        prefetch_promoted=c.prefetch_promoted,
        prefetch_used=c.prefetch_used,
        prefetch_wasted_bytes=c.prefetch_wasted_bytes,
        corrupt_writebacks=c.corrupt_writebacks,
        sparse_summaries=r.sparse.summaries,
        sparse_summary_bytes=r.sparse.summary_bytes,
        sparse_summaries_dropped=r.sparse.summaries_dropped,
        sparse_fits=r.sparse.fits,
        checkpoints=r.lower.checkpoint_figures() if r.lower is not None else None,
        counts=c,
    )


def _tenant_statistics(
    residency: Residency, io_backend: str, peer: PeerCredentials
) -> StoreStatistics:
    """Its tenants' namespaces and regions; nothing of anyone else (host-wide figures 0)."""
    r = residency
    registry = r.registry
    namespaces = [ns for ns in registry if registry.may_use(ns.spec.tenant, peer)]
    regions = {id(ns.region): ns.region for ns in namespaces if ns.region is not None}
    counts = sum((region.statistics() for region in regions.values()), TrafficCounts())
    tiers = [_dram_figures(namespaces, list(regions.values()), counts)]
    if r.lower is not None:
        tiers.append(
            TierFigures(
                name="nvme",
                blocks=sum(ns.nvme_blocks for ns in namespaces),
                used_bytes=sum(
                    ns.nvme_blocks * slot_bytes_for(ns.spec.block_bytes) for ns in namespaces
                ),
                capacity_bytes=r.lower.statistics().capacity_bytes,
                hits=counts.lower_hits,
                misses=0,
                evictions=0,
                bytes_read=0,
                bytes_written=0,
            )
        )
    scope = {id(ns) for ns in namespaces}
    dirty = [b for b in r.writeback.queued() if id(b.ns) in scope]
    return StoreStatistics(
        scope="tenant",
        io_backend=io_backend,
        namespaces=len(namespaces),
        tiers=tuple(tiers),
        dirty_blocks=len(dirty),
        dirty_bytes=sum(b.ref.raw_bytes for b in dirty),
        durable_blocks=sum(ns.nvme_blocks for ns in namespaces),
        promotions=counts.promotions,
        prefetch_promoted=0,
        prefetch_used=0,
        prefetch_wasted_bytes=0,
        corrupt_writebacks=counts.corrupt_writebacks,
        sparse_summaries=0,
        sparse_summary_bytes=0,
        sparse_summaries_dropped=0,
        sparse_fits=0,
        checkpoints=None,
        counts=counts,
    )


def _dram_figures(
    namespaces: Sequence[Namespace], regions: Sequence[TenantRegion], counts: TrafficCounts
) -> TierFigures:
    """The DRAM tier's figures over ``namespaces`` and their ``regions``."""
    return TierFigures(
        name="dram",
        blocks=sum(ns.dram_blocks for ns in namespaces),
        used_bytes=sum(r.allocator.used_bytes for r in regions),
        capacity_bytes=sum(r.allocator.capacity for r in regions),
        hits=counts.dram_hits,
        misses=counts.lower_hits + counts.misses,
        miss_bytes=counts.miss_bytes,
        evictions=counts.dram_evictions,
        bytes_read=counts.bytes_read,
        bytes_written=counts.bytes_committed,
    )
