"""The namespace catalog on disk: checksummed, kept as two copies, each replaced atomically.

Theory of operation. A copy is one small file::

    magic "KVTC", format version (u16), reserved (u16), payload length (u64), payload,
    xxh3-64 of every byte before it (u64)                      all integers little-endian

A copy is replaced the POSIX way: the new bytes go to a temporary file, which is fsynced,
renamed over the copy, and the directory fsynced. After a crash at any point each copy is
therefore its old content or its new content, whole (rename is atomic, and nothing is renamed
before its bytes are durable). The second copy is replaced only once the first is durable, so at
every moment at least one copy is intact and holds every namespace whose save returned. A copy
whose checksum fails (a flipped bit, a torn sector) is ignored and the other one serves.

Reading takes every copy whose checksum holds. What a copy lists can only be older than the
other copy, never contradict it (a namespace spec identifies itself: its digest is computed from
it), so the union of the copies is always safe.

Files from before this format (a bare msgpack list of specs, no checksum) are read as legacy
copies and rewritten in this format at the next save.

This module knows bytes and files, not namespaces: the payload is the caller's.
"""

from __future__ import annotations

import enum
import errno
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvtierd.errors import NoSpaceError, StorageIOError
from kvtierd.store.durable import replace_durably

__all__ = [
    "CATALOG_VERSION",
    "CatalogCopy",
    "CopyState",
    "CorruptCatalog",
    "copy_paths",
    "decode",
    "encode",
    "read_copies",
    "write_copies",
]

CATALOG_VERSION = 1
_MAGIC = b"KVTC"
_HEAD = struct.Struct("<4sHHQ")  # magic, version, reserved, payload length
_CHECK = struct.Struct("<Q")
#: First bytes of a msgpack array (fixarray, array 16, array 32): what a legacy file starts with.
_LEGACY_FIRST_BYTES = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


class CorruptCatalog(ValueError):
    """The bytes are not an intact catalog copy."""


class CopyState(enum.Enum):
    INTACT = "intact"
    #: The old format: no checksum, so the caller's decoding is the only check.
    LEGACY = "legacy"
    DAMAGED = "damaged"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class CatalogCopy:
    """One copy as read: its payload (when ``INTACT`` or ``LEGACY``) or why it is unusable."""

    path: Path
    state: CopyState
    payload: bytes = b""
    problem: str = ""


def copy_paths(path: Path) -> tuple[Path, Path]:
    """The two copies of the catalog named ``path``: ``path`` itself, then ``path.1``."""
    return path, path.with_name(path.name + ".1")


def encode(payload: bytes) -> bytes:
    """One copy's bytes for ``payload``."""
    body = _HEAD.pack(_MAGIC, CATALOG_VERSION, 0, len(payload)) + payload
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def decode(data: bytes) -> bytes:
    """The payload of an intact copy; raises :class:`CorruptCatalog` otherwise."""
    if len(data) < _HEAD.size + _CHECK.size:
        raise CorruptCatalog(f"{len(data)} bytes is too short for a catalog")
    magic, version, _, length = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise CorruptCatalog("no catalog magic")
    if len(data) != _HEAD.size + length + _CHECK.size:
        raise CorruptCatalog(f"{len(data)} bytes, but the header announces a {length}-byte payload")
    (stored,) = _CHECK.unpack_from(data, len(data) - _CHECK.size)
    if xxhash.xxh3_64_intdigest(data[: -_CHECK.size]) != stored:
        raise CorruptCatalog("checksum mismatch")
    if version != CATALOG_VERSION:
        raise CorruptCatalog(f"format version {version}, expected {CATALOG_VERSION}")
    return data[_HEAD.size : -_CHECK.size]


def read_copies(path: Path) -> list[CatalogCopy]:
    """Read both copies of the catalog ``path``; never raises for a missing or damaged one."""
    return [_read_copy(copy) for copy in copy_paths(path)]


def _read_copy(path: Path) -> CatalogCopy:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return CatalogCopy(path, CopyState.MISSING)
    except OSError as exc:
        return CatalogCopy(path, CopyState.DAMAGED, problem=f"unreadable: {exc.strerror}")
    if data[:1] and data[0] in _LEGACY_FIRST_BYTES:
        return CatalogCopy(path, CopyState.LEGACY, data)
    try:
        return CatalogCopy(path, CopyState.INTACT, decode(data))
    except CorruptCatalog as exc:
        return CatalogCopy(path, CopyState.DAMAGED, problem=str(exc))


def write_copies(path: Path, payload: bytes) -> None:
    """Replace both copies with ``payload``, the second only after the first is durable.

    Returns once both are durable. Raises :class:`NoSpaceError` when the file system is full
    (``ENOSPC``, ``EDQUOT``), :class:`StorageIOError` for any other failure; each copy then holds
    its old or its new content, whole, and no temporary file is left behind.
    """
    data = encode(payload)
    for copy in copy_paths(path):
        try:
            replace_durably(copy, data)
        except OSError as exc:
            reason = f"cannot save the namespace catalog {copy}: {exc.strerror or exc}"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpaceError(f"{reason} (the file system is full)") from exc
            raise StorageIOError(reason) from exc
