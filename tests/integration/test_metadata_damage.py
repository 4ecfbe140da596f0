"""Nothing acknowledged is lost to metadata, end to end with the real daemon.

Blocks are written and made durable (FSYNC), the daemon is stopped (cleanly, or with SIGKILL),
one bit of its metadata is flipped on disk, and a restarted daemon must serve every block with
its bytes:

* a segment header of the data file (``data/nvme.data``): the header is rebuilt (from the
  snapshot after a clean stop, from the record headers after a kill);
* either copy of the namespace catalog (``data/namespaces.catalog``, ``.1``);
* an index snapshot that decodes but disagrees with the data file (a segment past its end, a
  record listed twice): it is discarded and the headers scanned; the daemon starts.

And the catalog is durable before OPEN_NS answers: on a full file system the first OPEN_NS of a
new namespace answers ENOSPC, and so does its retry, until the catalog can be saved; after
``kill -9`` every block acknowledged in it is recovered.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import NoSpaceError, connect, connect_async
from kvtierd.store import snapshot as snapshots
from kvtierd.store.recovery import SNAPSHOT_NAME
from kvtierd.testing import DaemonProcess
from tests.support.filesystems import fill, small_file_system

pytestmark = pytest.mark.timeout(180)

BLOCK_BYTES = 64 << 10
BLOCKS = 100  # 1 MiB segments of 15 slots: 7 segments
CONFIG = '[nvme]\nsegment_bytes = "1M"\n'


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def key(i: int) -> bytes:
    return b"meta-%06d" % i + bytes(5)


def daemon_in(directory: Path, config: str = CONFIG) -> DaemonProcess:
    return DaemonProcess(directory, config_text=config)


def write_durably(daemon: DaemonProcess, keys: range = range(BLOCKS), name: str = "meta") -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=BLOCK_BYTES)
        for start in range(keys.start, keys.stop, 10):
            batch = range(start, min(start + 10, keys.stop))
            assert ns.put([key(i) for i in batch], [block(i) for i in batch]) == len(batch)
        client.fsync()


def check_every_block(
    daemon: DaemonProcess, keys: range = range(BLOCKS), name: str = "meta"
) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=BLOCK_BYTES, create=False)
        assert ns.lookup([key(i) for i in keys]) == len(keys)
        for start in range(keys.start, keys.stop, 10):
            batch = list(range(start, min(start + 10, keys.stop)))
            with ns.get([key(i) for i in batch]) as views:
                for i, view in zip(batch, views, strict=True):
                    assert bytes(view) == block(i).tobytes(), i


def segment_headers(data_file: Path) -> list[int]:
    """The offsets of the pages of ``data_file`` that begin with a segment header's magic."""
    found = []
    with open(data_file, "rb") as data:
        offset = 0
        while chunk := data.read(1 << 20):
            found += [
                offset + at for at in range(0, len(chunk), 4096) if chunk[at : at + 4] == b"KVTS"
            ]
            offset += len(chunk)
    return found


def flip_bit(path: Path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("stop", ["clean stop", "kill -9"])
def test_a_flipped_bit_in_a_segment_header_loses_no_block(tmp_path: Path, stop: str) -> None:
    daemon = daemon_in(tmp_path / "kvtierd")
    with daemon:
        write_durably(daemon)
        if stop == "kill -9":
            daemon.kill()
        else:
            assert daemon.stop() == 0
    data_file = daemon.data_dir / "nvme.data"
    headers = segment_headers(data_file)
    assert len(headers) >= 7
    flip_bit(data_file, headers[1] + 40)  # segment 1's slot count
    with daemon:
        check_every_block(daemon)
        daemon.kill()  # the header was repaired on disk: a scan finds every segment now
    with daemon:
        check_every_block(daemon)
    assert daemon.process is not None
    assert daemon.process.returncode == 0
    assert f"segment header at offset {headers[1]} " in daemon.log()


@pytest.mark.parametrize("copy", ["namespaces.catalog", "namespaces.catalog.1"])
def test_a_flipped_bit_in_the_namespace_catalog_loses_no_block(tmp_path: Path, copy: str) -> None:
    daemon = daemon_in(tmp_path / "kvtierd")
    with daemon:
        write_durably(daemon)
        daemon.kill()
    flip_bit(daemon.data_dir / copy, 20)
    with daemon:
        check_every_block(daemon)
        write_durably(daemon, range(BLOCKS, BLOCKS + 10), name="meta")
    assert "damaged namespace catalog copy" in daemon.log()
    # the damaged copy was rewritten: the other copy may now fail as well
    other = "namespaces.catalog.1" if copy == "namespaces.catalog" else "namespaces.catalog"
    flip_bit(daemon.data_dir / other, 20)
    with daemon:
        check_every_block(daemon, range(BLOCKS + 10))


def edit_snapshot(path: Path, change: str) -> None:
    snap = snapshots.decode(path.read_bytes())
    snap.columns = {name: column.copy() for name, column in snap.columns.items()}
    if change == "a segment past the end of the file":
        start, slot_bytes, count = snap.segments[-1]
        snap.segments[-1] = (start, slot_bytes, count + 100_000)
    elif change == "a record past its segment":
        snap.columns["index"][0] += 10_000
    else:
        snap.columns = {name: np.concatenate([c, c[:1]]) for name, c in snap.columns.items()}
    path.write_bytes(snapshots.encode(snap))


@pytest.mark.parametrize(
    "change", ["a segment past the end of the file", "a record past its segment", "a duplicate"]
)
def test_a_snapshot_that_disagrees_with_the_file_is_scanned_past(
    tmp_path: Path, change: str
) -> None:
    daemon = daemon_in(tmp_path / "kvtierd")
    with daemon:
        write_durably(daemon)
    snapshot = daemon.data_dir / SNAPSHOT_NAME
    edit_snapshot(snapshot, change)
    with daemon:
        check_every_block(daemon)
        with connect(daemon.socket) as client:
            assert client.stats()["durable_blocks"] == BLOCKS
    assert "index snapshot disagrees with the data file" in daemon.log()
    assert "Traceback" not in daemon.log()


@pytest.mark.anyio
async def test_open_ns_on_a_full_file_system_answers_enospc_until_the_catalog_is_saved(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "kvtierd"
    # the data directory (catalog, snapshot) on a small file system; the data file beside it
    config = CONFIG + f'path = "{tmp_path / "nvme.data"}"\n'
    with small_file_system(directory / "data", "4m") as data_dir:
        daemon = daemon_in(directory, config)
        with daemon:
            write_durably(daemon, range(20), name="before")
            filler = data_dir / "filler"
            fill(filler)
            async with connect_async(daemon.socket) as client:
                for _ in range(2):  # the retry must not answer as if the catalog were saved
                    with pytest.raises(NoSpaceError):
                        await client.namespace("fresh", block_bytes=BLOCK_BYTES)
                # a namespace whose catalog entry is durable still opens
                await client.namespace("before", block_bytes=BLOCK_BYTES, create=False)
            filler.unlink()
            write_durably(daemon, range(20, 40), name="fresh")
            daemon.kill()
        with daemon:
            check_every_block(daemon, range(20), name="before")
            check_every_block(daemon, range(20, 40), name="fresh")
        assert "unknown namespace" not in daemon.log()
