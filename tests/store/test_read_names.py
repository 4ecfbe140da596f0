"""A READ that names one block more than once (in-process store, real data file, io_uring and
thread backends): the block is promoted once, into one slot, and every name leases it; after
the release nothing is left pinned or holding a slot. Before, a batch read it into a slot per
name, installed each over the last (the others lost to the region) and failed the READ with an
internal error, one pin left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.store.test_read_runs import read_and_check, store_in_order, stored_on_disk

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
async def test_a_block_named_several_times_is_promoted_once(tmp_path: Path, backend: str) -> None:
    async with store_in_order(tmp_path, backend) as (store, ns):
        owner, written = await stored_on_disk(store, ns, 4)
        keys = [key for key in written for _ in range(3)]  # each cold block named three times
        requests = await read_and_check(store, owner, ns, keys)
        assert requests <= len(written)
        assert store.counters["lower_hits"] == len(written)
        assert ns.dram_blocks == len(written)
        assert await store.evict_dram(ns) == len(written)  # none left pinned
        assert ns.dram_blocks == 0
