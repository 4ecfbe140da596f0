"""Leases verified as they are copied out (``verify_on_copy``): an engine that copies every
block out of the arena pays one pass over memory, and a block changed after COMMIT by a client
of the same tenant is still a miss, found by the copy that would have carried it."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.client.arena import ByteRuns
from kvtierd.errors import CorruptBlockError, InvalidRequestError
from kvtierd.keys import chain_keys
from tests.support.daemon import DaemonProcess

BLOCK = 1 << 20  # past the one-pass kernel's minimum, and a piece of 4 KiB pages


def _blocks(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(32)
    return [rng.integers(0, 256, BLOCK, np.uint8) for _ in range(n)]


def test_copies_verify_and_a_scribbled_block_is_a_miss(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("verify-on-copy", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 3), 16, ns.key_salt)
        blocks = _blocks(3)
        assert ns.put(keys, blocks) == 3
        with ns.lease(keys, verify_on_copy=True) as lease:
            assert not lease.verified
            out = [np.zeros(BLOCK, np.uint8) for _ in keys]
            for i, dst in enumerate(out):
                lease.copy_into(i, dst)
            assert all(np.array_equal(a, b) for a, b in zip(out, blocks, strict=True))
            halves = [np.zeros(BLOCK // 3, np.uint8), np.zeros(BLOCK - BLOCK // 3 + 5, np.uint8)]
            lease.copy_into(2, halves)  # a scatter target, with room to spare
            assert np.array_equal(np.concatenate(halves)[:BLOCK], blocks[2])
            with pytest.raises(InvalidRequestError):
                lease.copy_into(0, np.zeros(BLOCK - 1, np.uint8))
            # Another client of the tenant writes block 1 after COMMIT, through its own mapping.
            extent = lease.extents[1]
            with mmap.mmap(ns.arena.fd, ns.arena.size_bytes) as region:
                region[extent.offset + 12345] ^= 0xFF
            with pytest.raises(CorruptBlockError):
                lease.copy_into(1, out[1])
            lease.copy_into(0, out[0])  # its neighbours still read
        # A lease verified when taken refuses the changed block too.
        with pytest.raises(CorruptBlockError):
            ns.acquire(keys[:2])


def test_copies_into_runs_verify_and_a_scribbled_block_is_a_miss(daemon: DaemonProcess) -> None:
    """``copy_into`` with :class:`ByteRuns` (a strided page of a host pool: equal runs of one
    buffer, here in reverse order with gaps): the block lands in the runs in order, checked in
    the same pass; a changed block is a miss; runs too small or outside their buffer refused."""
    run = BLOCK // 16
    with connect(daemon.socket) as client:
        ns = client.namespace("verify-into-runs", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 2), 16, ns.key_salt)
        blocks = _blocks(2)
        assert ns.put(keys, blocks) == 2
        storage = np.zeros(2 * BLOCK, np.uint8)
        offsets = [(2 * i + 1) * run for i in reversed(range(16))]
        with ns.lease(keys, verify_on_copy=True) as lease:
            lease.copy_into(0, ByteRuns(memoryview(storage), offsets, run))
            got = np.concatenate([storage[o : o + run] for o in offsets])
            assert np.array_equal(got, blocks[0])
            assert not storage[:run].any()  # the gaps between the runs are untouched
            with pytest.raises(InvalidRequestError):  # 15 runs hold less than the block
                lease.copy_into(0, ByteRuns(memoryview(storage), offsets[:15], run))
            with pytest.raises(InvalidRequestError):  # a run past the buffer's end
                lease.copy_into(0, ByteRuns(memoryview(storage), [*offsets[:15], 2 * BLOCK], run))
            extent = lease.extents[1]
            with mmap.mmap(ns.arena.fd, ns.arena.size_bytes) as region:
                region[extent.offset + 54321] ^= 0xFF
            with pytest.raises(CorruptBlockError):
                lease.copy_into(1, ByteRuns(memoryview(storage), offsets, run))


_PROBE_STARTED_BY_MAPPING = """
import sys, time
from kvtierd.client import connect
from kvtierd.store.copyhash import default_hasher
with connect(sys.argv[1]) as client:
    client.namespace("probe-at-map", block_bytes=1 << 16)  # maps the region, copies nothing
    deadline = time.monotonic() + 60
    while not default_hasher().native and time.monotonic() < deadline:
        time.sleep(0.05)
    print(default_hasher().native)
"""


def test_mapping_a_region_starts_the_copy_probe(daemon: DaemonProcess) -> None:
    """A client proves the copy kernel as soon as it maps a region, so that an engine's first
    copies do not run in Python while the probe's child starts: in a fresh process that only
    opens a namespace, the kernel is in use without any copy or any wait for the verdict."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _PROBE_STARTED_BY_MAPPING, str(daemon.socket)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert run.stdout.split() == ["True"]


def test_read_into_verifies_every_copy_of_one_call(daemon: DaemonProcess) -> None:
    """``read_into`` checks each copy against its own checksum, into one buffer or a list of
    them: the block that fails is the one named, and a buffer too small is refused before
    anything is copied."""
    with connect(daemon.socket) as client:
        ns = client.namespace("read-into", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 4), 16, ns.key_salt)
        blocks = _blocks(4)
        assert ns.put(keys, blocks) == 4
        out = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert ns.read_into(keys, out) == 4 * BLOCK
        assert all(np.array_equal(a, b) for a, b in zip(out, blocks, strict=True))
        mixed: list[object] = [np.zeros(BLOCK + 7, np.uint8) for _ in keys]
        mixed[3] = [np.zeros(BLOCK // 2, np.uint8), np.zeros(BLOCK - BLOCK // 2, np.uint8)]
        assert ns.read_into(keys, mixed) == 4 * BLOCK
        assert np.array_equal(np.concatenate(mixed[3]), blocks[3])  # type: ignore[arg-type]
        fresh = [np.zeros(BLOCK, np.uint8) for _ in keys]
        fresh[2] = np.zeros(BLOCK - 1, np.uint8)
        with pytest.raises(InvalidRequestError):
            ns.read_into(keys, fresh)
        assert not any(buffer.any() for buffer in fresh)
        with ns.lease(keys[2:3]) as lease:  # another client of the tenant writes block 2
            extent = lease.extents[0]
            with mmap.mmap(ns.arena.fd, ns.arena.size_bytes) as region:
                region[extent.offset + 777] ^= 0xFF
        for targets in (out, mixed):
            with pytest.raises(CorruptBlockError, match=keys[2].hex()):
                ns.read_into(keys, targets)
