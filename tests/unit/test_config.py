"""Configuration: sizes, defaults, overrides, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.config import load_config, parse_size
from kvtierd.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "value"),
    [("512M", 512 << 20), ("4G", 4 << 30), ("1.5GiB", 3 << 29), (4096, 4096), ("64k", 65536)],
)
def test_sizes(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "4X"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_defaults_load_and_overrides_win(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[dram]\nsize = '2G'\n[nvme]\nsize = 0\n")
    config = load_config(path, {"dram": {"size": "1G"}})
    assert config.dram.size == 1 << 30
    assert config.nvme.size == 0
    assert config.daemon.max_inflight == 256


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("[dram]\nsize = '1M'\n", "$.dram"),
        ("[nvme]\nio_backend = 'aio'\n", "$.nvme.io_backend"),
        ("[daemon]\nsocket_mode = '999'\n", "$.daemon.socket_mode"),
        ("[daemon]\nmetrics_port = 9100\nmetrics_address = '0.0.0.0'\n", "$.daemon"),
        ("[tenants]\nname = 'x'\n", "$.tenants"),
        ("[dram\n", "not valid TOML"),
    ],
)
def test_invalid_fields_are_named(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "k.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=__import__("re").escape(where)):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")
