"""The pool tier against a real redis-server: what it stores comes back exact, what is damaged,
evicted or foreign is a miss (logged), a full pool is a full medium, a detached tier refuses."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.config import PoolConfig, load_config
from kvtierd.errors import BlockNotFoundError
from kvtierd.pool.catalog import PoolCatalog
from kvtierd.pool.connect import PoolUnavailableError, RedisLike, connect_pool
from kvtierd.pool.tier import PoolTier
from kvtierd.pool.values import HEADER_BYTES, PoolNames
from kvtierd.store.namespaces import NamespaceSpec
from kvtierd.store.records import checksum
from kvtierd.store.tier import BlockRef, MediumFullError
from kvtierd.testing.redis_server import RedisServer, require_redis_server

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

NS = bytes(range(16))
BLOCK = 64 << 10


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's asyncio client runs on asyncio only


def _config(server: RedisServer, **extra: object) -> PoolConfig:
    values = {"url": server.url, "allow_plaintext": True, **extra}
    return load_config(overrides={"pool": values}).pool


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[RedisLike]:
    live = await connect_pool(_config(redis_server))
    try:
        yield live
    finally:
        await live.aclose()


def _tier(server: RedisServer, client: RedisLike | None, **extra: object) -> PoolTier:
    config = _config(server, **extra)
    tier = PoolTier(config, PoolNames(config.key_prefix, "g", 0))
    tier.client = client
    return tier


def _block(i: int, *, compressible: bool = False) -> tuple[BlockRef, memoryview]:
    rng = np.random.default_rng(i)
    data = (
        np.repeat(rng.integers(0, 4, BLOCK // 64, dtype=np.uint8), 64)
        if compressible
        else rng.integers(0, 256, BLOCK, dtype=np.uint8)
    )
    raw = data.tobytes()
    return BlockRef(NS, i.to_bytes(16, "big"), BLOCK, checksum(raw), i + 1), memoryview(raw)


async def test_blocks_come_back_exact(redis_server: RedisServer, client: RedisLike) -> None:
    tier = _tier(redis_server, client)
    blocks = [_block(i) for i in range(8)]
    outcome = await tier.store_many([(ref, await tier.encode(ref, raw)) for ref, raw in blocks])
    stored, error = outcome.locations, outcome.refused
    assert error is None
    locations = [location for location in stored if location is not None]
    assert len(locations) == len(blocks)
    for (ref, raw), location in zip(blocks, locations, strict=True):
        dest = bytearray(BLOCK)
        await tier.load(ref, location, memoryview(dest))
        assert dest == raw
    catalog = PoolCatalog(tier)
    assert await catalog.exists([*locations, tier.location(_block(99)[0])]) == [True] * 8 + [False]
    listed = {ref.key: ref for ref, _ in [entry async for entry in catalog.manifest()]}
    assert listed == {ref.key: ref for ref, _ in blocks}


async def test_compressed_blocks_come_back_exact(
    redis_server: RedisServer, client: RedisLike
) -> None:
    tier = _tier(redis_server, client, compress=True)
    ref, raw = _block(1, compressible=True)
    location = await tier.store(ref, raw)
    stored = await client.strlen(location)
    assert stored < BLOCK // 4
    dest = bytearray(BLOCK)
    await tier.load(ref, location, memoryview(dest))
    assert dest == raw


async def test_damaged_value_is_a_logged_miss(
    redis_server: RedisServer, client: RedisLike, caplog: pytest.LogCaptureFixture
) -> None:
    tier = _tier(redis_server, client)
    ref, raw = _block(2)
    location = await tier.store(ref, raw)
    await client.setrange(location, HEADER_BYTES + 1000, b"\xff\x00\xff")
    dest = bytearray(BLOCK)
    with caplog.at_level(logging.WARNING, "kvtierd.pool"), pytest.raises(BlockNotFoundError):
        await tier.load(ref, location, memoryview(dest))
    assert "not intact" in caplog.text
    assert dest == bytearray(BLOCK)  # nothing of the damaged value reached the destination


async def test_foreign_and_evicted_values_are_misses(
    redis_server: RedisServer, client: RedisLike
) -> None:
    tier = _tier(redis_server, client)
    ref, raw = _block(3)
    other, _ = _block(4)
    location = await tier.store(ref, raw)
    with pytest.raises(BlockNotFoundError):  # a value of another block under this key
        await tier.load(other, location, memoryview(bytearray(BLOCK)))
    await client.set(location, b"not a block at all")
    with pytest.raises(BlockNotFoundError):
        await tier.load(ref, location, memoryview(bytearray(BLOCK)))
    await client.delete(location)
    with pytest.raises(BlockNotFoundError, match="no longer"):
        await tier.load(ref, location, memoryview(bytearray(BLOCK)))


async def test_discard_removes_value_and_manifest_entry(
    redis_server: RedisServer, client: RedisLike
) -> None:
    tier = _tier(redis_server, client)
    ref, raw = _block(5)
    location = await tier.store(ref, raw)
    await tier.discard(ref, location)
    catalog = PoolCatalog(tier)
    assert await catalog.exists([location]) == [False]
    assert [entry async for entry in catalog.manifest()] == []


async def test_intents_and_namespaces(redis_server: RedisServer, client: RedisLike) -> None:
    tier = _tier(redis_server, client)
    catalog = PoolCatalog(tier)
    refs = [_block(i)[0] for i in range(3)]
    await catalog.note_intents(refs)
    assert sorted(await catalog.intents()) == sorted((r.ns_digest, r.key) for r in refs)
    await tier.store(refs[0], _block(0)[1])  # reaching the pool clears the intent
    assert sorted(await catalog.intents()) == sorted((r.ns_digest, r.key) for r in refs[1:])
    spec = NamespaceSpec("m", "default", BLOCK, None, 0, 2)
    await catalog.publish_namespaces({NS: spec})
    assert await catalog.namespaces() == [spec]


async def test_a_full_pool_is_a_full_medium(tmp_path: Path) -> None:
    require_redis_server()
    with RedisServer(
        tmp_path / "small", persistence=False, extra_config=["maxmemory 2mb"]
    ) as server:
        live = await connect_pool(_config(server))
        try:
            tier = _tier(server, live)

            async def fill() -> None:
                for i in range(64):
                    ref, raw = _block(i)
                    await tier.store(ref, raw)

            with pytest.raises(MediumFullError):
                await fill()
        finally:
            await live.aclose()


async def test_a_detached_tier_refuses_at_once(redis_server: RedisServer) -> None:
    tier = _tier(redis_server, None)
    ref, raw = _block(6)
    with pytest.raises(PoolUnavailableError, match="not attached"):
        await tier.store(ref, raw)
    with pytest.raises(PoolUnavailableError):
        await tier.load(ref, tier.location(ref), memoryview(bytearray(BLOCK)))
