"""A client that punches holes in its tenant's shared region (``madvise(MADV_REMOVE)`` on its
own mapping, or ``fallocate(PUNCH_HOLE)`` on the descriptor: the seals stop shrinking and
growing, not this), on the real daemon, asyncio and trio.

The region is registered with io_uring as fixed buffers, which hold references to its pages.
After a hole is punched the file's pages are new ones, but a fixed read still lands in the old,
orphaned pages: the daemon's mapping sees zeroes where the block was read, its checksum fails,
and the daemon takes the durable record for torn and discards it. Every cold read into that
region does the same until the daemon restarts: one call by one client of a tenant (of the
default tenant: any local client) destroys the tenant's FSYNC-acknowledged blocks as they are
read.

The test holds the property the daemon owes: whatever a client does to its region, the blocks
on the NVMe tier stay there and are served. It fails today (strict xfail, the fix belongs to
``store/nvme.py`` and ``store/residency.py``); it is skipped where no transfer used fixed
buffers (the threads backend, or a registration refused), where the attack cannot work.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.client.sync import Client
from kvtierd.errors import BlockNotFoundError
from kvtierd.testing import DaemonProcess
from tests.support.attacks import tier_usage

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 30.0
BLOCK = 256 << 10
KEYS = [b"holes-%03d" % i for i in range(8)]


@pytest.fixture(params=["asyncio", "trio"])
def daemon(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DaemonProcess]:
    process = DaemonProcess(tmp_path / "kvtierd", dram_size="16M", runtime=str(request.param))
    process.start(120)
    try:
        yield process
    finally:
        process.kill()


def _fixed_transfers(client: Client) -> int:
    """How many disk transfers used io_uring fixed buffers (the DOCTOR report's io line)."""
    (io,) = [check for check in client.doctor() if check["subject"] == "io"]
    found = re.search(r"(\d+) of \d+ transfers used fixed buffers", io["detail"])
    return int(found.group(1)) if found else 0


@pytest.mark.xfail(
    strict=True,
    reason="a fixed-buffer read into a region with a hole lands in orphaned pages; the daemon "
    "then discards the durable record as torn (store/nvme.py, store/residency.py)",
)
def test_holes_punched_in_a_region_destroy_no_durable_block(daemon: DaemonProcess) -> None:
    blocks = [np.full(BLOCK, i + 1, np.uint8) for i in range(len(KEYS))]
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        ns = client.namespace("holes", block_bytes=BLOCK)
        assert ns.put(KEYS, blocks) == len(KEYS)
        client.fsync()  # acknowledged: durable on the NVMe tier
        client.evict()
        assert tier_usage(client, "nvme")[0] == len(KEYS)
        with mmap.mmap(ns.arena.fd, ns.arena.size_bytes) as region:
            region.madvise(mmap.MADV_REMOVE)  # every page of the region: a hole
        try:
            with ns.get(KEYS) as views:
                for view, block in zip(views, blocks, strict=True):
                    assert np.array_equal(np.asarray(view), block)
        except BlockNotFoundError:
            pass  # a miss now is tolerable; losing the durable copies is not
        if _fixed_transfers(client) == 0:
            pytest.skip("no transfer used io_uring fixed buffers here")
        client.evict()
        assert tier_usage(client, "nvme")[0] == len(KEYS), "durable blocks were discarded"
        with ns.get(KEYS) as views:
            for view, block in zip(views, blocks, strict=True):
                assert np.array_equal(np.asarray(view), block)
    assert daemon.running
