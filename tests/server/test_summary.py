"""The start-up summary line (``kvtierd.server.summary``, pure): every listener, the sizes
``--check`` gives, the configuration's source."""

from __future__ import annotations

from pathlib import Path

from kvtierd.config import load_config
from kvtierd.server.summary import startup_summary

CONFIG = """
[daemon]
socket = "/run/kvtierd/kvtierd.sock"
metrics_port = 9464

[dram]
size = "1G"

[nvme]
size = "4G"
path = "/srv/nvme/kvtierd.data"

[pool]
url = "rediss://pool.example:6380/0"
group_id = "llama-70b"
rank = 0
world_size = 1

[[tenants]]
name = "alpha"
dram_share = 0.5

[[tenants]]
name = "beta"
dram_share = 0.25
"""


def test_the_summary_names_every_listener_and_size(tmp_path: Path) -> None:
    path = tmp_path / "kvtierd.toml"
    path.write_text(CONFIG)
    config = load_config(path)
    line = startup_summary(
        config, source=f"config {path}", io_backend="io_uring", arena_bytes=1 << 30, locked=True
    )
    assert line == (
        f"kvtierd {line.split()[1]} ready on /run/kvtierd/kvtierd.sock (config {path}): "
        "DRAM 1 GiB (arena 1 GiB locked, tenants alpha, beta); "
        "NVMe 4 GiB at /srv/nvme/kvtierd.data; I/O io_uring; "
        "pool rediss://pool.example:6380/0 group llama-70b; metrics 127.0.0.1:9464"
    )


def test_the_embedded_defaults_say_so() -> None:
    line = startup_summary(
        load_config(None),
        source="the embedded defaults",
        io_backend="threads",
        arena_bytes=0,
        locked=False,
    )
    assert "(the embedded defaults): DRAM " in line
    assert "arena 0 bytes not locked" in line
    assert "pool" not in line
