"""A block its tenant changes after COMMIT is dropped by write-back, never written; its DRAM slot
comes back even while a lease pins it (the suspected slot leak in ``store/writer.py``: the slot
is freed when the last pin goes). In-process, on a real data file."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvtierd.config import load_config
from kvtierd.store.index import Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import Namespace, NamespaceSpec
from kvtierd.store.records import checksum
from kvtierd.store.store import BlockStore
from tests.store.test_store_pressure import ROOT, content, key_of

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

BLOCK = 256 << 10


@contextlib.asynccontextmanager
async def tight_staging(directory: Path) -> AsyncIterator[tuple[BlockStore, Namespace]]:
    """A store whose COMMIT can stage one block: the second block of a COMMIT is hashed in its
    slot and copied (and verified) only at write-back."""
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(directory)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "64M", "segment_bytes": "4M", "staging_bytes": "512K"},
            "limits": {"max_block_bytes": "256K"},
        },
    )
    async with open_store(config) as store:
        ns, _ = store.registry.open(NamespaceSpec("c", "default", BLOCK, None, 0, 1), ROOT)
        yield store, ns


async def commit_two(store: BlockStore, owner: Owner, ns: Namespace) -> list[bytes]:
    keys = [key_of(0), key_of(1)]
    write = await store.alloc(owner, ns, keys)
    for key, slot in zip(keys, write.slots, strict=True):
        assert slot is not None
        store.arena.view[slot.offset : slot.offset + BLOCK] = content(key, BLOCK)
    await store.commit(owner, write.id, [checksum(content(k, BLOCK)) for k in keys], False)
    return keys


@pytest.mark.parametrize("leased", [True, False])
async def test_a_block_changed_after_commit_gives_its_slot_back(
    tmp_path: Path, leased: bool
) -> None:
    async with tight_staging(tmp_path) as (store, ns):
        assert ns.region is not None
        allocator = ns.region.allocator
        empty = allocator.free_bytes
        owner = Owner("tenant")
        keys = await commit_two(store, owner, ns)
        changed = store.index.get(ns, keys[1])
        assert changed is not None
        assert changed.staged is None  # hashed in its slot: write-back copies and verifies it
        lease = await store.read(owner, ns, [keys[1]]) if leased else None
        assert changed.dram is not None
        store.arena.view[changed.dram.offset] ^= 0xFF  # the tenant writes after COMMIT
        await store.fsync()
        assert store.counters["lost"] == 1
        assert store.index.get(ns, keys[1]) is None  # dropped, never written
        assert (changed.dram is not None) is leased  # a leased slot stays until released
        if lease is not None:
            store.release(owner, [lease.id])
        assert changed.dram is None
        assert await store.evict_dram(ns) == 1  # the block that was not changed, written back
        assert allocator.free_bytes == empty
