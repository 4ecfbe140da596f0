"""The one line a daemon logs once it serves: where it listens, what it holds, where from.

An operator reading the journal after a restart sees in one line which configuration the
daemon took, how much DRAM and NVMe it has (the sizes ``kvtierd --check`` prints), its tenants,
its I/O backend, and every listener: the socket, other hosts' TCP port, the pool, metrics.
Pure: it reads the configuration and a few facts the caller passes; the pool is named as the
pool's own log lines name it (``pool_address``: scheme, host and port, nothing else).
"""

from __future__ import annotations

from humanfriendly import format_size

from kvtierd import __version__
from kvtierd.config import Config
from kvtierd.pool.connect import pool_address
from kvtierd.store.lifecycle import nvme_data_path

__all__ = ["startup_summary"]


def startup_summary(
    config: Config, *, source: str, io_backend: str, arena_bytes: int, locked: bool
) -> str:
    """``kvtierd VERSION ready on SOCKET (config SOURCE): ...``; ``locked``: whether the arena
    is locked in RAM (``mlock``)."""
    dram = format_size(config.dram.size, binary=True)
    tenants = [t.name for t in config.tenants]
    arena = f"arena {format_size(arena_bytes, binary=True)} {'locked' if locked else 'not locked'}"
    parts = [f"DRAM {dram} ({arena}" + (f", tenants {', '.join(tenants)})" if tenants else ")")]
    if config.nvme.size:
        size = format_size(config.nvme.size, binary=True)
        parts.append(f"NVMe {size} at {nvme_data_path(config)}")
    else:
        parts.append("no NVMe tier")
    parts.append(f"I/O {io_backend}")
    if config.pool.url:
        parts.append(f"pool {pool_address(config.pool)} group {config.pool.group_id}")
    if config.remote.listen:
        kind = "TLS" if config.remote.cert_file else "plaintext"
        parts.append(f"other hosts on {config.remote.listen} ({kind})")
    if config.daemon.metrics_port:
        parts.append(f"metrics {config.daemon.metrics_address}:{config.daemon.metrics_port}")
    head = f"kvtierd {__version__} ready on {config.socket_path}"
    return f"{head} ({source}): " + "; ".join(parts) if source else f"{head}: " + "; ".join(parts)
