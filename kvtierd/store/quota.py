"""A connection's share of its tenant's DRAM region: what its leases and pending writes may pin.

Counted when the lease or write is granted (so requests that wait meanwhile see it), given back
when it ends. Pure bookkeeping on :class:`~kvtierd.store.index.Owner`; nothing here touches a
block.
"""

from __future__ import annotations

from kvtierd.config import LimitsConfig
from kvtierd.errors import QuotaError
from kvtierd.store.index import Owner
from kvtierd.store.namespaces import Namespace

__all__ = ["check_lease_quota", "hold_pinned"]


def check_lease_quota(limits: LimitsConfig, owner: Owner, ns: Namespace, count: int) -> int:
    """Count a lease of ``count`` blocks of ``ns`` against ``owner``'s quota at once; the bytes
    held, for the caller to give back if the lease is not granted. ``QuotaError`` beyond the
    limits."""
    if len(owner.leases) >= limits.max_leases_per_connection:
        raise QuotaError(
            f"this connection holds {len(owner.leases)} leases "
            "(limits.max_leases_per_connection): release some first"
        )
    return hold_pinned(limits, owner, ns, count * ns.spec.block_bytes)


def hold_pinned(limits: LimitsConfig, owner: Owner, ns: Namespace, nbytes: int) -> int:
    """Count ``nbytes`` against ``owner``'s share of ``ns``'s region; ``QuotaError`` (and
    nothing counted) when it would hold more than its share."""
    region = ns.region
    if region is None:
        return 0
    allowed = int(limits.connection_pinned_share * region.allocator.capacity)
    held = owner.pinned.get(region.id, 0)
    if held + nbytes > allowed:
        raise QuotaError(
            f"this connection would hold {held + nbytes} bytes of its tenant's "
            f"{region.allocator.capacity}-byte DRAM region in leases and pending writes; "
            f"limits.connection_pinned_share allows {allowed}"
        )
    owner.hold(region, nbytes)
    return nbytes
