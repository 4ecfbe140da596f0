"""Puts into a DRAM full of dirty blocks, in-process: each allocation evicts what write-back has
cleaned, and the DRAM policy is not asked about every resident block to find it (that walk, per
put, made puts past a full DRAM slow down with the blocks resident: docs/benchmarks.md, scale)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtierd.config import load_config
from kvtierd.store.index import Block, Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import NamespaceSpec, PeerCredentials
from kvtierd.store.records import checksum

ROOT = PeerCredentials(pid=1, uid=0, gid=0)
BLOCK = 4096
DRAM_BLOCKS = (16 << 20) // BLOCK
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


def content(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BLOCK)


def key_of(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"dirtyput"


@pytest.mark.parametrize("policy", ["slsap", "lru"])
async def test_puts_past_a_full_dram_ask_the_policy_about_few_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(tmp_path)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never", "policy": policy},
            "nvme": {"size": "96M", "segment_bytes": "4M"},
        },
    )
    owner = Owner("writer")
    async with open_store(config) as store:
        ns, _ = store.registry.open(NamespaceSpec("d", "default", BLOCK, None, 0, 1), ROOT)
        asked = 0
        evictable = store.residency.dram_evictable

        def counted(block: Block) -> bool:
            nonlocal asked
            asked += 1
            return evictable(block)

        monkeypatch.setattr(store.residency, "dram_evictable", counted)
        total = 2 * DRAM_BLOCKS  # the second half each needs a victim, most of DRAM dirty
        for start in range(0, total, 64):
            keys = [key_of(i) for i in range(start, start + 64)]
            write = await store.alloc(owner, ns, keys)
            for i, slot in enumerate(write.slots):
                assert slot is not None
                store.arena.view[slot.offset : slot.offset + BLOCK] = content(start + i)
            sums = [checksum(content(i)) for i in range(start, start + 64)]
            await store.commit(owner, write.id, sums, False)
        assert store.counters["dram_evictions"] >= total - DRAM_BLOCKS
        # Each question finds a victim but for the few clean blocks a read or write-back pins
        # meanwhile; asking about every resident for each put asks tens of millions.
        assert asked <= 4 * total
        await store.fsync()
        for i in (0, DRAM_BLOCKS, total - 1):  # evicted or resident, each reads back exactly
            lease = await store.read(owner, ns, [key_of(i)])
            try:
                slot = lease.blocks[0].dram
                assert slot is not None
                assert bytes(store.arena.view[slot.offset : slot.offset + BLOCK]) == content(i)
            finally:
                store.release(owner, [lease.id])
