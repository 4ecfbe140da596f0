"""``python -m tools.bench_nixl`` on its smallest settings: every side measured and reported as
JSON, in each placement, and ``netns`` refused with its reason where namespaces cannot be made. No
figure is checked against a goal: timing belongs to the benchmark, not to its test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtierd.testing.netns import NO_NETNS_ENV, require_netns
from kvtierd.testing.redis_server import require_redis_server

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SMALLEST = ["--quick", "--sizes", "2M", "--total", "4M", "--rounds", "1", "--repeats", "1"]
BLOCKS = 4 << 20


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.bench_nixl", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env=None if env is None else {**os.environ, **env},
    )


def _smallest(placement: str) -> dict[str, Any]:
    """The smallest run of ``placement``: its JSON, checked for what every placement reports."""
    run = _run(*SMALLEST, "--placements", placement, "--json", "--no-record")
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout)
    assert result["benchmark"] == "nixl"
    assert list(result["placements"]) == [placement]
    measured = result["placements"][placement]
    assert measured["nixl_daemon_idle_cpu"] >= 0
    (size,) = measured["sizes"]
    assert (size["block_bytes"], size["blocks"], size["total_bytes"]) == (2 << 20, 2, BLOCKS)
    assert set(size["cold"]) == {"pull", "raw"}
    assert set(size["read_transports"]) == {"pull", "raw"}
    for share in ("raw_owner_idle_cpu", "nixl_daemon_linger_cpu", "pool_daemon_idle_cpu"):
        assert size[share] >= 0
    (row,) = size["rounds"]
    for side in ("pull", "bare", "raw", "pool"):
        assert row[side]["gbps"] > 0
        assert size["median"][side]["gbps"] == row[side]["gbps"]
    assert row["pull"]["bytes"] == row["bare"]["bytes"] == row["raw"]["bytes"] == BLOCKS
    for ratio in ("pull_over_raw", "bare_over_raw", "pull_over_bare", "pull_over_pool"):
        assert size["median"][ratio] == row[ratio] > 0
    goals = {g["goal"]: g for g in result["goals"]}
    assert set(goals) == {"pull / raw >= 0.9 (2 MiB)", "pull / pool restore >= 2x (2 MiB)"}
    assert all(isinstance(g["met"], bool) and g["placement"] == placement for g in goals.values())
    return result


def test_netns_without_namespaces_is_refused_with_the_reason() -> None:
    """Needs no NIXL: the refusal comes before anything starts."""
    run = _run("--placements", "netns", "--json", "--no-record", env={NO_NETNS_ENV: "1"})
    assert run.returncode == 2
    assert "placement 'netns' needs network namespaces" in run.stderr
    assert f"{NO_NETNS_ENV}=1" in run.stderr
    assert run.stdout == ""


def test_the_smallest_local_run_reports_every_side(nixl_works: None) -> None:
    require_redis_server()
    local = _smallest("local")["placements"]["local"]
    (size,) = local["sizes"]
    assert size["reader_link"] is None  # one host: no link to count


def test_the_smallest_netns_run_pulls_across_the_veth_pair(nixl_works: None) -> None:
    """The daemon and the reader in two namespaces, over TCP with TLS and ``UCX_TLS=tcp``: the
    reader's host received at least what each NIXL side pulled, and UCX read over ``eth0``."""
    require_netns()
    require_redis_server()
    pytest.importorskip("trustme", reason="netns makes its TLS certificates with trustme")
    netns = _smallest("netns")["placements"]["netns"]
    assert netns["ucx_tls"] == "tcp"
    (size,) = netns["sizes"]
    for side in ("pull", "raw"):
        assert size["read_transports"][side]
        assert all(t.startswith("tcp/") for t in size["read_transports"][side])
    link = size["reader_link"]
    assert link["crossed"] is True
    # one round of one repeat, and a cold pull and raw READ before it
    moved = {"pull": 2 * BLOCKS, "bare": BLOCKS, "raw": 2 * BLOCKS, "pool": BLOCKS}
    for side, nbytes in moved.items():
        assert link[side]["moved_bytes"] == nbytes
        assert link[side]["rx_bytes"] >= nbytes
