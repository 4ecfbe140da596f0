"""Health that tells the truth about acknowledged data (issue 31, item 4), on a real daemon:

* its data file on a tiny tmpfs that fills: FSYNC answers ENOSPC, the failures are counted with
  reason ``enospc``, ``/health`` fails, ``/ready`` is degraded, one error line says what to do;
  once the space is freed write-back goes through by itself and health comes back;
* its data file replaced (another file renamed over it) or removed (unlinked): FSYNC
  acknowledges nothing (EIO), the failure is counted with reason ``replaced`` or ``removed``,
  health fails until a restart, and the restart is healthy again; the old file, copied back
  from the ``/proc`` path the remedy names, brings every block back;
* a raw block device (a loop device) is watched by its device number: its node recreated is
  no change, a node of another device in its place is ``replaced``;
* its data file truncated in place (same inode) or its superblock zeroed in place: FSYNC
  acknowledges nothing (EIO), reason ``truncated`` or ``damaged``, health fails until a
  restart; the restart refuses a file it cannot recognise (exit 1, one ERROR with the remedy)
  unless ``nvme.reinitialize_unreadable``, and rebuilds a superblock its first segment names;
* its namespace catalog removed: rewritten from memory at once (reason ``catalog`` counted,
  health stays ok) so that a kill -9 and restart still finds every acknowledged block; a
  catalog that cannot be rewritten refuses FSYNC and fails health until it can.

The daemon runs on the test's event loop kind (asyncio or trio); every wait is a poll with a
generous deadline, never a timing assertion.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from kvtierd.client import AsyncNamespace, NoSpaceError, StorageIOError, connect_async
from kvtierd.testing import DaemonProcess, free_port
from tests.integration.test_metrics import Scraped, http_get, scrape
from tests.support.filesystems import fill, small_file_system

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

MIB = 1 << 20


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, MIB, dtype=np.uint8)


def key(i: int) -> bytes:
    return b"disk-%06d" % i + bytes(5)


def config(port: int, nvme: str = "") -> str:
    return f"[daemon]\nmetrics_port = {port}\n\n[nvme]\nhealth_check_interval_s = 0.2\n{nvme}"


async def probe(port: int, path: str) -> tuple[int, dict[str, str]]:
    status, body = await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{port}{path}")
    return status, json.loads(body)


async def metrics(port: int) -> Scraped:
    return await anyio.to_thread.run_sync(scrape, port)


async def poll(what: str, check: Callable[[], Awaitable[bool]], deadline_s: float = 60) -> None:
    """Wait until ``check()`` is true; fail saying ``what`` after ``deadline_s``."""
    end = anyio.current_time() + deadline_s
    while anyio.current_time() < end:
        if await check():
            return
        await anyio.sleep(0.1)
    raise AssertionError(what)


async def put(ns: AsyncNamespace, ids: range) -> None:
    await ns.put([key(i) for i in ids], [block(i) for i in ids])


def error_lines(daemon: DaemonProcess, word: str) -> list[str]:
    return [
        line for line in daemon.log().splitlines() if "ERROR kvtierd.disk:" in line and word in line
    ]


async def healthy(port: int) -> bool:
    return (await probe(port, "/health"))[0] == 200


async def failures_reach(port: int, reason: str, count: float) -> bool:
    """Whether ``kvtierd_disk_failures_total{reason}`` has reached ``count``."""
    now = await metrics(port)
    return now.value("kvtierd_disk_failures_total", reason=reason) >= count


async def assert_blocks(ns: AsyncNamespace, count: int) -> None:
    """The first ``count`` blocks read back from ``ns`` are the ones :func:`put` stored."""
    async with ns.get([key(i) for i in range(count)]) as views:
        for i, view in enumerate(views):
            assert bytes(view) == block(i).tobytes(), i


def disk_daemon(tmp_path: Path, port: int, anyio_backend: str) -> DaemonProcess:
    """A daemon with 64 MiB of DRAM and of NVMe on the test's event loop kind."""
    return DaemonProcess(
        tmp_path / "kvtierd", dram_size="64M", nvme_size="64M", config_text=config(port),
        runtime=anyio_backend,
    )  # fmt: skip


