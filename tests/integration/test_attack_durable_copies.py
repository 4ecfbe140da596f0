"""A tenant's client writing to its own shared region while the daemon promotes blocks into it
must never make the daemon discard a durable (FSYNC-acknowledged) record, on the real daemon,
asyncio and trio.

The daemon reads a record from the NVMe tier into a DRAM slot of the tenant's region and hashes
the slot. The slot is memory every client of the tenant may write, so a mismatch there proves
nothing about the disk; the daemon used to take the record for torn and discard it
(``drop_lower``). Now a mismatch is judged again on a private re-read
(``NvmeTier._read_privately``). The two ways a client caused it:

* **holes**: the region is registered with io_uring as fixed buffers, which hold references to
  its pages. After a client punches a hole (``madvise(MADV_REMOVE)`` on its mapping, or
  ``fallocate(PUNCH_HOLE)``: the seals stop shrinking and growing, not this) the file's pages
  are new ones, and a fixed read still lands in the old, orphaned pages: the slot reads as
  zeroes, and every cold read into that region would have discarded its record (one call by
  one client of the default tenant: any local client). The re-read also gives up fixed
  buffers, so later reads land in the region's pages;
* **scribbles**: a client writing over the region while blocks are promoted changes a slot
  between the read and the hash (on the thread backend too).
"""

from __future__ import annotations

import contextlib
import mmap
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.client.sync import Client
from kvtierd.errors import BlockNotFoundError
from kvtierd.testing import DaemonProcess
from tests.support.attacks import tier_usage, unharmed

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


def test_scribbles_during_promotions_destroy_no_durable_block(tmp_path: Path) -> None:
    config = "[nvme]\nio_backend = 'threads'\n"  # no fixed buffers: not the holes' case
    blocks = [np.full(BLOCK, i + 1, np.uint8) for i in range(4 * len(KEYS))]
    keys = [b"scribbled-%03d" % i for i in range(len(blocks))]
    with DaemonProcess(tmp_path / "kvtierd", dram_size="16M", config_text=config) as daemon:
        with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
            ns = client.namespace("scribbled", block_bytes=BLOCK)
            assert ns.put(keys, blocks) == len(keys)
            client.fsync()
            client.evict()
            stop = threading.Event()

            def scribble() -> None:  # a byte of every page of the region, over and over
                with mmap.mmap(ns.arena.fd, ns.arena.size_bytes) as region:
                    pages = np.frombuffer(region, np.uint8)[:: mmap.PAGESIZE]
                    while not stop.is_set():
                        pages += 1
                    del pages

            scribbler = threading.Thread(target=scribble)
            scribbler.start()
            try:
                for _ in range(10):
                    for key in keys:  # a block read on its own: a promotion each
                        with (
                            contextlib.suppress(BlockNotFoundError),
                            ns.lease([key], verify_on_copy=True),
                        ):
                            pass
                    client.evict()
            finally:
                stop.set()
                scribbler.join()
            assert tier_usage(client, "nvme")[0] == len(keys), "durable blocks were discarded"
        unharmed(daemon)
