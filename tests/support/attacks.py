"""What every attack test checks of the daemon afterwards, and the tier figures it reads."""

from __future__ import annotations

from kvtierd.client.sync import Client
from kvtierd.testing import DaemonProcess


def tier_usage(client: Client, name: str) -> tuple[int, int]:
    """(blocks, bytes used) of tier ``name`` ("dram", "nvme") in the daemon's STATFS."""
    (tier,) = [t for t in client.stats()["tiers"] if t["name"] == name]
    return int(tier["blocks"]), int(tier["used_bytes"])


def unharmed(daemon: DaemonProcess) -> None:
    """The daemon still runs, and logged no traceback and no handler's internal error."""
    assert daemon.running, daemon.log()[-4000:]
    log = daemon.log()
    assert "Traceback" not in log, log[-4000:]
    assert "handler for" not in log, log[-4000:]
