"""The receivers (the daemon's sessions' and the async client's) on real Unix sockets, on
asyncio, uvloop and trio (and anyio's stream, for TLS): bytes arrive in order and whole, the
end of the stream reads as ``b""``, bytes that come while nobody waits are not lost (and do
not make the loop spin), a peer that hangs up on unread replies (an error event, after which
libuv stops the poll) never leaves the reader waiting for ever, descriptors passed with the
bytes reach the sink (none leaked), and closing a receiver ends a receive waiting on it."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import SocketAttribute, SocketListener, SocketStream

from kvtierd.client.base import close_all
from kvtierd.transport.receiving import ReadinessReceiver, Receiver, Taken, open_receiver

pytestmark = pytest.mark.anyio


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    backend: tuple[str, dict[str, Any]] = request.param
    return backend


class _Pair:
    """The daemon's end (a stream and its receiver) and a plain blocking client socket."""

    def __init__(self, stream: SocketStream, client: socket.socket) -> None:
        self.stream = stream
        self.raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
        self.receiver: Receiver = open_receiver(stream, self.raw)
        self.client = client


@contextlib.asynccontextmanager
async def _connected(listener: SocketListener, path: Path) -> AsyncIterator[_Pair]:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(path))
    pair = _Pair(await listener.accept(), client)
    try:
        yield pair
    finally:
        pair.receiver.close()  # before the stream closes the socket, as the session does
        client.close()
        await pair.stream.aclose()


@pytest.fixture
async def listener(tmp_path: Path) -> AsyncIterator[tuple[SocketListener, Path]]:
    path = tmp_path / "s.sock"
    async with await anyio.create_unix_listener(path) as listener:
        yield listener, path


@pytest.fixture
async def pair(listener: tuple[SocketListener, Path]) -> AsyncIterator[_Pair]:
    async with _connected(*listener) as pair:
        yield pair


async def _receive_exactly(receiver: Receiver, n: int) -> bytes:
    got = b""
    while len(got) < n:
        data = await receiver.receive(1 << 16)
        assert data, "end of stream before the bytes sent"
        got += data
    return got


async def test_bytes_arrive_in_order_then_the_end_reads_empty(pair: _Pair) -> None:
    with anyio.fail_after(10):
        for i in range(50):  # each one waited for: the registration is reused every time
            message = bytes([i]) * (i + 1)
            pair.client.sendall(message)
            assert await _receive_exactly(pair.receiver, len(message)) == message
        pair.client.close()
        assert await pair.receiver.receive(1 << 16) == b""


async def test_a_stream_written_through_only_reads_through_it(pair: _Pair) -> None:
    """Without the raw socket (TLS), anyio's receive, with the same contract."""
    receiver = open_receiver(pair.stream, None)
    with anyio.fail_after(10):
        pair.client.sendall(b"through the stream")
        assert await _receive_exactly(receiver, 18) == b"through the stream"
        pair.client.close()
        assert await receiver.receive(1 << 16) == b""


async def test_a_full_buffer_is_followed_by_the_rest(pair: _Pair) -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB: several receives, some of them full
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, pair.client.sendall, payload)
            assert await _receive_exactly(pair.receiver, len(payload)) == payload


class _CountingReceiver(ReadinessReceiver):
    """A real receiver that counts its readiness callbacks."""

    callbacks = 0

    def _on_readable(self) -> None:
        self.callbacks += 1
        super()._on_readable()


async def test_bytes_that_come_while_nobody_waits_neither_spin_nor_get_lost(
    pair: _Pair, anyio_backend: tuple[str, dict[str, Any]]
) -> None:
    if anyio_backend[0] != "asyncio":
        pytest.skip("the readiness receiver is asyncio's")
    import asyncio

    receiver = _CountingReceiver(pair.raw, asyncio.get_running_loop())
    with anyio.fail_after(10):
        pair.client.sendall(b"first")
        assert await _receive_exactly(receiver, 5) == b"first"  # registered, then woken
        pair.client.sendall(b"second")  # nobody waits now
        for _ in range(100):
            await anyio.lowlevel.checkpoint()  # turns of the loop with the bytes unread
        assert receiver.callbacks <= 2  # one to wake, at most one to stop watching
        assert await _receive_exactly(receiver, 6) == b"second"
    receiver.close()


async def test_a_peer_that_hangs_up_on_unread_replies_ends_the_stream(
    listener: tuple[SocketListener, Path],
) -> None:
    """The peer's unread bytes make its close an error (``ECONNRESET``, ``POLLERR``) on this
    side; what it sent before is still received, and then the end, never a wait for ever.
    Each round is a new connection, which may reuse the last one's descriptor number."""
    for round_ in range(20):  # the hang-up comes while the receiver waits, or before
        async with _connected(*listener) as pair:
            pair.raw.send(b"a reply nobody reads")

            def hang_up(pair: _Pair = pair) -> None:
                pair.client.sendall(b"last words")
                pair.client.close()

            with anyio.fail_after(10):
                if round_ % 2:
                    hang_up()
                else:
                    await _receive_after(pair, hang_up)  # registered, then woken: then no more
                assert await _receive_exactly(pair.receiver, 10) == b"last words"
                with contextlib.suppress(ConnectionResetError, anyio.BrokenResourceError):
                    assert await pair.receiver.receive(1 << 16) == b""


