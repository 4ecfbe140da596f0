"""Damaged and forged records in the data file against READ's runs (issue 32: side-by-side
records read in one request, ``NvmeTier.load_run``), on the real daemon, on asyncio and trio.

Blocks written one after another lie side by side, so a READ of them is one vectored request;
each record's header is then checked against the block asked for and each payload hashed. The
attacks change the data file under the daemon (as a failing disk, or anyone who can write the
file, would), between writing the blocks and reading them back: a torn payload, a header sealed
anew that claims its neighbour's identity (key, sequence number and checksum), one that claims
a payload longer than its slot. Read while the daemon runs and again after a kill -9 and a
recovery by scan, every block must be its own bytes or a miss: never another block's bytes,
never an internal error, and the daemon keeps running.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.client.sync import Namespace
from kvtierd.errors import BlockNotFoundError
from kvtierd.store.records import PAGE_BYTES, CorruptRecord, RecordHeader
from kvtierd.testing import DaemonProcess
from tests.support.attacks import unharmed

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 30.0
BLOCK = 64 << 10
COUNT = 12
KEYS = [b"record-%06d" % i for i in range(COUNT)]
#: Which blocks the attacks damage: a torn payload, a header claiming its neighbour's identity,
#: a header claiming a payload longer than its slot.
TORN, IMPOSTOR, WIDENED = 3, 6, 9


def _block(i: int) -> bytes:
    return np.random.default_rng(100 + i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def _records(data_file: Path) -> dict[int, tuple[int, RecordHeader]]:
    """Block number -> (file offset, header) of each record whose payload is one of ours."""
    firsts = {_block(i)[:256]: i for i in range(COUNT)}
    found: dict[int, tuple[int, RecordHeader]] = {}
    with open(data_file, "rb") as file:
        data = file.read()
    for offset in range(0, len(data) - 2 * PAGE_BYTES, PAGE_BYTES):
        if data[offset : offset + 4] != RecordHeader.MAGIC:
            continue
        try:
            header = RecordHeader.unpack(data[offset : offset + PAGE_BYTES])
        except CorruptRecord:
            continue
        i = firsts.get(data[offset + PAGE_BYTES : offset + PAGE_BYTES + 256])
        if i is not None:
            found[i] = (offset, header)
    return found


def _write(data_file: Path, offset: int, data: bytes) -> None:
    fd = os.open(data_file, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _damage(data_file: Path) -> None:
    records = _records(data_file)
    assert sorted(records) == list(range(COUNT)), "every block was written to the data file"
    # a torn payload: one byte in the middle of the block
    offset, _ = records[TORN]
    _write(data_file, offset + PAGE_BYTES + BLOCK // 2, b"\xa5")
    # a header sealed anew with its neighbour's key, sequence number and checksum
    offset, _ = records[IMPOSTOR]
    _, neighbour = records[IMPOSTOR + 1]
    _write(data_file, offset, neighbour.pack())
    # a header that claims a payload twice its slot's, into its neighbour's record
    offset, header = records[WIDENED]
    wide = dataclasses.replace(header, stored_bytes=2 * BLOCK, raw_bytes=2 * BLOCK)
    _write(data_file, offset, wide.pack())


def _own_bytes_or_a_miss(ns: Namespace) -> set[int]:
    """Read each block alone, then all at once; the blocks served (each checked against its
    own bytes). Fails on another block's bytes or on any error but a miss."""
    served = set()
    for i, key in enumerate(KEYS):
        try:
            with ns.get([key]) as (view,):
                assert bytes(view) == _block(i), f"block {i} served bytes not its own"
                served.add(i)
        except BlockNotFoundError:
            pass
    try:
        with ns.get(KEYS) as views:
            for i, view in enumerate(views):
                assert bytes(view) == _block(i), f"block {i} served bytes not its own"
    except BlockNotFoundError:
        pass
    return served


@pytest.fixture(params=["asyncio", "trio"])
def runtime(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def daemon(runtime: str, tmp_path: Path) -> Iterator[DaemonProcess]:
    process = DaemonProcess(tmp_path / "kvtierd", runtime=runtime)
    process.start(120)
    try:
        yield process
    finally:
        process.kill()


def _write_blocks(daemon: DaemonProcess) -> None:
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        ns = client.namespace("records", block_bytes=BLOCK)
        assert ns.put(KEYS, [_block(i) for i in range(COUNT)]) == COUNT
        client.fsync()
        client.evict()


def test_records_damaged_under_the_daemon(daemon: DaemonProcess) -> None:
    """Damaged while the daemon runs: its index still says what each slot held."""
    _write_blocks(daemon)
    _damage(daemon.data_dir / "nvme.data")
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        served = _own_bytes_or_a_miss(client.namespace("records", block_bytes=BLOCK))
    assert served >= set(range(COUNT)) - {TORN, IMPOSTOR, WIDENED}
    assert not served & {TORN, IMPOSTOR}
    unharmed(daemon)


def test_records_damaged_before_a_recovery_by_scan(daemon: DaemonProcess) -> None:
    """Damaged after a kill -9: the next start scans the data file and adopts what its
    headers say, the forged ones included (the impostor's twin may become a miss too)."""
    _write_blocks(daemon)
    daemon.kill()
    _damage(daemon.data_dir / "nvme.data")
    daemon.start(120)
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        served = _own_bytes_or_a_miss(client.namespace("records", block_bytes=BLOCK))
    assert served >= set(range(COUNT)) - {TORN, IMPOSTOR, IMPOSTOR + 1, WIDENED}
    assert not served & {TORN, IMPOSTOR}
    unharmed(daemon)
