"""The store's link to the pool against a real redis-server, in process: FORGET racing the
write-back, a key committed again after FORGET, and FSYNC against a pool that refuses every block
(review findings, 2026-11-29); idle blocks on the disk only let go with a pool configured, and
those waiting for the pool kept (issue 32)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from kvtierd.config import Config, load_config
from kvtierd.server.assembly import open_daemon_store
from kvtierd.store.index import Owner
from kvtierd.store.namespaces import Namespace, NamespaceSpec, PeerCredentials
from kvtierd.store.records import checksum
from kvtierd.store.store import BlockStore
from kvtierd.testing.redis_server import RedisServer
from tests.store.test_store_pressure import read_back

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

ROOT = PeerCredentials(pid=1, uid=0, gid=0)
SPEC = NamespaceSpec("p", "default", 4096, None, 0, 1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's asyncio client


@contextlib.asynccontextmanager
async def open_store(config: Config) -> AsyncIterator[BlockStore]:
    """The store for ``config``, joined to the pool as a daemon's is."""
    async with open_daemon_store(config) as assembled:
        yield assembled.store


def _config(directory: Path, url: str | None, **pool: object) -> Config:
    """A store with a pool at ``url`` (none: the local tiers only)."""
    sections: dict[str, object] = {
        "daemon": {"data_dir": str(directory)},
        "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
        "nvme": {"size": "64M", "segment_bytes": "4M", "queue_depth": 16},
    }
    if url is not None:
        sections["pool"] = {
            "url": url,
            "allow_plaintext": True,
            "write_policy": "write-back",
            "vote_timeout_s": 1.0,
            "heartbeat_s": 0.2,
            **pool,
        }
    return load_config(None, sections)


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


async def test_fsync_gives_up_on_a_pool_that_refuses_every_block(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # The group's own keys may still be written, so the rank stays attached; every block's SET
    # is refused (NOPERM), a refusal that may pass, so the writer retries it. A retry is not
    # progress: FSYNC must return the local guarantee after the stall time, not wait forever.
    with redis_server.client() as admin:
        admin.execute_command(
            "ACL", "SETUSER", "default", "-set", "(+set %W~*:proposal %W~*:decision %W~*:probe:*)"
        )
    owner = Owner("t")
    async with open_store(_config(tmp_path / "a", redis_server.url, timeout_s=1.0)) as store:
        assert store.pool is not None
        with anyio.fail_after(20):
            await store.pool.settled.wait()  # restored after attaching, or gone local
        assert store.pool.attached
        ns, _ = store.registry.open(SPEC, ROOT)
        await _put(store, owner, ns, b"R" * 16, b"r" * 4096)
        with anyio.fail_after(30):  # the stall time is 2 * timeout_s + 2 s
            await store.fsync()
        assert store.pool.attached
        assert store.pool.pending  # still waiting for the pool, retried in the background
        assert store.pool.counters["write_failures"] >= 1


def _refuse_blocks(redis_server: RedisServer) -> None:
    """The group's own keys may still be written, so the rank stays attached; every block's
    SET is refused (NOPERM), a refusal that may pass, so the writer retries it."""
    with redis_server.client() as admin:
        admin.execute_command(
            "ACL", "SETUSER", "default", "-set", "(+set %W~*:proposal %W~*:decision %W~*:probe:*)"
        )


async def test_blocks_read_from_the_disk_are_let_go_again_with_a_pool_configured(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Blocks on the disk only (written before the pool was configured), read after a restart
    with one: once their DRAM copies go, their rows stand for them again, as without a pool."""
    owner = Owner("t")
    keys = [b"%015d" % i for i in range(12)]
    async with open_store(_config(tmp_path / "a", None)) as store:
        ns, _ = store.registry.open(SPEC, ROOT)
        store.registry.save()  # (the daemon saves it at OPEN_NS) a restart names it
        for i, key in enumerate(keys):
            await _put(store, owner, ns, key, bytes([i]) * 4096)
        await store.fsync()
    async with open_store(_config(tmp_path / "a", redis_server.url)) as store:
        assert store.pool is not None
        with anyio.fail_after(20):
            await store.pool.settled.wait()
        ns, _ = store.registry.open(SPEC, ROOT)
        assert store.index.blocks() == []  # rows only after the restart
        for i, key in enumerate(keys):
            assert await read_back(store, owner, ns, key) == bytes([i]) * 4096
        assert len(store.index.blocks()) == len(keys)  # each has a DRAM copy now
        assert await store.evict_dram(ns) == len(keys)
        assert store.index.blocks() == []
        assert [store.index.live(ns, key) for key in keys] == [None] * len(keys)
        for i, key in enumerate(keys):  # and their rows serve them again
            assert await read_back(store, owner, ns, key) == bytes([i]) * 4096


async def test_blocks_waiting_for_the_pool_stay_live_until_it_has_them(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Blocks on the disk only that the link still has to write to the pool (it refuses them
    for now) keep their ``Block``, the one the link holds; once the pool takes them they have
    a pool copy to keep track of as well."""
    _refuse_blocks(redis_server)
    owner = Owner("t")
    keys = [b"W%014d" % i for i in range(8)]
    async with open_store(_config(tmp_path / "a", redis_server.url, timeout_s=1.0)) as store:
        assert store.pool is not None
        with anyio.fail_after(20):
            await store.pool.settled.wait()
        assert store.pool.attached
        ns, _ = store.registry.open(SPEC, ROOT)
        for i, key in enumerate(keys):
            await _put(store, owner, ns, key, bytes([i]) * 4096)
        with anyio.fail_after(30):  # the stall time is 2 * timeout_s + 2 s
            await store.fsync()
        await store.evict_dram(ns)  # (a retry writing some holds them in DRAM meanwhile)
        live = [store.index.live(ns, key) for key in keys]
        assert all(block is not None and store.pool.holds(block) for block in live)
        with redis_server.client() as admin:
            admin.execute_command("ACL", "SETUSER", "default", "+set")
        assert await store.pool.drain(30)
        assert [store.index.live(ns, key) for key in keys] == live
        assert all(block is not None and block.pool is not None for block in live)
        for i, key in enumerate(keys):
            assert await read_back(store, owner, ns, key) == bytes([i]) * 4096