async def _receive_after(pair: _Pair, hang_up: Callable[[], None]) -> None:
    """Have the receiver register and wait first, then hang up the peer (sending a first
    byte, read here, so that the second wait is on a registration that has fired)."""
    async with anyio.create_task_group() as tg:

        async def later() -> None:
            await anyio.sleep(0.01)
            pair.client.sendall(b"!")

        tg.start_soon(later)
        assert await pair.receiver.receive(1 << 16) == b"!"
    hang_up()


async def test_a_serving_callback_answers_while_the_reader_sleeps(
    pair: _Pair, anyio_backend: tuple[str, dict[str, Any]]
) -> None:
    """With ``serve_now`` the callback receives for the waiting reader: bytes it serves never
    wake the reader; bytes it declines wake it with ``None`` (they are the session's already);
    the end of the stream still reads as ``b""``."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("the readiness receiver is asyncio's")
    import asyncio

    served: list[bytes] = []
    arrived = {b"served one": anyio.Event(), b"served two": anyio.Event()}

    def serve_now(data: bytes) -> Taken:
        served.append(data)
        if data in arrived:
            arrived[data].set()
        return Taken.LEFT if data.startswith(b"reader") else Taken.AWAITING

    receiver = ReadinessReceiver(pair.raw, asyncio.get_running_loop(), serve_now)
    got: list[bytes | None] = []

    async def read() -> None:
        got.append(await receiver.receive(1 << 16))

    with anyio.fail_after(10):
        pair.client.sendall(b"x")
        assert await receiver.receive(1 << 16) == b"x"  # its own recv: nothing waited yet
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            for message, event in arrived.items():
                pair.client.sendall(message)
                await event.wait()
            assert got == []  # still asleep
            pair.client.sendall(b"reader, please")
        assert got == [None]
        assert served == [b"served one", b"served two", b"reader, please"]
        pair.client.close()
        assert await receiver.receive(1 << 16) == b""
    receiver.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_descriptors_passed_with_the_bytes_go_to_the_sink_in_order(pair: _Pair) -> None:
    """The async client's reads: descriptors (a region) reach the sink in arrival order, with
    their bytes; more than ``max_fds`` in one message are closed by the kernel, none leaked."""
    sink: list[int] = []
    receiver = open_receiver(pair.stream, pair.raw, fds=sink)
    memfds = [os.memfd_create(f"region-{i}") for i in range(6)]
    try:
        before = _open_fds()
        with anyio.fail_after(10):
            socket.send_fds(pair.client, [b"one"], memfds[:1])
            assert await _receive_exactly(receiver, 3) == b"one"
            assert len(sink) == 1
            assert os.readlink(f"/proc/self/fd/{sink[0]}").startswith("/memfd:region-0")
            socket.send_fds(pair.client, [b"many"], memfds[1:])  # 5: one past the cap
            assert await _receive_exactly(receiver, 4) == b"many"
        names = [os.readlink(f"/proc/self/fd/{fd}") for fd in sink]
        assert [n.split(" ")[0] for n in names] == [f"/memfd:region-{i}" for i in range(5)]
        assert _open_fds() == before + len(sink)  # the sixth was never installed here
    finally:
        close_all(sink)
        close_all(memfds)
        receiver.close()


async def test_closing_the_receiver_ends_a_waiting_receive(pair: _Pair) -> None:
    """The client closes its receiver, then the socket, under its waiting reader: the reader
    ends with ``ClosedResourceError`` on every loop, never waits for ever."""
    receiver = open_receiver(pair.stream, pair.raw, fds=[])
    ended: list[BaseException] = []

    async def reader() -> None:
        try:
            while True:
                await receiver.receive(1 << 16)
        except anyio.ClosedResourceError as exc:
            ended.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            receiver.close()
            await pair.stream.aclose()
    assert len(ended) == 1


async def test_a_serving_callback_that_takes_a_hung_up_peers_last_bytes_ends_the_stream(
    pair: _Pair, anyio_backend: tuple[str, dict[str, Any]]
) -> None:
    """The peer sends half a frame and hangs up on a reply it never read, while the reader
    waits: its last bytes and its close's error (``ECONNRESET``: ``POLLERR``) are one event.
    libuv stops the poll on it after one last callback, which hands the half frame to
    ``serve_now`` (nothing to answer yet: it leaves the reader waiting); the reader must then
    still see the end, never wait for ever (on uvloop it did, until its registration was
    renewed: a daemon session left open, an async client's requests never answered)."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("the readiness receiver is asyncio's")
    import asyncio

    served: list[bytes] = []

    def serve_now(data: bytes) -> Taken:
        served.append(data)
        return Taken.AWAITING  # half a frame: the rest awaited, the reader waits on

    receiver = ReadinessReceiver(pair.raw, asyncio.get_running_loop(), serve_now)
    ended: list[bytes | BaseException | None] = []

    async def reader() -> None:
        try:
            while True:
                data = await receiver.receive(1 << 16)
                ended.append(data)
                if data == b"":
                    return
        except (ConnectionResetError, anyio.BrokenResourceError) as exc:
            ended.append(exc)

    with anyio.fail_after(10):  # not a time assertion: the hang becomes a failure
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()  # registered, waiting
            pair.raw.send(b"a reply nobody reads")
            pair.client.sendall(b"half a frame")
            pair.client.close()  # both before the loop looks again: one event
    assert served == [b"half a frame"]
    assert len(ended) == 1
    assert ended[0] == b"" or isinstance(ended[0], ConnectionResetError | anyio.BrokenResourceError)
    receiver.close()
