"""The index snapshot's format: the cold index's columns and the segment geometry, checked.

Pure (bytes in, bytes out). Format 2 is the columns themselves, so a restart at millions of
blocks is one read and a few passes of numpy, never a Python object per block::

    magic "KVTI", version (u16), reserved (u16), length of the head (u64)
    head (msgpack): file id, file bytes, segments [(start, slot bytes, slot count)], namespace
        digests, the data file's mtime, rows, the xxh3-64 of each column's bytes, and the
        checkpoint's generation (format 3; nil for a snapshot at a clean stop)
    xxh3-64 of every byte before it (u64)
    each column of :data:`~kvtierd.store.coldindex.COLUMNS` in order, little-endian

Format 3 adds to the head the generation of a checkpoint (the snapshot written while serving,
:mod:`kvtierd.store.checkpoint`). Format 2 (without it) and format 1 (a msgpack array with a
tuple per record) are still read, and written no more.

A snapshot that decodes is not yet trusted: :func:`problem` says what makes it impossible for
the data file (the checks docs/architecture.md's "Crash safety" lists), all vectorised.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash

from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.store.coldindex import COLUMNS, identity_hashes, impossible_lengths, repeated
from kvtierd.store.records import PAGE_BYTES, RecordHeader

__all__ = ["Snapshot", "SnapshotV1", "decode", "encode", "encode_parts", "largest", "problem"]

_MAGIC = b"KVTI"
_VERSION = 3
#: Format 2 is format 3 without the checkpoint's generation.
_READ_VERSIONS = (2, 3)
_FRAME = struct.Struct("<4sH2xQ")
_CHECK = struct.Struct("<Q")
_KNOWN_FLAGS = RecordHeader.FLAG_ZSTD
_LIMITS = {"stored": 1 << 32, "raw": 1 << 32, "segment": 1 << 32, "index": 1 << 32}
_U64 = 1 << 64
#: More than any head can take beside its segments: the file id, 65,536 namespace digests
#: (``ns`` is a u16) and the columns' checksums, msgpack-framed.
_HEAD_BYTES = 2 << 20
#: A segment in the head (three msgpack integers of up to 9 bytes, and the array's byte).
_SEGMENT_BYTES = 32


class SnapshotV1(msgspec.Struct, array_like=True):
    """Format 1, as versions before issue 32's index reshape wrote it."""

    file_id: bytes
    file_bytes: int
    segments: list[tuple[int, int, int]]  # start, slot bytes, slot count
    records: list[tuple[int, int, bytes, bytes, int, int, int, int, int]]
    # segment, index, ns digest, key, stored, raw, checksum, seq, flags
    data_mtime_ns: int | None = None


class _Head(msgspec.Struct, array_like=True):
    file_id: bytes
    file_bytes: int
    segments: list[tuple[int, int, int]]
    digests: list[bytes]
    data_mtime_ns: int | None
    rows: int
    checksums: list[int]
    generation: int | None = None  # format 3


@dataclass
class Snapshot:
    """A snapshot decoded: ``columns`` as :meth:`~kvtierd.store.coldindex.ColdIndex.columns`
    gives them, their ``ns`` numbering ``digests``."""

    file_id: bytes
    file_bytes: int
    segments: list[tuple[int, int, int]]
    digests: list[bytes]
    columns: dict[str, npt.NDArray[Any]]
    #: The data file's mtime when it was written (``None``: a block device, or an old snapshot).
    data_mtime_ns: int | None = None
    #: A checkpoint's generation (:mod:`kvtierd.store.changes`); ``None``: not a checkpoint.
    generation: int | None = None


class CorruptSnapshot(ValueError):
    """The bytes are not a snapshot."""


def encode(snap: Snapshot) -> bytes:
    return b"".join(encode_parts(snap))


def encode_parts(snap: Snapshot) -> list[bytes | memoryview]:
    """:func:`encode`'s bytes in pieces, the columns as views of their arrays: what a writer
    of a large snapshot writes one after the other, without joining them into one more copy
    of the index."""
    return encode_pieces(snap, [snap.columns])


