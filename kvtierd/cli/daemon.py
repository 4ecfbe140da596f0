"""``kvtierd``: run the daemon in the foreground (systemd's ``Type=notify`` service).

Flags override the configuration file, which overrides the embedded defaults. Exit status:
0 after a clean stop, 2 for an invalid configuration or command line, 1 when the daemon cannot
start (no memory for the arena, no room for the data file, socket in use).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import anyio

from kvtierd import __version__
from kvtierd.config import Config, Runtime, load_config
from kvtierd.errors import ConfigError, KvtierError
from kvtierd.server.daemon import serve_daemon

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtierd", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--socket", help="Unix socket path (daemon.socket)")
    parser.add_argument("--data-dir", help="state directory (daemon.data_dir)")
    parser.add_argument("--dram-size", help="arena size, e.g. 512M or 4G (dram.size)")
    parser.add_argument("--nvme-size", help="NVMe tier size, 0 disables it (nvme.size)")
    parser.add_argument("--runtime", choices=[r.value for r in Runtime], help="event loop")
    parser.add_argument("--log-level", help="debug, info, warning or error")
    parser.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    overrides: dict[str, dict[str, Any]] = {}
    pairs = {
        ("daemon", "socket"): args.socket,
        ("daemon", "data_dir"): args.data_dir,
        ("daemon", "runtime"): args.runtime,
        ("daemon", "log_level"): args.log_level,
        ("dram", "size"): args.dram_size,
        ("nvme", "size"): args.nvme_size,
    }
    for (section, field), value in pairs.items():
        if value is not None:
            overrides.setdefault(section, {})[field] = value
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"kvtierd: {exc}", file=sys.stderr)
        return 2
    # journald stamps every line itself; elsewhere the time is part of the line.
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(
        level=config.daemon.log_level.upper(),
        format=stamp + "%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    backend = config.daemon.runtime.value
    options = {"use_uvloop": True} if backend == "asyncio" and _have_uvloop() else {}
    try:
        anyio.run(serve_daemon, config, backend=backend, backend_options=options)
    except BaseExceptionGroup as group:
        return _report(_first_leaf(group))
    except (KvtierError, OSError) as exc:
        return _report(exc)
    return 0


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _report(exc: BaseException) -> int:
    """Print a start-up failure as one line; re-raise what is not an expected failure."""
    if isinstance(exc, ConfigError):
        print(f"kvtierd: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, KvtierError | OSError):
        print(f"kvtierd: cannot run: {exc}", file=sys.stderr)
        return 1
    raise exc


def _have_uvloop() -> bool:
    return importlib.util.find_spec("uvloop") is not None


if __name__ == "__main__":
    sys.exit(main())
