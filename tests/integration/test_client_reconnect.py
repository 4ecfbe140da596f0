"""Reconnecting across a real daemon restart (stopped, started again on the same socket and data
directory while a client is connected), for both clients: requests after the restart work, the
namespaces the caller holds are opened again, blocks committed and FSYNCed before are read back,
a lease from before raises, a write in flight raises, and the attempts bound is kept when the
daemon does not come back or keeps answering that it is starting."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from kvtierd.client import (
    BrokenConnectionError,
    DaemonNotRunningError,
    InvalidRequestError,
    Reconnect,
    StartingError,
    chain_keys,
    connect,
    connect_async,
)
from kvtierd.protocol import ServerConnection
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.timeout(180)

BLOCK = 4096
#: Quick retries: a restart here takes a second or two, well within 20 attempts of 0.5 s.
POLICY = Reconnect(attempts=20, first_backoff_s=0.05, max_backoff_s=0.5)


def _blocks(n: int, first: int = 1) -> list[np.ndarray]:
    return [np.full(BLOCK, first + i, np.uint8) for i in range(n)]


def _restart(daemon: DaemonProcess) -> None:
    daemon.stop()
    daemon.start()


def test_a_sync_client_carries_on_across_a_restart(daemon: DaemonProcess) -> None:
    with connect(daemon.socket, reconnect=POLICY) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 6), 16, ns.key_salt)
        blocks = _blocks(4)
        ns.put(keys[:4], blocks)
        assert client.fsync() == 4
        before = ns.handle
        arena = ns.arena
        lease = ns.acquire(keys[:2])

        _restart(daemon)

        assert client.stats()["tiers"][0]["name"] == "dram"  # first request: reconnects
        assert client.reconnects == 1
        assert ns.handle is not before
        assert ns.handle.key_salt == before.key_salt
        assert ns.arena is not arena  # the new daemon's region, mapped again
        assert ns.lookup(keys) == 4
        out = [bytearray(BLOCK) for _ in range(4)]
        assert ns.read_into(keys[:4], out) == 4 * BLOCK
        assert [bytes(o) for o in out] == [b.tobytes() for b in blocks]

        with pytest.raises(BrokenConnectionError, match="lease the blocks again"):
            lease.views  # noqa: B018
        lease.release()  # nothing to give back: the old daemon released it
        assert client.stats()["leases"] == 0

        assert ns.put(keys[4:], _blocks(2, first=9)) == 2  # writes reach the new region
        with ns.get(keys[4:]) as views:
            assert bytes(views[1]) == _blocks(2, first=9)[1].tobytes()
        with pytest.raises(BrokenConnectionError, match="use the namespace's arena again"):
            arena.view(0, BLOCK)


def test_a_write_in_flight_across_a_restart_raises(daemon: DaemonProcess) -> None:
    with connect(daemon.socket, reconnect=POLICY) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 2), 16, ns.key_salt)
        write = ns.write(keys)
        for view, block in zip(write.__enter__().views, _blocks(2), strict=True):
            assert view is not None
            view[:] = block.tobytes()
        _restart(daemon)
        with pytest.raises(BrokenConnectionError, match="write of 2 blocks was in flight"):
            write.__exit__(None, None, None)  # the end of its with block: COMMIT
        assert ns.lookup(keys) == 0  # never acknowledged, never stored
        assert client.reconnects == 1
        assert ns.put(keys, _blocks(2)) == 2


def test_fsync_is_not_retried(daemon: DaemonProcess) -> None:
    with connect(daemon.socket, reconnect=POLICY) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        ns.put(chain_keys(range(16), 16, ns.key_salt), _blocks(1))
        daemon.stop()
        with pytest.raises(BrokenConnectionError):
            client.fsync()  # the blocks it was to make durable may be gone: say so
        daemon.start()
        client.fsync()  # a new FSYNC, on the new connection
        assert client.reconnects == 1


def test_without_a_policy_a_restart_breaks_the_client(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        client.namespace("t", block_bytes=BLOCK)
        _restart(daemon)
        with pytest.raises(BrokenConnectionError):
            client.stats()
        with pytest.raises(BrokenConnectionError):
            client.stats()
        assert client.reconnects == 0


def test_giving_up_after_the_attempts_when_the_daemon_stays_away(daemon: DaemonProcess) -> None:
    policy = Reconnect(attempts=3, first_backoff_s=0.01, max_backoff_s=0.02)
    with connect(daemon.socket, reconnect=policy) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        daemon.stop()
        with pytest.raises(DaemonNotRunningError) as gone:
            ns.lookup([b"k" * 16])
        assert str(gone.value) == (
            f"kvtierd is not running (no daemon on {daemon.socket}) "
            "(gave up reconnecting after 3 attempts)"
        )
        daemon.start()  # a later call tries again, with the whole budget
        assert ns.lookup([b"k" * 16]) == 0


@contextlib.contextmanager
def _starting_daemon(path: Path) -> Iterator[list[int]]:
    """Listen on ``path`` and answer every connection as a daemon still starting does (the
    ``EAGAIN`` fatal frame, then close); yields the count of connections, as a one-item list."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    count = [0]
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                peer, _ = listener.accept()
            except OSError:
                return
            with peer:
                count[0] += 1
                peer.sendall(ServerConnection().fatal(StartingError("starting: pre-faulting")))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield count
    finally:
        done.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(10)
        os.unlink(path)


