"""The store's one statistics record (``BlockStore.statistics``): each tier's figures, the
counts they were made of, the disk tier's checkpoints; for one peer's tenants only their own
blocks and traffic. In-process, on a real data file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.config import load_config
from kvtierd.errors import BlockNotFoundError
from kvtierd.store.counts import StoreCounts, TrafficCounts
from kvtierd.store.index import Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import NamespaceSpec, PeerCredentials
from kvtierd.store.records import checksum
from tests.store.test_store_pressure import ROOT, content, key_of

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

BLOCK = 64 << 10
ALPHA = PeerCredentials(pid=2, uid=2001, gid=2001)


async def test_one_record_for_the_host_and_another_for_a_tenant(tmp_path: Path) -> None:
    toml = tmp_path / "kvtierd.toml"
    toml.write_text(
        """
[[tenants]]
name = "alpha"
uids = [2001]
dram_size = "4M"

[[tenants]]
name = "beta"
uids = [2002]
dram_size = "4M"
"""
    )
    config = load_config(
        toml,
        {
            "daemon": {"data_dir": str(tmp_path)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "64M", "segment_bytes": "4M"},
        },
    )
    async with open_store(config) as store:
        for tenant, blocks in (("alpha", 2), ("beta", 3)):
            ns, _ = store.registry.open(NamespaceSpec(tenant, tenant, BLOCK, None, 0, 1), ROOT)
            keys = [key_of(i) for i in range(blocks)]
            owner = Owner()
            write = await store.alloc(owner, ns, keys)
            for key, slot in zip(keys, write.slots, strict=True):
                assert slot is not None
                store.arena.view[slot.offset : slot.offset + BLOCK] = content(key, BLOCK)
            sums = [checksum(content(k, BLOCK)) for k in keys]
            await store.commit(owner, write.id, sums, False)

        host = store.statistics()
        assert host.scope == "host"
        assert [t.name for t in host.tiers] == ["dram", "nvme"]
        dram = host.tier("dram")
        assert dram is not None
        assert dram.blocks == 5
        assert dram.bytes_written == 5 * BLOCK
        assert host.tier("pool") is None
        assert isinstance(host.counts, StoreCounts)
        assert host.checkpoints is not None  # the disk tier's, on or off, never absent

        alpha = store.statistics(ALPHA)
        assert alpha.scope == "tenant"
        assert alpha.namespaces == 1
        own = alpha.tier("dram")
        assert own is not None
        assert own.blocks == 2
        assert own.bytes_written == 2 * BLOCK
        assert type(alpha.counts) is TrafficCounts
        assert alpha.checkpoints is None


async def test_miss_bytes_count_what_dram_did_not_have(tmp_path: Path) -> None:
    """Each tier's miss bytes (minor 13): DRAM's are the bytes of the blocks read from below
    or not found, never those it served."""
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(tmp_path)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "64M", "segment_bytes": "4M"},
        },
    )
    async with open_store(config) as store:
        ns, _ = store.registry.open(NamespaceSpec("m", "default", BLOCK, None, 0, 1), ROOT)
        keys = [key_of(i) for i in range(3)]
        owner = Owner()
        write = await store.alloc(owner, ns, keys)
        for key, slot in zip(keys, write.slots, strict=True):
            assert slot is not None
            store.arena.view[slot.offset : slot.offset + BLOCK] = content(key, BLOCK)
        await store.commit(owner, write.id, [checksum(content(k, BLOCK)) for k in keys], False)
        store.release(owner, [(await store.read(owner, ns, keys)).id])  # all in DRAM
        dram = store.statistics().tier("dram")
        assert dram is not None
        assert (dram.misses, dram.miss_bytes) == (0, 0)
        await store.fsync()
        assert await store.evict_dram(ns) == 3
        store.release(owner, [(await store.read(owner, ns, keys[:2])).id])  # from NVMe
        with pytest.raises(BlockNotFoundError):
            await store.read(owner, ns, [key_of(99)])
        dram = store.statistics().tier("dram")
        assert dram is not None
        assert (dram.misses, dram.miss_bytes) == (3, 3 * BLOCK)