async def failing_for(port: int, reason: str) -> bool:
    status, body = await probe(port, "/health")
    return status == 503 and body["status"] == "failing" and f"({reason})" in body["reason"]


async def assert_failing(port: int, reason: str, remedy: str) -> Scraped:
    """Every outward sign of a failing disk tier, for ``reason``; returns the scrape."""
    status, body = await probe(port, "/health")
    assert status == 503, body
    assert body["status"] == "failing"
    assert f"({reason})" in body["reason"]
    assert remedy in body["reason"]
    status, body = await probe(port, "/ready")
    assert (status, body["status"]) == (503, "degraded"), body
    seen: Scraped | None = None

    async def counted() -> bool:
        nonlocal seen
        seen = await metrics(port)
        return seen.value("kvtierd_disk_failures_total", reason=reason) >= 1

    await poll(f"kvtierd_disk_failures_total{{reason={reason}}} never moved", counted)
    assert seen is not None
    assert seen.value("kvtierd_disk_failing", reason=reason) == 1
    reasons = ("enospc", "eio", "replaced", "removed", "truncated", "damaged", "catalog")
    others = [r for r in reasons if r != reason]
    assert all(seen.value("kvtierd_disk_failing", reason=r) == 0 for r in others)
    assert seen.value("kvtierd_ready") == 0
    assert seen.value("kvtierd_healthy") == 0
    return seen


async def assert_healthy(port: int) -> None:
    status, body = await probe(port, "/health")
    assert (status, body["status"]) == (200, "ok"), body
    status, body = await probe(port, "/ready")
    assert (status, body["status"]) == (200, "ready"), body
    seen = await metrics(port)
    assert seen.value("kvtierd_ready") == 1
    assert seen.value("kvtierd_healthy") == 1
    assert seen.total("kvtierd_disk_failing") == 0


async def test_a_full_file_system_fails_health_until_space_is_freed(
    tmp_path: Path, anyio_backend: str
) -> None:
    port = free_port()
    with small_file_system(tmp_path / "fs", "40m") as fs:
        nvme = f'preallocate = false\npath = "{fs / "nvme.data"}"\n'
        with DaemonProcess(
            tmp_path / "kvtierd",
            dram_size="64M",
            nvme_size="128M",
            config_text=config(port, nvme),
            runtime=anyio_backend,
        ) as daemon:
            async with connect_async(daemon.socket) as client:
                ns = await client.namespace("disk", block_bytes=MIB)
                await put(ns, range(4))
                await client.fsync()
                await assert_healthy(port)
                fill(fs / "filler")  # another process takes the rest of the file system
                await put(ns, range(4, 12))
                with pytest.raises(NoSpaceError):
                    await client.fsync()
                seen = await assert_failing(port, "enospc", "free space on the file system")
                # the timer keeps retrying (each retry counted) but says so only once
                first = seen.value("kvtierd_disk_failures_total", reason="enospc")
                await poll(
                    "failed blocks were never tried again",
                    lambda: failures_reach(port, "enospc", first + 3),
                )
                assert await failing_for(port, "enospc")
                lines = error_lines(daemon, "enospc")
                assert len(lines) == 1, daemon.log()
                assert "Remedy: free space on the file system" in lines[0]
                # blocks whose write-back waits are still served, from DRAM
                async with ns.get([key(7)]) as views:
                    assert bytes(views[0]) == block(7).tobytes()

                (fs / "filler").unlink()  # space freed: write-back goes through by itself
                await poll(
                    "health never came back after the space was freed", lambda: healthy(port)
                )
                await assert_healthy(port)
                assert "disk tier healthy again" in daemon.log()
                assert len(error_lines(daemon, "enospc")) == 1
                await client.fsync()
                await client.evict()  # read them back from the disk
                await assert_blocks(ns, 12)
            assert daemon.stop() == 0


