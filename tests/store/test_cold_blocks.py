"""Blocks idle on NVMe only have no Python ``Block`` (docs/architecture.md, "The index at
scale", step 4): a restart adopts the tier's rows without making one, a READ, promotion or
FORGET materialises one from its row, and it is let go again once idle. What is checked here,
on the real store, data file and io_uring/thread backend: counts stay true through all of it,
LOOKUP counts cold blocks without making them, a let-go ``Block`` is never one something
holds (a lease, a queued promotion), and READ, FORGET and eviction of a cold block after a
restart do what they did for a live one."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from kvtierd.errors import BlockNotFoundError
from kvtierd.policy import ServedBy
from kvtierd.store.index import ColdKey, Owner
from kvtierd.store.namespaces import Namespace
from kvtierd.store.nvme import NvmeTier
from kvtierd.store.segments import slot_bytes_for
from kvtierd.store.store import BlockStore
from tests.store.test_store_pressure import content, key_of, put, read_back, small_store

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

BLOCK = 64 << 10
COUNT = 24
BIG = 256 << 10  # blocks enough to fill the disk in a test's time


def _live(store: BlockStore) -> int:
    return len(store.index.blocks())


async def _written_and_evicted(store: BlockStore, ns: Namespace, count: int) -> list[bytes]:
    owner = Owner("setup")
    keys = [key_of(i) for i in range(count)]
    for key in keys:
        await put(store, owner, ns, key)
    await store.fsync()
    store.registry.save()  # (the daemon saves it at OPEN_NS) a restart names the namespace
    assert await store.evict_dram(ns) == count
    return keys


@contextlib.asynccontextmanager
async def _restarted(directory: Path, how: str) -> AsyncIterator[tuple[BlockStore, Namespace]]:
    """The store reopened on ``directory``: from its index snapshot, or (``how == "scan"``)
    by the header scan, the snapshot removed."""
    if how == "scan":
        async for snapshot in anyio.Path(directory).glob("*.snapshot"):
            await snapshot.unlink()
    async with small_store(directory, BLOCK) as (store, ns):
        assert store.lower is not None
        assert getattr(store.lower, "recovery_source", how) == how
        yield store, ns


def _counts(store: BlockStore, ns: Namespace) -> tuple[int, int, int, int]:
    return len(store.index), ns.blocks, ns.nvme_blocks, ns.dram_blocks


async def test_an_evicted_block_is_let_go_and_read_back(tmp_path: Path) -> None:
    """Written back and evicted from DRAM, a block has no ``Block``; LOOKUP counts it (NVMe)
    without making one; READ makes it, serves its bytes, and once released and evicted it is
    let go again, its counts unchanged throughout."""
    async with small_store(tmp_path, BLOCK) as (store, ns):
        keys = await _written_and_evicted(store, ns, COUNT)
        assert _live(store) == 0
        assert _counts(store, ns) == (COUNT, COUNT, COUNT, 0)
        hits, tiers = store.lookup(ns, [*keys, b"absent-key"], promote=False)
        assert (hits, tiers) == (COUNT, bytes([ServedBy.NVME]) * COUNT)
        assert _live(store) == 0  # counted, nothing made
        owner = Owner("reader")
        assert await read_back(store, owner, ns, keys[3]) == content(keys[3], BLOCK)
        block = store.index.live(ns, keys[3])
        assert block is not None
        assert block.dram is not None
        assert block.lower is not None
        assert _counts(store, ns) == (COUNT, COUNT, COUNT, 1)
        assert await store.evict_dram(ns) == 1
        assert store.index.live(ns, keys[3]) is None
        assert not store.index.holds(block)
        again = store.index.get(ns, keys[3])  # made anew from the same row
        assert again is not None
        assert again is not block
        assert (again.ref, again.lower) == (block.ref, block.lower)
        assert _counts(store, ns) == (COUNT, COUNT, COUNT, 0)


async def test_a_leased_or_queued_block_is_never_let_go(tmp_path: Path) -> None:
    """What holds a ``Block`` keeps it: a lease (its pin) through an eviction of everything
    else, and a LOOKUP's queued promotion, which makes the block and installs it in DRAM (the
    same object the queue held, not a second one of the key)."""
    async with small_store(tmp_path, BLOCK) as (store, ns):
        keys = await _written_and_evicted(store, ns, COUNT)
        owner = Owner("reader")
        lease = await store.read(owner, ns, keys[:2])
        held = list(lease.blocks)
        await store.evict_dram(ns)  # leased: pinned, not evicted, not let go
        assert [store.index.live(ns, key) for key in keys[:2]] == held
        store.release(owner, [lease.id])
        assert await store.evict_dram(ns) == 2
        assert _live(store) == 0
        # LOOKUP with promotion: made, queued, installed in DRAM
        hits, _ = store.lookup(ns, keys[5:8])
        assert hits == 3
        queued = [store.index.live(ns, key) for key in keys[5:8]]
        assert all(block is not None for block in queued)
        for _ in range(200):
            if all(b is not None and b.dram is not None for b in queued):
                break
            await anyio.sleep(0.01)
        assert [store.index.live(ns, key) for key in keys[5:8]] == queued
        assert all(b is not None and b.dram is not None for b in queued)
        assert _counts(store, ns) == (COUNT, COUNT, COUNT, 3)


async def test_a_read_of_many_cold_keys_makes_each_block_once(tmp_path: Path) -> None:
    """A READ of many keys idle on NVMe, beside a live block and with a key asked twice: each
    key's ``Block`` is made once and serves its own bytes; a READ with an absent key fails,
    pinning nothing."""
    count = 100
    async with small_store(tmp_path, BLOCK) as (store, ns):
        keys = await _written_and_evicted(store, ns, count)
        live = store.index.get(ns, keys[70])  # made live before the READ
        owner = Owner("reader")
        asked = [keys[3], *keys]
        lease = await store.read(owner, ns, asked)
        try:
            assert lease.blocks[1 + 70] is live
            assert lease.blocks[0] is lease.blocks[1 + 3]
            assert [store.index.live(ns, key) for key in keys] == lease.blocks[1:]
            for key, block in zip(asked, lease.blocks, strict=True):
                assert block.ref.key == key
                assert block.dram is not None
                view = store.arena.view[block.dram.offset :][:BLOCK]
                assert bytes(view) == content(key, BLOCK)
        finally:
            store.release(owner, [lease.id])
        assert _counts(store, ns) == (count, count, count, count)
        await store.evict_dram(ns)
        with pytest.raises(BlockNotFoundError):
            await store.read(owner, ns, [*keys[:80], b"absent-key", *keys[80:]])
        assert all(block.pins == 0 for block in store.index.blocks())
        assert _counts(store, ns) == (count, count, count, 0)


async def test_many_cold_keys_are_probed_together_as_one_by_one(tmp_path: Path) -> None:
    """Past a few hundred keys not live, the rows are probed together (numpy): LOOKUP's
    leading hits, ALLOC's "stored already" and a LIST_KEYS page's sizes answer as the probes
    one key at a time do."""
    count = 400  # more than the keys probed one by one
    async with small_store(tmp_path, 16 << 10) as (store, ns):
        keys = await _written_and_evicted(store, ns, count)
        absent = [b"absent-%d" % i for i in range(count)]
        mixed = [key for pair in zip(keys, absent, strict=True) for key in pair]
        assert store.index.contains_many(ns, mixed) == [
            store.index.contains(ns, key) for key in mixed
        ]
        assert store.index.contains_many(ns, mixed) == [True, False] * count
        hits, tiers = store.lookup(ns, [*keys[:350], b"absent-key", *keys[350:]], promote=False)
        assert (hits, tiers) == (350, bytes([ServedBy.NVME]) * 350)
        listed, more = store.page(ns, b"", 1000)  # a LIST_KEYS page: sizes read together
        assert not more
        assert listed == [ColdKey(key, 16 << 10) for key in sorted(keys)]
        assert _live(store) == 0


@pytest.mark.parametrize("how", ["snapshot", "scan"])
async def test_a_restart_makes_no_block_and_counts_every_one(tmp_path: Path, how: str) -> None:
    """After a restart by snapshot or by scan: no ``Block`` at all, the counts and listing of
    every block, a READ of a cold block, a FORGET of another (gone after the next restart
    too), and an ALLOC of a stored key that reserves nothing."""
    async with small_store(tmp_path, BLOCK) as (store, ns):
        keys = await _written_and_evicted(store, ns, COUNT)
    async with _restarted(tmp_path, how) as (store, ns):
        assert _live(store) == 0
        assert _counts(store, ns) == (COUNT, COUNT, COUNT, 0)
        listed, more = store.page(ns, b"", 1000)
        assert not more
        assert sorted(b.key for b in listed) == sorted(keys)
        assert all(isinstance(b, ColdKey) and b.raw_bytes == BLOCK for b in listed)
        assert _live(store) == 0  # listed, nothing kept
        owner = Owner("after")
        assert await read_back(store, owner, ns, keys[0]) == content(keys[0], BLOCK)
        write = await store.alloc(owner, ns, [keys[1]])
        assert write.slots == [None]  # stored already: a cold key is a key
        await store.commit(owner, write.id, [0], True)
        assert await store.forget(ns, [keys[2]]) == 1
        assert _counts(store, ns) == (COUNT - 1, COUNT - 1, COUNT - 1, 1)
        assert store.lookup(ns, keys[2:3], promote=False) == (0, b"")
        assert store.index.get(ns, keys[2]) is None
    async with _restarted(tmp_path, "snapshot") as (store, ns):
        assert _counts(store, ns) == (COUNT - 1, COUNT - 1, COUNT - 1, 0)
        assert store.lookup(ns, keys[2:3], promote=False) == (0, b"")
        hits, _ = store.lookup(ns, keys[3:], promote=False)
        assert hits == COUNT - 3


async def test_eviction_of_cold_blocks_after_a_restart(tmp_path: Path) -> None:
    """The NVMe policy (CLOCK over the rows, told nothing per block at start-up) evicts cold
    blocks: each made from its row, dropped, its counts, row and listing gone, none left
    live."""
    async with small_store(tmp_path, BLOCK) as (store, ns):
        keys = await _written_and_evicted(store, ns, COUNT)
    async with _restarted(tmp_path, "snapshot") as (store, ns):
        r = store.residency
        assert await r.evict_lower(slot_bytes_for(BLOCK))
        evicted = r.counters["lower_evictions"]
        assert evicted > 0
        assert _counts(store, ns) == (COUNT - evicted, COUNT - evicted, COUNT - evicted, 0)
        assert _live(store) == 0
        gone = [key for key in keys if not store.index.contains(ns, key)]
        assert len(gone) == evicted
        assert store.lookup(ns, gone[:1], promote=False) == (0, b"")
        left = [key for key in keys if key not in gone]
        assert [b.key for b in store.page(ns, b"", 1000)[0]] == sorted(left)
        owner = Owner("after")
        assert await read_back(store, owner, ns, left[-1]) == content(left[-1], BLOCK)


async def _fill(store: BlockStore, ns: Namespace, keys: list[bytes], until: int) -> int:
    """Write ``keys`` (written back, out of DRAM: rows) until ``until`` NVMe evictions in
    all; how many were written."""
    owner, r = Owner("filler"), store.residency
    for done in range(0, len(keys), 8):
        if r.counters["lower_evictions"] >= until:
            return done
        for key in keys[done : done + 8]:
            await put(store, owner, ns, key)
        await store.fsync()
        await store.evict_dram(ns)
    return len(keys)


async def test_a_full_disk_of_rows_evicts_the_least_recently_read(tmp_path: Path) -> None:
    """After a restart with every block a row (no ``Block``, nothing told to the policy per
    block), new writes to the full disk evict rows by CLOCK: the blocks read since the restart
    survive a round of evictions, the unread ones go, and no ``Block`` is kept for either."""
    old = [key_of(i) for i in range(1000)]
    async with small_store(tmp_path, BIG) as (store, ns):  # about 240 blocks fill the disk
        await _fill(store, ns, old, 1)
        stored = [key for key in old if store.index.contains(ns, key)]
        store.registry.save()
    async with small_store(tmp_path, BIG) as (store, ns):
        assert _live(store) == 0
        assert _counts(store, ns)[:3] == (len(stored),) * 3
        hot = stored[:6]  # the oldest: the rows the hand meets first
        owner = Owner("reader")
        for key in hot:
            assert await read_back(store, owner, ns, key) == content(key, BIG)
        await store.evict_dram(ns)
        assert _live(store) == 0
        new = [b"new-%06d" % i for i in range(len(stored))]
        written = await _fill(store, ns, new, len(stored) // 2)
        assert store.residency.counters["lower_evictions"] >= len(stored) // 2
        assert all(store.index.contains(ns, key) for key in hot)
        unread = [key for key in stored[len(hot) :] if store.index.contains(ns, key)]
        assert len(unread) < len(stored) - len(hot) - len(stored) // 4
        assert _live(store) == 0
        listed = [b.key for b in store.page(ns, b"", 10_000)[0]]
        kept = [key for key in new[:written] if store.index.contains(ns, key)]
        assert listed == sorted(hot + unread + kept)
        for key in hot:
            assert await read_back(store, owner, ns, key) == content(key, BIG)


async def test_rows_of_a_namespace_the_catalog_lost_stay_unindexed(tmp_path: Path) -> None:
    """Blocks of a namespace missing from the catalog at start-up are not adopted (as before
    step 4): when the namespace is opened again they are not found, not counted, and its new
    blocks stay live rather than let go onto rows the index does not look in."""
    async with small_store(tmp_path, BLOCK) as (store, ns):
        owner = Owner("setup")
        keys = [key_of(i) for i in range(4)]
        for key in keys:
            await put(store, owner, ns, key)
        await store.fsync()  # the catalog is not saved: the restart does not know the namespace
    async with small_store(tmp_path, BLOCK) as (store, ns):
        assert _counts(store, ns) == (0, 0, 0, 0)
        assert store.lookup(ns, keys, promote=False) == (0, b"")
        assert not store.index.contains(ns, keys[0])
        owner = Owner("again")
        await put(store, owner, ns, keys[0])
        await store.fsync()
        assert await store.evict_dram(ns) == 1
        assert store.index.live(ns, keys[0]) is not None
        assert _counts(store, ns) == (1, 1, 1, 0)
        assert await read_back(store, owner, ns, keys[0]) == content(keys[0], BLOCK)


async def test_a_hint_promotes_cold_blocks(tmp_path: Path) -> None:
    """HINT plans promotions of cold blocks (counted by their rows, made when queued) and they
    land in DRAM as the same ``Block`` the queue held."""
    async with small_store(tmp_path, BLOCK) as (store, ns):
        keys = await _written_and_evicted(store, ns, COUNT)
        assert await store.hint(ns, [keys[:4]]) > 0
        queued = [store.index.live(ns, key) for key in keys[:4]]
        made = [block for block in queued if block is not None]
        assert made
        for _ in range(200):
            if all(block.dram is not None for block in made):
                break
            await anyio.sleep(0.01)
        assert all(block.dram is not None and store.index.holds(block) for block in made)
        assert _counts(store, ns) == (COUNT, COUNT, COUNT, len(made))


async def test_a_read_beside_a_forget_never_takes_another_blocks_record(tmp_path: Path) -> None:
    """A FORGET of a cold block whose discard waits (its segment's mark in the generation
    table, just after a checkpoint) while a READ of the key comes: no ``Block`` may be made of
    the row meanwhile, and a copy dropped late never takes the record now in its slot. Both
    once failed together: the READ made a block naming the slot, the slot went to the next
    block written, and the READ's failed promotion discarded that block's record, acknowledged
    by FSYNC (the crash soak's "FSYNC'd key is missing")."""
    async with small_store(tmp_path, BLOCK, checkpoint_every_bytes="1G") as (store, ns):
        tier = store.lower
        assert isinstance(tier, NvmeTier)
        assert tier.checkpoints is not None
        keys = await _written_and_evicted(store, ns, 2)
        gone, other = keys[0], b"written-after-the-forget"
        place = store.index.peek(ns, gone)
        assert place is not None
        await tier.checkpoints.take(tier._segmap, tier.cold)  # the next mark of a segment waits
        owner = Owner("reader")
        forgetting = store.index.get(ns, gone)  # the block the FORGET will drop
        assert forgetting is not None
        forgotten = anyio.Event()

        async def forget() -> None:
            await store.forget(ns, [gone])
            forgotten.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(forget)
            while forgetting.lower is not None:  # until the FORGET is in the tier's discard
                await anyio.lowlevel.checkpoint()
            assert not forgotten.is_set()  # (it waits there for the mark)
            made = store.index.get(ns, gone)  # what a READ of the key does first
        assert made is None
        await put(store, owner, ns, other)  # into the freed slot, as the next write goes
        await store.fsync()
        written = store.index.live(ns, other)
        assert written is not None
        assert written.lower == place.lower  # (the slot the forgotten record left)
        with pytest.raises(BlockNotFoundError):
            await store.read(owner, ns, [gone])
        # a copy dropped late (a block made before the discard) leaves the new record alone
        await tier.discard(place.ref, place.lower)
        assert tier.cold.find(ns.digest, other) >= 0
        assert await read_back(store, owner, ns, other) == content(other, BLOCK)
    async with _restarted(tmp_path, "snapshot") as (store, ns):
        assert await read_back(store, Owner("after"), ns, other) == content(other, BLOCK)
        assert not store.index.contains(ns, gone)


async def test_a_forget_while_its_write_back_waits_for_a_mark_leaves_no_block_to_read(
    tmp_path: Path,
) -> None:
    """A checkpoint taken while a block's record is written: its segment is marked again
    before the row goes in, so a FORGET and a READ while that mark waits find no row (the
    READ misses, as after any FORGET), the write-back then drops the record, and the key is
    new again to an ALLOC. (When the row went in first, the READ served the forgotten block
    and left a ``Block`` of a freed slot live, which made ALLOC skip the key.)"""
    async with small_store(tmp_path, BLOCK, checkpoint_every_bytes="1G") as (store, ns):
        tier = store.lower
        assert isinstance(tier, NvmeTier)
        assert tier.checkpoints is not None
        owner = Owner("writer")
        key = b"forgotten-while-written"
        table = tier.checkpoints.table
        saving, release = threading.Event(), threading.Event()
        real_save, real_writev = table.save, tier._backend.writev

        def save() -> None:  # the re-mark's save waits until the test lets it go
            if not release.is_set():
                saving.set()
                release.wait(30)
            real_save()

        async def writev(fd: int, offset: int, buffers: list[memoryview]) -> int:
            done = await real_writev(fd, offset, buffers)
            if len(buffers) == 2 and key in bytes(buffers[0]):
                table.advance()  # a checkpoint taken while the record was written
                table.save = save  # type: ignore[method-assign]
            return done

        tier._backend.writev = writev  # type: ignore[method-assign]
        await put(store, owner, ns, key)  # write-back runs in the background
        # the record is written, its segment's mark waits
        assert await anyio.to_thread.run_sync(saving.wait, 30)
        assert tier.cold.find(ns.digest, key) == -1  # no row yet
        assert await store.forget(ns, [key]) == 1
        with pytest.raises(BlockNotFoundError):
            await store.read(owner, ns, [key])
        release.set()
        await store.fsync()
        assert store.index.live(ns, key) is None
        assert tier.cold.find(ns.digest, key) == -1  # the write-back dropped the record
        write = await store.alloc(owner, ns, [key])
        assert write.slots[0] is not None  # a new key again
        await store.commit(owner, write.id, [0], True)
