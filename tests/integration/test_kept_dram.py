"""Restarts keep the DRAM (issue 35, item 2): a clean stop hands the tenant regions and an image
of their blocks to systemd's file-descriptor store, and the next start serves every block from
DRAM again, each verified; a block changed meanwhile, a crash, a changed size or a store too
small fall back to NVMe, never to wrong bytes. The harness is the part of systemd the daemon
talks to (:class:`kvtierd.testing.ServiceManager`: the notify socket and the fd store, the
descriptors passed back through ``LISTEN_FDS``/``LISTEN_FDNAMES``); PID 1 is not systemd here.
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.client import DaemonNotRunningError, Reconnect, StartingError, connect
from kvtierd.server.fdstore import IMAGE_NAME, region_name
from kvtierd.store.kept import decode_image
from kvtierd.testing import DaemonProcess, ServiceManager
from tests.support.configs import config_text, tenant_table
from tests.support.kept_dram import BLOCK, pattern, put_blocks
from tests.support.kept_dram import read_blocks as _read
from tests.support.kept_dram import tiers_of as _tiers

pytestmark = pytest.mark.timeout(240)

COUNT = 24


def _put(daemon: DaemonProcess, name: str = "kept", tenant: str = "default", *,
         durable: bool = True) -> list[bytes]:  # fmt: skip
    return put_blocks(daemon, COUNT, name, tenant, durable=durable)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ServiceManager]:
    with ServiceManager(tmp_path) as manager:
        yield manager


def _dram_hits(daemon: DaemonProcess) -> int:
    with connect(daemon.socket) as client:
        return int(client.stats()["tiers"][0]["hits"])


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_a_restart_serves_every_block_from_dram_verified(
    tmp_path: Path, manager: ServiceManager, runtime: str
) -> None:
    with DaemonProcess(tmp_path / "d", manager=manager, runtime=runtime) as daemon:
        keys = _put(daemon)
        assert daemon.stop() == 0
        assert sorted(manager.names()) == sorted([region_name(1), IMAGE_NAME])
        daemon.start()
        # Taken back and out of systemd's store at once: a crash now is handed nothing.
        assert manager.names() == []
        assert _tiers(daemon, keys) == ["dram"] * COUNT
        assert _read(daemon, keys) == [pattern(b"kept", k) for k in keys]
        assert _dram_hits(daemon) == COUNT
        assert f"DRAM kept across the restart: {COUNT} blocks (" in daemon.log()


def test_without_a_disk_tier_the_blocks_outlive_the_restart(
    tmp_path: Path, manager: ServiceManager
) -> None:
    """DRAM only: before, a restart lost every block; now a clean one loses none."""
    with DaemonProcess(tmp_path / "d", manager=manager, nvme_size="0") as daemon:
        keys = _put(daemon, durable=False)
        assert daemon.stop() == 0
        daemon.start()
        assert _read(daemon, keys) == [pattern(b"kept", k) for k in keys]
        daemon.stop()
        assert sorted(manager.names()) == sorted([region_name(1), IMAGE_NAME])  # and kept again


def test_a_block_changed_while_no_daemon_ran_is_dropped_and_served_from_nvme(
    tmp_path: Path, manager: ServiceManager
) -> None:
    """The region is its tenant's clients' to write: what changed in it is not adopted."""
    with DaemonProcess(tmp_path / "d", manager=manager) as daemon:
        keys = _put(daemon)
        assert daemon.stop() == 0
        stored = dict(manager.stored())
        image = decode_image(os.pread(stored[IMAGE_NAME], 1 << 20, 0))
        victim = next(b for b in image.blocks if b.key == keys[5])
        region = stored[region_name(victim.region)]
        with mmap.mmap(region, os.fstat(region).st_size) as memory:
            memory[victim.offset + 100] ^= 0xFF
        daemon.start()
        tiers = _tiers(daemon, keys)
        assert tiers[5] == "nvme"
        assert tiers[:5] + tiers[6:] == ["dram"] * (COUNT - 1)
        assert _read(daemon, keys) == [pattern(b"kept", k) for k in keys]
        assert "1 blocks changed while no daemon ran" in daemon.log()


def test_after_a_crash_nothing_is_handed_back(tmp_path: Path, manager: ServiceManager) -> None:
    with DaemonProcess(tmp_path / "d", manager=manager) as daemon:
        keys = _put(daemon)
        assert daemon.stop() == 0
        daemon.start()
        daemon.kill()  # kill -9: the DRAM it took back is not in the store any more
        assert manager.names() == []
        daemon.start()
        assert _tiers(daemon, keys) == ["nvme"] * COUNT
        assert _read(daemon, keys) == [pattern(b"kept", k) for k in keys]


def test_regions_handed_without_their_image_are_not_trusted(
    tmp_path: Path, manager: ServiceManager
) -> None:
    """Only the image says what a region holds: without it (a stop that did not finish), the
    regions are closed and the DRAM starts empty."""
    with DaemonProcess(tmp_path / "d", manager=manager) as daemon:
        keys = _put(daemon)
        assert daemon.stop() == 0
        image_fd = dict(manager.stored())[IMAGE_NAME]
        manager._handle(f"FDSTOREREMOVE=1\nFDNAME={IMAGE_NAME}", [])
        with pytest.raises(OSError):
            os.fstat(image_fd)
        daemon.start()
        assert _tiers(daemon, keys) == ["nvme"] * COUNT
        assert "without their image" in daemon.log()


def test_a_changed_dram_size_starts_empty_and_serves_nvme(
    tmp_path: Path, manager: ServiceManager
) -> None:
    daemon = DaemonProcess(tmp_path / "d", manager=manager)
    with daemon:
        keys = _put(daemon)
    bigger = DaemonProcess(tmp_path / "d", manager=manager, dram_size="96M")
    with bigger:
        assert manager.names() == []
        assert _tiers(bigger, keys) == ["nvme"] * COUNT
        assert "none of its 24 blocks taken" in bigger.log()


def test_a_store_too_small_keeps_nothing_and_says_so(tmp_path: Path) -> None:
    with (
        ServiceManager(tmp_path, fdstore_max=1) as manager,
        DaemonProcess(tmp_path / "d", manager=manager) as daemon,
    ):
        keys = _put(daemon)
        assert daemon.stop() == 0
        assert manager.names() == []
        assert "FileDescriptorStoreMax= allows 1" in daemon.log()
        daemon.start()
        assert _tiers(daemon, keys) == ["nvme"] * COUNT


def test_keep_across_restarts_off_keeps_nothing(tmp_path: Path, manager: ServiceManager) -> None:
    config = config_text(dram={"keep_across_restarts": False})
    with DaemonProcess(tmp_path / "d", manager=manager, config_text=config) as daemon:
        keys = _put(daemon)
        assert daemon.stop() == 0
        assert manager.names() == []
        daemon.start()
        assert _tiers(daemon, keys) == ["nvme"] * COUNT


def test_each_tenant_gets_its_own_region_back_whatever_the_order(
    tmp_path: Path, manager: ServiceManager
) -> None:
    """Listed in the other order, the tenants' regions change places in the arena and their
    numbers: each region still goes back to its own tenant, never to the other."""
    tenants = [tenant_table("alpha", uids=(2001,)), tenant_table("beta", uids=(2002,))]
    first = config_text(*tenants, dram={"size": "96M"})
    swapped = config_text(*reversed(tenants), dram={"size": "96M"})
    inodes: dict[str, int] = {}
    directory = tmp_path / "d"
    with DaemonProcess(directory, dram_size=None, config_text=first, manager=manager) as daemon:
        keys = {t: _put(daemon, t, tenant=t) for t in ("alpha", "beta")}
        with connect(daemon.socket) as client:
            for t in ("alpha", "beta"):
                inodes[t] = os.fstat(
                    client.namespace(t, block_bytes=BLOCK, tenant=t).arena.fd
                ).st_ino
    with DaemonProcess(directory, dram_size=None, config_text=swapped, manager=manager) as daemon:
        for t in ("alpha", "beta"):
            assert _tiers(daemon, keys[t], t, tenant=t) == ["dram"] * COUNT
            assert _read(daemon, keys[t], t, tenant=t) == [pattern(t.encode(), k) for k in keys[t]]
            with connect(daemon.socket) as client:
                ns = client.namespace(t, block_bytes=BLOCK, tenant=t)
                assert os.fstat(ns.arena.fd).st_ino == inodes[t]


def test_an_engine_connected_across_a_restart_sees_no_failed_request_and_dram_after(
    tmp_path: Path, manager: ServiceManager
) -> None:
    """Socket activation and the fd store together: what a `systemctl restart` (an upgrade)
    looks like to an engine that keeps reading: every request answered, every block the same,
    and served from DRAM after the restart as before it."""
    directory = tmp_path / "d"
    directory.mkdir()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(directory / "kvtierd.sock"))
    listening.listen(64)
    daemon = DaemonProcess(directory, manager=manager, listening=listening)
    try:
        daemon.start()
        keys = _put(daemon)
        failures: list[BaseException] = []
        reads = 0
        done = threading.Event()

        def engine() -> None:
            nonlocal reads
            with connect(daemon.socket, reconnect=Reconnect(timeout_s=60.0)) as client:
                ns = client.namespace("kept", block_bytes=BLOCK)
                while not done.is_set():
                    try:
                        with ns.get(keys) as views:
                            assert [bytes(v) for v in views] == [pattern(b"kept", k) for k in keys]
                        reads += 1
                    except BaseException as exc:  # what the assertion shows
                        failures.append(exc)
                        return

        reader = threading.Thread(target=engine)
        reader.start()
        while reads < 3 and reader.is_alive():
            done.wait(0.05)
        assert daemon.stop() == 0
        daemon.start()
        before = reads
        while reads < before + 3 and reader.is_alive():
            done.wait(0.05)
        done.set()
        reader.join(60)
        assert failures == []
        assert reads >= before + 3
        assert _tiers(daemon, keys) == ["dram"] * COUNT
        assert "verified and adopted" in daemon.log()
    finally:
        daemon.kill()
        listening.close()


def test_the_real_systemd_keeps_the_dram_across_systemctl_restart(tmp_path: Path) -> None:
    """Where systemd is PID 1: a transient unit with the fd store, `systemctl restart`, the
    blocks served from DRAM by the new daemon."""
    if not Path("/run/systemd/system").is_dir() or os.geteuid() != 0:
        pytest.skip("needs systemd as PID 1 and root (this machine's PID 1 is not systemd)")
    unit = f"kvtierd-kept-{os.getpid()}"
    directory = tmp_path / "d"
    daemon = DaemonProcess(directory)  # for its paths and arguments; systemd runs it
    command = [
        "systemd-run",
        f"--unit={unit}",
        "--property=Type=notify",
        "--property=NotifyAccess=main",
        "--property=FileDescriptorStoreMax=66",
        f"--setenv=PYTHONPATH={Path(__file__).parents[2]}",
        sys.executable,
        "-m",
        "kvtierd",
        *daemon.args,
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    try:
        wait_for_socket(daemon.socket)
        keys = _put(daemon)
        subprocess.run(["systemctl", "restart", unit], check=True, timeout=120)
        wait_for_socket(daemon.socket)
        assert _tiers(daemon, keys) == ["dram"] * COUNT
        assert _read(daemon, keys) == [pattern(b"kept", k) for k in keys]
    finally:
        subprocess.run(["systemctl", "stop", unit], check=False, timeout=120)


def wait_for_socket(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with connect(path, timeout_s=5):
                return
        except (DaemonNotRunningError, StartingError, ConnectionError):
            time.sleep(0.1)
    raise AssertionError(f"no daemon served {path} within {timeout_s} s")