def encode_pieces(
    snap: Snapshot, pieces: Sequence[Mapping[str, npt.NDArray[Any]]]
) -> list[bytes | memoryview]:
    """:func:`encode_parts` of ``snap`` with its rows given as ``pieces`` (each a set of
    columns, rows one after the other; ``snap.columns`` is not read): an index copied a slice
    at a time is written with no copy joining the slices. Each column's checksum is hashed
    across its pieces, as of the column whole."""
    parts: list[bytes | memoryview] = []
    checksums = []
    for name, d, _ in COLUMNS:
        hashed = xxhash.xxh3_64()
        for piece in pieces:
            part = np.ascontiguousarray(piece[name], dtype=d).reshape(-1).view(np.uint8).data
            hashed.update(part)
            parts.append(part)
        checksums.append(hashed.intdigest())
    head = msgspec.msgpack.encode(
        _Head(
            snap.file_id,
            snap.file_bytes,
            snap.segments,
            snap.digests,
            snap.data_mtime_ns,
            sum(len(piece["klen"]) for piece in pieces),
            checksums,
            snap.generation,
        )
    )
    framed = _FRAME.pack(_MAGIC, _VERSION, len(head)) + head
    return [framed, _CHECK.pack(xxhash.xxh3_64_intdigest(framed)), *parts]


def largest(file_bytes: int) -> int:
    """The most bytes a snapshot of a data file of ``file_bytes`` can take (any format): a row
    per slot, and no slot takes less than two pages. Read no more: a snapshot file grown past
    it (a sparse terabyte, say) must cost a scan, never an allocation the size of the file."""
    slots = max(file_bytes, 0) // (2 * PAGE_BYTES)
    row = sum(np.dtype(dtype).itemsize * width for _, dtype, width in COLUMNS)
    # format 1 spends more a row than format 2's columns (msgpack, a digest per record): 3x
    return _HEAD_BYTES + slots * (3 * row + _SEGMENT_BYTES)


def decode(raw: bytes) -> Snapshot:
    """The snapshot in ``raw`` (either format); raises :class:`CorruptSnapshot`."""
    if raw[:4] != _MAGIC:
        try:
            return _from_v1(msgspec.msgpack.decode(raw, type=SnapshotV1))
        except msgspec.DecodeError as exc:
            raise CorruptSnapshot(str(exc)) from exc
    if len(raw) < _FRAME.size:
        raise CorruptSnapshot("short snapshot")
    _, version, head_bytes = _FRAME.unpack_from(raw)
    end = _FRAME.size + head_bytes
    if version not in _READ_VERSIONS or len(raw) < end + _CHECK.size:
        raise CorruptSnapshot(f"format version {version}, or short")
    (check,) = _CHECK.unpack_from(raw, end)
    if xxhash.xxh3_64_intdigest(raw[:end]) != check:
        raise CorruptSnapshot("head checksum mismatch")
    try:
        head = msgspec.msgpack.decode(raw[_FRAME.size : end], type=_Head)
    except msgspec.DecodeError as exc:
        raise CorruptSnapshot(str(exc)) from exc
    if len(head.checksums) != len(COLUMNS):
        raise CorruptSnapshot("the head lists another number of columns")
    columns: dict[str, npt.NDArray[Any]] = {}
    at = end + _CHECK.size
    view = memoryview(raw)
    for (name, dtype, width), expected in zip(COLUMNS, head.checksums, strict=True):
        length = head.rows * width * np.dtype(dtype).itemsize
        part = view[at : at + length]
        if len(part) != length or xxhash.xxh3_64_intdigest(part) != expected:
            raise CorruptSnapshot(f"column {name} is short or fails its checksum")
        column = np.frombuffer(part, dtype=np.dtype(dtype).newbyteorder("<"))
        columns[name] = column.reshape(head.rows, width) if width > 1 else column
        at += length
    if at != len(raw):
        raise CorruptSnapshot("bytes after the last column")
    if head.generation is not None and not 0 <= head.generation < _U64:
        raise CorruptSnapshot("an impossible generation")
    return Snapshot(
        head.file_id,
        head.file_bytes,
        head.segments,
        head.digests,
        columns,
        head.data_mtime_ns,
        head.generation,
    )


def _from_v1(old: SnapshotV1) -> Snapshot:
    numbers: dict[bytes, int] = {}
    values: dict[str, list[Any]] = {name: [] for name, _, _ in COLUMNS}
    for segment, index, digest, key, stored, raw, checksum, seq, flags in old.records:
        fields = {"stored": stored, "raw": raw, "segment": segment, "index": index}
        if not 0 < len(key) <= MAX_KEY_BYTES or len(digest) != 16:
            raise CorruptSnapshot("a record's key or namespace digest is impossible")
        if any(not 0 <= v < _LIMITS[k] for k, v in fields.items()) or not 0 <= flags < 256:
            raise CorruptSnapshot(f"the record in slot {index} of segment {segment} is impossible")
        if not (0 <= checksum < _U64 and 0 <= seq < _U64):
            raise CorruptSnapshot(f"the record in slot {index} of segment {segment} is impossible")
        for name, value in fields.items():
            values[name].append(value)
        values["key"].append(np.frombuffer(key.ljust(MAX_KEY_BYTES, b"\0"), "<u8"))
        values["klen"].append(len(key))
        values["ns"].append(numbers.setdefault(digest, len(numbers)))
        values["flags"].append(flags)
        values["checksum"].append(checksum)
        values["seq"].append(seq)
    columns = {
        name: np.array(values[name], dtype=dtype).reshape(-1, width)
        if width > 1
        else np.array(values[name], dtype=dtype)
        for name, dtype, width in COLUMNS
    }
    return Snapshot(
        old.file_id, old.file_bytes, old.segments, list(numbers), columns, old.data_mtime_ns
    )


