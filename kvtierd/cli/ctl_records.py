"""What ``kvtierctl --json`` prints, and the rates ``top`` derives: pure functions of the dicts
the client returns (``Client.stats()``, ``Client.namespaces()``).

The records keep the daemon's own field names and values and add a few derived fields
(``hit_ratio`` per tier, ``prefetch_accuracy``). Compatibility rule, as for the wire protocol:
fields are only ever added, never renamed or removed, so scripts that parse them keep working.
"""

from __future__ import annotations

import enum
import errno
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tomli_w

__all__ = [
    "DaemonHealth",
    "Rates",
    "Stats",
    "TierRates",
    "TopState",
    "config_record",
    "config_text",
    "error_record",
    "hit_ratio",
    "keys_record",
    "namespace_stats_record",
    "namespaces_record",
    "not_ready_record",
    "prefetch_accuracy",
    "rates_between",
    "rates_record",
    "stats_record",
    "status_record",
    "tenants_record",
    "top_record",
]

#: How ``--tenants`` names the DRAM region of the tenants ``[[tenants]]`` does not list (the
#: daemon says ``""``; the metrics say the same).
UNLISTED = "(unlisted)"

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


def tenants_record(stats: Stats) -> dict[str, Any]:
    """``stats --tenants --json``: each DRAM region's tenant with ``dram_fill`` (used over
    capacity) and ``hit_ratio`` (READ blocks served from DRAM, of all its READ blocks)
    added."""
    tenants = []
    for t in stats.get("tenants", []):
        capacity = int(t["dram_capacity_bytes"])
        below = int(t["nvme_hits"]) + int(t["pool_hits"]) + int(t["misses"])
        tenants.append(
            {
                **t,
                "tenant": t["tenant"] or UNLISTED,
                "dram_fill": int(t["dram_used_bytes"]) / capacity if capacity else None,
                "hit_ratio": hit_ratio(int(t["dram_hits"]), below),
            }
        )
    return {"tenants": tenants}


def config_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """``config --json``: ``source``, ``digest``, ``changed`` and ``config``, every field as
    tables (sizes as the file writes them)."""
    return {
        "source": record["source"],
        "digest": record["digest"],
        "changed": record["changed"],
        "config": tomllib.loads(record["toml"]),
    }


def config_text(record: Mapping[str, Any], *, effective: bool) -> str:
    """``config``: a TOML file of the fields that differ from the defaults (``effective``:
    every field), after comments saying where it came from and its digest."""
    tables = tomllib.loads(record["toml"])
    changed = list(record["changed"])
    if not effective:
        shown: dict[str, Any] = {}
        for name in changed:
            section, _, field = name.partition(".")
            if field:
                shown.setdefault(section, {})[field] = tables[section][field]
            else:
                shown[section] = tables[section]
        tables = shown
    what = "every field" if effective else f"{len(changed)} field(s) not at their defaults"
    head = (
        f"# kvtierd's running configuration, from {record['source']}: {what}\n"
        f"# digest {record['digest']}\n"
    )
    return head + ("\n" + tomli_w.dumps(tables) if tables else "")


@dataclass(frozen=True, slots=True)
class DaemonHealth:
    """What ``status`` tells besides STATFS: the pool's state and reason (POOL_STATUS: ``none``
    without a pool) and the disk tier's failing condition (the detail of the DOCTOR report's
    failed ``nvme`` line; ``""`` while healthy, ``None`` when the report is not the caller's
    to see: only the daemon's user and root get it)."""

    pool_state: str
    pool_reason: str
    disk_failing: str | None

    def problems(self) -> list[str]:
        """Why the daemon serves degraded, a few words each: ``pool local``, ``disk tier
        failing``; empty while it is not."""
        problems = [] if self.pool_state in ("none", "attached") else [f"pool {self.pool_state}"]
        return [*problems, "disk tier failing"] if self.disk_failing else problems

    @property
    def degraded(self) -> bool:
        """Serving, but not as configured: the pool not attached, or the disk tier failing
        (``/ready`` says ``degraded`` then)."""
        return bool(self.problems())


def status_record(socket: Path, stats: Stats, health: DaemonHealth) -> dict[str, Any]:
    """``status --json`` when the daemon answered."""
    return {
        "ready": True,
        "degraded": health.degraded,
        "pool": {"state": health.pool_state, "reason": health.pool_reason},
        "disk_failing": health.disk_failing,
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
        "checkpoints": checkpoint_record(stats),
    }


def checkpoint_record(stats: Stats) -> dict[str, Any]:
    """The disk tier's checkpoints in ``status --json`` (a record without the fields, as an
    older daemon's, reads as no checkpoints)."""
    return {
        "state": stats.get("checkpoints", "off"),
        "written": stats.get("checkpoints_written", 0),
        "age_s": stats.get("checkpoint_age_s", -1.0),
        "bytes_since": stats.get("bytes_since_checkpoint", 0),
    }


