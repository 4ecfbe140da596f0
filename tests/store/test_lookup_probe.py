"""LOOKUP's probe (``BlockIndex.leading``): the live dict is probed for every key of a long
chain at once and the answer cut at the first key not live (a short chain: a loop that stops
there), then the rows are probed from there. What is checked here, on the real store and data
file: the count stops at the first key stored nowhere whatever follows it (live blocks
included), live and cold blocks mix in one chain with their tiers in order, and nothing is
made for the cold ones."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from kvtierd.policy import ServedBy
from kvtierd.store.index import _MAPPED_FROM, Owner
from tests.store.test_store_pressure import key_of, put, read_back, small_store

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

BLOCK = 64 << 10


async def test_a_chain_of_live_and_cold_blocks_counts_up_to_the_first_miss(
    tmp_path: Path,
) -> None:
    """Long chains (one ``map()`` over the dict, from ``_MAPPED_FROM`` keys) and short ones
    (a loop) alike."""
    assert _MAPPED_FROM <= 16
    async with small_store(tmp_path, BLOCK) as (store, ns):
        owner = Owner("setup")
        keys = [key_of(i) for i in range(40)]
        for key in keys[:36]:
            await put(store, owner, ns, key)
        await store.fsync()
        assert await store.evict_dram(ns) == 36  # all idle on NVMe only: rows, no Block
        for key in keys[:20]:  # the first twenty read back: live again, in DRAM
            await read_back(store, owner, ns, key)
        absent = keys[36]  # stored nowhere
        for key in keys[37:]:  # live, after the key stored nowhere
            await put(store, owner, ns, key)
        dram, nvme = bytes([ServedBy.DRAM]), bytes([ServedBy.NVME])
        live_before = len(store.index.blocks())

        def lookup(chain: list[bytes]) -> tuple[int, bytes]:
            return store.lookup(ns, chain, promote=False)

        # long chains
        assert lookup(keys) == (36, dram * 20 + nvme * 16)
        assert lookup(keys[:20]) == (20, dram * 20)
        assert lookup([*keys[37:], *keys[:20]]) == (23, dram * 23)
        assert lookup([absent, *keys[37:], *keys[:20]]) == (0, b"")  # a miss first
        assert lookup([*keys[:10], absent, *keys[10:20]]) == (10, dram * 10)
        assert lookup([*keys[20:36], *keys[:20]]) == (36, nvme * 16 + dram * 20)
        # short chains
        assert lookup(keys[:3]) == (3, dram * 3)
        assert lookup([absent, keys[37], keys[0]]) == (0, b"")
        assert lookup([keys[0], absent, keys[1]]) == (1, dram)
        assert lookup([keys[34], keys[35], keys[0]]) == (3, nvme * 2 + dram)
        assert len(store.index.blocks()) == live_before  # the cold ones were counted, not made


async def test_a_lookup_of_each_key_answers_past_the_misses(tmp_path: Path) -> None:
    """LOOKUP with ``each`` (``BlockStore.lookup_each``): a code for every key, the miss
    code for the absent ones wherever they fall, the leading count as LOOKUP's; nothing made
    without ``promote``, and with it every hit off DRAM (past a miss too) starts moving up."""
    async with small_store(tmp_path, BLOCK) as (store, ns):
        owner = Owner("setup")
        keys = [key_of(i) for i in range(24)]
        for key in keys[:8]:
            await put(store, owner, ns, key)
        await store.fsync()
        assert await store.evict_dram(ns) == 8  # idle on NVMe only
        for key in keys[:4]:
            await read_back(store, owner, ns, key)  # in DRAM again
        for key in keys[16:]:
            await put(store, owner, ns, key)  # after eight keys stored nowhere
        dram, nvme, miss = (bytes([code]) for code in (ServedBy.DRAM, ServedBy.NVME, 3))
        assert ServedBy.MISS == 3  # the wire's miss code (docs/protocol.md)
        live_before = len(store.index.blocks())
        for chain in (keys, keys[::-1], keys[6:18], [keys[9], keys[5], keys[17]]):
            hits, codes = store.lookup_each(ns, chain, promote=False)
            expected = [
                dram
                if keys.index(k) < 4 or keys.index(k) >= 16
                else nvme
                if keys.index(k) < 8
                else miss
                for k in chain
            ]
            assert codes == b"".join(expected)
            assert hits == next((i for i, c in enumerate(expected) if c == miss), len(chain))
        assert len(store.index.blocks()) == live_before  # the cold ones were counted, not made
        # promote: the NVMe hits after the gap of misses are queued too
        hits, codes = store.lookup_each(ns, [keys[10], keys[6], keys[7]], promote=True)
        assert (hits, codes) == (0, miss + nvme + nvme)
        for _ in range(200):
            if store.lookup_each(ns, keys[6:8], promote=False)[1] == dram * 2:
                break
            await anyio.sleep(0.01)
        assert store.lookup_each(ns, keys[4:8], promote=False)[1] == nvme * 2 + dram * 2
