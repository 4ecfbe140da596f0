"""LOOKUP's probe (``BlockIndex.leading``): the live dict is probed for every key at once and
the answer cut at the first key not live, then the rows are probed from there. What is checked
here, on the real store and data file: the count stops at the first key stored nowhere
whatever follows it (live blocks included), live and cold blocks mix in one chain with their
tiers in order, and nothing is made for the cold ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.policy import ServedBy
from kvtierd.store.index import Owner
from tests.store.test_store_pressure import key_of, put, read_back, small_store

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

BLOCK = 64 << 10


async def test_a_chain_of_live_and_cold_blocks_counts_up_to_the_first_miss(
    tmp_path: Path,
) -> None:
    async with small_store(tmp_path, BLOCK) as (store, ns):
        owner = Owner("setup")
        keys = [key_of(i) for i in range(8)]
        for key in keys[:6]:
            await put(store, owner, ns, key)
        await store.fsync()
        assert await store.evict_dram(ns) == 6  # all six idle on NVMe only: rows, no Block
        for key in keys[:3]:  # the first three read back: live again, in DRAM
            await read_back(store, owner, ns, key)
        await put(store, owner, ns, keys[7])  # live, after the key stored nowhere (keys[6])
        dram, nvme = bytes([ServedBy.DRAM]), bytes([ServedBy.NVME])
        live_before = len(store.index.blocks())

        assert store.lookup(ns, keys, promote=False) == (6, dram * 3 + nvme * 3)
        assert store.lookup(ns, keys[:3], promote=False) == (3, dram * 3)
        assert store.lookup(ns, [keys[7], *keys[:3]], promote=False) == (4, dram * 4)
        # a miss first: nothing counts, live blocks after it included
        assert store.lookup(ns, [keys[6], keys[7], *keys[:3]], promote=False) == (0, b"")
        # a miss between live blocks stops the count there
        assert store.lookup(ns, [keys[0], keys[6], keys[1]], promote=False) == (1, dram)
        # cold first, then live: the rows answer for the first keys, the dict for the rest
        assert store.lookup(ns, [keys[4], keys[5], keys[0]], promote=False) == (
            3,
            nvme * 2 + dram,
        )
        assert len(store.index.blocks()) == live_before  # the cold ones were counted, not made
