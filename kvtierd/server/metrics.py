"""Prometheus metrics on an optional loopback port.

The HTTP server runs in prometheus-client's own thread, which must never touch the store (the
store belongs to the event loop). So a task on the loop takes a :class:`StatfsReply` snapshot
every second, and the collector only reads the latest snapshot: one reference swap, no lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtierd.protocol.messages import StatfsReply

if TYPE_CHECKING:
    from kvtierd.server.daemon import Daemon

__all__ = ["serve_metrics"]

_COUNTERS = (
    "requests",
    "promotions",
    "prefetch_promoted",
    "prefetch_used",
    "prefetch_wasted_bytes",
)
_GAUGES = (
    "connections",
    "namespaces",
    "leases",
    "leased_blocks",
    "pending_writes",
    "dirty_blocks",
    "dirty_bytes",
    "durable_blocks",
)


class _SnapshotCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: StatfsReply | None = None

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snap = self.snapshot
        if snap is None:
            return
        for name in _COUNTERS:
            yield CounterMetricFamily(
                f"kvtierd_{name}", name.replace("_", " "), getattr(snap, name)
            )
        for name in _GAUGES:
            yield GaugeMetricFamily(f"kvtierd_{name}", name.replace("_", " "), getattr(snap, name))
        per_tier: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "blocks": GaugeMetricFamily("kvtierd_tier_blocks", "blocks", labels=["tier"]),
            "used_bytes": GaugeMetricFamily(
                "kvtierd_tier_used_bytes", "bytes used", labels=["tier"]
            ),
            "capacity_bytes": GaugeMetricFamily(
                "kvtierd_tier_capacity_bytes", "capacity", labels=["tier"]
            ),
            "hits": CounterMetricFamily("kvtierd_tier_hits", "hits", labels=["tier"]),
            "misses": CounterMetricFamily("kvtierd_tier_misses", "misses", labels=["tier"]),
            "evictions": CounterMetricFamily(
                "kvtierd_tier_evictions", "evictions", labels=["tier"]
            ),
            "bytes_read": CounterMetricFamily("kvtierd_tier_read_bytes", "read", labels=["tier"]),
            "bytes_written": CounterMetricFamily(
                "kvtierd_tier_written_bytes", "written", labels=["tier"]
            ),
        }
        for tier in snap.tiers:
            for field, family in per_tier.items():
                family.add_metric([tier.name], getattr(tier, field))
        yield from per_tier.values()
        info = GaugeMetricFamily(
            "kvtierd_info", "version and I/O backend", labels=["version", "io_backend"]
        )
        info.add_metric([snap.version, snap.io_backend], 1)
        yield info


async def serve_metrics(
    daemon: Daemon, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``/metrics`` on the configured loopback port until cancelled."""
    registry = CollectorRegistry()
    collector = _SnapshotCollector()
    registry.register(collector)
    config = daemon.config.daemon
    server, thread = start_http_server(config.metrics_port, config.metrics_address, registry)
    try:
        task_status.started()
        while True:
            collector.snapshot = daemon.statistics()
            await anyio.sleep(1.0)
    finally:
        server.shutdown()
        thread.join(timeout=5)
