"""What the pool stores, byte for byte, and the names it stores it under. Pure: no I/O.

A block is one value::

    header (56 bytes, little-endian)
        magic "KVTP", format version u16, flags u16 (bit 0: zstd; others must be 0)
        raw length u64, stored length u64, xxh3-64 of the raw bytes u64, seq u64
        xxh3-64 of the namespace digest + key u64 (what the value claims to be)
        xxh3-64 of the 48 bytes above
    payload (stored length bytes: the raw block, or its zstd frame)

A value that is short, has another magic or version, claims another block, or whose payload
does not hash to the checksum is a miss (:class:`CorruptValue`), never served.

Names (``P`` is ``pool.key_prefix``, ``g`` the group id)::

    P:b:<ns digest><key>        a block (binary key; spread over the cluster's slots)
    P:{g}:ns                    hash: namespace digest -> namespace spec (msgpack)
    P:{g}:m:<rank>              hash: ns digest + key -> manifest entry: blocks in the pool
    P:{g}:i:<rank>              hash: ns digest + key -> seq: committed, not yet in the pool
    P:{g}:...                   the group consensus (kvtierd.pool.group)

The group keys share the ``{g}`` hash tag, so a cluster keeps them in one slot.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgspec
import xxhash

from kvtierd.store.records import checksum
from kvtierd.store.tier import BlockRef

__all__ = [
    "HEADER_BYTES",
    "CorruptValue",
    "ManifestEntry",
    "PoolNames",
    "decode_header",
    "encode_header",
    "verify_payload",
]

_MAGIC = b"KVTP"
_VERSION = 1
_FLAG_ZSTD = 1
_HEADER = struct.Struct("<4sHHQQQQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _HEADER.size + _CHECK.size


class CorruptValue(ValueError):
    """A value in the pool is not an intact copy of the block asked for."""


class ManifestEntry(msgspec.Struct, array_like=True, frozen=True):
    """What a rank needs to index a block it finds only in the pool (after a disk wipe)."""

    raw_bytes: int
    checksum: int
    seq: int
    compress: bool


def _identity(ref: BlockRef) -> int:
    return xxhash.xxh3_64_intdigest(ref.ns_digest + ref.key)


def encode_header(ref: BlockRef, stored_bytes: int, compressed: bool) -> bytes:
    flags = _FLAG_ZSTD if compressed else 0
    header = _HEADER.pack(
        _MAGIC, _VERSION, flags, ref.raw_bytes, stored_bytes, ref.checksum, ref.seq, _identity(ref)
    )
    return header + _CHECK.pack(checksum(header))


def decode_header(ref: BlockRef, value: bytes | memoryview) -> tuple[bool, memoryview]:
    """Check ``value``'s header against ``ref``; ``(compressed, payload)``. The payload's own
    checksum is checked by :func:`verify_payload` once it is decompressed."""
    if len(value) < HEADER_BYTES:
        raise CorruptValue(f"value of {len(value)} bytes is shorter than a header")
    magic, version, flags, raw, stored, digest, _seq, identity = _HEADER.unpack_from(value)
    if magic != _MAGIC or version != _VERSION:
        raise CorruptValue(f"not a kvtierd block (magic {magic!r}, version {version})")
    (check,) = _CHECK.unpack_from(value, _HEADER.size)
    if check != checksum(memoryview(value)[: _HEADER.size]) or flags & ~_FLAG_ZSTD:
        raise CorruptValue("damaged header")
    if identity != _identity(ref):
        raise CorruptValue("value belongs to another block")
    if raw != ref.raw_bytes or digest != ref.checksum:
        raise CorruptValue("value is another version of the block")
    payload = memoryview(value)[HEADER_BYTES:]
    if len(payload) != stored:
        raise CorruptValue(f"payload is {len(payload)} bytes, header says {stored}")
    return bool(flags & _FLAG_ZSTD), payload


def verify_payload(ref: BlockRef, raw: bytes | memoryview) -> None:
    if len(raw) != ref.raw_bytes or checksum(raw) != ref.checksum:
        raise CorruptValue("payload checksum mismatch")


@dataclass(frozen=True, slots=True)
class PoolNames:
    """Key names for one daemon (its prefix, group and rank)."""

    prefix: str
    group: str
    rank: int

    def block(self, ns_digest: bytes, key: bytes) -> bytes:
        return f"{self.prefix}:b:".encode() + ns_digest + key

    def _group_key(self, suffix: str) -> bytes:
        return f"{self.prefix}:{{{self.group}}}:{suffix}".encode()

    @property
    def namespaces(self) -> bytes:
        return self._group_key("ns")

    def manifest(self, rank: int | None = None) -> bytes:
        return self._group_key(f"m:{self.rank if rank is None else rank}")

    def intents(self, rank: int | None = None) -> bytes:
        return self._group_key(f"i:{self.rank if rank is None else rank}")
