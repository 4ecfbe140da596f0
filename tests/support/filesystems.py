"""Small real file systems for the full-disk tests: a tmpfs of a given size, and filling one."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["fill", "small_file_system"]


@contextlib.contextmanager
def small_file_system(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (skips the test where mounting is refused)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Write ``path`` until its file system is full."""
    with open(path, "wb", buffering=0) as out:
        try:
            while True:
                out.write(bytes(64 << 10))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
