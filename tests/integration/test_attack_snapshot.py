"""An attacker's forgeries of the index snapshot (format 2), end to end with the real daemon.

Blocks are written and made durable, the daemon stops cleanly (so it writes its snapshot), the
snapshot is forged, and a restarted daemon must start, never crash or allocate without bound,
and serve every block with its own bytes or as a miss, never another's. A forgery that makes
the snapshot impossible for the data file (columns whose checksums are right but whose values
are not: a row past the file, two rows in one slot, a key twice with one seq, a length past
its slot, a namespace number with no digest, a head that claims rows by the trillion, a file
truncated or grown past any snapshot the data file could have) is discarded and the headers are
scanned: then every block is served. A forgery that stays possible (two rows that swap their
slots) is caught by the record header each read checks: a miss, never the other block.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import struct
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import xxhash

from kvtierd.client import connect
from kvtierd.errors import BlockNotFoundError
from kvtierd.store import snapshot as snapshots
from kvtierd.store.records import PAGE_BYTES, RecordHeader
from kvtierd.store.recovery import SNAPSHOT_NAME
from kvtierd.testing import DaemonProcess
from tests.support.attacks import unharmed

pytestmark = pytest.mark.timeout(180)

BLOCK_BYTES = 64 << 10
BLOCKS = 40
CONFIG = '[nvme]\nsegment_bytes = "1M"\n'


def block(i: int) -> bytes:
    return np.random.default_rng(1000 + i).integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes()


def key(i: int) -> bytes:
    return b"forged-%06d" % i + bytes(3)


def write_durably(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("forged", block_bytes=BLOCK_BYTES)
        for start in range(0, BLOCKS, 10):
            batch = range(start, start + 10)
            assert ns.put([key(i) for i in batch], [block(i) for i in batch]) == len(batch)
        client.fsync()


def served(
    daemon: DaemonProcess,
    name: str = "forged",
    block_bytes: int = BLOCK_BYTES,
    blocks: Callable[[int], bytes] | None = None,
    keys: Callable[[int], bytes] | None = None,
    count: int = BLOCKS,
) -> set[int]:
    """The blocks of namespace ``name`` the daemon serves; each one read must be its own
    bytes."""
    blocks, keys = blocks or block, keys or key
    found = set()
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=block_bytes, create=False)
        for i in range(count):
            try:
                with ns.get([keys(i)]) as (view,):
                    assert bytes(view) == blocks(i), f"block {i} served with other bytes"
            except BlockNotFoundError:
                continue
            found.add(i)
    return found


def _columns(change: Callable[[dict[str, np.ndarray]], None]) -> Callable[[Path], None]:
    def forge(path: Path) -> None:
        snap = snapshots.decode(path.read_bytes())
        snap.columns = {name: column.copy() for name, column in snap.columns.items()}
        change(snap.columns)
        path.write_bytes(snapshots.encode(snap))  # every checksum right

    return forge


def _two_rows_in_one_slot(c: dict[str, np.ndarray]) -> None:
    c["segment"][1], c["index"][1] = c["segment"][0], c["index"][0]


def _a_key_twice_with_one_seq(c: dict[str, np.ndarray]) -> None:
    for name in ("key", "klen", "ns", "seq"):
        c[name][1] = c[name][0]


def _past_the_file(c: dict[str, np.ndarray]) -> None:
    c["segment"][0] = 1 << 31


def _length_past_the_slot(c: dict[str, np.ndarray]) -> None:
    c["stored"][0] = c["raw"][0] = 1 << 31


def _stored_beyond_raw(c: dict[str, np.ndarray]) -> None:
    c["raw"][0] = c["stored"][0] - 1


def _namespace_without_digest(c: dict[str, np.ndarray]) -> None:
    c["ns"][0] = 7


def _empty_key(c: dict[str, np.ndarray]) -> None:
    c["klen"][0] = 0


def _key_bytes_past_its_length(c: dict[str, np.ndarray]) -> None:
    c["klen"][0] = 5  # its bytes from the sixth on are not zero


def _trillions_of_rows(path: Path) -> None:
    """The head (checksum right) claims 2**40 rows; the columns are what they were."""
    raw = path.read_bytes()
    frame = struct.Struct("<4sH2xQ")
    _, _, head_bytes = frame.unpack_from(raw)
    head = msgspec.msgpack.decode(raw[frame.size : frame.size + head_bytes])
    head[5] = 1 << 40
    encoded = msgspec.msgpack.encode(head)
    framed = frame.pack(b"KVTI", 2, len(encoded)) + encoded
    columns = raw[frame.size + head_bytes + 8 :]
    path.write_bytes(framed + struct.pack("<Q", xxhash.xxh3_64_intdigest(framed)) + columns)


def _truncated(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) * 2 // 3])


def _a_terabyte_sparse(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(1 << 40)


FORGERIES: dict[str, Callable[[Path], None]] = {
    "two rows in one slot": _columns(_two_rows_in_one_slot),
    "a key twice with one seq": _columns(_a_key_twice_with_one_seq),
    "a row past the file": _columns(_past_the_file),
    "a length past the slot": _columns(_length_past_the_slot),
    "stored beyond raw": _columns(_stored_beyond_raw),
    "a namespace number with no digest": _columns(_namespace_without_digest),
    "an empty key": _columns(_empty_key),
    "key bytes past its length": _columns(_key_bytes_past_its_length),
    "trillions of rows": _trillions_of_rows,
    "truncated": _truncated,
    "a terabyte, sparse": _a_terabyte_sparse,
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_an_impossible_snapshot_is_scanned_past_and_every_block_served(
    tmp_path: Path, forgery: str
) -> None:
    daemon = DaemonProcess(tmp_path / "kvtierd", config_text=CONFIG)
    with daemon:
        write_durably(daemon)
    snapshot = daemon.data_dir / SNAPSHOT_NAME
    assert snapshot.exists()
    FORGERIES[forgery](snapshot)
    with daemon:
        assert served(daemon) == set(range(BLOCKS))
        with connect(daemon.socket) as client:
            assert client.stats()["durable_blocks"] == BLOCKS
        unharmed(daemon)
    assert not snapshot.exists() or snapshot.stat().st_size < 1 << 30
    assert "blocks recovered by scan" in daemon.log(), daemon.log()[-3000:]


def test_rows_that_swap_their_slots_serve_misses_never_the_other_block(tmp_path: Path) -> None:
    """Possible for the data file (every check passes), wrong about two slots: each read
    checks the record header it reads, so those two blocks are misses, the rest served."""
    daemon = DaemonProcess(tmp_path / "kvtierd", config_text=CONFIG)
    with daemon:
        write_durably(daemon)
    snapshot = daemon.data_dir / SNAPSHOT_NAME
    snap = snapshots.decode(snapshot.read_bytes())
    c = {name: column.copy() for name, column in snap.columns.items()}
    for name in ("segment", "index"):
        c[name][[0, 1]] = c[name][[1, 0]]
    snap.columns = c
    assert snapshots.problem(snap, os.stat(daemon.data_dir / "nvme.data").st_size) is None
    snapshot.write_bytes(snapshots.encode(snap))
    with daemon:
        found = served(daemon)
        assert len(found) >= BLOCKS - 2
        unharmed(daemon)


# -- forged record headers against the vectorised scan ---------------------------------------

SMALL = 4096  # 8 KiB slots: a 1 MiB segment is one run of the scan's vectorised parser
SMALL_COUNT = 300


def small_block(i: int) -> bytes:
    return i.to_bytes(4, "little") * (SMALL // 4)


def small_key(i: int) -> bytes:
    return b"scan-%06d" % i


def _record_offsets(data_file: Path) -> dict[int, int]:
    """Block number -> file offset of its record header (found by its payload)."""
    data = data_file.read_bytes()
    found = {}
    for offset in range(0, len(data) - 2 * PAGE_BYTES, PAGE_BYTES):
        if data[offset : offset + 4] == RecordHeader.MAGIC:
            payload = data[offset + PAGE_BYTES : offset + PAGE_BYTES + 8]
            i = int.from_bytes(payload[:4], "little")
            if payload == small_block(i)[:8] and i < SMALL_COUNT:
                found[i] = offset
    return found


def _header_at(data_file: Path, offset: int) -> RecordHeader:
    with open(data_file, "rb") as f:
        f.seek(offset)
        return RecordHeader.unpack(f.read(PAGE_BYTES))


def _seal_at(data_file: Path, offset: int, header: RecordHeader) -> None:
    fd = os.open(data_file, os.O_WRONLY)
    try:
        os.pwrite(fd, header.pack(), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _small_blocks_killed(tmp_path: Path) -> tuple[DaemonProcess, Path, dict[int, int]]:
    """A daemon that made :data:`SMALL_COUNT` small blocks durable and was killed; its data
    file, and where each block's record header lies in it."""
    daemon = DaemonProcess(tmp_path / "kvtierd", nvme_size="64M", config_text=CONFIG)
    with daemon:
        with connect(daemon.socket) as client:
            ns = client.namespace("scan", block_bytes=SMALL)
            for start in range(0, SMALL_COUNT, 50):
                batch = range(start, start + 50)
                blocks = [small_block(i) for i in batch]
                assert ns.put([small_key(i) for i in batch], blocks) == 50
            client.fsync()
        daemon.kill()
    data_file = daemon.data_dir / "nvme.data"
    offsets = _record_offsets(data_file)
    assert sorted(offsets) == list(range(SMALL_COUNT))
    return daemon, data_file, offsets