async def test_a_replaced_data_file_is_never_acknowledged(
    tmp_path: Path, anyio_backend: str
) -> None:
    port = free_port()
    daemon = disk_daemon(tmp_path, port, anyio_backend)
    data = daemon.data_dir / "nvme.data"
    with daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            await put(ns, range(4))
            await client.fsync()
            await assert_healthy(port)
            nvme = [c for c in await client.doctor() if c["subject"] == "nvme"]
            assert [c["status"] for c in nvme] == ["ok"]
            impostor = data.with_name("impostor")
            impostor.write_bytes(bytes(4096))
            os.rename(impostor, data)  # what a careless deploy or restore script does
            await put(ns, range(4, 8))
            with pytest.raises(StorageIOError, match="no longer the data file"):
                await client.fsync()
            await assert_failing(port, "replaced", "restart kvtierd")
            # and it stays refused: nothing is acknowledged onto the old file
            with pytest.raises(StorageIOError, match="FSYNC refused"):
                await client.fsync()
            await poll(
                "the refused FSYNC was not counted", lambda: failures_reach(port, "replaced", 2)
            )
            lines = error_lines(daemon, "replaced")
            assert len(lines) == 1, daemon.log()
            assert "until kvtierd is restarted" in lines[0]
            assert "restart kvtierd" in lines[0]
            # kvtierctl doctor (DOCTOR) fails its nvme line with the same words
            nvme = [c for c in await client.doctor() if c["subject"] == "nvme"]
            assert [c["status"] for c in nvme] == ["fail"]
            assert "(replaced)" in nvme[0]["detail"]
            assert "restart kvtierd" in nvme[0]["detail"]
            # what is in DRAM is still served
            async with ns.get([key(5)]) as views:
                assert bytes(views[0]) == block(5).tobytes()
            # the operator's rescue, while the daemon runs: the old file back at the path
            reason = (await probe(port, "/health"))[1]["reason"]
            old = re.search(r"/proc/\d+/fd/\d+", reason)
            assert old is not None, reason
            shutil.copyfile(old[0], data)
        assert daemon.stop() == 0
    assert "no index snapshot written" in daemon.log()
    # the copy is the data file again: every block written to the old file is back, from disk
    with daemon:
        await assert_healthy(port)
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB, create=False)
            await assert_blocks(ns, 8)


async def test_a_removed_data_file_is_noticed_without_an_fsync(
    tmp_path: Path, anyio_backend: str
) -> None:
    port = free_port()
    daemon = disk_daemon(tmp_path, port, anyio_backend)
    data = daemon.data_dir / "nvme.data"
    with daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            await put(ns, range(4))
            await client.fsync()
            await assert_healthy(port)
            data.unlink()
            # nobody FSYNCs: the timer notices
            await poll("the removal was never noticed", lambda: failing_for(port, "removed"))
            await assert_failing(port, "removed", "restart kvtierd")
            before = (await metrics(port)).value("kvtierd_disk_failures_total", reason="removed")
            await put(ns, range(4, 8))
            with pytest.raises(StorageIOError, match="removed"):
                await client.fsync()
            await poll(
                "the refused FSYNC was not counted",
                lambda: failures_reach(port, "removed", before + 1),
            )
            assert len(error_lines(daemon, "removed")) == 1, daemon.log()
        assert daemon.stop() == 0
    # only a restart clears it: a new data file, healthy again
    with daemon:
        assert data.exists()
        await assert_healthy(port)
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            await put(ns, range(2))
            assert await client.fsync() >= 2


