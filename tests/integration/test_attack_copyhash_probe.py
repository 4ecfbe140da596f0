"""The copy kernel's probe from the daemon's side (issue 32: ``store/copyhash.py``): a module
whose self-test never returns, in a real daemon.

The probe runs in a thread of the daemon, which starts a child in a session of its own; the
child loads the module. While it hangs the daemon must copy and verify in Python and serve
every block; SIGTERM must stop it cleanly without waiting for the probe; and the hung child
must not outlive it (the child dies with the thread that started it, ``PR_SET_PDEATHSIG``),
an orphan holding memory and a process slot for as long as its alarm allows.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.store.copyhash import MODULE_ENV
from kvtierd.testing import DaemonProcess

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 30.0
BLOCK = 1 << 20  # past the native minimum: every copy asks the hasher


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "(zombie)" not in state


def _serves(daemon: DaemonProcess, ns_name: str) -> None:
    """Blocks put, read from DRAM, then promoted from the NVMe tier: each its own bytes."""
    blocks = [np.full(BLOCK, i, np.uint8) for i in range(8)]
    keys = [b"probe-%d" % i for i in range(8)]
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        ns = client.namespace(ns_name, block_bytes=BLOCK)
        assert ns.put(keys, blocks) == len(keys)
        for _ in range(2):  # from DRAM, then promoted from the NVMe tier
            with ns.get(keys) as views:
                for view, block in zip(views, blocks, strict=True):
                    assert np.array_equal(np.asarray(view), block)
            client.fsync()
            client.evict()


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_a_probe_that_hangs_neither_stops_the_daemon_nor_outlives_it(
    runtime: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pidfile = tmp_path / "probe.pid"
    monkeypatch.setenv(MODULE_ENV, "tests.store.standins.hang_copyhash")
    monkeypatch.setenv("KVTIERD_TEST_HANG_PIDFILE", str(pidfile))
    daemon = DaemonProcess(tmp_path / "kvtierd", runtime=runtime)
    daemon.start(120)
    try:
        _serves(daemon, "before")
        deadline = time.monotonic() + DEADLINE_S
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pidfile.exists(), "the daemon never probed the copy kernel"
        child = int(pidfile.read_text())
        assert _alive(child)  # the probe hangs now
        _serves(daemon, "while")
        assert daemon.stop() == 0
    finally:
        daemon.kill()
    deadline = time.monotonic() + DEADLINE_S
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the probe's child outlived the daemon"
    log = daemon.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_a_probe_that_dies_of_sigill_leaves_the_daemon_serving(
    runtime: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MODULE_ENV, "tests.store.standins.sigill_copyhash")
    daemon = DaemonProcess(tmp_path / "kvtierd", runtime=runtime)
    daemon.start(120)
    try:
        for name in ("first", "second"):  # the probe's verdict comes between, or before
            _serves(daemon, name)
        assert daemon.stop() == 0
    finally:
        daemon.kill()
    log = daemon.log()
    assert "Traceback" not in log, log[-4000:]
