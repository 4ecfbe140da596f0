"""The lower-tier contract (:mod:`kvtierd.testing.tier_contract`) run against the pool tier on a
real ``redis-server``: the same suite as the NVMe tier, less what the pool does not promise (it is
indexed by its link's restore, not when opened, and it evicts by itself: the skips name the
capability). Damage is done straight in the server, behind the tier's back."""

from __future__ import annotations

import contextlib
import mmap
import zlib
from collections.abc import AsyncIterator, Hashable
from pathlib import Path

import pytest
import redis

from kvtierd.config import load_config
from kvtierd.pool.connect import connect_pool
from kvtierd.pool.tier import PoolTier
from kvtierd.pool.values import HEADER_BYTES, PoolNames
from kvtierd.testing.redis_server import RedisServer
from kvtierd.testing.tier_contract import Harness, TierContract

pytestmark = pytest.mark.redis

BUFFERS = 4


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's asyncio client runs on asyncio only


class TestPoolTier(TierContract):
    capabilities = PoolTier.capabilities

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def _prefix(self, directory: Path) -> str:
        """One key prefix per "medium" (directory), so that reopening one finds its values."""
        return f"c{zlib.crc32(directory.name.encode()):08x}"

    @contextlib.asynccontextmanager
    async def open_tier(self, directory: Path, size_bytes: int) -> AsyncIterator[Harness]:
        config = load_config(
            overrides={
                "pool": {
                    "url": self.server.url,
                    "allow_plaintext": True,
                    "key_prefix": self._prefix(directory),
                }
            }
        ).pool
        tier = PoolTier(config, PoolNames(config.key_prefix, "g", 0))
        buffers = [mmap.mmap(-1, self.MAX_BLOCK_BYTES) for _ in range(BUFFERS)]
        client = await connect_pool(config)
        tier.client = client
        try:
            yield Harness(tier, [memoryview(b) for b in buffers])
        finally:
            tier.client = None
            await client.aclose()

    def corrupt(self, directory: Path, location: Hashable, where: str) -> None:
        assert isinstance(location, bytes)
        with redis.Redis.from_url(self.server.url) as server:
            value = bytearray(server.get(location) or b"")
            assert len(value) > HEADER_BYTES, "the value to damage is not in the pool"
            offset = 9 if where == "header" else HEADER_BYTES + (len(value) - HEADER_BYTES) // 2
            value[offset] ^= 0x01
            server.set(location, bytes(value))
