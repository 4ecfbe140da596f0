"""Prometheus metrics: what the daemon counts, as families with units and bounded labels.

Theory of operation. The HTTP threads of the metrics listener (:mod:`kvtierd.server.endpoint`)
must never touch the store, which belongs to the event loop. So a task on the loop takes a
:class:`~kvtierd.server.figures.MetricsSnapshot` every second (:mod:`kvtierd.server.figures`:
the STATFS record, the pool's status, the namespace counters folded into their labels, the
transfers by direction, the disk tier's failures and checkpoints), and
:class:`SnapshotCollector` only reads the latest one: one reference swap, no lock. Request
latencies cannot wait for a snapshot: they are one prometheus_client ``Histogram`` (which is
thread-safe), observed once per request by the session through :class:`RequestTimings`.

Every label is bounded: ``tier`` (dram, nvme, pool), ``direction`` (six), ``opcode`` (the
protocol's), ``state`` (the pool's three), ``phase`` (three), ``reason`` (the disk tier's four
faults, :class:`~kvtierd.store.diskhealth.DiskFault`, every one always exported).
``namespace`` takes a namespace's name when it is listed in ``daemon.metrics_namespaces`` or,
when that list is empty, when it is among the first ``daemon.metrics_namespace_limit`` names
the daemon came to know; every other namespace is summed into ``namespace="other"``.

The pool's tier gauges (``kvtierd_tier_blocks{tier="pool"}`` and its bytes) describe the pool
only while this rank is attached to it; while it is not, those series are left out rather than
repeat a figure nobody can check (``kvtierd_pool_up`` is 0 then); its counters stay.

The module is past 600 lines because it is every family the daemon exports, each beside its
HELP text, in one place that reads side by side with the table in ``docs/operations.md``
(which a test checks against the live registry); what a snapshot reads of the loop is
:mod:`kvtierd.server.figures`.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtierd.config import DaemonConfig
from kvtierd.io.base import LATENCY_BUCKETS_S, IoStatistics
from kvtierd.protocol import Opcode
from kvtierd.protocol.messages import PoolStatusReply
from kvtierd.server.figures import (
    MetricsSnapshot,
    NamespaceFigures,
    NamespaceLabels,
    Observed,
    Transfer,
    take_snapshot,
)
from kvtierd.server.readiness import DaemonPhase, PoolView, Readiness
from kvtierd.store.counts import CheckpointFigures
from kvtierd.store.diskhealth import DiskFault
from kvtierd.store.reports import TenantFigures

__all__ = ["DURATION_BUCKETS_S", "Metrics", "RequestTimings"]

#: Request duration buckets, 5 µs (a LOOKUP served inline) to 60 s (an FSYNC behind a large
#: write-back backlog), in 1-2.5-5 steps.
DURATION_BUCKETS_S = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
)  # fmt: skip
POOL_STATES = ("local", "voting", "attached")

_SINCE_START = "since the daemon started"
#: STATFS fields exported as themselves: (field, metric, HELP).
_COUNTERS = (
    ("requests", "kvtierd_requests", f"Requests served, every opcode, {_SINCE_START}."),
    (
        "promotions",
        "kvtierd_promotions",
        f"Blocks copied up into DRAM from NVMe or the pool (on demand or ahead), {_SINCE_START}.",
    ),
    (
        "prefetch_promoted",
        "kvtierd_prefetch_promoted",
        f"Blocks promoted into DRAM ahead of any READ (LOOKUP, HINT, reuse model), {_SINCE_START}.",
    ),
    (
        "prefetch_used",
        "kvtierd_prefetch_used",
        f"Blocks promoted ahead that a READ then used, {_SINCE_START}.",
    ),
    (
        "prefetch_wasted_bytes",
        "kvtierd_prefetch_wasted_bytes",
        f"Bytes promoted ahead and evicted unread, {_SINCE_START}.",
    ),
    (
        "corrupt_writebacks",
        "kvtierd_corrupt_writebacks",
        "Blocks dropped instead of written back because their tenant changed them after "
        f"COMMIT, {_SINCE_START}.",
    ),
)
_GAUGES = (
    ("connections", "kvtierd_connections", "Client connections open now."),
    ("namespaces", "kvtierd_namespaces", "Namespaces this daemon knows (opened or recovered)."),
    ("leases", "kvtierd_leases", "READ leases clients hold now."),
    ("leased_blocks", "kvtierd_leased_blocks", "Blocks pinned in DRAM by leases now."),
    ("pending_writes", "kvtierd_pending_writes", "ALLOCs not yet committed or aborted."),
    (
        "dirty_blocks",
        "kvtierd_dirty_blocks",
        "Committed blocks not yet written back to NVMe (the write-back backlog).",
    ),
    ("dirty_bytes", "kvtierd_dirty_bytes", "Bytes of the write-back backlog."),
    ("durable_blocks", "kvtierd_durable_blocks", "Blocks with a copy on NVMe."),
)
#: TierStatistics fields: (field, metric, kind, HELP).
_TIER = (
    ("blocks", "kvtierd_tier_blocks", "gauge", "Blocks held by each tier (pool: while attached)."),
    ("used_bytes", "kvtierd_tier_used_bytes", "gauge", "Bytes used in each tier."),
    (
        "capacity_bytes",
        "kvtierd_tier_capacity_bytes",
        "gauge",
        "Capacity of each tier in bytes (pool: 0, the pool's own maxmemory is not known).",
    ),
    (
        "hits",
        "kvtierd_tier_hits",
        "counter",
        f"Blocks each tier served: DRAM reads, NVMe/pool promotions, {_SINCE_START}.",
    ),
    (
        "misses",
        "kvtierd_tier_misses",
        "counter",
        "Blocks each tier did not have or could not serve (DRAM: served from below or missing; "
        f"NVMe/pool: absent, unreadable or failing their checksum), {_SINCE_START}.",
    ),
    (
        "miss_bytes",
        "kvtierd_tier_miss_bytes",
        "counter",
        "Bytes of the blocks counted in kvtierd_tier_misses (DRAM: what had to come from below "
        f"or was missing), {_SINCE_START}.",
    ),
    (
        "evictions",
        "kvtierd_tier_evictions",
        "counter",
        f"Blocks evicted from each tier, {_SINCE_START}.",
    ),
    (
        "bytes_read",
        "kvtierd_tier_read_bytes",
        "counter",
        "Bytes read from each tier (DRAM: by clients; NVMe: record pages; pool: values), "
        f"{_SINCE_START}.",
    ),
    (
        "bytes_written",
        "kvtierd_tier_written_bytes",
        "counter",
        "Bytes written into each tier (DRAM: committed; NVMe: record pages; pool: values), "
        f"{_SINCE_START}.",
    ),
)
_POOL_GAUGES = (
    ("epoch", "kvtierd_pool_epoch", "Epoch of the last group decision this rank took part in."),
    ("members", "kvtierd_pool_members", "Ranks that voted yes in that decision."),
    (
        "changed_at",
        "kvtierd_pool_state_changed_timestamp_seconds",
        "Unix time of the pool state's last change.",
    ),
    (
        "backlog_blocks",
        "kvtierd_pool_backlog_blocks",
        "Committed blocks waiting to be written to the pool (bounded by pool.writeback_bytes).",
    ),
    ("backlog_bytes", "kvtierd_pool_backlog_bytes", "Bytes waiting to be written to the pool."),
    (
        "unreached",
        "kvtierd_pool_unreached_blocks",
        "Blocks the last restore found announced in the pool but lost everywhere.",
    ),
)
_POOL_COUNTERS = (
    ("restored", "kvtierd_pool_restored_blocks", "Blocks indexed from the pool by restores"),
    ("written", "kvtierd_pool_written_blocks", "Blocks written to the pool"),
    ("write_failures", "kvtierd_pool_write_failures", "Pool writes that failed (one per batch)"),
    (
        "skipped",
        "kvtierd_pool_skipped_blocks",
        "Blocks not written to the pool (backlog full, or left after a failure)",
    ),
    ("lost", "kvtierd_pool_lost_blocks", "Blocks whose last copy went before reaching the pool"),
    (
        "group_lookups",
        "kvtierd_pool_group_lookups",
        "TP-group LOOKUPs answered by asking the pool",
    ),
)
#: NamespaceFigures fields: (field, metric, HELP).
_NAMESPACE = (
    ("lookup_blocks", "kvtierd_namespace_lookup_blocks", "Keys asked for by LOOKUP"),
    (
        "hit_blocks",
        "kvtierd_namespace_hit_blocks",
        "Keys LOOKUP answered as hits (the leading hits; every hit for a LOOKUP with each)",
    ),
    (
        "lookup_tokens",
        "kvtierd_namespace_lookup_tokens",
        "Tokens asked for by LOOKUP: keys x layout.block_tokens, namespaces with a layout only",
    ),
    (
        "hit_tokens",
        "kvtierd_namespace_hit_tokens",
        "Tokens LOOKUP answered as hits: hit keys x layout.block_tokens, with a layout only",
    ),
    ("read_blocks", "kvtierd_namespace_read_blocks", "Blocks leased to clients by READ"),
    ("read_bytes", "kvtierd_namespace_read_bytes", "Bytes leased to clients by READ"),
    ("committed_blocks", "kvtierd_namespace_committed_blocks", "Blocks published by COMMIT"),
    ("committed_bytes", "kvtierd_namespace_committed_bytes", "Bytes published by COMMIT"),
)


def _counter(name: str, doc: str, labels: Sequence[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _gauge(name: str, doc: str, value: float | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class SnapshotCollector(Collector):
    """Families built from the latest :class:`MetricsSnapshot` (none before the first)."""

    def __init__(self) -> None:
        self.snapshot: MetricsSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        stats = snap.statfs
        for field, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        yield CounterMetricFamily(
            "kvtierd_lost_copies",
            "Block copies dropped because they failed their checksum, could not be read, or "
            f"changed after COMMIT (the block is then a miss), {_SINCE_START}.",
            value=snap.lost_copies,
        )
        for field, name, doc in _GAUGES:
            yield _gauge(name, doc, getattr(stats, field))
        yield from self._tiers(snap)
        info = GaugeMetricFamily(
            "kvtierd_info",
            "Always 1; the labels say the daemon's version, its NVMe I/O backend and the "
            "digest of the configuration it runs (the first 16 hex digits of kvtierctl "
            "config's: two daemons with one digest run one configuration).",
            labels=["version", "io_backend", "config_digest"],
        )
        info.add_metric([stats.version, stats.io_backend, snap.config_digest[:16]], 1)
        yield info
        yield from self._namespaces(snap.namespaces)
        yield from self._tenants(snap.tenants)
        if snap.io is not None:
            yield from self._io(snap.io, snap.queued_promotions)
        yield from self._transfers(snap.transfers)
        failures = _counter(
            "kvtierd_disk_failures",
            "Disk tier failures by reason (enospc, eio: a block's write-back or a sync failed; "
            "replaced, removed: the data file path no longer names the open file; truncated, "
            "damaged: the data file is shorter than the tier, or its superblock no longer reads "
            "back as written; each seen by a check or an FSYNC refused for it; catalog: a "
            "namespace catalog copy removed, replaced or changed under the daemon, each rewrite "
            f"and each failed rewrite), {_SINCE_START}.",
            ["reason"],
        )
        for fault, count in snap.disk_failures:
            failures.add_metric([fault.value], count)
        yield failures
        if snap.checkpoints is not None:
            yield from self._checkpoints(snap.checkpoints)
        if snap.pool is not None:
            yield from self._pool(snap.pool)

    @staticmethod
    def _checkpoints(figures: CheckpointFigures) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvtierd_checkpoints_written",
            "Index checkpoints of the disk tier written (nvme.checkpoint_every_bytes), "
            f"{_SINCE_START}.",
            value=figures.written,
        )
        yield _gauge(
            "kvtierd_checkpoints_on",
            "1 while the disk tier takes index checkpoints; 0 when they are off "
            "(nvme.checkpoint_every_bytes = 0) or were given up for this run because the data "
            "directory could not take the generation table (an ERROR in the journal): a crash "
            "restart then scans every slot header.",
            float(figures.on),
        )
        yield _gauge(
            "kvtierd_checkpoint_longest_slice_seconds",
            "The longest the event loop was held by one slice of a checkpoint's copy of the "
            f"index, {_SINCE_START}.",
            figures.longest_slice_s,
        )

    @staticmethod
    def _tiers(snap: MetricsSnapshot) -> Iterator[Metric]:
        detached = snap.pool is not None and snap.pool.state != "attached"
        for field, name, kind, doc in _TIER:
            family: Metric = (
                GaugeMetricFamily(name, doc, labels=["tier"])
                if kind == "gauge"
                else CounterMetricFamily(name, doc, labels=["tier"])
            )
            for tier in snap.statfs.tiers:
                if kind == "gauge" and tier.name == "pool" and detached:
                    continue  # a detached pool's figures are stale: left out, pool_up says why
                family.add_metric([tier.name], getattr(tier, field))  # type: ignore[attr-defined]
            yield family

    @staticmethod
    def _namespaces(figures: tuple[NamespaceFigures, ...]) -> Iterator[Metric]:
        for field, name, doc in _NAMESPACE:
            family = _counter(
                name,
                f"{doc}, per namespace by tenant, name and TP rank (bounded: see "
                f'metrics_namespaces; the others summed as namespace="other"), {_SINCE_START}.',
                ["tenant", "namespace", "rank"],
            )
            for row in figures:
                family.add_metric([row.tenant, row.label, row.rank], getattr(row, field))
            yield family

    @staticmethod
    def _tenants(rows: tuple[tuple[str, TenantFigures], ...]) -> Iterator[Metric]:
        by = ["tenant", "tier"]
        blocks = GaugeMetricFamily(
            "kvtierd_tenant_blocks", "Blocks each tenant's namespaces hold in each tier.", labels=by
        )
        used = GaugeMetricFamily(
            "kvtierd_tenant_used_bytes",
            "Bytes each tenant uses in each tier (DRAM: its region's slots, pending writes "
            "included; NVMe: its blocks' slots).",
            labels=by,
        )
        capacity = GaugeMetricFamily(
            "kvtierd_tenant_capacity_bytes",
            "Each tenant's DRAM region in bytes (NVMe is shared: see kvtierd_tier_capacity_bytes).",
            labels=by,
        )
        hits = _counter(
            "kvtierd_tenant_hits",
            f"Blocks each tier served to each tenant's READs, {_SINCE_START}.",
            by,
        )
        misses = _counter(
            "kvtierd_tenant_misses",
            f"Blocks each tenant's READs found in no tier, {_SINCE_START}.",
            ["tenant"],
        )
        evictions = _counter(
            "kvtierd_tenant_evictions",
            f"Blocks evicted from each tenant's DRAM region, {_SINCE_START}.",
            by,
        )
        moved = _counter(
            "kvtierd_tenant_bytes",
            "Bytes each tenant's clients read (leased) and committed, by direction "
            f"(dram_to_client, client_to_dram), {_SINCE_START}.",
            ["tenant", "direction"],
        )
        for label, f in rows:
            c = f.counts
            for tier, count, nbytes in (
                ("dram", f.dram_blocks, f.dram_used_bytes),
                ("nvme", f.nvme_blocks, f.nvme_used_bytes),
            ):
                blocks.add_metric([label, tier], count)
                used.add_metric([label, tier], nbytes)
            capacity.add_metric([label, "dram"], f.dram_capacity_bytes)
            for tier, count in (
                ("dram", c.dram_hits),
                ("nvme", c.lower_hits),
                ("pool", c.pool_hits),
            ):
                hits.add_metric([label, tier], count)
            misses.add_metric([label], c.misses)
            evictions.add_metric([label, "dram"], c.dram_evictions)
            moved.add_metric([label, "dram_to_client"], c.bytes_read)
            moved.add_metric([label, "client_to_dram"], c.bytes_committed)
        yield from (blocks, used, capacity, hits, misses, evictions, moved)

    @staticmethod
    def _io(io: IoStatistics, queued_promotions: int) -> Iterator[Metric]:
        yield _gauge(
            "kvtierd_io_in_flight",
            "Disk operations in the kernel now (at most kvtierd_io_queue_depth).",
            io.in_flight,
        )
        yield _gauge(
            "kvtierd_io_queue_depth",
            "Disk operations the I/O backend keeps in the kernel at most.",
            io.queue_depth,
        )
        yield CounterMetricFamily(
            "kvtierd_io_operations",
            f"Disk operations completed (reads, writes, syncs), {_SINCE_START}.",
            value=io.completed,
        )
        yield CounterMetricFamily(
            "kvtierd_io_submit_calls",
            "System calls that handed disk operations to the kernel (io_uring hands a turn of "
            f"the loop's over in one), {_SINCE_START}.",
            value=io.submit_calls,
        )
        bounds = [f"{bound:g}" for bound in LATENCY_BUCKETS_S] + ["+Inf"]
        cumulative = itertools.accumulate(io.latency_counts or [0] * len(bounds))
        yield HistogramMetricFamily(
            "kvtierd_disk_operation_seconds",
            "How long each disk operation took, from the queue-depth slot it got to its "
            "completion (queueing in the kernel and the device included).",
            buckets=[(b, float(n)) for b, n in zip(bounds, cumulative, strict=True)],
            sum_value=io.latency_sum_s,
        )
        yield _gauge(
            "kvtierd_prefetch_queue_blocks",
            "Blocks queued for promotion into DRAM (LOOKUP, HINT, the reuse model) that no "
            "promoter has taken yet.",
            queued_promotions,
        )

    @staticmethod
    def _transfers(transfers: tuple[Transfer, ...]) -> Iterator[Metric]:
        where = (
            "client_to_dram COMMIT, dram_to_client READ, dram_to_nvme write-back, nvme_to_dram "
            "and pool_to_dram promotions, dram_to_pool pool writes"
        )
        blocks = _counter(
            "kvtierd_transfer_blocks", f"Blocks moved, by direction ({where}), {_SINCE_START}.",
            ["direction"],
        )  # fmt: skip
        nbytes = _counter(
            "kvtierd_transfer_bytes",
            f"Bytes moved, by direction (NVMe: the record pages the device moved), {_SINCE_START}.",
            ["direction"],
        )
        for moved in transfers:
            blocks.add_metric([moved.direction], moved.blocks)
            nbytes.add_metric([moved.direction], moved.bytes)
        yield blocks
        yield nbytes

    @staticmethod
    def _pool(pool: PoolStatusReply) -> Iterator[Metric]:
        yield _gauge(
            "kvtierd_pool_up",
            "1 while this rank's TP group is attached to the pool and uses it; 0 while it serves "
            "from its local tiers only (pool unreachable, refused, or voting).",
            float(pool.state == "attached"),
        )
        state = GaugeMetricFamily(
            "kvtierd_pool_state",
            "The group membership's state: 1 for the current one of local, voting, attached.",
            labels=["state"],
        )
        for name in POOL_STATES:
            state.add_metric([name], float(pool.state == name))
        yield state
        for field, name, doc in _POOL_GAUGES:
            value = getattr(pool, field)
            yield _gauge(name, doc, float(len(value) if isinstance(value, list) else value))
        for field, name, doc in _POOL_COUNTERS:
            yield CounterMetricFamily(name, f"{doc}, {_SINCE_START}.", value=getattr(pool, field))


class ReadinessCollector(Collector):
    """``/health`` and ``/ready`` as gauges, judged at scrape time (works while starting)."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness

    def collect(self) -> Iterator[Metric]:
        r = self.readiness
        yield _gauge(
            "kvtierd_ready",
            "1 when /ready answers 200: started, serving, not stopping, the disk tier not "
            "failing (a detached pool still counts as ready).",
            float(r.ready().ok),
        )
        yield _gauge(
            "kvtierd_healthy",
            "1 when /health answers 200: the event loop beat within the last 5 s and the disk "
            "tier is not failing.",
            float(r.health().ok),
        )
        condition = r.disk_condition()
        failing = GaugeMetricFamily(
            "kvtierd_disk_failing",
            "1 for the reason the disk tier fails now (acknowledged data at risk: /health "
            "fails), 0 for the others; all 0 while it is healthy.",
            labels=["reason"],
        )
        for fault in DiskFault:
            failing.add_metric(
                [fault.value], float(condition is not None and condition.fault is fault)
            )
        yield failing
        yield _gauge(
            "kvtierd_event_loop_heartbeat_age_seconds",
            "Seconds since the event loop last beat (every 0.5 s when idle); a growing value "
            "means a blocked loop.",
            r.heartbeat_age_s(),
        )
        phase = GaugeMetricFamily(
            "kvtierd_phase",
            "The daemon's phase: 1 for the current one of starting, serving, stopping.",
            labels=["phase"],
        )
        for name in DaemonPhase:
            phase.add_metric([name.value], float(r.phase is name))
        yield phase


