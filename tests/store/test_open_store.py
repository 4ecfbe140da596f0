"""``kvtierd.store.open_store`` knows nothing of the pool: a pool configured but not joined to it
(the composition root, ``kvtierd.server.assembly``, does that) is refused, not dropped."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtierd.config import load_config
from kvtierd.errors import ConfigError
from kvtierd.store.lifecycle import open_store

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
async def test_the_store_pins_its_arena_before_anything_faults_it_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mlock: str
) -> None:
    """With io_uring fixed buffers, the arena is registered untouched, so the registration
    faults its pages in (see tests/store/test_arena_pin.py for why); the pre-fault is skipped
    and every disk transfer of the store can use the fixed buffers."""
    config = load_config(
        None,
        {
            "daemon": {"data_dir": str(tmp_path)},
            "dram": {"size": "16M", "mlock": mlock, "hugepages": "never"},
            "nvme": {"size": "64M", "io_backend": "io_uring"},
        },
    )
    caplog.set_level(logging.INFO, logger="kvtierd.arena")
    async with open_store(config) as store:
        backend = store.io_backend
        assert backend is not None
        if not backend.supports_fixed_buffers:
            pytest.skip("this kernel has no READV_FIXED: the arena is pre-faulted instead")
        assert store.arena.info.prefaulted
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("arena: pinning") for m in messages), messages
    assert not any("pre-faulting" in m for m in messages), messages
