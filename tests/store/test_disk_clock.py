"""What sets a disk row's CLOCK byte through the store, in-process: a READ of a block whose
copy is on the disk, and a promotion that is no read (a prefetch); nothing else touches it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtierd.store.clock import MAX_CHECKS, ClockPolicy
from kvtierd.store.index import Owner
from kvtierd.store.namespaces import Compression, NamespaceSpec
from kvtierd.store.nvme import NvmeTier
from kvtierd.store.records import checksum
from kvtierd.store.segments import slot_bytes_for
from tests.store.test_store_pressure import ROOT, content, key_of, put, read_back, small_store

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


@pytest.mark.parametrize(
    ("filler", "needed"),
    [(4096, 8192), (8192, 4096)],
    ids=["large-among-small", "small-among-large"],
)
async def test_a_write_back_finds_a_victim_of_its_class_among_thousands_of_another(
    tmp_path: Path, filler: int, needed: int
) -> None:
    """A disk full of blocks of one slot class and one full segment of another: blocks of the
    other class are written back by evicting their own kind (space of one class is never given
    to another), although more rows of the first kind than the policy asks about one by one in
    a call lie in the hand's way. FSYNC succeeds and every block still indexed reads back."""
    owner = Owner("writer")
    async with small_store(tmp_path, needed, segment_bytes="1M") as (store, few):
        many, _ = store.registry.open(NamespaceSpec("q", "default", filler, None, 0, 1), ROOT)
        tier = store.residency.lower
        assert isinstance(tier, NvmeTier)
        per_segment = (1 << 20) // slot_bytes_for(needed)
        for i in range(per_segment):  # one segment of the needed class, full
            await put(store, owner, few, key_of(i))
        await store.fsync()
        written = 0
        while not store.counters["lower_evictions"]:  # the other class fills the rest
            for i in range(written, written + 64):
                await put(store, owner, many, key_of(i))
            written += 64
            await store.fsync()
        for i in range(written, written + 32):  # its hand moves past the needed class's rows
            await put(store, owner, many, key_of(i))
        written += 32
        await store.fsync()
        store.lower_policy.flush()
        cold = tier.cold
        fillers = [i for i in range(written) if cold.find(many.digest, key_of(i)) >= 0]
        assert len(fillers) > MAX_CHECKS
        evictions = store.counters["lower_evictions"]
        more = range(per_segment, per_segment + 3 * 16)  # more than the file's leftover room
        for i in more:
            await put(store, owner, few, key_of(i))
        assert await store.fsync() > 0
        assert store.counters["lower_evictions"] > evictions
        assert [i for i in more if cold.find(few.digest, key_of(i)) >= 0] == list(more)
        on_disk = [i for i in range(per_segment) if cold.find(few.digest, key_of(i)) >= 0]
        assert len(on_disk) < per_segment  # their own kind made room
        assert [i for i in fillers if cold.find(many.digest, key_of(i)) >= 0] == fillers
        await store.evict_dram(None)
        for i in [*on_disk[:4], *more[-4:]]:
            assert await read_back(store, owner, few, key_of(i)) == content(key_of(i), needed)
        assert await read_back(store, owner, many, key_of(fillers[0])) == content(
            key_of(fillers[0]), filler
        )


async def test_a_disk_full_of_compressed_blocks_evicts_by_their_stored_class(
    tmp_path: Path,
) -> None:
    """A compressed namespace's records lie in slots of their compressed size, a class smaller
    than their blocks' raw one: write-back asks for victims of the class that is full (the
    tier names it), so a disk full of them keeps taking more, evicting the oldest."""
    block = 256 << 10
    owner = Owner("writer")

    def data(i: int) -> bytes:  # half noise, half zeros: about half the size compressed
        return np.random.default_rng(i).bytes(block // 2) + bytes(block // 2)

    async with small_store(tmp_path, 4096) as (store, _):
        spec = NamespaceSpec("z", "default", block, None, 0, 1, Compression.ZSTD)
        ns, _ = store.registry.open(spec, ROOT)
        total = 2 * (64 << 20) // (block // 2)  # about twice what the disk holds
        for i in range(total):
            write = await store.alloc(owner, ns, [key_of(i)])
            slot = write.slots[0]
            assert slot is not None
            store.arena.view[slot.offset : slot.offset + block] = data(i)
            await store.commit(owner, write.id, [checksum(data(i))], False)
        assert await store.fsync() > 0
        assert store.counters["lower_evictions"] > 0
        present = [i for i in range(total) if store.index.contains(ns, key_of(i))]
        assert total // 4 < len(present) < total
        assert present[-1] == total - 1  # the newest survive
        await store.evict_dram(None)
        for i in [present[0], present[-1]]:
            assert await read_back(store, owner, ns, key_of(i)) == data(i)
