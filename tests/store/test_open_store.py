"""``kvtierd.store.open_store`` knows nothing of the pool: a pool configured but not joined to it
(the composition root, ``kvtierd.server.assembly``, does that) is refused, not dropped."""

from __future__ import annotations

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
