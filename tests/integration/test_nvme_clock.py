"""A daemon whose NVMe tier fills and evicts with the default policy (CLOCK over its rows):
blocks read since the hand last passed survive the next round of evictions, while blocks
written as long ago and not read go."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import connect_async
from kvtierd.testing import DaemonProcess

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

BLOCK = (1 << 20) - 4096  # a record (header page and payload) fills a 1 MiB slot
CONFIG = '[dram]\npolicy = "lru"\n[nvme]\nsegment_bytes = "4M"\n'


def block(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BLOCK)


def key(i: int) -> bytes:
    return b"clock-%08d" % i


async def test_blocks_read_recently_outlive_idle_ones_on_a_full_disk(tmp_path: Path) -> None:
    with DaemonProcess(
        tmp_path / "kvtierd", dram_size="16M", nvme_size="64M", config_text=CONFIG
    ) as daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("clock", block_bytes=BLOCK)
            written = 0

            async def write(count: int) -> None:
                nonlocal written
                for start in range(written, written + count, 4):
                    batch = range(start, start + 4)
                    await ns.put([key(i) for i in batch], [block(i) for i in batch])
                    await client.fsync()
                written += count

            async def stored(keys: range) -> list[int]:
                return [i for i in keys if await ns.lookup([key(i)], promote=False)]

            # Well past the disk's size: the hand has swept every row and evicted the oldest.
            await write(160)
            survivors = await stored(range(written))
            disk = len(survivors)
            assert 40 < disk < 80
            assert (await client.stats())["tiers"][1]["evictions"] > 0
            # Read the oldest survivors (from the disk: DRAM holds a dozen of the newest), the
            # next ones an LRU of writes would evict.
            hot, cold = survivors[:8], survivors[8:20]
            async with ns.get([key(i) for i in hot]) as views:
                for i, view in zip(hot, views, strict=True):
                    assert bytes(view) == block(i)
            # Half the disk again: a round of evictions, less than one turn of the hand.
            await write(4 * (disk // 8))
            assert await stored(range(written - 4 * (disk // 8))) != survivors
            assert await stored(hot) == hot
            # Written after every hot one and not read: some are gone (an LRU of writes would
            # have evicted every hot one first). Not all: those written after the hand last
            # passed keep their bytes from the write, and how many they are depends on where
            # concurrent write-backs left the hand: 5 of the 12 kept in 21 runs under load and
            # 6 in one, so "fewer than half" (< 6) failed now and then.
            assert len(await stored(cold)) < len(cold)
            async with ns.get([key(i) for i in hot]) as views:
                for i, view in zip(hot, views, strict=True):
                    assert bytes(view) == block(i)
