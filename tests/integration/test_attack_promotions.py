"""Attacks on READ's batched promotions from the NVMe tier (issue 32: ``store/runs.py``,
``Promotions.make_all_resident`` and ``_promote_run``, ``nvme.read_batch_*``), on the real
daemon with a small DRAM region, on asyncio and trio.

What a client controls is which keys a READ names, how many READs run at once over how many
connections and namespaces, and when it goes away. None of it may make the daemon hold a DRAM
slot, a pin or a lease past the READ or the connection: once every client has gone, EVICT must
leave DRAM empty, and a READ that fits the region must get every block's own bytes.

Found here: a READ naming one cold block twice put it twice into one batch, which allocated
two slots for it, installed both (the first slot never freed again), then failed the READ with
an internal error, the block's second pin never released: each such READ took DRAM from its
tenant for the daemon's life.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.errors import NoSpaceError, StorageIOError
from kvtierd.testing import DaemonProcess
from tests.support.attacks import tier_usage, unharmed

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 30.0
BLOCK = 256 << 10
DRAM = "16M"  # 64 slots of BLOCK
NAMESPACES = ("left", "right")
KEYS = [b"cold-%06d" % i for i in range(24)]  # 6 MiB a namespace: 12 of the 16 MiB in all


def _block(ns: str, i: int) -> np.ndarray:
    seed = NAMESPACES.index(ns) * 1000 + i
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture(params=["asyncio", "trio"])
def daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    runtime: str = request.param
    directory = tmp_path_factory.mktemp(f"attack-promotions-{runtime}")
    process = DaemonProcess(directory, dram_size=DRAM, runtime=runtime)
    process.start(120)
    try:
        with connect(process.socket, timeout_s=DEADLINE_S) as client:
            for name in NAMESPACES:
                ns = client.namespace(name, block_bytes=BLOCK)
                blocks = [_block(name, i) for i in range(len(KEYS))]
                assert ns.put(KEYS, blocks) == len(KEYS)
            client.fsync()
            client.evict()
        yield process
    finally:
        process.kill()


def _nothing_held(daemon: DaemonProcess) -> None:
    """Once only this connection is left: no lease, and EVICT empties DRAM (every block is
    clean); then each namespace's blocks, read cold, are their own bytes."""
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        deadline = time.monotonic() + DEADLINE_S
        while (stats := client.stats())["connections"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # the attackers' sessions finish closing
        assert stats["connections"] == 1
        assert stats["leases"] == 0
        assert stats["leased_blocks"] == 0
        client.evict()
        assert tier_usage(client, "dram") == (0, 0)
        for name in NAMESPACES:
            ns = client.namespace(name, block_bytes=BLOCK)
            with ns.get(KEYS) as views:
                for i, view in enumerate(views):
                    assert np.array_equal(np.asarray(view), _block(name, i)), (name, i)
            client.evict()
    unharmed(daemon)


def test_a_read_naming_cold_blocks_twice_holds_nothing_after(daemon: DaemonProcess) -> None:
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        ns = client.namespace("left", block_bytes=BLOCK)
        for first in range(0, len(KEYS), 4):
            keys = KEYS[first : first + 4]
            named = [key for key in keys for _ in range(3)]  # each cold block three times
            with ns.get(named) as views:
                for key, view in zip(named, views, strict=True):
                    assert np.array_equal(np.asarray(view), _block("left", KEYS.index(key)))
            client.evict()
    _nothing_held(daemon)


#: A child that reads both namespaces cold (EVICT, READ of every key, again) from four threads
#: on four connections, killed (SIGKILL) once one READ was answered: its connections end with
#: the other READs' promotions in flight.
_READER = """
import sys, threading
from kvtierd.client import connect
socket_path, block = sys.argv[1], int(sys.argv[2])
keys = [b"cold-%06d" % i for i in range(24)]
sent = threading.Event()

def read(name, order):
    with connect(socket_path, timeout_s=30) as client:
        ns = client.namespace(name, block_bytes=block)
        for _ in range(100):
            try:
                with ns.get(keys[::order]):
                    pass
                client.evict()
            except Exception:
                pass
            sent.set()

for name in ("left", "right"):
    for order in (1, -1):
        threading.Thread(target=read, args=(name, order), daemon=True).start()
sent.wait(30)
print("sent", flush=True)
threading.Event().wait(60)
"""


def test_clients_killed_in_the_middle_of_cold_reads_hold_nothing_after(
    daemon: DaemonProcess,
) -> None:
    env = dict(os.environ)
    for _ in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c", _READER, str(daemon.socket), str(BLOCK)],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"sent\n"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
    assert daemon.running
    _nothing_held(daemon)


def test_reads_past_the_region_fail_cleanly_and_hold_nothing_after(
    daemon: DaemonProcess,
) -> None:
    """Two connections each leasing more than half the region: the second READ may get
    ENOSPC, never an internal error, and the first one's blocks stay right."""
    with (
        connect(daemon.socket, timeout_s=DEADLINE_S) as first,
        connect(daemon.socket, timeout_s=DEADLINE_S) as second,
    ):
        left = first.namespace("left", block_bytes=BLOCK)
        right = second.namespace("right", block_bytes=BLOCK)
        more = KEYS + KEYS[: len(KEYS) // 2]  # 36 blocks named, 24 distinct: 9 MiB leased
        with left.lease(more) as held:
            assert len(held.views) == len(more)
            try:
                with right.lease(more) as also:
                    assert len(also.views) == len(more)
            except NoSpaceError:
                pass  # the region is taken: refused, and nothing else
            except StorageIOError as exc:  # an internal error
                pytest.fail(f"the second READ failed inside the daemon: {exc}")
    _nothing_held(daemon)