class RequestTimings:
    """``kvtierd_request_duration_seconds{opcode, tier}``: one observe per request; and
    ``kvtierd_request_errors_total{opcode, errno, tenant}``: one count per failed request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._histogram = Histogram(
            "kvtierd_request_duration_seconds",
            "Time from a request's dispatch to its reply being ready (not the peer's reading "
            "of it), by opcode; READ also by tier, the deepest its blocks came from (dram, "
            'nvme, pool; "none": the READ failed, e.g. a key was not stored); tier is empty '
            "for other opcodes.",
            ["opcode", "tier"],
            registry=registry,
            buckets=DURATION_BUCKETS_S,
        )
        self._children: dict[tuple[int, str], Histogram] = {}
        self._errors = Counter(
            "kvtierd_request_errors",
            "Requests answered with an error, by opcode, errno (its name: ENOENT, ENOSPC...) "
            "and tenant (the DRAM region of the request's namespace: a listed tenant, "
            '"(unlisted)" for the region of the others, "none" for a request on no namespace), '
            f"{_SINCE_START}.",
            ["opcode", "errno", "tenant"],
            registry=registry,
        )
        self._error_children: dict[tuple[str, int, str], Counter] = {}

    def observe(self, opcode: int, tier: str, seconds: float) -> None:
        child = self._children.get((opcode, tier))
        if child is None:
            try:
                name = Opcode(opcode).name
            except ValueError:
                return  # never dispatched: only known opcodes reach a handler
            child = self._children[(opcode, tier)] = self._histogram.labels(name, tier)
        child.observe(seconds)

    def failed(self, opcode: int, code: int, tenant: str) -> None:
        """Count a request answered with errno ``code`` (``tenant``: its bounded label)."""
        try:
            name = Opcode(opcode).name
        except ValueError:
            name = "unknown"  # an opcode the protocol does not have: one series for them all
        child = self._error_children.get((name, code, tenant))
        if child is None:
            label = errno.errorcode.get(code, str(code))
            child = self._errors.labels(name, label, tenant)
            self._error_children[(name, code, tenant)] = child
        child.inc()


class Metrics:
    """The daemon's registry: the snapshot, readiness, request timings, and the process's own
    collectors (CPU, memory, descriptors, Python's GC)."""

    def __init__(self, config: DaemonConfig, readiness: Readiness) -> None:
        # A ``_created`` series per counter and histogram child doubles what a scrape carries
        # and no dashboard reads it (prometheus-client's switch is process-wide).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.readiness = readiness
        self.snapshots = SnapshotCollector()
        self.registry.register(self.snapshots)
        self.registry.register(ReadinessCollector(readiness))
        self.timings = RequestTimings(self.registry)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.labels = NamespaceLabels(config.metrics_namespaces, config.metrics_namespace_limit)
        #: The running daemon, once it serves (nothing to snapshot while it starts).
        self._observed: Observed | None = None

    def relabel(self, config: DaemonConfig) -> None:
        """Which namespaces get series of their own, from ``config`` (a SIGHUP changed
        ``metrics_namespaces`` or ``metrics_namespace_limit``); the next snapshot uses it."""
        self.labels = NamespaceLabels(config.metrics_namespaces, config.metrics_namespace_limit)

    def observe(self, daemon: Observed) -> None:
        """Take snapshots of ``daemon`` from now on (it serves): the first one now."""
        self._observed = daemon
        self.refresh()

    def refresh(self) -> None:
        """Take a new snapshot of the running daemon (on the event loop)."""
        daemon = self._observed
        if daemon is None:
            return
        snap = take_snapshot(daemon, self.labels)
        self.snapshots.snapshot = snap
        pool = snap.pool
        self.readiness.pool = (
            PoolView(pool.state, pool.reason, pool.epoch) if pool is not None else None
        )
