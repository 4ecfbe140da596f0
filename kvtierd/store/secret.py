"""The daemon's key secret: 32 random bytes that key every tenant's salt.

Made once, at the first start, in the data directory (mode 0600, written durably before it is
used), and read at every later start. Block keys are derived from the salt, so the secret must
outlive the blocks: a lost secret makes every stored block unreachable (they are then evicted
like any unused block), and hosts that share a pool must share the file for their keys to meet.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from kvtierd.errors import ConfigError, NoSpaceError, StorageIOError
from kvtierd.store.durable import fsync_directory

__all__ = ["SECRET_BYTES", "load_secret"]

SECRET_BYTES = 32


def load_secret(path: Path) -> bytes:
    """The secret in ``path``, made first if the file does not exist (runs in a worker thread).
    Raises :class:`ConfigError` for a file others may read or of the wrong size,
    :class:`NoSpaceError` when a new one cannot be written for lack of space."""
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    secret = os.urandom(SECRET_BYTES)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A name of its own (mode 0600): hosts that share the file may make it at the same moment,
        # and one's clean-up must not remove the other's half before it is linked.
        fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secret)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a secret another process made meanwhile
        except FileExistsError:
            return _read(path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_directory(path.parent)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        if exc.errno in (28, 122):  # ENOSPC, EDQUOT
            raise NoSpaceError(f"cannot write the key secret {path}: no space left") from exc
        raise StorageIOError(f"cannot write the key secret {path}: {exc.strerror}") from exc
    return secret


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"the key secret {path} is readable by others (mode {info.st_mode & 0o777:o}): "
                "chmod 600 it, since it decides every tenant's keys"
            )
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise ConfigError(
            f"the key secret {path} holds {len(data)} bytes, not {SECRET_BYTES}: restore it "
            "from a backup (or remove it, which makes every stored block unreachable)"
        )
    return data
