"""The store's link to the pool against a real redis-server, in process: FORGET racing the
write-back, and a key committed again after FORGET (review findings, 2026-11-29)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from kvtierd.config import Config, load_config
from kvtierd.store.index import Owner
from kvtierd.store.lifecycle import open_store
from kvtierd.store.namespaces import Namespace, NamespaceSpec, PeerCredentials
from kvtierd.store.records import checksum
from kvtierd.store.store import BlockStore
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

ROOT = PeerCredentials(pid=1, uid=0, gid=0)
SPEC = NamespaceSpec("p", "default", 4096, None, 0, 1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's asyncio client


def _config(directory: Path, url: str) -> Config:
    return load_config(
        None,
        {
            "daemon": {"data_dir": str(directory)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "64M", "segment_bytes": "4M", "queue_depth": 16},
            "pool": {
                "url": url,
                "allow_plaintext": True,
                "write_policy": "write-back",
                "vote_timeout_s": 1.0,
                "heartbeat_s": 0.2,
            },
        },
    )


async def _put(store: BlockStore, owner: Owner, ns: Namespace, key: bytes, data: bytes) -> None:
    write = await store.alloc(owner, ns, [key])
    slot = write.slots[0]
    assert slot is not None
    store.arena.view[slot.offset : slot.offset + len(data)] = data
    await store.commit(owner, write.id, [checksum(data)], False)


async def test_forget_during_the_write_back_never_comes_back(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    owner = Owner("t")
    key = b"K" * 16
    async with open_store(_config(tmp_path / "a", redis_server.url)) as store:
        assert store.pool is not None
        ns, _ = store.registry.open(SPEC, ROOT)
        await _put(store, owner, ns, key, b"a" * 4096)
        while store.pool.in_flight == 0:  # the value is on its way to the pool
            await anyio.lowlevel.checkpoint()
        assert await store.forget(ns, [key]) == 1
        await store.fsync()
    async with open_store(_config(tmp_path / "wiped", redis_server.url)) as store:
        ns, _ = store.registry.open(SPEC, ROOT)
        assert store.lookup(ns, [key]) == (0, b"")
    assert redis_server.client().exists(b"kvt:b:" + ns.digest + key) == 0


async def test_a_key_committed_again_after_forget_reaches_the_pool(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    owner = Owner("t")
    key = b"J" * 16
    async with open_store(_config(tmp_path / "a", redis_server.url)) as store:
        assert store.pool is not None
        ns, _ = store.registry.open(SPEC, ROOT)
        await _put(store, owner, ns, key, b"b" * 4096)
        await store.forget(ns, [key])
        await _put(store, owner, ns, key, b"c" * 4096)  # before a writer took the first one
        await store.fsync()
        block = store.index.get(ns, key)
        assert block is not None
        assert block.pool is not None
        assert not store.pool.pending
    async with open_store(_config(tmp_path / "wiped", redis_server.url)) as store:
        ns, _ = store.registry.open(SPEC, ROOT)
        lease = await store.read(owner, ns, [key])
        slot = lease.blocks[0].dram
        assert slot is not None
        assert bytes(store.arena.view[slot.offset : slot.offset + 4096]) == b"c" * 4096
        store.release(owner, [lease.id])