def test_a_starting_daemon_is_retried_up_to_the_bound(daemon: DaemonProcess) -> None:
    policy = Reconnect(attempts=4, first_backoff_s=0.0, max_backoff_s=0.0)
    with connect(daemon.socket, reconnect=policy) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        daemon.stop()
        with _starting_daemon(daemon.socket) as connections:
            with pytest.raises(StartingError, match="gave up reconnecting after 4 attempts"):
                client.stats()
            assert connections == [4]
        daemon.start()
        assert ns.lookup([b"k" * 16]) == 0
        assert client.reconnects == 1


def test_a_namespace_the_new_daemon_salts_otherwise_is_lost(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    with connect(daemon.socket, reconnect=POLICY) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        daemon.stop()
        # Another daemon on the same socket, with its own data (and so its own secret).
        other = DaemonProcess(tmp_path / "other")
        other.args[other.args.index("--socket") + 1] = str(daemon.socket)
        other.socket = daemon.socket
        with other:
            with pytest.raises(InvalidRequestError, match="another key salt"):
                ns.lookup([b"k" * 16])
            assert "lost" in repr(ns)
            again = client.namespace("t", block_bytes=BLOCK)
            assert again.lookup([b"k" * 16]) == 0


# -- the async client ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_async_client_carries_on_across_a_restart(daemon: DaemonProcess) -> None:
    async with connect_async(daemon.socket, reconnect=POLICY) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 4), 16, ns.key_salt)
        blocks = _blocks(4)
        await ns.put(keys, blocks)
        assert await client.fsync() == 4
        before = ns.handle
        async with contextlib.AsyncExitStack() as stack:
            lease = await stack.enter_async_context(ns.lease(keys[:1]))
            await anyio.to_thread.run_sync(_restart, daemon)
            assert await ns.lookup(keys) == 4  # reconnects
            with pytest.raises(BrokenConnectionError, match="lease the blocks again"):
                lease.views  # noqa: B018
        assert client.reconnects == 1
        assert ns.handle is not before
        out = [bytearray(BLOCK) for _ in range(4)]
        assert await ns.read_into(keys, out) == 4 * BLOCK
        assert [bytes(o) for o in out] == [b.tobytes() for b in blocks]
        assert (await client.stats())["leases"] == 0

        # Several tasks meet the broken connection at once: one reconnects, all succeed.
        await anyio.to_thread.run_sync(_restart, daemon)
        hits: list[int] = []
        async with anyio.create_task_group() as tg:
            for _ in range(4):

                async def look() -> None:
                    hits.append(await ns.lookup(keys))

                tg.start_soon(look)
        assert hits == [4] * 4
        assert client.reconnects == 2


@pytest.mark.anyio
async def test_an_async_write_in_flight_across_a_restart_raises(daemon: DaemonProcess) -> None:
    async with connect_async(daemon.socket, reconnect=POLICY) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 2), 16, ns.key_salt)
        write = ns.write(keys)
        for view, block in zip((await write.__aenter__()).views, _blocks(2), strict=True):
            assert view is not None
            view[:] = block.tobytes()
        await anyio.to_thread.run_sync(_restart, daemon)
        with pytest.raises(BrokenConnectionError, match="write of 2 blocks was in flight"):
            await write.__aexit__(None, None, None)  # the end of its with block: COMMIT
        assert await ns.lookup(keys) == 0
        assert await ns.put(keys, _blocks(2)) == 2


@pytest.mark.anyio
async def test_an_async_client_gives_up_after_the_attempts(daemon: DaemonProcess) -> None:
    policy = Reconnect(attempts=4, first_backoff_s=0.0, max_backoff_s=0.0)
    async with connect_async(daemon.socket, reconnect=policy) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        await anyio.to_thread.run_sync(daemon.stop)
        with _starting_daemon(daemon.socket) as connections:
            with pytest.raises(StartingError, match="gave up reconnecting after 4 attempts"):
                await ns.lookup([b"k" * 16])
            assert connections == [4]
        with pytest.raises(DaemonNotRunningError, match="gave up reconnecting after 4"):
            await client.stats()
        await anyio.to_thread.run_sync(daemon.start)
        assert await ns.lookup([b"k" * 16]) == 0
