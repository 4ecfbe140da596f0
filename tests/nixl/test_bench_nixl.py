"""``tools/bench_nixl.py`` on its smallest settings: every side measured and reported as JSON,
and the placement that cannot run yet refused with its reason. No figure is checked against a
goal: timing belongs to the benchmark, not to its test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.redis_server import require_redis_server

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_nixl.py"
SMALLEST = ["--quick", "--sizes", "2M", "--total", "4M", "--rounds", "1", "--repeats", "1"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )


def test_the_netns_placement_is_refused_with_its_reason() -> None:
    """Needs no NIXL: the refusal comes before anything starts."""
    run = _run("--placements", "netns", "--json", "--no-record")
    assert run.returncode == 2
    assert "placement 'netns' is not available yet" in run.stderr
    assert "TCP control connections" in run.stderr
    assert run.stdout == ""


def test_the_smallest_run_reports_every_side(nixl_works: None) -> None:
    require_redis_server()
    run = _run(*SMALLEST, "--json", "--no-record")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["benchmark"] == "nixl"
    assert list(result["placements"]) == ["local"]
    local = result["placements"]["local"]
    assert local["nixl_daemon_idle_cpu"] >= 0
    (size,) = local["sizes"]
    assert (size["block_bytes"], size["blocks"], size["total_bytes"]) == (2 << 20, 2, 4 << 20)
    assert set(size["cold"]) == {"pull", "raw"}
    assert set(size["read_transports"]) == {"pull", "raw"}
    (row,) = size["rounds"]
    for side in ("pull", "bare", "raw", "pool"):
        assert row[side]["gbps"] > 0
        assert size["median"][side]["gbps"] == row[side]["gbps"]
    assert row["pull"]["bytes"] == row["bare"]["bytes"] == row["raw"]["bytes"] == 4 << 20
    for ratio in ("pull_over_raw", "bare_over_raw", "pull_over_bare", "pull_over_pool"):
        assert size["median"][ratio] == row[ratio] > 0
    goals = {g["goal"]: g for g in result["goals"]}
    assert set(goals) == {"pull / raw >= 0.9 (2 MiB)", "pull / pool restore >= 2x (2 MiB)"}
    assert all(isinstance(g["met"], bool) for g in goals.values())
