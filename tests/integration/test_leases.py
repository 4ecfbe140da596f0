"""Leases: a client that dies holding leases and pending writes frees them; a leased block is
never evicted or reused while its lease is held."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from kvtierd.client import NoSpaceError, connect, connect_async
from kvtierd.testing import DaemonProcess

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20
HOLDER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from kvtierd.client import connect
    from kvtierd.protocol.messages import AllocRequest

    socket_path, leased, pending = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    client = connect(socket_path, client_name="holder")
    ns = client.namespace("leases", block_bytes=1 << 20)
    keys = [b"held-%04d" % i + bytes(7) for i in range(leased)]
    ns.put(keys, [np.full(1 << 20, i, np.uint8) for i in range(leased)])
    client.fsync()
    with ns.get(keys) as views:  # leased until this process dies
        alloc = [b"pend-%04d" % i + bytes(7) for i in range(pending)]
        client._call(AllocRequest(alloc), ns.handle.ns)  # never committed
        print("holding", flush=True)
        time.sleep(600)
    """
)


def _stats_until(socket: Path, predicate, timeout_s: float = 30.0) -> dict:  # type: ignore[no-untyped-def, type-arg]
    deadline = time.monotonic() + timeout_s
    with connect(socket) as client:
        while True:
            stats = client.stats()
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


async def _put_expecting_no_space(socket: Path, count: int) -> None:
    async with connect_async(socket) as client:
        ns = await client.namespace("leases", block_bytes=MIB)
        others = [b"other-%04d" % i + bytes(6) for i in range(count)]
        with pytest.raises(NoSpaceError):
            await ns.put(others, [np.zeros(MIB, np.uint8)] * count)
        assert (await client.stats())["pending_writes"] == 1  # only the holder's


def test_a_killed_client_frees_its_leases_and_pending_writes(tmp_path: Path) -> None:
    # One connection may hold the whole region here: the test is about what its death frees.
    config = "[limits]\nconnection_pinned_share = 1.0\n"
    with DaemonProcess(tmp_path / "kvtierd", dram_size="32M", config_text=config) as daemon:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(daemon.socket), "12", "16"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "holding"
            stats = _stats_until(daemon.socket, lambda s: s["pending_writes"] == 1)
            assert stats["leases"] == 1
            assert stats["leased_blocks"] == 12
            assert stats["pending_writes"] == 1
            # 28 of 32 MiB are leased or pending: no room for 8 more (the async client: the
            # sync one reports ENOSPC as a broken connection, a client bug reported separately)
            anyio.run(_put_expecting_no_space, daemon.socket, 8)
        finally:
            holder.kill()
            holder.wait(30)
            if holder.stdout is not None:
                holder.stdout.close()

        stats = _stats_until(daemon.socket, lambda s: s["connections"] == 1 and s["leases"] == 0)
        assert stats["leases"] == 0
        assert stats["leased_blocks"] == 0
        assert stats["pending_writes"] == 0
        with connect(daemon.socket) as client:
            ns = client.namespace("leases", block_bytes=MIB)
            refill = [b"refill-%04d" % i + bytes(5) for i in range(30)]
            blocks = [np.full(MIB, 200 + i % 50, np.uint8) for i in range(30)]
            assert ns.put(refill, blocks) == 30  # the whole arena is usable again
            with ns.get(refill) as views:
                assert all(bytes(v) == b.tobytes() for v, b in zip(views, blocks, strict=True))
            # the dead client's blocks were committed and fsynced: they are still there
            held = [b"held-%04d" % i + bytes(7) for i in range(12)]
            assert ns.lookup(held) == 12
            with ns.get(held[3:4]) as views:
                assert bytes(views[0]) == bytes([3]) * MIB
            # and its uncommitted ALLOC never became visible
            assert ns.lookup([b"pend-%04d" % 0 + bytes(7)]) == 0
            assert client.stats()["leases"] == 0


@pytest.mark.anyio
async def test_a_leased_block_is_never_evicted_or_reused(daemon: DaemonProcess) -> None:
    rng = np.random.default_rng(3)
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("pinned", block_bytes=MIB)
        keys = [b"pinned-%03d" % i + bytes(6) for i in range(6)]
        blocks = [rng.integers(0, 256, MIB, dtype=np.uint8) for _ in keys]
        await ns.put(keys, blocks)
        await client.fsync()
        async with ns.get(keys) as views:
            assert await client.evict() >= 0
            # far more than the 64 MiB arena, so that everything unleased is evicted
            for round_ in range(5):
                more = [b"press-%d-%03d" % (round_, i) + bytes(4) for i in range(24)]
                await ns.put(more, [np.full(MIB, round_ * 24 + i, np.uint8) for i in range(24)])
                await client.fsync()
                await client.evict()
            assert [bytes(v) for v in views] == [b.tobytes() for b in blocks]
            stats = await client.stats()
            assert stats["leased_blocks"] == 6
            # the pressure really evicted: the first round is no longer in DRAM
            assert stats["tiers"][0]["evictions"] > 0
        assert (await client.stats())["leases"] == 0
        # released blocks are ordinary again: evictable, and still readable from the NVMe tier
        await client.evict()
        async with ns.get(keys) as views:
            assert [bytes(v) for v in views] == [b.tobytes() for b in blocks]


