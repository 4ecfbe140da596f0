"""Pool health in ``/metrics``: a real daemon attached to a real redis-server, which is killed
while attached and started again; every figure is read from a live scrape."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtierd.client import chain_keys, connect
from kvtierd.testing import DaemonProcess, free_port
from kvtierd.testing.redis_server import RedisServer
from tests.integration.test_metrics import (
    Scraped,
    daemon_config,
    http_get,
    scrape,
    wait_for,
)

pytestmark = pytest.mark.redis

BLOCK = 4096
POOL_TIER = ("kvtierd_tier_blocks", frozenset({("tier", "pool")}))


def scrape_until(port: int, what: str, holds: Callable[[Scraped], bool]) -> Scraped:
    return wait_for(what, lambda: s if holds(s := scrape(port)) else None)


def state_is(name: str) -> Callable[[Scraped], bool]:
    return lambda s: s.samples.get(("kvtierd_pool_state", frozenset({("state", name)}))) == 1


def test_pool_health_follows_redis_down_and_back(tmp_path: Path, redis_server: RedisServer) -> None:
    port = free_port()
    config = daemon_config(port, redis_server.url, limit=20)
    with DaemonProcess(tmp_path / "kvtierd", config_text=config) as daemon:
        up = scrape_until(port, "never attached", lambda s: s.value("kvtierd_pool_up") == 1)
        assert up.value("kvtierd_pool_state", state="attached") == 1
        assert up.value("kvtierd_pool_state", state="local") == 0
        assert up.value("kvtierd_pool_epoch") >= 1
        assert up.value("kvtierd_pool_members") == 1
        assert POOL_TIER in up.samples
        with connect(daemon.socket) as client:
            ns = client.namespace("pooled", block_bytes=BLOCK)
            before = chain_keys(range(4), 1, ns.key_salt)
            ns.put(before, [bytes([i]) * BLOCK for i in range(4)])
            written = scrape_until(
                port,
                "the write-through never counted",
                lambda s: s.total("kvtierd_pool_written_blocks_total") >= 4,
            )
            assert written.value("kvtierd_transfer_blocks_total", direction="dram_to_pool") >= 4
            assert written.value("kvtierd_pool_backlog_blocks") == 0

            redis_server.kill()
            ns.put(chain_keys(range(4, 5), 1, ns.key_salt), [bytes(BLOCK)])  # as it goes down
            down = scrape_until(port, "pool_up never went to 0", state_is("local"))
            assert down.value("kvtierd_pool_up") == 0
            assert down.value("kvtierd_pool_state", state="attached") == 0
            assert POOL_TIER not in down.samples  # no stale block count while unreachable
            # what is committed meanwhile waits for the pool, and is counted
            during = chain_keys(range(5, 13), 1, ns.key_salt)
            ns.put(during, [bytes(BLOCK)] * len(during))
            queued = scrape_until(
                port,
                "the backlog never grew",
                lambda s: s.value("kvtierd_pool_backlog_blocks") >= len(during),
            )
            assert queued.value("kvtierd_pool_backlog_bytes") >= len(during) * BLOCK
            assert queued.total("kvtierd_pool_write_failures_total") + queued.value(
                "kvtierd_pool_backlog_blocks"
            ) > len(during), (
                "the block committed as the pool went down is neither failed nor queued"
            )
            status, body = http_get(f"http://127.0.0.1:{port}/ready")
            assert status == 200  # degraded: still serving from the local tiers
            assert b'"degraded"' in body
            assert b"pool local" in body

            redis_server.start()
            back = scrape_until(
                port,
                "never attached again, or the backlog was never written",
                lambda s: (
                    s.value("kvtierd_pool_up") == 1 and s.value("kvtierd_pool_backlog_blocks") == 0
                ),
            )
            assert back.value("kvtierd_pool_state", state="attached") == 1
            assert back.value("kvtierd_pool_state_changed_timestamp_seconds") >= down.value(
                "kvtierd_pool_state_changed_timestamp_seconds"
            )
            assert back.total("kvtierd_pool_written_blocks_total") >= 4 + len(during)
            assert POOL_TIER in back.samples
            status, body = http_get(f"http://127.0.0.1:{port}/ready")
            assert status == 200
            assert b'"ready"' in body
            assert b"pool attached" in body