@contextlib.contextmanager
def loop_devices(directory: Path, count: int) -> Iterator[list[Path]]:
    """``count`` loop devices over sparse 96 MiB files in ``directory``; detached afterwards."""
    if shutil.which("losetup") is None or not Path("/dev/loop-control").exists():
        pytest.skip("needs losetup and /dev/loop-control (util-linux, loop module)")
    if os.geteuid() != 0:
        pytest.skip("attaching a loop device needs root")
    devices: list[Path] = []
    try:
        for i in range(count):
            image = directory / f"device{i}.img"
            with open(image, "wb") as out:
                out.truncate(96 << 20)
            attached = subprocess.run(
                ["losetup", "--find", "--show", str(image)],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            if attached.returncode != 0:
                pytest.skip(f"losetup cannot attach a loop device: {attached.stderr.strip()}")
            devices.append(Path(attached.stdout.strip()))
        yield devices
    finally:
        for device in devices:
            subprocess.run(["losetup", "--detach", str(device)], check=False, timeout=60)


def node_of(device: Path, path: Path) -> None:
    """Put a block device node for ``device`` at ``path`` (atomically, as udev would)."""
    fresh = path.with_name(path.name + ".new")
    os.mknod(fresh, stat.S_IFBLK | 0o600, os.stat(device).st_rdev)
    os.rename(fresh, path)


async def test_a_raw_device_is_watched_by_its_device_number(
    tmp_path: Path, anyio_backend: str
) -> None:
    port = free_port()
    with loop_devices(tmp_path, 2) as (mine, other):
        node = tmp_path / "kvtierd-disk"
        node_of(mine, node)
        nvme = f'segment_bytes = "1M"\npath = "{node}"\n'
        with DaemonProcess(
            tmp_path / "kvtierd", nvme_size="64M", config_text=config(port, nvme),
            runtime=anyio_backend,
        ) as daemon:  # fmt: skip
            async with connect_async(daemon.socket) as client:
                ns = await client.namespace("raw", block_bytes=MIB)
                await put(ns, range(4))
                await client.fsync()
                node_of(mine, node)  # a new node, the same device: no change
                await put(ns, range(4, 8))
                assert await client.fsync() == 8
                await assert_healthy(port)
                node_of(other, node)  # the path now names another device
                with pytest.raises(StorageIOError, match="no longer the data file"):
                    await client.fsync()
                await assert_failing(port, "replaced", "restart kvtierd")
            assert daemon.stop() == 0


def tamper_config(daemon: DaemonProcess, port: int, nvme: str = "") -> None:
    """Rewrite the daemon's configuration file before its next start."""
    (daemon.directory / "kvtierd.toml").write_text(config(port, nvme))


def overwrite(path: Path, data: bytes) -> None:
    """Write ``data`` over the start of ``path`` in place (the same inode and size), durably."""
    with open(path, "r+b") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def start_fails(daemon: DaemonProcess) -> str:
    """Start ``daemon``, which must exit instead of serving; the log it left."""
    with pytest.raises(RuntimeError, match="exited with 1"):
        daemon.start(60)
    return daemon.log()


async def test_a_truncated_data_file_is_never_acknowledged_nor_silently_reinitialised(
    tmp_path: Path, anyio_backend: str
) -> None:
    port = free_port()
    daemon = disk_daemon(tmp_path, port, anyio_backend)
    data = daemon.data_dir / "nvme.data"
    with daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            await put(ns, range(4))
            assert await client.fsync() == 4
            await assert_healthy(port)
            os.truncate(data, 0)  # the same inode: only its size tells
            await put(ns, range(4, 8))
            with pytest.raises(StorageIOError, match="truncated"):
                await client.fsync()
            await assert_failing(port, "truncated", "move")
            with pytest.raises(StorageIOError, match="FSYNC refused"):
                await client.fsync()
            lines = error_lines(daemon, "truncated")
            assert len(lines) == 1, daemon.log()
            assert "until kvtierd is restarted" in lines[0]
        daemon.kill()  # the crash case: nothing is written on the way out
    assert data.stat().st_size > 0  # write-back went on writing into the shortened file
    # the restart refuses the file it cannot recognise, saying what it found and what to do
    log = start_fails(daemon)
    refusal = [line for line in log.splitlines() if "refusing to start" in line]
    assert len(refusal) == 1, log
    assert "ERROR kvtierd.nvme:" in refusal[0]
    assert str(data) in refusal[0]
    assert "found zeroes" in refusal[0]
    assert "nvme.reinitialize_unreadable" in refusal[0]
    assert f"{data}.damaged" in refusal[0]
    assert "kvtierd: cannot run:" in log
    # the operator opts in (for one start): initialised empty, one ERROR line, healthy
    tamper_config(daemon, port, "reinitialize_unreadable = true\n")
    with daemon:
        assert "initialising it empty as nvme.reinitialize_unreadable" in daemon.log()
        await assert_healthy(port)
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            assert await ns.lookup([key(i) for i in range(8)], promote=False) == 0
            await put(ns, range(2))
            assert await client.fsync() == 2
        assert daemon.stop() == 0


async def test_a_moved_aside_data_file_starts_afresh(tmp_path: Path, anyio_backend: str) -> None:
    """The remedy the refusal names: the damaged file moved aside, the start creates anew."""
    port = free_port()
    daemon = disk_daemon(tmp_path, port, anyio_backend)
    data = daemon.data_dir / "nvme.data"
    with daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            await put(ns, range(2))
            await client.fsync()
        daemon.kill()
    overwrite(data, b"\xa5" * (2 * 4096))  # no superblock, no segment header left
    log = start_fails(daemon)
    assert "found no superblock: no magic" in log
    data.rename(data.with_name("nvme.data.damaged"))
    with daemon:
        await assert_healthy(port)
        assert data.exists()
        assert data.with_name("nvme.data.damaged").exists()
        assert daemon.stop() == 0


async def test_a_zeroed_superblock_is_never_acknowledged_and_rebuilt_at_restart(
    tmp_path: Path, anyio_backend: str
) -> None:
    port = free_port()
    daemon = disk_daemon(tmp_path, port, anyio_backend)
    data = daemon.data_dir / "nvme.data"
    with daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            await put(ns, range(4))
            assert await client.fsync() == 4
            await assert_healthy(port)
            overwrite(data, bytes(4096))  # in place, the same inode and size
            # nobody FSYNCs: the timer reads the first page back
            await poll(
                "the zeroed superblock was never noticed", lambda: failing_for(port, "damaged")
            )
            await assert_failing(port, "damaged", "move")
            with pytest.raises(StorageIOError, match="FSYNC refused"):
                await client.fsync()
            lines = error_lines(daemon, "damaged")
            assert len(lines) == 1, daemon.log()
            assert "found zeroes" in lines[0]
        daemon.kill()
    # the first segment header still names the file: the restart rebuilds the superblock
    # from it (a warning) and every acknowledged block is back
    with daemon:
        assert "rebuilt from its first segment" in daemon.log()
        await assert_healthy(port)
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB, create=False)
            await assert_blocks(ns, 4)
        assert daemon.stop() == 0


