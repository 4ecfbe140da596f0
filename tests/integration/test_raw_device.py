"""The NVMe index snapshot lives in the data directory, one per data file, and a raw block device
works as ``nvme.path``, end to end with the real daemon.

Blocks are written and made durable (FSYNC), the daemon is stopped cleanly and started again; the
restart must load the snapshot (its log says ``recovered by snapshot``, not ``by scan``) and serve
every block byte-exact:

* a data file in another directory: the snapshot is in the data directory, nothing is written
  beside the data file;
* two daemons whose data files share one directory: each keeps its own snapshot;
* a snapshot an older version left beside the data file is loaded once, then removed; with one
  in the data directory too, neither is trusted (one is stale);
* a data file written by a daemon with another data directory since the snapshot was taken: the
  snapshot is stale, the restart scans and sees what the other daemon left;
* a second daemon on a data file or device in use refuses to start;
* a loop device (``losetup``) as ``nvme.path``: the blocks are on the device, the snapshot in the
  data directory; an ``nvme.size`` larger than the device is refused with a clear error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.store.records import PAGE_BYTES, Superblock
from kvtierd.store.recovery import SNAPSHOT_NAME, snapshot_path
from kvtierd.testing import DaemonProcess

pytestmark = pytest.mark.timeout(180)

BLOCK_BYTES = 64 << 10
BLOCKS = 40
DEVICE_BYTES = 96 << 20
CONFIG = '[nvme]\nsegment_bytes = "1M"\npath = "{path}"\n'


def block(i: int, salt: int = 0) -> np.ndarray:
    return np.random.default_rng(i + 1000 * salt).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def key(i: int) -> bytes:
    return b"raw-%06d" % i + bytes(11)


def daemon_for(
    directory: Path, data_file: Path, nvme_size: str = "64M", secret: Path | None = None
) -> DaemonProcess:
    """A daemon on ``data_file``; ``secret``: a key secret shared with another daemon, which
    then finds the same namespaces' blocks."""
    config = CONFIG.format(path=data_file)
    if secret is not None:
        config = f'[daemon]\nkey_secret_file = "{secret}"\n{config}'
    return DaemonProcess(directory, nvme_size=nvme_size, config_text=config)


def write_durably(daemon: DaemonProcess, salt: int = 0) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("raw", block_bytes=BLOCK_BYTES)
        for start in range(0, BLOCKS, 10):
            batch = range(start, start + 10)
            assert ns.put([key(i) for i in batch], [block(i, salt) for i in batch]) == 10
        client.fsync()


def check_every_block(daemon: DaemonProcess, salt: int = 0, first: int = 0) -> None:
    """Blocks ``first`` to ``first + BLOCKS`` are stored, byte-exact."""
    with connect(daemon.socket) as client:
        ns = client.namespace("raw", block_bytes=BLOCK_BYTES, create=False)
        assert ns.lookup([key(i) for i in range(first, first + BLOCKS)]) == BLOCKS
        for start in range(first, first + BLOCKS, 10):
            batch = list(range(start, start + 10))
            with ns.get([key(i) for i in batch]) as views:
                for i, view in zip(batch, views, strict=True):
                    assert bytes(view) == block(i, salt).tobytes(), i


def recoveries(daemon: DaemonProcess, source: str) -> int:
    """How many starts logged an NVMe recovery by ``source`` (the log keeps every run)."""
    return sum(
        "blocks recovered by " + source in line and f": {BLOCKS} blocks" in line
        for line in daemon.log().splitlines()
    )


def test_a_data_file_elsewhere_keeps_its_snapshot_in_the_data_dir(tmp_path: Path) -> None:
    data_file = tmp_path / "elsewhere" / "kv.data"
    daemon = daemon_for(tmp_path / "kvtierd", data_file)
    with daemon:
        write_durably(daemon)
    snapshot = snapshot_path(daemon.data_dir, data_file)
    assert snapshot.parent == daemon.data_dir
    assert snapshot.is_file()
    assert sorted(p.name for p in data_file.parent.iterdir()) == ["kv.data"]
    with daemon:
        check_every_block(daemon)
    assert recoveries(daemon, "snapshot") == 1
    assert "Traceback" not in daemon.log()