def _served_small(daemon: DaemonProcess) -> set[int]:
    return served(daemon, "scan", SMALL, small_block, small_key, SMALL_COUNT)


def test_forged_record_headers_at_the_edges_of_a_scan_run(tmp_path: Path) -> None:
    """After a kill -9 the headers are scanned, a segment's slots parsed together. Headers
    sealed anew (their checksums right) at the first and last slots of segments: a payload
    past the slot, another record's identity, a compressed payload claiming 4 GiB, a
    namespace the catalog never had, flags of a later version. The daemon starts, serves
    every other block, each its own bytes, the forged ones as misses; and again after a clean
    stop (from the snapshot that scan made)."""
    daemon, data_file, offsets = _small_blocks_killed(tmp_path)
    by_offset = sorted(offsets, key=offsets.__getitem__)
    # where one segment's slots end and the next one's begin (a segment header between)
    edges = [i for i, j in itertools.pairwise(by_offset) if offsets[j] - offsets[i] > 2 * SMALL]
    assert len(edges) >= 2, edges
    last0, first1 = edges[0], by_offset[by_offset.index(edges[0]) + 1]
    last1, first2 = edges[1], by_offset[by_offset.index(edges[1]) + 1]
    middle = by_offset[by_offset.index(first2) + 5]
    h = {i: _header_at(data_file, offsets[i]) for i in (last0, first1, last1, first2, middle)}
    forged = {
        last0: dataclasses.replace(h[last0], stored_bytes=2 * PAGE_BYTES + 1, raw_bytes=3 << 12),
        first1: _header_at(data_file, offsets[first1 + 1]),  # its neighbour's identity
        last1: dataclasses.replace(h[last1], raw_bytes=(1 << 32) - 1, flags=1),
        first2: dataclasses.replace(h[first2], ns_digest=bytes(range(16))),
        middle: dataclasses.replace(h[middle], flags=0x80),
    }
    for i, header in forged.items():
        _seal_at(data_file, offsets[i], header)
    lost = set(forged) | {first1 + 1}
    for restart in ("scan", "snapshot"):
        with daemon:
            served = _served_small(daemon)
            assert served >= set(range(SMALL_COUNT)) - lost, restart
            assert not served & (set(forged) - {first2}), restart
            unharmed(daemon)


def test_a_record_of_another_block_size_is_a_miss(tmp_path: Path) -> None:
    """A header sealed anew: a compressed payload of twice the namespace's block size (a
    length a write can make, for another namespace). Scanned, it must be a miss."""
    daemon, data_file, offsets = _small_blocks_killed(tmp_path)
    header = _header_at(data_file, offsets[7])
    _seal_at(data_file, offsets[7], dataclasses.replace(header, raw_bytes=2 * SMALL, flags=1))
    with daemon:
        assert _served_small(daemon) == set(range(SMALL_COUNT)) - {7}
        unharmed(daemon)