#: Background promotions off, so that only the test decides what is in DRAM.
NO_PREFETCH = "[dram]\nprefetch_bytes_per_s = 0\n"


@pytest.mark.anyio
async def test_read_resident_leases_the_leading_dram_hits_and_never_waits(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    with DaemonProcess(tmp_path / "kvtierd", config_text=NO_PREFETCH) as daemon:
        async with connect_async(daemon.socket) as client:
            ns = await client.namespace("resident", block_bytes=MIB)
            keys = [b"resident-%03d" % i + bytes(4) for i in range(6)]
            blocks = [rng.integers(0, 256, MIB, dtype=np.uint8) for _ in keys]
            await ns.put(keys, blocks)
            await client.fsync()
            await client.evict()  # all six on NVMe only
            async with ns.lease(keys, resident_only=True) as lease:
                assert lease.keys == []
                assert lease.views == []
            async with ns.get(keys[:3]) as _:  # READ promotes the first three
                pass
            assert await ns.lookup_tiers(keys, promote=False) == ["dram"] * 3 + ["nvme"] * 3
            started = (await client.stats())["prefetch_promoted"]
            async with ns.lease([*keys, b"never-stored-key"], resident_only=True) as lease:
                assert lease.keys == keys[:3]
                assert [bytes(v) for v in lease.views] == [b.tobytes() for b in blocks[:3]]
                # a READ_RESIDENT promotes nothing (a promotion is counted as it starts, before
                # the reply): the NVMe blocks stay where they were
                assert (await client.stats())["prefetch_promoted"] == started
                assert await ns.lookup_tiers(keys, promote=False) == ["dram"] * 3 + ["nvme"] * 3
                # and what it holds is leased: EVICT cannot take it
                await client.evict()
                assert (await client.stats())["leased_blocks"] == 3
                assert [bytes(v) for v in lease.views] == [b.tobytes() for b in blocks[:3]]
            stats = await client.stats()
            assert stats["leases"] == 0
            await client.evict()
            assert await ns.lookup_tiers(keys, promote=False) == ["nvme"] * 6


def test_read_resident_sync_client_and_an_older_daemon(tmp_path: Path) -> None:
    with (
        DaemonProcess(tmp_path / "kvtierd", config_text=NO_PREFETCH) as daemon,
        connect(daemon.socket) as client,
    ):
        ns = client.namespace("resident", block_bytes=MIB)
        keys = [b"sync-%03d" % i + bytes(8) for i in range(4)]
        ns.put(keys, [np.full(MIB, i, np.uint8) for i in range(4)])
        with ns.acquire(keys, resident_only=True) as lease:  # just written: in DRAM
            assert lease.keys == keys
            assert [v[0] for v in lease.views] == [0, 1, 2, 3]
            assert client.stats()["leased_blocks"] == 4
        assert client.stats()["leases"] == 0
        # a daemon that predates READ_RESIDENT is not asked: the lease is empty, no error
        client.daemon_minor = 3
        lease = ns.acquire(keys, resident_only=True)
        assert lease.keys == []
        assert lease.extents == []
        lease.release()
        assert client.stats()["leases"] == 0


def test_connected_sees_the_daemon_close_behind_unread_replies(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "kvtierd").start()
    try:
        client = connect(daemon.socket)
        ns = client.namespace("alive", block_bytes=MIB)
        ns.put([b"alive-key-00001"], [np.zeros(MIB, np.uint8)])
        with ns.get([b"alive-key-00001"]):
            pass  # its RELEASE is answered, and nobody reads that reply
        assert client.connected()
        daemon.stop()
        assert not client.connected()
        client.close()
    finally:
        daemon.kill()


def test_a_release_from_inside_a_call_waits_for_that_call_not_for_the_lock(
    tmp_path: Path,
) -> None:
    """A lease can end in a finalizer (LMCache frees memory objects from ``__del__``) on a
    thread that is inside a call on the same connection: the RELEASE must not wait for the
    connection's lock (a deadlock); it goes out when that call ends."""
    with (
        DaemonProcess(tmp_path / "kvtierd") as daemon,
        connect(daemon.socket) as client,
        connect(daemon.socket) as observer,
    ):
        ns = client.namespace("finalizer", block_bytes=MIB)
        keys = [b"final-%03d" % i + bytes(7) for i in range(2)]
        ns.put(keys, [np.zeros(MIB, np.uint8)] * 2)
        lease = ns.acquire(keys)
        with client._lock:  # as if this thread were inside a call
            lease.release()  # returns at once
        assert observer.stats()["leases"] == 1  # still held: nothing was sent yet
        ns.lookup(keys)  # the next call sends it as it ends...
        assert client.stats()["leases"] == 0  # ...before any later request of the connection
