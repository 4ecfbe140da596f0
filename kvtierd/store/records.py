"""The on-disk format of the NVMe tier: superblock, segment headers and record headers.

Layout of a data file (all integers little-endian, every structure in its own 4 KiB page so
that ``O_DIRECT`` I/O stays aligned)::

    [superblock][segment 0][segment 1] ...           carved in order, never moved
    segment  = [segment header][slot 0] ... [slot n-1]   all slots of one size
    slot     = [record header][payload, padded to 4 KiB]

Every structure starts with a magic and a format version and ends with an xxh3-64 checksum of
the bytes before it, so recovery can tell an intact header from zeroes, garbage or a torn write.
A record header also holds the xxh3-64 of the block's bytes: a payload that does not match is
a torn or corrupt block and is treated as a miss, never served. ``seq`` grows with every write,
so when two records claim one key the newer wins.

Crash reasoning: a segment header is written and made durable before any slot in the segment is
used, so a scan can always step from segment to segment. A block is written as one vectored
write (header and payload); whatever subset of its sectors reached the disk, the two checksums
decide whether it is whole. Nothing else is needed for correctness; the index snapshot is only a
shortcut for recovery after a clean shutdown.

Damage reasoning: a segment header damaged later (a flipped bit) is still recognisable as one
(:func:`damaged_segment_header`), so recovery can tell it from the never-carved tail of the file
and rebuild it rather than stop there.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import xxhash

from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.store.copyhash import checksums_each

__all__ = [
    "FORMAT_VERSION",
    "PAGE_BYTES",
    "CorruptRecord",
    "RecordHeader",
    "SegmentHeader",
    "Superblock",
    "checksum",
    "damaged_segment_header",
    "record_headers",
]

FORMAT_VERSION = 1
PAGE_BYTES = 4096

_SUPER = struct.Struct("<4sH2x16sQQ")  # magic, version, file id, file bytes, created (ns)
_SEGMENT = struct.Struct("<4sH2x16sQQI4x")  # magic, version, file id, start, slot bytes, count
_RECORD = struct.Struct("<4sHH16sB32s3xIIQQ")
# record: magic, version, flags, namespace digest, key length, key, stored length, raw length,
#         payload checksum (of the raw bytes), seq
_CHECK = struct.Struct("<Q")


class CorruptRecord(ValueError):
    """The bytes are not an intact structure of the expected kind."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data`` (the checksum used everywhere a block crosses a tier)."""
    return xxhash.xxh3_64_intdigest(data)


def _seal(body: bytes) -> bytes:
    return _page(_sealed(body))


def _sealed(body: bytes) -> bytes:
    """``body`` and its checksum: what :func:`_open` reads of a page (never the padding)."""
    return body + _CHECK.pack(checksum(body))


def _page(sealed: bytes) -> bytes:
    """``sealed`` padded with zeros to a page, as written."""
    return sealed + bytes(PAGE_BYTES - len(sealed))


def _open(
    data: bytes | bytearray | memoryview, layout: struct.Struct, magic: bytes
) -> tuple[Any, ...]:
    if len(data) < layout.size + _CHECK.size:
        raise CorruptRecord("short header")
    body = bytes(data[: layout.size])
    (stored,) = _CHECK.unpack_from(data, layout.size)
    if body[:4] != magic:
        raise CorruptRecord("no magic")
    if checksum(body) != stored:
        raise CorruptRecord("header checksum mismatch")
    fields = layout.unpack(body)
    if fields[1] != FORMAT_VERSION:
        raise CorruptRecord(f"format version {fields[1]}, expected {FORMAT_VERSION}")
    return fields


