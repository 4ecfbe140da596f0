"""READs of blocks whose NVMe records lie side by side: one request per run, each block still
verified alone (a damaged record inside a run is a miss for that block only), and a run that
changes while it is read (FORGET) leaks nothing. In-process, on the real io_uring or thread
backend and a real data file."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kvtierd.config import load_config
from kvtierd.errors import BlockNotFoundError
from kvtierd.store.index import Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import Namespace, NamespaceSpec
from kvtierd.store.records import PAGE_BYTES
from kvtierd.store.segments import DiskSlot
from kvtierd.store.store import BlockStore
from tests.store.test_store_pressure import ROOT, content, key_of, put, read_back, small_store
from tests.support.gates import gate

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

BLOCK = 256 << 10


@contextlib.asynccontextmanager
async def store_in_order(
    directory: Path, backend: str
) -> AsyncIterator[tuple[BlockStore, Namespace]]:
    """A store whose write-back writes one block at a time, so that blocks committed in order
    get slots in order, side by side."""
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(directory)},
            "dram": {"size": "32M", "mlock": "never", "hugepages": "never"},
            "nvme": {
                "size": "64M",
                "segment_bytes": "8M",
                "queue_depth": 16,
                "writeback_concurrency": 1,
                "io_backend": backend,
            },
        },
    )
    async with open_store(config) as store:
        ns, _ = store.registry.open(NamespaceSpec("r", "default", BLOCK, None, 0, 1), ROOT)
        yield store, ns


async def stored_on_disk(store: BlockStore, ns: Namespace, count: int) -> tuple[Owner, list[bytes]]:
    owner = Owner("runs")
    keys = [key_of(i) for i in range(count)]
    for key in keys:
        await put(store, owner, ns, key)
    await store.fsync()
    assert await store.evict_dram(ns) == count
    return owner, keys


async def read_and_check(store: BlockStore, owner: Owner, ns: Namespace, keys: list[bytes]) -> int:
    """READ ``keys``, check every block's bytes in DRAM, release; how many disk requests it took."""
    assert store.io_backend is not None
    before = store.io_backend.statistics().submitted
    lease = await store.read(owner, ns, keys)
    requests = store.io_backend.statistics().submitted - before
    _check_then_release(store, owner, keys, lease)
    return requests


def _check_then_release(store: BlockStore, owner: Owner, keys: list[bytes], lease: Any) -> None:
    """Every block of ``lease`` in DRAM with its own bytes; the lease given back either way."""
    try:
        for key, block in zip(keys, lease.blocks, strict=True):
            assert block.dram is not None
            assert bytes(store.arena.view[block.dram.offset :][:BLOCK]) == content(key, BLOCK)
    finally:
        store.release(owner, [lease.id])


def location(store: BlockStore, ns: Namespace, key: bytes) -> DiskSlot:
    block = store.index.get(ns, key)
    assert block is not None
    assert isinstance(block.lower, DiskSlot)
    return block.lower


