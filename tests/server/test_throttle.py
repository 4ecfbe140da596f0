"""The log throttle (one report per key per period, with a count of what it held back) and the
descriptor budget's arithmetic: both pure, the time passed in."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtierd.config import load_config
from kvtierd.server.budget import (
    BASE_RESERVE,
    TENANT_RESERVE,
    UNIX_REFUSALS,
    budget_problem,
    descriptor_budget,
)
from kvtierd.server.throttle import OTHERS, Throttle


def test_one_report_per_key_per_period_with_the_count_held_back() -> None:
    throttle = Throttle(period_s=60.0)
    assert throttle.admit("10.0.0.1", 0.0) == 0
    assert [throttle.admit("10.0.0.1", t) for t in (1.0, 30.0, 59.9)] == [None, None, None]
    assert throttle.admit("10.0.0.1", 60.0) == 3
    assert throttle.admit("10.0.0.1", 61.0) is None
    assert throttle.admit("10.0.0.1", 500.0) == 1


def test_keys_are_throttled_apart() -> None:
    throttle = Throttle(period_s=60.0)
    assert throttle.admit("a", 0.0) == 0
    assert throttle.admit("b", 1.0) == 0
    assert throttle.admit("a", 2.0) is None
    assert throttle.admit("b", 61.0) == 0
    assert throttle.admit("a", 61.0) == 1


def test_past_max_keys_new_keys_share_one() -> None:
    throttle = Throttle(period_s=60.0, max_keys=2)
    assert throttle.admit("a", 0.0) == 0
    assert throttle.admit("b", 0.0) == 0
    assert throttle.admit("c", 1.0) == 0  # reported, as "others"
    assert throttle.admit("d", 2.0) is None  # "others" again, within its period
    assert throttle.admit(OTHERS, 61.0) == 1
    # Once a and b's periods are over they are forgotten, and a new key has its own again.
    assert throttle.admit("e", 130.0) == 0
    assert throttle.admit("e", 131.0) is None


@pytest.mark.parametrize(("period_s", "max_keys"), [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_a_throttle_needs_a_period_and_room(period_s: float, max_keys: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Throttle(period_s, max_keys)


def test_report_logs_the_first_and_holds_back_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    throttle = Throttle(period_s=3600.0)
    logger = logging.getLogger("kvtierd.test-throttle")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for i in range(5):
            throttle.report(logger, logging.WARNING, "10.0.0.1", "handshake %d failed", i)
    assert [r.getMessage() for r in caplog.records] == ["handshake 0 failed"]


def test_the_budget_adds_each_listener_and_the_reserve() -> None:
    plain = descriptor_budget(load_config())
    assert (plain.unix, plain.tcp, plain.metrics) == (256 + UNIX_REFUSALS, 0, 0)
    assert plain.total == 256 + UNIX_REFUSALS + BASE_RESERVE
    config = load_config(
        None,
        {
            "daemon": {"max_connections": 10, "metrics_port": 9100, "metrics_max_connections": 3},
            "nixl": {"enabled": True},
            "remote": {
                "listen": "127.0.0.1:7460",
                "allow_plaintext": True,
                "plaintext_uid": 7,
                "max_handshakes": 5,
                "max_handshakes_per_host": 2,
                "max_connections": 6,
            },
        },
    )
    budget = descriptor_budget(config)
    # the metrics port: 3 sending their request, 3 answering a scrape, and the probes' room
    assert (budget.unix, budget.tcp, budget.metrics) == (10 + UNIX_REFUSALS, 11, 2 * 3 + 8)
    assert budget.reserve == BASE_RESERVE
    assert budget_problem(budget, budget.total) is None
    problem = budget_problem(budget, budget.total - 1)
    assert problem is not None
    assert f"exceeds RLIMIT_NOFILE {budget.total - 1}" in problem
    assert budget.describe() in problem


def test_tenants_and_the_pool_come_out_of_the_reserve(tmp_path: Path) -> None:
    path = tmp_path / "kvtierd.toml"
    path.write_text(
        '[pool]\nurl = "redis://127.0.0.1:6379"\nallow_plaintext = true\n'
        '[[tenants]]\nname = "a"\ndram_size = "4M"\n'
        '[[tenants]]\nname = "b"\ndram_size = "4M"\n'
    )
    assert descriptor_budget(load_config(path)).reserve == BASE_RESERVE + 64 + 2 * TENANT_RESERVE
