"""Crash loop: SIGKILL the daemon at random moments during heavy writes, restart, verify.

The loop itself is :mod:`tools.soak_crash` (which runs it longer); here it runs 50 iterations
against one data directory, alternating asyncio and trio daemons. After every kill: each key whose
FSYNC returned is present and byte-exact, and every block served for any key ever written is
byte-exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools import soak_crash

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_no_torn_block_is_served_and_fsynced_blocks_survive_kill_9(tmp_path: Path) -> None:
    try:
        summary = soak_crash.run(50, directory=tmp_path / "kvtierd", seed=20261129)
    finally:
        shutil.rmtree(tmp_path / "kvtierd", ignore_errors=True)
    assert summary.violations == []
    assert summary.iterations == 50
    # the loop did real work: blocks were made durable and checked after kills
    assert summary.fsyncs > 50
    assert summary.durable_checked > 1000
    assert summary.reads_during_run > 0