def damage(directory: Path, slot: DiskSlot, where: str) -> None:
    """Flip one byte of the record at ``slot`` on the medium, behind the tier's back."""
    offset = slot.offset + (PAGE_BYTES + 20 if where == "payload" else 40)
    fd = os.open(directory / "nvme.data", os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
async def test_blocks_written_in_order_are_read_in_runs(tmp_path: Path, backend: str) -> None:
    async with store_in_order(tmp_path, backend) as (store, ns):
        owner, keys = await stored_on_disk(store, ns, 12)
        slots = [location(store, ns, key) for key in keys]
        assert all(a.offset + a.size == b.offset for a, b in itertools.pairwise(slots))
        requests = await read_and_check(store, owner, ns, keys)
        assert requests < len(keys)  # 12 x 260 KiB in runs of at most 4 MiB: 1 or 2 requests
        assert store.counters["lower_hits"] == len(keys)


#: The order a READ asks for the blocks written 0, 1, ... 11: no two neighbours side by side
#: on disk except 4, 5 (then 8, 9 and 10, 11 in reverse, which no request can merge).
SHUFFLED = [3, 0, 7, 4, 5, 1, 9, 8, 11, 10, 2, 6]


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
async def test_blocks_read_in_any_order_are_read_together_and_verified(
    tmp_path: Path, backend: str
) -> None:
    async with store_in_order(tmp_path, backend) as (store, ns):
        owner, written = await stored_on_disk(store, ns, 12)
        keys = [written[i] for i in SHUFFLED]
        requests = await read_and_check(store, owner, ns, keys)
        assert requests == len(keys) - 1  # 4 and 5 in one request, every other block alone
        assert store.counters["lower_hits"] == len(keys)


@pytest.mark.parametrize("order", ["in_order", "shuffled"])
@pytest.mark.parametrize("where", ["payload", "header"])
async def test_a_damaged_record_inside_a_run_is_a_miss_for_it_alone(
    tmp_path: Path, where: str, order: str
) -> None:
    async with store_in_order(tmp_path, "io_uring") as (store, ns):
        owner, keys = await stored_on_disk(store, ns, 5)
        damage(tmp_path, location(store, ns, keys[2]), where)
        asked = keys if order == "in_order" else [keys[i] for i in (3, 2, 0, 4, 1)]
        with pytest.raises(BlockNotFoundError):
            await store.read(owner, ns, asked)
        assert store.index.get(ns, keys[2]) is None  # the damaged copy was its only one
        assert store.counters["lost"] == 1
        assert not owner.leases
        for key in keys[:2] + keys[3:]:  # read together, their bytes in DRAM now
            assert await read_back(store, owner, ns, key) == content(key, BLOCK)
        await store.evict_dram(ns)
        assert store.regions.used_bytes == 0


def rewrite_header_page(directory: Path, slot: DiskSlot, page: bytes) -> None:
    fd = os.open(directory / "nvme.data", os.O_RDWR)
    try:
        os.pwrite(fd, page, slot.offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def header_page(directory: Path, slot: DiskSlot) -> bytes:
    with open(directory / "nvme.data", "rb") as f:
        f.seek(slot.offset)
        return f.read(PAGE_BYTES)


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
async def test_a_header_page_unlike_the_index_is_judged_on_what_it_says(
    tmp_path: Path, backend: str
) -> None:
    """A run's header pages are accepted at a glance when they are byte for byte the header
    the index holds; any other page is unpacked and judged as before: another block's intact
    header is a miss, the right header with other bytes in its page's unused tail a hit."""
    async with store_in_order(tmp_path, backend) as (store, ns):
        owner, keys = await stored_on_disk(store, ns, 5)
        slots = [location(store, ns, key) for key in keys]
        stray = bytearray(header_page(tmp_path, slots[1]))
        stray[-1] ^= 0xFF  # past the sealed header: not part of what it says
        rewrite_header_page(tmp_path, slots[1], bytes(stray))
        rewrite_header_page(tmp_path, slots[3], header_page(tmp_path, slots[4]))
        with pytest.raises(BlockNotFoundError):
            await store.read(owner, ns, keys)
        assert store.index.get(ns, keys[3]) is None  # its slot names another block
        assert store.counters["lost"] == 1
        for key in keys[:3] + keys[4:]:  # the stray tail did not cost keys[1] its copy
            assert await read_back(store, owner, ns, key) == content(key, BLOCK)


async def test_forget_while_a_run_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FORGET of a block of a run in flight: the READ is a miss, the others land, nothing
    leaks, and the forgotten block stays forgotten."""
    async with store_in_order(tmp_path, "io_uring") as (store, ns):
        owner, keys = await stored_on_disk(store, ns, 4)
        assert store.lower is not None
        real_load_run = store.lower.load_run
        started, proceed = gate(monkeypatch, store.lower, "load_run")
        outcome: list[BaseException | None] = []

        async def reader() -> None:
            try:
                await store.read(owner, ns, keys)
                outcome.append(None)
            except BlockNotFoundError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await started.wait()
            assert await store.forget(ns, [keys[1]]) == 1
            proceed.set()
        monkeypatch.setattr(store.lower, "load_run", real_load_run)
        assert len(outcome) == 1
        assert isinstance(outcome[0], BlockNotFoundError)
        assert store.index.get(ns, keys[1]) is None
        assert not owner.leases
        for key in (keys[0], keys[2], keys[3]):
            assert await read_back(store, owner, ns, key) == content(key, BLOCK)
        await store.evict_dram(ns)
        assert store.regions.used_bytes == 0
        await store.fsync()  # the store's own tasks are still alive


async def test_a_read_waits_for_a_block_a_prefetch_is_promoting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block of the READ is being promoted by a prefetch (LOOKUP) when the READ arrives: the
    READ reads the others (in runs around it), waits for that one, and gets every block."""
    async with store_in_order(tmp_path, "io_uring") as (store, ns):
        owner, keys = await stored_on_disk(store, ns, 6)
        assert store.lower is not None
        started, proceed = gate(monkeypatch, store.lower, "load")
        assert store.lookup(ns, [keys[2]]) == (1, b"\x01")  # promotes it in the background
        await started.wait()
        leases = []
        async with anyio.create_task_group() as tg:

            async def reader() -> None:
                leases.append(await store.read(owner, ns, keys))

            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            assert not leases  # waiting for the block the prefetch holds
            proceed.set()
        (lease,) = leases
        _check_then_release(store, owner, keys, lease)


async def test_a_lookup_promotes_blocks_on_disk_in_batches(tmp_path: Path) -> None:
    """Background promotions (a LOOKUP's) read the queued blocks together as a READ's batch
    is: records side by side in one request, each still verified alone."""
    async with store_in_order(tmp_path, "io_uring") as (store, ns):
        owner, keys = await stored_on_disk(store, ns, 12)
        damage(tmp_path, location(store, ns, keys[5]), "payload")
        assert store.io_backend is not None
        before = store.io_backend.statistics().submitted
        hits, _ = store.lookup(ns, keys)
        assert hits == len(keys)
        while store.counters["promotions"] + store.counters["lost"] < len(keys):  # noqa: ASYNC110
            await anyio.sleep(0.01)  # promotions have no event to wait on
        requests = store.io_backend.statistics().submitted - before
        assert requests < len(keys)  # 12 x 260 KiB queued together: one or two requests
        assert store.index.get(ns, keys[5]) is None  # its only copy failed its checksum
        assert store.counters["lost"] == 1
        for key in keys[:5] + keys[6:]:
            block = store.index.get(ns, key)
            assert block is not None
            assert block.dram is not None  # promoted, not read yet
            assert bytes(store.arena.view[block.dram.offset :][:BLOCK]) == content(key, BLOCK)
        assert await read_back(store, owner, ns, keys[0]) == content(keys[0], BLOCK)


async def test_background_batches_leave_a_small_region_room_for_the_next_read(
    tmp_path: Path,
) -> None:
    """A LOOKUP of more blocks than a small region holds queues promotions in batches; what
    they load at once stays within a quarter of the region beyond one block per promoter,
    so the READ that follows at once finds room (its blocks, not ENOSPC)."""
    async with small_store(tmp_path, BLOCK, segment_bytes="8M") as (store, ns):
        owner = Owner("small")
        keys = [key_of(i) for i in range(80)]  # 20 MiB on disk, 16 MiB of DRAM
        for key in keys:
            await put(store, owner, ns, key)
        await store.fsync()
        await store.evict_dram(ns)
        region = ns.region
        assert region is not None
        bound = region.allocator.capacity // 4 + 8 * BLOCK
        hits, _ = store.lookup(ns, keys[:64])
        assert hits == 64
        highest = 0

        async def watch() -> None:
            nonlocal highest
            while True:
                highest = max(highest, sum(store._loading_bytes.values()))
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            for key in keys[64:]:  # not named by the LOOKUP: read from disk now
                assert await read_back(store, owner, ns, key) == content(key, BLOCK)
            while store._promotions or any(store._loading_bytes.values()):  # noqa: ASYNC110
                await anyio.sleep(0.01)  # promotions have no event to wait on
            tg.cancel_scope.cancel()
        assert 0 < highest <= bound
