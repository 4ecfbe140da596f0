"""Small files written so that a crash leaves the old or the new contents, never a mix.

The daemon's metadata beside the data file (the namespace catalog, the index snapshot, the key
secret) is written to a temporary name, fsynced, renamed over the old file, and the directory
fsynced, so the rename itself survives a power loss. A write that fails (a full disk) leaves no
temporary file behind.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["fsync_directory", "replace_durably"]


def replace_durably(path: Path, data: bytes | Sequence[bytes | memoryview]) -> None:
    """Make ``data`` (or its pieces, one after the other) the contents of ``path``, durably;
    raises ``OSError`` (leaving ``path`` as it was and no temporary file) when it cannot."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as out:
            for piece in [data] if isinstance(data, bytes) else data:
                out.write(piece)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not keep a half-written file
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make the names in ``directory`` (a rename, a new link, an unlink) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
