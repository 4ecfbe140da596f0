"""One client shared by many threads (or tasks), and a client after ``close()``, against a real
daemon.

A blocking reader drops every reply that is not its own, so a thread that read while another
waited would leave that one waiting for ever. Each thread here runs a mix of every kind of call
(namespace opens of new and existing namespaces, put, lookup, get, read_into, FSYNC, STATFS,
EVICT, the namespace listing) and checks every result; the clients have a timeout, so a lost
reply fails the test as ``TimedOutError`` instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import numpy as np
import pytest

from kvtierd.client import Client, chain_keys, connect, connect_async
from kvtierd.errors import ClosedError
from kvtierd.testing import DaemonProcess

pytestmark = pytest.mark.timeout(180)

T = TypeVar("T")
BLOCK = 16 << 10
BLOCKS = 4  # per put
THREADS = 8
ROUNDS = 12
#: Longer than any call here takes, shorter than the test's timeout: a lost reply fails.
CALL_TIMEOUT_S = 30.0


def _in_threads(target: Callable[[int], T], count: int = THREADS) -> list[T]:
    """``target(i)`` for ``i`` in ``range(count)``, each in its own thread, started together;
    returns the results, or raises the first thread's exception."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as exc:  # reported by the test, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 2 * CALL_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


def _blocks(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]


def _tokens(thread: int, round_: int) -> range:
    """Tokens of their own for each thread and round, so every put stores new keys."""
    first = (thread * ROUNDS + round_) * BLOCKS * 16
    return range(first, first + BLOCKS * 16)


def _namespace_name(thread: int, round_: int) -> str:
    """The shared namespace (opened by every thread) on even rounds, a new one on odd ones."""
    return "shared" if round_ % 2 == 0 else f"thread-{thread}-round-{round_}"


def _side_call(client: Client, round_: int, name: str) -> None:
    """One of the client's calls that are not an operation on a namespace."""
    match round_ % 4:
        case 0:
            assert client.fsync() >= BLOCKS  # this thread's blocks at least
        case 1:
            assert client.stats()["version"] == client.daemon_version
        case 2:
            assert client.evict() >= 0  # the daemon's own user may evict
        case _:
            assert name in {info["name"] for info in client.namespaces()}


def test_threads_sharing_a_client_each_get_their_own_replies(daemon: DaemonProcess) -> None:
    with connect(daemon.socket, timeout_s=CALL_TIMEOUT_S) as client:

        def worker(thread: int) -> int:
            for round_ in range(ROUNDS):
                name = _namespace_name(thread, round_)
                ns = client.namespace(name, block_bytes=BLOCK)
                keys = chain_keys(_tokens(thread, round_), 16, salt=ns.key_salt)
                blocks = _blocks(thread * ROUNDS + round_)
                assert ns.put(keys, blocks) == BLOCKS
                assert ns.lookup(keys) == BLOCKS
                with ns.get(keys) as views:
                    assert [bytes(v) for v in views] == [b.tobytes() for b in blocks]
                out = [np.empty(BLOCK, np.uint8) for _ in keys]
                assert ns.read_into(keys, out) == BLOCKS * BLOCK
                assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
                _side_call(client, round_, name)
            return ROUNDS

        assert _in_threads(worker) == [ROUNDS] * THREADS
        # Everything every thread stored is there, and nothing it was granted is still held:
        # RELEASEs queued by any thread go out before this connection's next request.
        for thread in range(THREADS):
            for round_ in range(ROUNDS):
                ns = client.namespace(_namespace_name(thread, round_), block_bytes=BLOCK)
                keys = chain_keys(_tokens(thread, round_), 16, salt=ns.key_salt)
                out = [np.empty(BLOCK, np.uint8) for _ in keys]
                ns.read_into(keys, out)
                want = _blocks(thread * ROUNDS + round_)
                assert all((o == b).all() for o, b in zip(out, want, strict=True))
        stats = client.stats()
        assert (stats["leases"], stats["pending_writes"]) == (0, 0)