@dataclass(frozen=True, slots=True)
class Superblock:
    file_id: bytes
    file_bytes: int
    created_ns: int
    MAGIC: ClassVar[bytes] = b"KVTF"

    def pack(self) -> bytes:
        return _seal(
            _SUPER.pack(self.MAGIC, FORMAT_VERSION, self.file_id, self.file_bytes, self.created_ns)
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Superblock:
        _, _, file_id, file_bytes, created = _open(data, _SUPER, cls.MAGIC)
        return cls(file_id, file_bytes, created)


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    file_id: bytes
    start: int
    slot_bytes: int
    slot_count: int
    MAGIC: ClassVar[bytes] = b"KVTS"

    @property
    def end(self) -> int:
        return self.start + PAGE_BYTES + self.slot_bytes * self.slot_count

    def slot_offset(self, index: int) -> int:
        return self.start + PAGE_BYTES + index * self.slot_bytes

    def pack(self) -> bytes:
        return _seal(
            _SEGMENT.pack(
                self.MAGIC,
                FORMAT_VERSION,
                self.file_id,
                self.start,
                self.slot_bytes,
                self.slot_count,
            )
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> SegmentHeader:
        _, _, file_id, start, slot_bytes, count = _open(data, _SEGMENT, cls.MAGIC)
        if slot_bytes < 2 * PAGE_BYTES or slot_bytes % PAGE_BYTES or count < 1:
            raise CorruptRecord("impossible segment geometry")
        return cls(file_id, start, slot_bytes, count)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The header page in front of every stored block."""

    ns_digest: bytes
    key: bytes
    stored_bytes: int
    raw_bytes: int
    payload_checksum: int
    seq: int
    flags: int = 0
    MAGIC: ClassVar[bytes] = b"KVTB"
    FLAG_ZSTD: ClassVar[int] = 1

    def pack(self) -> bytes:
        """The header page as written: :meth:`sealed`, padded to a page."""
        return _page(self.sealed())

    def sealed(self) -> bytes:
        """The header's fields and their checksum, without the page's padding: all that
        :meth:`unpack` reads of a page, so a page that starts with these bytes unpacks to this
        header."""
        if not 0 < len(self.key) <= MAX_KEY_BYTES or len(self.ns_digest) != 16:
            raise ValueError("bad key or namespace digest")
        return _sealed(
            _RECORD.pack(
                self.MAGIC,
                FORMAT_VERSION,
                self.flags,
                self.ns_digest,
                len(self.key),
                self.key,
                self.stored_bytes,
                self.raw_bytes,
                self.payload_checksum,
                self.seq,
            )
        )

    @classmethod
    def known(
        cls,
        ns_digest: bytes,
        key: bytes,
        stored_bytes: int,
        raw_bytes: int,
        payload_checksum: int,
        seq: int,
        flags: int,
    ) -> RecordHeader:
        """A header of fields already checked (the cold index's rows), made without the
        frozen dataclass's ``__init__``, whose ``object.__setattr__`` per field costs twice as
        much: the NVMe tier makes one on every READ's path."""
        header = object.__new__(cls)
        put = _HEADER_SETTERS
        put[0](header, ns_digest)
        put[1](header, key)
        put[2](header, stored_bytes)
        put[3](header, raw_bytes)
        put[4](header, payload_checksum)
        put[5](header, seq)
        put[6](header, flags)
        return header

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> RecordHeader:
        fields = _open(data, _RECORD, cls.MAGIC)
        _, _, flags, digest, key_len, key, stored, raw, payload_checksum, seq = fields
        if not 0 < key_len <= MAX_KEY_BYTES:
            raise CorruptRecord("bad key length")
        return cls(digest, key[:key_len], stored, raw, payload_checksum, seq, flags)


_HEADER_SETTERS = tuple(
    getattr(RecordHeader, name).__set__
    for name in (
        "ns_digest",
        "key",
        "stored_bytes",
        "raw_bytes",
        "payload_checksum",
        "seq",
        "flags",
    )
)

#: A sealed segment header page is zero from here on (its fields, then its checksum).
_SEGMENT_SEALED_BYTES = _SEGMENT.size + _CHECK.size
#: At most this many bits of the file id may differ in a header taken for a damaged one of ours.
_FILE_ID_BITS_OFF = 8


def damaged_segment_header(data: bytes | bytearray | memoryview, file_id: bytes) -> bool:
    """Whether ``data`` (a page that is not an intact segment header of ``file_id``) is one with
    a few bits wrong: shaped like a sealed segment header (nothing but zeroes after its fields
    and checksum, a few stray bytes allowed), not all zeroes, and naming ``file_id`` but for a
    few bits. Zeroes (the never-carved tail), payload bytes, record headers (whose fields run
    past a segment header's) and another file's segment headers are not."""
    page = bytes(data[:PAGE_BYTES])
    if len(page) < PAGE_BYTES or not any(page[:_SEGMENT_SEALED_BYTES]):
        return False
    stray = PAGE_BYTES - _SEGMENT_SEALED_BYTES - page.count(0, _SEGMENT_SEALED_BYTES)
    if stray > 2:
        return False
    named = int.from_bytes(page[8:24], "little") ^ int.from_bytes(file_id, "little")
    return named.bit_count() <= _FILE_ID_BITS_OFF


_RECORD_MAGIC = int.from_bytes(b"KVTB", "little")
#: The fields of :data:`_RECORD` (and the checksum after it) at their offsets.
_RECORD_FIELDS = {
    "magic": ("<u4", 0),
    "version": ("<u2", 4),
    "flags": ("<u2", 6),
    "digest": ("V16", 8),
    "klen": ("u1", 24),
    "key": (("<u8", (4,)), 25),
    "stored": ("<u4", 60),
    "raw": ("<u4", 64),
    "checksum": ("<u8", 68),
    "seq": ("<u8", 76),
    "check": ("<u8", _RECORD.size),
}


def record_headers(
    buffer: bytes | bytearray | memoryview, stride: int, count: int, slot_bytes: int
) -> tuple[npt.NDArray[np.intp], dict[str, npt.NDArray[Any]]]:
    """The intact record headers among ``count`` pages ``stride`` bytes apart in ``buffer``
    that fit a slot of ``slot_bytes``: their positions (0 to ``count - 1``) and their fields
    (columns: ``digest`` (16-byte voids), ``klen``, ``key`` as four u64 words, zero past the key,
    ``flags``, ``stored``, ``raw``, ``checksum``, ``seq``). What :meth:`RecordHeader.unpack`
    accepts, parsed with numpy; the header checksums, of the pages that start with the magic,
    in one call (:func:`~kvtierd.store.copyhash.checksums_each`: native once probed)."""
    names = list(_RECORD_FIELDS)
    layout = np.dtype(
        {
            "names": names,
            "formats": [_RECORD_FIELDS[n][0] for n in names],
            "offsets": [_RECORD_FIELDS[n][1] for n in names],
            "itemsize": _RECORD.size + _CHECK.size,
        }
    )
    view = memoryview(buffer)
    if count:
        span = view[: (count - 1) * stride + layout.itemsize]
        pages = np.ndarray((count,), layout, buffer=span, strides=(stride,))
    else:
        pages = np.zeros(0, layout)
    keep = (pages["magic"] == _RECORD_MAGIC) & (pages["version"] == FORMAT_VERSION)
    keep &= (pages["klen"] >= 1) & (pages["klen"] <= MAX_KEY_BYTES)
    padded = PAGE_BYTES + (pages["stored"].astype(np.int64) + PAGE_BYTES - 1) // PAGE_BYTES * (
        PAGE_BYTES
    )
    keep &= padded <= slot_bytes
    candidates = np.flatnonzero(keep)
    if len(candidates):
        sums = checksums_each(view, candidates * stride, _RECORD.size)
        keep[candidates] = sums == pages["check"][candidates]
    found = np.flatnonzero(keep)
    fields = {
        name: np.ascontiguousarray(pages[name][found])
        for name in ("digest", "klen", "key", "flags", "stored", "raw", "checksum", "seq")
    }
    as_bytes = fields["key"].view(np.uint8).reshape(len(found), MAX_KEY_BYTES)
    as_bytes[np.arange(MAX_KEY_BYTES) >= fields["klen"][:, None].astype(np.int64)] = 0
    return found, fields