def not_ready_record(socket: Path, error: str, *, starting: bool = False) -> dict[str, Any]:
    """``status --json`` when the daemon did not answer, or answered that it is starting."""
    return {"ready": False, "starting": starting, "socket": str(socket), "error": error}


def error_record(error: str, errno_value: int | None) -> dict[str, Any]:
    """What a ``--json`` command prints instead of its document when it fails."""
    name = errno.errorcode.get(errno_value) if errno_value is not None else None
    return {"error": error, "errno": name}


def namespace_stats_record(info: Mapping[str, Any]) -> dict[str, Any]:
    """``stats --namespace --json``: the LIST_NS entry with its hit ratio (hit blocks of looked
    up blocks) and, with a layout, the block counters in tokens."""
    record = dict(info)
    lookups, hits = int(info["lookup_blocks"]), int(info["hit_blocks"])
    record["hit_ratio"] = hits / lookups if lookups else None
    layout = info.get("layout")
    tokens = int(layout["block_tokens"]) if layout else None
    for field in ("lookup", "hit", "read", "committed"):
        blocks = int(info[f"{field}_blocks"])
        record[f"{field}_tokens"] = blocks * tokens if tokens is not None else None
    return record


def keys_record(info: Mapping[str, Any], page: Mapping[str, Any]) -> dict[str, Any]:
    """``ls --keys --json``: one LIST_KEYS page, keys in hex as ``forget`` takes them;
    ``next_after`` is the ``--after`` of the next page (``null`` after the last)."""
    keys = [
        {
            "key": bytes(k["key"]).hex(),
            "tiers": [t for t in ("dram", "nvme", "pool") if k[t]],
            "raw_bytes": k["raw_bytes"],
            "dirty": k["dirty"],
        }
        for k in page["keys"]
    ]
    last = keys[-1]["key"] if keys and page["more"] else None
    return {
        "namespace": {f: info[f] for f in ("ns", "name", "tenant", "rank", "world_size")},
        "blocks": page["blocks"],
        "keys": keys,
        "more": page["more"],
        "next_after": last,
    }


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
    #: hits / (hits + misses) of this interval's reads; ``None`` when there were none.
    hit_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class Rates:
    """Counter deltas per second between two STATFS records, on the daemon's own clock."""

    interval_s: float
    requests: float
    promotions: float
    prefetch_promoted: float
    tiers: dict[str, TierRates]


def _delta(old: Mapping[str, Any], new: Mapping[str, Any], field: str) -> int:
    return max(0, int(new[field]) - int(old[field]))


def rates_between(before: Stats, after: Stats, *, own_requests: int = 0) -> Rates | None:
    """Rates from ``before`` to ``after``; ``None`` when no time passed or the daemon restarted
    (its uptime went backwards), since counter deltas would then mean nothing.

    ``own_requests`` is what the sampler itself sent in the interval (``top``: its STATFS, and
    INIT after a reconnect): not counted, so an idle daemon shows 0 requests per second."""
    interval = float(after["uptime_s"]) - float(before["uptime_s"])
    if interval <= 0:
        return None

    def rate(old: Mapping[str, Any], new: Mapping[str, Any], field: str) -> float:
        return _delta(old, new, field) / interval

    old_tiers = {t["name"]: t for t in before["tiers"]}
    tiers = {
        t["name"]: TierRates(
            rate(old, t, "hits"),
            rate(old, t, "misses"),
            rate(old, t, "evictions"),
            rate(old, t, "bytes_read"),
            rate(old, t, "bytes_written"),
            hit_ratio(_delta(old, t, "hits"), _delta(old, t, "misses")),
        )
        for t in after["tiers"]
        if (old := old_tiers.get(t["name"])) is not None
    }
    requests = max(0, _delta(before, after, "requests") - own_requests)
    return Rates(
        interval,
        requests / interval,
        rate(before, after, "promotions"),
        rate(before, after, "prefetch_promoted"),
        tiers,
    )


class TopState(enum.StrEnum):
    """Where ``top`` stands with the daemon."""

    CONNECTED = "connected"
    #: The connection went (or the daemon is not there): waiting for it to come back.
    RESTARTING = "restarting"
    #: The daemon answered that it is starting (``StartingError``).
    STARTING = "starting"


def rates_record(rates: Rates | None) -> dict[str, Any] | None:
    """``Rates`` as JSON: per second, each tier's ``hit_ratio`` of the interval."""
    return None if rates is None else asdict(rates)


def top_record(
    state: TopState, socket: Path, stats: Stats | None, rates: Rates | None, reason: str | None
) -> dict[str, Any]:
    """One line of ``top --json``: the state, the interval's rates (``null`` until two samples
    of one daemon run) and the raw STATFS record (the last one seen while not connected)."""
    return {
        "state": state.value,
        "socket": str(socket),
        "reason": reason,
        "rates": rates_record(rates),
        "stats": stats_record(stats) if stats is not None else None,
    }
