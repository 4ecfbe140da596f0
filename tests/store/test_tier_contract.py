"""The lower-tier contract (:mod:`kvtierd.testing.tier_contract`) run against the NVMe tier, over
both I/O backends; the pool tier runs it in ``tests/pool/test_pool_tier_contract.py``."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Hashable
from pathlib import Path
from typing import Any

import pytest

from kvtierd.config import TriState
from kvtierd.errors import NoSpaceError, StorageIOError
from kvtierd.io import open_io_backend
from kvtierd.store.arena import Arena
from kvtierd.store.nvme import NvmeTier, open_nvme_tier
from kvtierd.store.records import PAGE_BYTES
from kvtierd.store.recovery import SNAPSHOT_NAME
from kvtierd.store.segments import DiskSlot
from kvtierd.store.staging import StagingPages
from kvtierd.store.tier import MediumFullError
from kvtierd.testing.tier_contract import Harness, TierContract, content

STAGING_PAGES = 64
BUFFERS = 4
DATA_FILE = "nvme.data"


class TestNvmeTier(TierContract):
    capabilities = NvmeTier.capabilities
    merges_following_copies = True

    @pytest.fixture(autouse=True, params=["io_uring", "threads"])
    def io_backend(self, request: pytest.FixtureRequest) -> str:
        self.backend_name = str(request.param)
        return self.backend_name

    @contextlib.asynccontextmanager
    async def open_tier(self, directory: Path, size_bytes: int) -> AsyncIterator[Harness]:
        staging = STAGING_PAGES * PAGE_BYTES
        arena = Arena.create(
            staging + BUFFERS * self.MAX_BLOCK_BYTES, hugepages=TriState.NEVER, mlock=TriState.NEVER
        )
        try:
            async with open_io_backend(self.backend_name, queue_depth=16) as backend:
                backend.register_buffer(arena.view)
                pages = StagingPages(arena.view[:staging], STAGING_PAGES)
                buffers = [
                    arena.view[staging + i * self.MAX_BLOCK_BYTES :][: self.MAX_BLOCK_BYTES]
                    for i in range(BUFFERS)
                ]
                async with open_nvme_tier(
                    directory / DATA_FILE,
                    size_bytes,
                    backend=backend,
                    pages=pages,
                    segment_bytes=1 << 20,
                ) as tier:
                    assert isinstance(tier, NvmeTier)
                    yield Harness(tier, buffers, seq=tier.max_seq)
                for view in buffers:
                    view.release()
                pages._region.release()
        finally:
            arena.close()

    def corrupt(self, directory: Path, location: Hashable, where: str) -> None:
        assert isinstance(location, DiskSlot)
        offset = location.offset + (PAGE_BYTES + 20 if where == "payload" else 40)
        fd = os.open(directory / DATA_FILE, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
            os.fsync(fd)
        finally:
            os.close(fd)

    def simulate_crash(self, directory: Path) -> None:
        (directory / SNAPSHOT_NAME).unlink()


class TestNvmeTierFaults:
    """What only the NVMe tier can be made to do: a medium that fails a write."""

    @pytest.mark.anyio
    @pytest.mark.parametrize("error", [NoSpaceError, StorageIOError])
    async def test_a_failed_write_gives_its_slot_back(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[Exception]
    ) -> None:
        contract = TestNvmeTier()
        contract.backend_name = "threads"
        async with contract.open_tier(tmp_path, 4 << 20) as h:
            tier = h.tier
            assert isinstance(tier, NvmeTier)
            real_writev = tier._backend.writev
            await h.put(b"first".ljust(16, b"."), content(b"first", 64 << 10))
            before = tier.statistics()

            async def failing_writev(*args: Any) -> int:
                raise error("injected")

            monkeypatch.setattr(tier._backend, "writev", failing_writev)
            for _ in range(100):  # more failures than the tier has slots
                with pytest.raises(error) as raised:
                    await h.put(b"fails".ljust(16, b"."), content(b"fails", 64 << 10))
                # the medium refused the write: the store must not evict for it
                assert isinstance(raised.value, MediumFullError) == (error is NoSpaceError)
            assert tier.statistics().used_bytes == before.used_bytes
            assert tier.statistics().blocks == before.blocks
            monkeypatch.setattr(tier._backend, "writev", real_writev)
            ok = await h.put(b"after".ljust(16, b"."), content(b"after", 64 << 10))
            assert await h.get(*ok) == content(b"after", 64 << 10)
        shutil.rmtree(tmp_path, ignore_errors=True)