def problem(snap: Snapshot, file_bytes: int) -> str | None:
    """What makes ``snap`` impossible for a data file of ``file_bytes``, or ``None``: segments
    not following each other inside the file, or of an impossible geometry; a record in a slot
    that does not exist or that it does not fit; a slot, or a key with one seq, listed twice; an
    impossible key, namespace or flag; lengths no write made
    (:func:`~kvtierd.store.coldindex.impossible_lengths`)."""
    tail = PAGE_BYTES
    for number, (start, slot_bytes, count) in enumerate(snap.segments):
        if start != tail:
            return f"segment {number} starts at {start}, not where segment {number - 1} ends"
        if slot_bytes < 2 * PAGE_BYTES or slot_bytes % PAGE_BYTES or count < 1:
            return f"segment {number} has an impossible geometry"
        tail = start + PAGE_BYTES + slot_bytes * count
        if tail > file_bytes:
            return f"segment {number} ends at {tail}, past the end of the file at {file_bytes}"
    c = snap.columns
    rows = len(c["klen"])
    if any(len(c[name]) != rows for name, _, _ in COLUMNS):
        return "its columns differ in length"
    if not rows:
        return None
    if len(set(snap.digests)) != len(snap.digests) or any(len(d) != 16 for d in snap.digests):
        return "its namespace digests are impossible"
    segment, index = c["segment"].astype(np.int64), c["index"].astype(np.int64)
    if int(segment.max()) >= len(snap.segments):
        return f"a record names segment {int(segment.max())} of {len(snap.segments)}"
    geometry = np.array([(s, n) for _, s, n in snap.segments], dtype=np.int64).reshape(-1, 2)
    slot_bytes, counts = geometry[segment, 0], geometry[segment, 1]
    past = np.flatnonzero(index >= counts)
    if len(past):
        i = int(past[0])
        return f"a record names slot {index[i]} of the {counts[i]} of segment {segment[i]}"
    if repeated((segment << 32 | index).astype(np.uint64)).any():
        return "a slot is listed twice"
    klen = c["klen"].astype(np.int64)
    if klen.min() < 1 or klen.max() > MAX_KEY_BYTES or int(c["ns"].max()) >= len(snap.digests):
        return "a record's key or namespace is impossible"
    if (c["flags"] & ~np.uint8(_KNOWN_FLAGS)).any():
        return "a record has flags this version does not know"
    beyond = np.arange(MAX_KEY_BYTES) >= klen[:, None]
    if (c["key"].view(np.uint8).reshape(rows, MAX_KEY_BYTES)[beyond]).any():
        return "a record's key has bytes past its length"
    stored = c["stored"].astype(np.int64)
    pages = PAGE_BYTES + (stored + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES
    if (pages > slot_bytes).any():
        return "a record does not fit its slot"
    if impossible_lengths(c["stored"], c["raw"], c["flags"]).any():
        return "a record has lengths no write made"
    # Only rows whose (key, seq) hash repeats can repeat: compare those exactly.
    hashes = identity_hashes(c["key"], c["klen"], c["ns"], 0) ^ c["seq"].astype(np.uint64)
    suspects = np.flatnonzero(repeated(hashes))
    if len(suspects):
        mine = {name: column[suspects] for name, column in c.items()}
        versions = {(r[0], r[1], r[2].tobytes(), r[3]) for r in _identities(mine)}
        if len(versions) != len(suspects):
            return "a key is listed twice with one sequence number"
    return None


def _identities(c: dict[str, npt.NDArray[Any]]) -> list[tuple[int, int, Any, int]]:
    """``(namespace, key length, key words, seq)`` of each row of ``c``."""
    return list(zip(c["ns"].tolist(), c["klen"].tolist(), c["key"], c["seq"].tolist(), strict=True))
