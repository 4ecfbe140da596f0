"""What sets a disk row's CLOCK byte through the store, in-process: a READ of a block whose
copy is on the disk, and a promotion that is no read (a prefetch); nothing else touches it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.store.clock import ClockPolicy
from kvtierd.store.index import Owner
from kvtierd.store.nvme import NvmeTier
from tests.store.test_store_pressure import key_of, put, read_back, small_store

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def test_reads_and_promotions_set_the_byte_of_the_disk_row(tmp_path: Path) -> None:
    owner = Owner("writer")
    async with small_store(tmp_path, (1 << 20) - 4096) as (store, ns):
        tier = store.residency.lower
        assert isinstance(tier, NvmeTier)
        assert isinstance(store.lower_policy.policy, ClockPolicy)  # the default
        for i in range(30):  # twice the DRAM: the first ones are on the disk only
            await put(store, owner, ns, key_of(i))
        await store.fsync()
        store.lower_policy.flush()
        cold = tier.cold
        rows = [cold.find(ns.digest, key_of(i)) for i in range(3)]
        cold.clear_references(0, cold.extent)

        def referenced() -> list[bool]:
            store.lower_policy.flush()
            clear = set(cold.unreferenced(0, cold.extent).tolist())
            return [row not in clear for row in rows]

        assert referenced() == [False, False, False]
        assert len(await read_back(store, owner, ns, key_of(1))) == ns.spec.block_bytes
        assert referenced() == [False, True, False]
        block = store.index.get(ns, key_of(2))
        assert block is not None
        assert block.dram is None
        await store.residency.promotions.make_resident(block)  # a prefetch: no read
        assert referenced() == [False, True, True]
