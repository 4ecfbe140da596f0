"""Full disk: the writer gets ENOSPC (``NoSpaceError``) and the store stays consistent.

* the arena cannot hold an ALLOC while nothing is evictable;
* a real full file system (a 40 MiB tmpfs under a 128 MiB sparse data file): FSYNC reports that
  blocks could not be made durable, earlier durable blocks stay readable, the daemon stays up,
  and writes succeed again once blocks are forgotten;
* a data file that cannot be preallocated: the daemon refuses to start, with exit status 1 and
  one line saying why.

ENOSPC is checked through the async client: the sync client currently reports every
``OSError`` subclass, ``NoSpaceError`` included, as a broken connection (a client bug).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import NoSpaceError, connect_async
from kvtierd.testing import DaemonProcess
from tests.support.filesystems import small_file_system

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, MIB, dtype=np.uint8)


def key(i: int) -> bytes:
    return b"full-%06d" % i + bytes(5)


@pytest.mark.anyio
async def test_an_alloc_larger_than_the_arena_gets_enospc(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "kvtierd", dram_size="16M") as daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("arena", block_bytes=MIB)
            with pytest.raises(NoSpaceError):
                await ns.put([key(i) for i in range(24)], [block(i) for i in range(24)])
            stats = await client.stats()
            assert stats["pending_writes"] == 0
            assert stats["tiers"][0]["used_bytes"] == 0  # the partial ALLOC was given back
            assert await ns.lookup([key(0)]) == 0
            # smaller writes still work, and fill what the failed one could not
            for start in range(0, 24, 4):
                keys = [key(i) for i in range(start, start + 4)]
                assert await ns.put(keys, [block(i) for i in range(start, start + 4)]) == 4
                await client.fsync()
            async with ns.get([key(0), key(23)]) as views:
                assert bytes(views[0]) == block(0).tobytes()
                assert bytes(views[1]) == block(23).tobytes()


@pytest.mark.anyio
async def test_a_full_file_system_fails_fsync_and_keeps_durable_blocks(tmp_path: Path) -> None:
    with small_file_system(tmp_path / "fs", "40m") as fs:
        config = f'[nvme]\npreallocate = false\npath = "{fs / "nvme.data"}"\n'
        with DaemonProcess(
            tmp_path / "kvtierd", dram_size="64M", nvme_size="128M", config_text=config
        ) as daemon:
            async with connect_async(daemon.socket) as client:
                ns = await client.namespace("disk", block_bytes=MIB)
                durable: list[int] = []
                failed_at = None
                for start in range(0, 80, 4):  # twice what the file system holds
                    batch = list(range(start, start + 4))
                    await ns.put([key(i) for i in batch], [block(i) for i in batch])
                    try:
                        await client.fsync()
                    except NoSpaceError:
                        failed_at = start
                        break
                    durable += batch
                assert failed_at is not None, "FSYNC never reported the full file system"
                assert len(durable) >= 16
                # the daemon is up, and every block whose FSYNC returned is intact
                stats = await client.stats()
                assert stats["durable_blocks"] >= len(durable)
                await client.evict()  # read them from the disk, not from DRAM
                async with ns.get([key(i) for i in durable]) as views:
                    for i, view in zip(durable, views, strict=True):
                        assert bytes(view) == block(i).tobytes(), i
                # blocks that could not be written are still served from DRAM, intact
                async with ns.get([key(failed_at)]) as views:
                    assert bytes(views[0]) == block(failed_at).tobytes()
                # make room: forget durable blocks; the blocked ones become durable
                assert await ns.forget([key(i) for i in durable[:12]]) == 12
                await client.fsync()
                more = list(range(1000, 1004))
                await ns.put([key(i) for i in more], [block(i) for i in more])
                await client.fsync()
                await client.evict()
                survivors = durable[12:] + list(range(failed_at, failed_at + 4)) + more
                async with ns.get([key(i) for i in survivors]) as views:
                    for i, view in zip(survivors, views, strict=True):
                        assert bytes(view) == block(i).tobytes(), i
                assert (await client.stats())["leases"] == 0
            assert daemon.stop() == 0  # and it still stops cleanly


def test_a_data_file_that_cannot_be_preallocated_stops_the_start(tmp_path: Path) -> None:
    with small_file_system(tmp_path / "fs", "40m") as fs:
        config = tmp_path / "kvtierd.toml"
        config.write_text(f'[nvme]\npath = "{fs / "nvme.data"}"\n')
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtierd",
                "--config",
                str(config),
                "--socket",
                str(tmp_path / "kvtierd.sock"),
                "--data-dir",
                str(tmp_path / "data"),
                "--dram-size",
                "16M",
                "--nvme-size",
                "128M",
                "--log-level",
                "error",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 1, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("kvtierd: ")
        assert "full" in lines[0] or "space" in lines[0].lower(), lines[0]
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "kvtierd.sock").exists()
