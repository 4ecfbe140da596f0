"""The pure parts of ``kvtierctl``: JSON records, rates from counter deltas, formatting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtierd.cli.ctl_records import (
    DaemonHealth,
    Rates,
    TopState,
    hit_ratio,
    namespace_stats_record,
    not_ready_record,
    rates_between,
    stats_record,
    status_record,
    top_record,
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


def test_the_hit_ratio_is_the_intervals_not_the_lifetimes() -> None:
    before = _stats(10.0, _tier("dram", hits=900, misses=100), _tier("nvme", hits=5))
    after = _stats(11.0, _tier("dram", hits=901, misses=103), _tier("nvme", hits=5))
    rates = rates_between(before, after)
    assert rates is not None
    assert rates.tiers["dram"].hit_ratio == 0.25  # 1 of 4 reads this second; lifetime ~0.9
    assert rates.tiers["nvme"].hit_ratio is None  # no reads this second


def test_the_samplers_own_requests_are_not_counted() -> None:
    idle_before, idle_after = _stats(1.0, requests=40), _stats(2.0, requests=41)
    rates = rates_between(idle_before, idle_after, own_requests=1)
    assert rates is not None
    assert rates.requests == 0.0
    busy = rates_between(idle_before, _stats(3.0, requests=52), own_requests=2)
    assert busy is not None
    assert busy.requests == 5.0  # 12 requests in 2 s, 2 of them the sampler's
    assert rates_between(idle_before, idle_before | {"uptime_s": 2.0}, own_requests=3) == Rates(
        1.0, 0.0, 0.0, 0.0, {}
    )


def test_top_records_carry_the_state_rates_and_raw_counters() -> None:
    socket = Path("/run/kvtierd/kvtierd.sock")
    before = _stats(1.0, _tier("dram", hits=1, misses=1), requests=3)
    after = _stats(3.0, _tier("dram", hits=5, misses=1), requests=10)
    rates = rates_between(before, after, own_requests=1)
    line = top_record(TopState.CONNECTED, socket, after, rates, None)
    assert json.loads(json.dumps(line)) == line  # one JSON line
    assert line["state"] == "connected"
    assert line["rates"]["requests"] == 3.0
    assert line["rates"]["interval_s"] == 2.0
    assert line["rates"]["tiers"]["dram"] == {
        "hits": 2.0,
        "misses": 0.0,
        "evictions": 0.0,
        "read_bytes": 0.0,
        "written_bytes": 0.0,
        "hit_ratio": 1.0,
    }
    assert line["stats"]["requests"] == 10
    assert line["stats"]["tiers"][0]["hit_ratio"] == 5 / 6  # the raw record's lifetime ratio
    waiting = top_record(TopState.RESTARTING, socket, after, None, "connection lost")
    assert (waiting["state"], waiting["rates"], waiting["reason"]) == (
        "restarting",
        None,
        "connection lost",
    )


def test_namespace_stats_in_tokens_only_with_a_layout() -> None:
    info = {
        "ns": 2,
        "layout": {"block_tokens": 16},
        "lookup_blocks": 10,
        "hit_blocks": 4,
        "read_blocks": 4,
        "committed_blocks": 6,
    }
    record = namespace_stats_record(info)
    assert (record["hit_ratio"], record["hit_tokens"], record["committed_tokens"]) == (0.4, 64, 96)
    bare = namespace_stats_record(info | {"layout": None, "lookup_blocks": 0})
    assert (bare["hit_ratio"], bare["hit_tokens"]) == (None, None)


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
    healthy = DaemonHealth("none", "no pool is configured (pool.url is empty)", "")
    ready = status_record(socket, _stats(1.0, _tier("dram", blocks=2)), healthy)
    assert (ready["ready"], ready["degraded"], ready["disk_failing"]) == (True, False, "")
    assert ready["pool"] == {"state": "none", "reason": healthy.pool_reason}
    assert ready["tiers"] == [
        {"name": "dram", "blocks": 2, "used_bytes": 0, "capacity_bytes": 1 << 20}
    ]
    assert not_ready_record(socket, "down") == {
        "ready": False,
        "starting": False,
        "socket": str(socket),
        "error": "down",
    }
    assert not_ready_record(socket, "starting: scanning", starting=True)["starting"] is True


@pytest.mark.parametrize(
    ("pool_state", "disk_failing", "problems"),
    [
        ("none", "", []),
        ("attached", "", []),
        ("attached", None, []),  # the disk tier's state not shown to this caller
        ("voting", "", ["pool voting"]),
        ("local", "", ["pool local"]),
        ("none", "data file failing (removed)", ["disk tier failing"]),
        ("local", "write-back failing (enospc)", ["pool local", "disk tier failing"]),
    ],
)
def test_the_daemon_is_degraded_while_its_pool_is_not_attached_or_its_disk_fails(
    pool_state: str, disk_failing: str | None, problems: list[str]
) -> None:
    health = DaemonHealth(pool_state, "", disk_failing)
    assert (health.problems(), health.degraded) == (problems, bool(problems))


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
