"""What a SIGHUP applies and what waits for a restart (``kvtierd.server.reload``, pure)."""

from __future__ import annotations

from kvtierd.config import load_config
from kvtierd.server.reload import LIVE_FIELDS, plan_reload


def test_live_fields_are_applied_and_the_others_held_for_a_restart() -> None:
    running = load_config(None, {"daemon": {"log_level": "info"}, "dram": {"size": "1G"}})
    read = load_config(
        None,
        {
            "daemon": {"log_level": "debug", "idle_timeout_s": 60.0},
            "dram": {"size": "2G", "prefetch_bytes_per_s": "64M"},
        },
    )
    plan = plan_reload(running, read)
    assert [d.name for d in plan.applied] == [
        "daemon.idle_timeout_s", "daemon.log_level", "dram.prefetch_bytes_per_s",
    ]  # fmt: skip
    assert [(d.name, d.before, d.after) for d in plan.held] == [("dram.size", '"1G"', '"2G"')]
    assert plan.config.daemon.log_level.value == "debug"
    assert plan.config.daemon.idle_timeout_s == 60.0
    assert plan.config.dram.prefetch_bytes_per_s == 64 << 20
    assert plan.config.dram.size == 1 << 30  # held: the running value stays
    assert plan_reload(plan.config, read).applied == ()  # applied once


def test_every_live_field_exists() -> None:
    config = load_config(None)
    for name in LIVE_FIELDS:
        section, _, field = name.partition(".")
        assert hasattr(getattr(config, section), field), name
