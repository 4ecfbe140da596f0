"""What ``kvtierctl --json`` prints, and the rates ``top`` derives: pure functions of the dicts
the client returns (``Client.stats()``, ``Client.namespaces()``).

The records keep the daemon's own field names and values and add a few derived fields
(``hit_ratio`` per tier, ``prefetch_accuracy``). Compatibility rule, as for the wire protocol:
fields are only ever added, never renamed or removed, so scripts that parse them keep working.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Rates",
    "Stats",
    "TierRates",
    "hit_ratio",
    "namespaces_record",
    "not_ready_record",
    "prefetch_accuracy",
    "rates_between",
    "stats_record",
    "status_record",
]

#: A STATFS record as ``Client.stats()`` returns it.
Stats = Mapping[str, Any]


# -- JSON records -----------------------------------------------------------------------------


def hit_ratio(hits: int, misses: int) -> float | None:
    """``hits / (hits + misses)``, or ``None`` before the first access."""
    total = hits + misses
    return hits / total if total else None


def prefetch_accuracy(stats: Stats) -> float | None:
    """Prefetched blocks that were read, of those prefetched; ``None`` before the first."""
    promoted = int(stats["prefetch_promoted"])
    return int(stats["prefetch_used"]) / promoted if promoted else None


def stats_record(stats: Stats) -> dict[str, Any]:
    """The STATFS record with ``hit_ratio`` per tier and ``prefetch_accuracy`` added."""
    record = dict(stats)
    record["tiers"] = [
        {**tier, "hit_ratio": hit_ratio(int(tier["hits"]), int(tier["misses"]))}
        for tier in stats["tiers"]
    ]
    record["prefetch_accuracy"] = prefetch_accuracy(stats)
    return record


def status_record(socket: Path, stats: Stats) -> dict[str, Any]:
    """``status --json`` when the daemon answered."""
    return {
        "ready": True,
        "socket": str(socket),
        "version": stats["version"],
        "uptime_s": stats["uptime_s"],
        "io_backend": stats["io_backend"],
        "connections": stats["connections"],
        "namespaces": stats["namespaces"],
        "dirty_blocks": stats["dirty_blocks"],
        "durable_blocks": stats["durable_blocks"],
        "tiers": [
            {k: tier[k] for k in ("name", "blocks", "used_bytes", "capacity_bytes")}
            for tier in stats["tiers"]
        ],
    }


def not_ready_record(socket: Path, error: str) -> dict[str, Any]:
    """``status --json`` when the daemon did not answer."""
    return {"ready": False, "socket": str(socket), "error": error}


def namespaces_record(namespaces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``ls --json``: the LIST_NS entries as the daemon sent them."""
    return {"namespaces": [dict(ns) for ns in namespaces]}


# -- rates ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierRates:
    hits: float
    misses: float
    evictions: float
    read_bytes: float
    written_bytes: float


@dataclass(frozen=True, slots=True)
class Rates:
    """Counter deltas per second between two STATFS records, on the daemon's own clock."""

    interval_s: float
    requests: float
    promotions: float
    prefetch_promoted: float
    tiers: dict[str, TierRates]


def rates_between(before: Stats, after: Stats) -> Rates | None:
    """Rates from ``before`` to ``after``; ``None`` when no time passed or the daemon restarted
    (its uptime went backwards), since counter deltas would then mean nothing."""
    interval = float(after["uptime_s"]) - float(before["uptime_s"])
    if interval <= 0:
        return None

    def rate(old: Mapping[str, Any], new: Mapping[str, Any], field: str) -> float:
        return max(0, int(new[field]) - int(old[field])) / interval

    old_tiers = {t["name"]: t for t in before["tiers"]}
    tiers = {
        t["name"]: TierRates(
            rate(old, t, "hits"),
            rate(old, t, "misses"),
            rate(old, t, "evictions"),
            rate(old, t, "bytes_read"),
            rate(old, t, "bytes_written"),
        )
        for t in after["tiers"]
        if (old := old_tiers.get(t["name"])) is not None
    }
    return Rates(
        interval,
        rate(before, after, "requests"),
        rate(before, after, "promotions"),
        rate(before, after, "prefetch_promoted"),
        tiers,
    )
