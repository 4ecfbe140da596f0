"""What the metrics read of the daemon: one :class:`MetricsSnapshot` a second, taken on the event
loop (:func:`take_snapshot`: the STATFS record, the pool's status, the namespace counters folded
into their bounded labels, the transfers by direction, the disk tier's failures and checkpoints; all
but the namespaces' from the store's one record,
:meth:`~kvtierd.store.store.BlockStore.statistics`), which :mod:`kvtierd.server.metrics`' collector,
on the HTTP threads, only reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtierd.io import IoStatistics
from kvtierd.pool.link import PoolLink
from kvtierd.protocol.messages import PoolStatusReply, StatfsReply
from kvtierd.server.context import Reports
from kvtierd.store.counts import CheckpointFigures, StoreCounts, StoreStatistics
from kvtierd.store.diskhealth import DiskFault
from kvtierd.store.index import Block
from kvtierd.store.reports import TenantFigures
from kvtierd.store.store import BlockStore

__all__ = [
    "NO_TENANT",
    "OTHER_NAMESPACE",
    "UNLISTED_TENANT",
    "MetricsSnapshot",
    "NamespaceFigures",
    "NamespaceLabels",
    "Observed",
    "Transfer",
    "take_snapshot",
    "tenant_label",
]


class Observed(Reports, Protocol):
    """What a snapshot reads of the daemon: its reports, its store and its pool link."""

    @property
    def store(self) -> BlockStore: ...

    @property
    def pool(self) -> PoolLink[Block] | None: ...

    @property
    def config_digest(self) -> str: ...


#: The ``namespace`` label of every namespace not given its own.
OTHER_NAMESPACE = "other"
#: The ``tenant`` label of the DRAM region shared by the tenants ``[[tenants]]`` does not list
#: (every tenant's, when it lists none).
UNLISTED_TENANT = "(unlisted)"
#: The ``tenant`` label of a request on no namespace (INIT, OPEN_NS, STATFS...).
NO_TENANT = "none"


def tenant_label(region_tenant: str | None) -> str:
    """The bounded ``tenant`` label of what lives in a DRAM region of ``region_tenant``: a
    listed tenant's name, or :data:`UNLISTED_TENANT` for the region of the others (``None``).
    A tenant is told apart where it has a region of its own, which is also where its figures
    can be told apart."""
    return region_tenant if region_tenant is not None else UNLISTED_TENANT


@dataclass(frozen=True, slots=True)
class NamespaceFigures:
    """The counters of the namespace one (``tenant``, ``label``, ``rank``) stands for, or of
    every namespace without series of its own (``"other"``, ``"other"``, ``""``), summed."""

    tenant: str
    label: str
    rank: str
    lookup_blocks: int = 0
    hit_blocks: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    committed_blocks: int = 0
    committed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Transfer:
    """Blocks and bytes moved one way (``direction``: ``client_to_dram``, ...)."""

    direction: str
    blocks: int
    bytes: int


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """What the event loop saw at one instant; the collector's only source."""

    statfs: StatfsReply
    pool: PoolStatusReply | None
    namespaces: tuple[NamespaceFigures, ...]
    transfers: tuple[Transfer, ...]
    lost_copies: int
    #: The disk tier's failures by fault (every fault; zeros without an NVMe tier).
    disk_failures: tuple[tuple[DiskFault, int], ...] = ()
    #: The disk tier's index checkpoints (``None``: no NVMe tier).
    checkpoints: CheckpointFigures | None = None
    #: Each DRAM region's tenant label and figures.
    tenants: tuple[tuple[str, TenantFigures], ...] = ()
    #: The I/O backend's counters (``None``: no NVMe tier).
    io: IoStatistics | None = None
    #: Blocks queued for promotion into DRAM, not yet taken by a promoter.
    queued_promotions: int = 0
    #: The running configuration's digest (SHA-256 hex).
    config_digest: str = ""