def test_two_daemons_sharing_a_data_file_directory_keep_one_snapshot_each(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    daemons = [daemon_for(tmp_path / f"kvtierd-{n}", shared / f"{n}.data") for n in range(2)]
    for salt, daemon in enumerate(daemons):
        with daemon:
            write_durably(daemon, salt)
    snapshots = {snapshot_path(d.data_dir, shared / f"{n}.data") for n, d in enumerate(daemons)}
    assert len(snapshots) == 2
    assert all(s.is_file() for s in snapshots)
    assert not (shared / SNAPSHOT_NAME).exists()
    for salt, daemon in enumerate(daemons):
        with daemon:
            check_every_block(daemon, salt)
        assert recoveries(daemon, "snapshot") == 1, daemon.log()


def test_a_snapshot_left_beside_the_data_file_is_loaded_once(tmp_path: Path) -> None:
    data_file = tmp_path / "elsewhere" / "kv.data"
    daemon = daemon_for(tmp_path / "kvtierd", data_file)
    with daemon:
        write_durably(daemon)
    legacy = data_file.parent / SNAPSHOT_NAME
    snapshot_path(daemon.data_dir, data_file).rename(legacy)  # where older versions wrote it
    with daemon:
        assert not legacy.exists()  # deleted before the daemon serves anything
        check_every_block(daemon)
    assert "loading the index snapshot an older version left at" in daemon.log()
    assert recoveries(daemon, "snapshot") == 1


def test_two_snapshots_of_one_data_file_are_both_distrusted(tmp_path: Path) -> None:
    """A downgrade and an upgrade back leave one in each place; one of them is stale."""
    data_file = tmp_path / "elsewhere" / "kv.data"
    daemon = daemon_for(tmp_path / "kvtierd", data_file)
    with daemon:
        write_durably(daemon)
    legacy = data_file.parent / SNAPSHOT_NAME
    shutil.copy(snapshot_path(daemon.data_dir, data_file), legacy)
    with daemon:
        assert not legacy.exists()
        assert not snapshot_path(daemon.data_dir, data_file).exists()
        check_every_block(daemon)
    assert "two index snapshots of this data file" in daemon.log()
    assert recoveries(daemon, "scan") == 1
    assert recoveries(daemon, "snapshot") == 0


def test_a_snapshot_is_stale_once_another_data_dir_wrote_the_file(tmp_path: Path) -> None:
    data_file = tmp_path / "elsewhere" / "kv.data"
    secret = tmp_path / "key.secret"
    first, other = (
        daemon_for(tmp_path / name, data_file, secret=secret) for name in ("first", "other")
    )
    with first:
        write_durably(first)
    other.data_dir.mkdir(parents=True)  # knows the namespace too, but has no snapshot: it scans
    shutil.copy(first.data_dir / "namespaces.catalog", other.data_dir)
    with other, connect(other.socket) as client:
        ns = client.namespace("raw", block_bytes=BLOCK_BYTES)
        assert ns.forget([key(i) for i in range(10)]) == 10
        batch = range(BLOCKS, BLOCKS + 10)
        assert ns.put([key(i) for i in batch], [block(i) for i in batch]) == 10
        client.fsync()
    assert snapshot_path(first.data_dir, data_file).is_file()  # written before the change
    with first:
        check_every_block(first, first=10)  # what the other daemon left, not the snapshot
        with connect(first.socket) as client:
            ns = client.namespace("raw", block_bytes=BLOCK_BYTES, create=False)
            assert ns.lookup([key(i) for i in range(10)]) == 0
    assert "the data file was written after its index snapshot" in first.log()
    assert recoveries(first, "scan") == 1
    assert recoveries(first, "snapshot") == 0


def test_a_second_daemon_on_a_data_file_in_use_refuses_to_start(tmp_path: Path) -> None:
    data_file = tmp_path / "elsewhere" / "kv.data"
    first, second = (daemon_for(tmp_path / name, data_file) for name in ("first", "second"))
    with first:
        write_durably(first)
        with pytest.raises(RuntimeError, match="exited with"):
            second.start()
        assert f"{data_file} is in use by another kvtierd" in second.log()
        check_every_block(first)
    assert "Traceback" not in second.log()


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[Path]:
    """A loop device over a sparse file in ``tmp_path``; detached afterwards, always."""
    if shutil.which("losetup") is None or not Path("/dev/loop-control").exists():
        pytest.skip("needs losetup and /dev/loop-control (util-linux, loop module)")
    if os.geteuid() != 0:
        pytest.skip("attaching a loop device needs root")
    backing = tmp_path / "device.img"
    with open(backing, "wb") as image:
        image.truncate(DEVICE_BYTES)
    attached = subprocess.run(
        ["losetup", "--find", "--show", str(backing)], capture_output=True, text=True, timeout=60
    )
    if attached.returncode != 0:
        pytest.skip(f"losetup cannot attach a loop device here: {attached.stderr.strip()}")
    device = Path(attached.stdout.strip())
    try:
        yield device
    finally:
        subprocess.run(["losetup", "--detach", str(device)], check=True, timeout=60)


def test_a_raw_block_device_keeps_its_blocks_across_a_restart(
    tmp_path: Path, loop_device: Path
) -> None:
    daemon = daemon_for(tmp_path / "kvtierd", loop_device)
    with daemon:
        write_durably(daemon)
        second = daemon_for(tmp_path / "second", loop_device)
        with pytest.raises(RuntimeError, match="exited with"):
            second.start()  # the kernel's exclusive claim (O_EXCL) keeps it out
        assert f"{loop_device} is in use (mounted, or by another kvtierd)" in second.log()
    snapshot = snapshot_path(daemon.data_dir, loop_device)
    assert snapshot.is_file()
    assert not (loop_device.parent / SNAPSHOT_NAME).exists()
    # the blocks went to the device: its backing file begins with the tier's superblock
    with open(tmp_path / "device.img", "rb") as image:
        assert Superblock.unpack(image.read(PAGE_BYTES)).file_bytes == 64 << 20
    with daemon:
        check_every_block(daemon)
        daemon.kill()  # a crash: no snapshot is written, the next start scans the device
    assert recoveries(daemon, "snapshot") == 1
    with daemon:
        check_every_block(daemon)
    assert recoveries(daemon, "scan") == 1
    assert "Traceback" not in daemon.log()


def test_an_nvme_size_larger_than_the_device_is_refused(tmp_path: Path, loop_device: Path) -> None:
    daemon = daemon_for(tmp_path / "kvtierd", loop_device, nvme_size="1G")
    with pytest.raises(RuntimeError, match="exited with 2"):
        daemon.start()
    assert f"nvme.size: 1073741824 bytes do not fit in {loop_device}" in daemon.log()
    assert "Traceback" not in daemon.log()
