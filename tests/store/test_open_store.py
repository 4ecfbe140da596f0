"""``kvtierd.store.open_store`` knows nothing of the pool: a pool configured but not joined to it
(the composition root, ``kvtierd.server.assembly``, does that) is refused, not dropped."""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import pytest

from kvtierd.config import load_config
from kvtierd.errors import ConfigError
from kvtierd.store.lifecycle import open_store
from tests.store.test_arena_pin import resident_pages

pytestmark = pytest.mark.anyio


async def test_a_pool_not_joined_to_the_store_is_refused(tmp_path: Path) -> None:
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(tmp_path)},
            "dram": {"size": "16M", "mlock": "never", "hugepages": "never"},
            "nvme": {"size": "0"},
            "pool": {"url": "redis://127.0.0.1:1", "allow_plaintext": True},
        },
    )
    with pytest.raises(ConfigError, match="open_daemon_store"):
        async with open_store(config):
            pass
    assert not (tmp_path / "namespaces.catalog").exists()  # refused before anything was made


@pytest.mark.parametrize("mlock", ["auto", "never"])
@pytest.mark.parametrize("backend", ["io_uring", "threads"])
async def test_the_store_pins_its_arena_before_anything_faults_it_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mlock: str, backend: str
) -> None:
    """With io_uring fixed buffers, the arena is registered untouched, so the registration
    faults its pages in (see tests/store/test_arena_pin.py for why) and the pre-fault is
    skipped; a backend without fixed buffers (threads) leaves the pre-fault to do it."""
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(tmp_path)},
            "dram": {"size": "16M", "mlock": mlock, "hugepages": "never"},
            "nvme": {"size": "64M", "io_backend": backend},
        },
    )
    caplog.set_level(logging.INFO, logger="kvtierd")
    async with open_store(config) as store:
        assert store.io_backend is not None
        fixed = store.io_backend.supports_fixed_buffers
        if backend == "io_uring" and not fixed:
            pytest.skip("this kernel has no READV_FIXED: the arena is pre-faulted instead")
        arena = store.arena
        assert arena.info.prefaulted
        view = arena.view[: arena.resident_bytes]
        assert resident_pages(view) == view.nbytes // mmap.PAGESIZE
    messages = [r.getMessage() for r in caplog.records]
    pinned = any(m.startswith("arena: pinning") for m in messages)
    prefaulted = any(m.startswith("arena: pre-faulting") for m in messages)
    assert (pinned, prefaulted) == (fixed, not fixed), messages
    assert any("registered as fixed buffers" in m for m in messages) == fixed, messages