@pytest.mark.anyio
async def test_tasks_sharing_an_async_client_each_get_their_own_replies(
    daemon: DaemonProcess,
) -> None:
    async with connect_async(daemon.socket) as client:

        async def worker(task: int) -> None:
            for round_ in range(ROUNDS):
                name = _namespace_name(task, round_)
                ns = await client.namespace(name, block_bytes=BLOCK)
                keys = chain_keys(_tokens(task, round_), 16, salt=ns.key_salt)
                blocks = _blocks(task * ROUNDS + round_)
                assert await ns.put(keys, blocks) == BLOCKS
                assert await ns.lookup(keys) == BLOCKS
                async with ns.get(keys) as views:
                    assert [bytes(v) for v in views] == [b.tobytes() for b in blocks]
                match round_ % 3:
                    case 0:
                        assert await client.fsync() >= BLOCKS
                    case 1:
                        assert (await client.stats())["version"] == client.daemon_version
                    case _:
                        assert await client.evict() >= 0
            done.append(task)

        done: list[int] = []
        with anyio.fail_after(2 * CALL_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                for task in range(THREADS):
                    tg.start_soon(worker, task)
        assert sorted(done) == list(range(THREADS))
        stats = await client.stats()
        assert (stats["leases"], stats["pending_writes"]) == (0, 0)


def _connections_soon(observer: Client, wanted: int) -> bool:
    """The daemon forgets a closed connection a moment after the client has closed it."""
    deadline = time.monotonic() + 10
    while observer.stats()["connections"] != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(observer.stats()["connections"] == wanted)


def test_every_call_after_close_raises_closed_error(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as observer:
        client = connect(daemon.socket)
        ns = client.namespace("closed", block_bytes=BLOCK)
        keys = chain_keys(range(16 * BLOCKS), 16, salt=ns.key_salt)
        ns.put(keys, _blocks(0))
        client.close()
        client.close()  # idempotent
        assert _connections_soon(observer, 1)
        calls: list[Callable[[], object]] = [
            lambda: client.namespace("closed", block_bytes=BLOCK),
            lambda: client.namespace("never-opened", block_bytes=BLOCK),
            client.fsync,
            client.stats,
            client.evict,
            client.namespaces,
            lambda: ns.put(keys, _blocks(1)),
            lambda: ns.lookup(keys),
            lambda: ns.acquire(keys),
            lambda: ns.read_into(keys, [np.empty(BLOCK, np.uint8) for _ in keys]),
            lambda: ns.forget(keys),
            lambda: ns.arena,
        ]
        for call in calls:
            with pytest.raises(ClosedError):
                call()
        assert observer.stats()["connections"] == 1  # nothing reconnected
        assert ns.key_salt  # what needs no connection still answers


def test_a_close_from_another_thread_ends_every_threads_calls_with_closed_error(
    daemon: DaemonProcess,
) -> None:
    """Threads call in a loop while two others close the client: each call either completes
    or raises ``ClosedError``, never another error, and nothing is left connected."""
    with connect(daemon.socket) as observer:
        client = connect(daemon.socket, timeout_s=CALL_TIMEOUT_S)
        ns = client.namespace("closing", block_bytes=BLOCK)
        keys = chain_keys(range(16 * BLOCKS), 16, salt=ns.key_salt)
        callers = THREADS - 2
        under_way = threading.Barrier(THREADS)  # every caller 20 calls in, and the closers

        def one_call(thread: int, calls: int) -> None:
            match calls % 4:
                case 0:
                    assert ns.put(keys, _blocks(thread)) == BLOCKS
                case 1:
                    assert ns.lookup(keys) == BLOCKS
                case 2:
                    client.namespace("closing", block_bytes=BLOCK)
                case _:
                    client.stats()

        def caller(thread: int) -> int:
            """Calls until the client is closed; how many completed."""
            calls = 0
            while True:
                try:
                    one_call(thread, calls)
                except ClosedError:
                    return calls
                calls += 1
                if calls == 20:
                    under_way.wait(CALL_TIMEOUT_S)

        def closer(_: int) -> int:
            under_way.wait(CALL_TIMEOUT_S)
            client.close()
            return 0

        def either(i: int) -> int:
            return caller(i) if i < callers else closer(i)

        assert min(_in_threads(either)[:callers]) >= 20
        assert _connections_soon(observer, 1)
        with pytest.raises(ClosedError):
            client.stats()


@pytest.mark.anyio
async def test_every_async_call_after_aclose_raises_closed_error(daemon: DaemonProcess) -> None:
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("closed", block_bytes=BLOCK)
        keys = chain_keys(range(16 * BLOCKS), 16, salt=ns.key_salt)
        await ns.put(keys, _blocks(0))
        await client.aclose()
        await client.aclose()  # idempotent
        with connect(daemon.socket) as observer:
            assert _connections_soon(observer, 1)
        with pytest.raises(ClosedError):
            await client.namespace("closed", block_bytes=BLOCK)
        with pytest.raises(ClosedError):
            await client.fsync()
        with pytest.raises(ClosedError):
            await client.stats()
        with pytest.raises(ClosedError):
            await client.evict()
        with pytest.raises(ClosedError):
            await ns.lookup(keys)
        with pytest.raises(ClosedError):
            await ns.put(keys, _blocks(1))
        with pytest.raises(ClosedError):
            async with ns.get(keys):
                pass
        with pytest.raises(ClosedError):
            ns.arena  # noqa: B018 - the property is the call under test
    # leaving connect_async closes again: still nothing raised
