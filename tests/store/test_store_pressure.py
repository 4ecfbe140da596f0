"""The store under capacity pressure, in-process: a full NVMe tier evicts while many write-back
workers run at once, promotions race with FORGET, and the arena refuses what cannot fit."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from kvtierd.config import load_config
from kvtierd.errors import BlockNotFoundError
from kvtierd.store.index import Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import Namespace, NamespaceSpec, PeerCredentials
from kvtierd.store.records import checksum
from kvtierd.store.residency import EVICT_BATCH
from kvtierd.store.store import BlockStore
from tests.support.gates import gate

ROOT = PeerCredentials(pid=1, uid=0, gid=0)
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def content(key: bytes, nbytes: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(nbytes)


def key_of(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"pressure"


@contextlib.asynccontextmanager
async def small_store(
    directory: Path, block_bytes: int, **nvme: Any
) -> AsyncIterator[tuple[BlockStore, Namespace]]:
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(directory)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "64M", "segment_bytes": "4M", "queue_depth": 16, **nvme},
        },
    )
    async with open_store(config) as store:
        ns, _ = store.registry.open(NamespaceSpec("p", "default", block_bytes, None, 0, 1), ROOT)
        yield store, ns


async def put(store: BlockStore, owner: Owner, ns: Namespace, key: bytes) -> None:
    data = content(key, ns.spec.block_bytes)
    write = await store.alloc(owner, ns, [key])
    slot = write.slots[0]
    if slot is not None:
        store.arena.view[slot.offset : slot.offset + len(data)] = data
    await store.commit(owner, write.id, [checksum(data)], False)


async def read_back(store: BlockStore, owner: Owner, ns: Namespace, key: bytes) -> bytes:
    lease = await store.read(owner, ns, [key])
    try:
        block = lease.blocks[0]
        assert block.dram is not None
        return bytes(store.arena.view[block.dram.offset :][: block.ref.raw_bytes])
    finally:
        store.release(owner, [lease.id])


async def test_a_full_nvme_tier_evicts_under_concurrent_write_back(tmp_path: Path) -> None:
    """Far more data than the NVMe tier holds, written through 16 write-back workers: the
    oldest blocks are evicted, no more than room needed (the 16 workers that find the tier full
    at once evict one batch, not one each), every block still indexed reads back exactly, FSYNC
    succeeds."""
    block = (1 << 20) - 4096
    owner = Owner("writer")
    async with small_store(tmp_path, block, writeback_concurrency=16) as (store, ns):
        total = 160  # about 2.5 times the tier
        for i in range(total):
            await put(store, owner, ns, key_of(i))
        await store.fsync()
        assert store.lower is not None
        holds = store.lower.statistics().capacity_bytes // (1 << 20)
        assert total - holds <= store.counters["lower_evictions"] < total - holds + EVICT_BATCH
        present = [i for i in range(total) if store.index.get(ns, key_of(i)) is not None]
        assert len(present) < total
        assert present[-1] == total - 1  # the newest survive
        for i in present:
            assert await read_back(store, owner, ns, key_of(i)) == content(key_of(i), block)
        stats = store.lower.statistics()
        assert stats.used_bytes <= stats.capacity_bytes


async def _fsynced_and_evicted(store: BlockStore, ns: Namespace, keys: list[bytes]) -> Owner:
    owner = Owner("setup")
    for key in keys:
        await put(store, owner, ns, key)
    await store.fsync()
    assert await store.evict_dram(ns) == len(keys)
    return owner


@pytest.mark.parametrize("how", ["read", "prefetch"])
async def test_forget_while_a_promotion_reads_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """FORGET lands while the block is being read up from NVMe: the reader gets a miss, the
    store stays up, and no arena space leaks."""
    async with small_store(tmp_path, 256 << 10) as (store, ns):
        key, other = key_of(1), key_of(2)
        owner = await _fsynced_and_evicted(store, ns, [key, other])
        assert store.lower is not None
        real_load = store.lower.load
        started, proceed = gate(monkeypatch, store.lower, "load")
        block = store.index.get(ns, key)
        assert block is not None
        outcome: list[BaseException | None] = []

        async def reader() -> None:
            try:
                await store.read(owner, ns, [key])
                outcome.append(None)
            except BlockNotFoundError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            if how == "read":
                tg.start_soon(reader)
            else:
                assert store.lookup(ns, [key]) == (1, b"\x01")
            await started.wait()
            assert await store.forget(ns, [key]) == 1
            proceed.set()
        monkeypatch.setattr(store.lower, "load", real_load)
        with anyio.fail_after(10):  # the promotion has finished, one way or the other
            while block.loading is not None:
                await block.loading.wait()
        if how == "read":
            assert len(outcome) == 1
            assert isinstance(outcome[0], BlockNotFoundError)
        assert store.index.get(ns, key) is None
        assert store.regions.used_bytes == 0
        assert await read_back(store, owner, ns, other) == content(other, 256 << 10)
        await store.fsync()  # the store's own tasks are still alive


async def test_a_failing_disk_read_leaks_no_arena_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtierd.errors import StorageIOError

    async with small_store(tmp_path, 256 << 10) as (store, ns):
        key = key_of(7)
        owner = await _fsynced_and_evicted(store, ns, [key])
        assert store.lower is not None
        real_load = store.lower.load

        async def failing_load(*args: Any) -> None:
            raise StorageIOError("injected medium error")

        monkeypatch.setattr(store.lower, "load", failing_load)
        with pytest.raises(StorageIOError):
            await store.read(owner, ns, [key])
        assert store.regions.used_bytes == 0
        assert not owner.leases
        monkeypatch.setattr(store.lower, "load", real_load)
        assert await read_back(store, owner, ns, key) == content(key, 256 << 10)