async def test_a_removed_catalog_is_rewritten_from_memory(
    tmp_path: Path, anyio_backend: str
) -> None:
    port = free_port()
    daemon = disk_daemon(tmp_path, port, anyio_backend)
    copies = [daemon.data_dir / n for n in ("namespaces.catalog", "namespaces.catalog.1")]
    with daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            await put(ns, range(4))
            assert await client.fsync() == 4
            await assert_healthy(port)
            for copy in copies:
                copy.unlink()

            async def restored() -> bool:
                now = await metrics(port)
                counted = now.value("kvtierd_disk_failures_total", reason="catalog") >= 1
                return counted and all(copy.exists() for copy in copies)

            await poll("the removed catalog was never rewritten", restored)
            await assert_healthy(port)  # nothing acknowledged is at risk any more
            warned = [line for line in daemon.log().splitlines() if "rewritten from memory" in line]
            assert len(warned) == 1, daemon.log()
            assert "WARNING kvtierd.disk:" in warned[0]
            # removed again just before an FSYNC: the FSYNC itself rewrites it first
            for copy in copies:
                copy.unlink()
            await put(ns, range(4, 8))
            assert await client.fsync() == 8
            assert all(copy.exists() for copy in copies)
        daemon.kill()
    with daemon:
        assert "recovered blocks of namespaces the namespace catalog does not name" not in (
            daemon.log()
        )
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB, create=False)
            assert await ns.lookup([key(i) for i in range(8)], promote=False) == 8
        assert daemon.stop() == 0


async def test_a_catalog_that_cannot_be_rewritten_refuses_fsync_until_it_can(
    tmp_path: Path, anyio_backend: str
) -> None:
    port = free_port()
    daemon = disk_daemon(tmp_path, port, anyio_backend)
    catalog = daemon.data_dir / "namespaces.catalog"
    with daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("disk", block_bytes=MIB)
            await put(ns, range(2))
            await client.fsync()
            catalog.unlink()
            catalog.mkdir()  # a directory at the path: the rewrite's rename fails
            await put(ns, range(2, 4))
            with pytest.raises(StorageIOError, match="namespace catalog"):
                await client.fsync()
            await assert_failing(port, "catalog", "rewrites it")
            assert len(error_lines(daemon, "catalog")) == 1, daemon.log()
            catalog.rmdir()
            await poll(
                "health never came back once the catalog could be written", lambda: healthy(port)
            )
            await assert_healthy(port)
            assert catalog.is_file()
            assert await client.fsync() == 4
        assert daemon.stop() == 0
