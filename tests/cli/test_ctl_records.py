"""The pure parts of ``kvtierctl``: JSON records, rates from counter deltas, formatting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtierd.cli.ctl_records import (
    hit_ratio,
    not_ready_record,
    rates_between,
    stats_record,
    status_record,
)
from kvtierd.cli.ctl_views import format_bytes, format_duration, format_ratio


def _tier(name: str, **counters: int) -> dict[str, Any]:
    tier: dict[str, Any] = dict.fromkeys(
        ("blocks", "used_bytes", "capacity_bytes", "hits", "misses", "evictions"), 0
    )
    tier.update(name=name, bytes_read=0, bytes_written=0, capacity_bytes=1 << 20)
    tier.update(counters)
    return tier


def _stats(uptime_s: float, *tiers: dict[str, Any], **counters: int) -> dict[str, Any]:
    fields = [
        "connections",
        "requests",
        "namespaces",
        "leases",
        "leased_blocks",
        "pending_writes",
        "dirty_blocks",
        "dirty_bytes",
        "durable_blocks",
        "promotions",
        "prefetch_promoted",
        "prefetch_used",
        "prefetch_wasted_bytes",
    ]
    stats: dict[str, Any] = dict.fromkeys(fields, 0)
    stats.update(version="0.1.0", uptime_s=uptime_s, io_backend="threads", tiers=list(tiers))
    stats.update(counters)
    return stats


def test_rates_are_counter_deltas_over_the_daemons_own_clock() -> None:
    before = _stats(10.0, _tier("dram", hits=100, bytes_read=1 << 20), requests=50)
    after = _stats(12.0, _tier("dram", hits=160, bytes_read=5 << 20), requests=70)
    rates = rates_between(before, after)
    assert rates is not None
    assert rates.interval_s == 2.0
    assert rates.requests == 10.0
    assert rates.tiers["dram"].hits == 30.0
    assert rates.tiers["dram"].read_bytes == 2 << 20


def test_no_rates_across_a_restart_or_without_elapsed_time() -> None:
    busy = _stats(100.0, _tier("dram", hits=1000))
    assert rates_between(busy, _stats(1.0, _tier("dram", hits=3))) is None
    assert rates_between(busy, busy) is None


def test_a_tier_that_appears_between_samples_has_no_rates_yet() -> None:
    rates = rates_between(_stats(1.0, _tier("dram")), _stats(2.0, _tier("dram"), _tier("nvme")))
    assert rates is not None
    assert set(rates.tiers) == {"dram"}


def test_stats_record_keeps_the_daemons_fields_and_adds_ratios() -> None:
    stats = _stats(
        5.0, _tier("dram", hits=3, misses=1), _tier("nvme"), prefetch_promoted=4, prefetch_used=1
    )
    record = stats_record(stats)
    assert {k: v for k, v in record.items() if k not in ("tiers", "prefetch_accuracy")} == {
        k: v for k, v in stats.items() if k != "tiers"
    }
    assert [t["hit_ratio"] for t in record["tiers"]] == [0.75, None]
    assert record["prefetch_accuracy"] == 0.25
    assert stats["tiers"][0].get("hit_ratio") is None  # the input is not modified


def test_status_records_say_whether_the_daemon_is_ready() -> None:
    socket = Path("/run/kvtierd/kvtierd.sock")
    ready = status_record(socket, _stats(1.0, _tier("dram", blocks=2)))
    assert ready["ready"] is True
    assert ready["tiers"] == [
        {"name": "dram", "blocks": 2, "used_bytes": 0, "capacity_bytes": 1 << 20}
    ]
    assert not_ready_record(socket, "down") == {
        "ready": False,
        "socket": str(socket),
        "error": "down",
    }


@pytest.mark.parametrize(("hits", "misses", "expected"), [(0, 0, None), (1, 3, 0.25), (5, 0, 1.0)])
def test_hit_ratio(hits: int, misses: int, expected: float | None) -> None:
    assert hit_ratio(hits, misses) == expected


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (64 << 20, "64.0 MiB"), (3 << 50, "3.0 PiB")],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(4.25, "4.2s"), (192, "3m 12s"), (5 * 3600 + 180, "5h 03m"), (2 * 86400 + 4 * 3600, "2d 04h")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_ratio() -> None:
    assert format_ratio(None) == "–"
    assert format_ratio(0.875) == "87.5%"