class NamespaceLabels:
    """Which namespaces get series of their own, labelled by tenant, name and TP rank (so the
    same name in two tenants or of two ranks is two series): those whose name ``allowed``
    lists, or, with no allow-list, the first ``limit`` namespaces seen; the others are summed
    into one ``namespace="other"`` series. A namespace once given series of its own keeps them
    for the daemon's life (stable series)."""

    def __init__(self, allowed: Sequence[str], limit: int) -> None:
        self._allowed = frozenset(allowed)
        self._limit = limit
        self._own: set[tuple[str, str, int]] = set()  # at most ``limit`` namespaces

    def labels(self, tenant: str, name: str, rank: int) -> tuple[str, str, str]:
        """``(tenant, namespace, rank)`` labels of the namespace ``name`` of ``tenant``."""
        identity = (tenant, name, rank)
        if self._allowed:
            own = name in self._allowed
        elif identity in self._own:
            own = True
        elif len(self._own) < self._limit:
            self._own.add(identity)
            own = True
        else:
            own = False
        return (tenant, name, str(rank)) if own else (OTHER_NAMESPACE, OTHER_NAMESPACE, "")


def _fold_namespaces(daemon: Observed, labels: NamespaceLabels) -> tuple[NamespaceFigures, ...]:
    sums: dict[tuple[str, str, str], list[int]] = {}
    for ns in daemon.store.registry:
        c = ns.counters
        spec = ns.spec
        tokens = spec.layout.block_tokens if spec.layout is not None else 0
        row = sums.setdefault(labels.labels(spec.tenant, spec.name, spec.rank), [0] * 8)
        for i, value in enumerate(
            (
                c.lookup_blocks,
                c.hit_blocks,
                c.lookup_blocks * tokens,
                c.hit_blocks * tokens,
                c.read_blocks,
                c.read_bytes,
                c.committed_blocks,
                c.committed_bytes,
            )
        ):
            row[i] += value
    return tuple(NamespaceFigures(*key, *row) for key, row in sorted(sums.items()))


def _transfers(
    daemon: Observed,
    store: StoreStatistics,
    c: StoreCounts,
    namespaces: Iterable[NamespaceFigures],
) -> tuple[Transfer, ...]:
    """Blocks and bytes by direction (``c``: the host's counts behind ``store``). Client
    traffic counts whole blocks; NVMe bytes are what the device moved (a record's header page
    and its payload padded to 4 KiB, compressed where zstd is on); pool bytes are the values
    sent and received."""
    figures = list(namespaces)
    moved = [
        Transfer(
            "client_to_dram",
            sum(f.committed_blocks for f in figures),
            sum(f.committed_bytes for f in figures),
        ),
        Transfer(
            "dram_to_client",
            sum(f.read_blocks for f in figures),
            sum(f.read_bytes for f in figures),
        ),
    ]
    nvme = store.tier("nvme")
    if nvme is not None:
        moved.append(Transfer("dram_to_nvme", c.written_back, nvme.bytes_written))
        moved.append(Transfer("nvme_to_dram", c.lower_hits, nvme.bytes_read))
    pool = store.tier("pool")
    if pool is not None and daemon.pool is not None:
        written = daemon.pool.statistics().written
        moved.append(Transfer("dram_to_pool", written, pool.bytes_written))
        moved.append(Transfer("pool_to_dram", c.pool_hits, pool.bytes_read))
    return tuple(moved)


def take_snapshot(daemon: Observed, labels: NamespaceLabels) -> MetricsSnapshot:
    """Everything the collector exports, read on the event loop (cheap: counters and sums)."""
    namespaces = _fold_namespaces(daemon, labels)
    store = daemon.store.statistics()
    c = store.counts
    assert isinstance(c, StoreCounts)  # the host's scope
    return MetricsSnapshot(
        daemon.statistics(figures=store),
        daemon.pool_status() if daemon.pool is not None else None,
        namespaces,
        _transfers(daemon, store, c, namespaces),
        c.lost,
        _disk_failures(daemon),
        store.checkpoints,
        tuple((tenant_label(f.tenant), f) for f in daemon.store.tenant_statistics()),
        backend.statistics() if (backend := daemon.store.io_backend) is not None else None,
        daemon.store.queued_promotions,
        daemon.config_digest,
    )


def _disk_failures(daemon: Observed) -> tuple[tuple[DiskFault, int], ...]:
    watch = daemon.store.disk
    counts = watch.health.failures if watch is not None else dict.fromkeys(DiskFault, 0)
    return tuple((fault, counts[fault]) for fault in DiskFault)
