"""Reading a connection's bytes: one ``recv`` per wake-up, and no readiness churn on asyncio.

The daemon's sessions and the async client's reply reader both read this way. A reader that
may be passed descriptors (the client: an OPEN_NS reply's region) gives a ``fds`` sink: every
read is then a ``recvmsg`` taking at most ``max_fds`` descriptors (``SCM_RIGHTS``), appended
to the sink in arrival order; more than that in one message are closed by the kernel
(``MSG_CTRUNC``), as anyio's ``receive_fds`` let them be.

Theory of operation. anyio's socket stream on asyncio (uvloop included) receives by trying
``recv`` after a checkpoint and, when it would block, registering a reader with the loop for
that one wait and removing it after: per request that is an extra turn of the loop, a
``recv`` that fails with ``EAGAIN``, and two ``epoll_ctl`` calls (measured with ``strace``: 3.6
``epoll_ctl`` and 1.6 ``recvfrom`` per LOOKUP). A LOOKUP's reply costs about as much as all
that, so on asyncio :class:`ReadinessReceiver` keeps the socket's reader registered while the
connection lives and waits on it directly:

* after a ``recv`` that returned less than it asked for, the socket was empty, so the next
  receive waits for readiness without trying ``recv`` first (the reader is level-triggered:
  bytes that came meanwhile make it fire at once);
* after a full ``recv`` (more may be queued) it tries again after one checkpoint, so that a
  client streaming requests still gives the loop back between buffers, as anyio's does;
* a readiness callback that finds nobody waiting (the reader is busy serving) removes the
  reader, so a connection whose bytes wait unread never makes the loop spin; the next wait
  registers it again;
* each wait registers the reader again, which for a registered one costs no system call
  (uvloop and the selector loop only swap the callback) and survives libuv's rule that an
  error event (``POLLERR``: a peer that closed with replies unread) stops the poll for good;
* a callback that leaves the reader waiting (below) without having written to the peer
  registers it again once the loop is done with the event, on uvloop: that event may have
  been the error, after which libuv never calls back, and the bytes it read the peer's last
  (half a frame), so that the end of the stream would wait unread under a reader waiting for
  ever (:meth:`ReadinessReceiver._wait_on`).

Serving from the callback. The session may hand :class:`ReadinessReceiver` a ``serve_now``
function. Then a readiness callback that finds the reader waiting does the ``recv`` itself and
passes the bytes to ``serve_now``, which answers at once what needs no waiting (a LOOKUP of
a few keys) and says (:class:`Taken`) whether it answered everything: if so the reader sleeps
on, so a request costs no wake-up of the reader's task and no extra turns of the loop (the
daemon's CPU per LOOKUP fell about a fifth); if not, the bytes are already the session's and
``receive`` returns ``None`` to say so. The end of the stream and socket errors go to the
reader as they would from its own ``recv``.

Every wait is a checkpoint, as anyio's receive is: cancelling the reader's scope interrupts it.
On trio, :class:`WaitingReceiver` follows the same rules with the backend's own
``wait_readable`` (which registers for each wait, as trio's sockets do, but skips the turn of
the loop trio's ``recv`` takes after every read). For streams written through only (TLS),
:class:`StreamReceiver` is anyio's ``receive``. All return ``b""`` at the end of the stream; a
socket error propagates as the ``OSError`` it is, or as anyio's ``BrokenResourceError``
(:class:`StreamReceiver`): the session ends on either.
"""

from __future__ import annotations

import array
import asyncio
import enum
import socket
from asyncio.selector_events import BaseSelectorEventLoop
from collections.abc import Callable, MutableSequence
from typing import Protocol, cast

import anyio
import anyio.lowlevel
import sniffio
from anyio.abc import ByteStream

__all__ = [
    "ReadinessReceiver",
    "Receiver",
    "StreamReceiver",
    "Taken",
    "WaitingReceiver",
    "open_receiver",
    "recv_with_fds",
]

#: Descriptors taken per ``recvmsg`` unless told otherwise.
MAX_FDS = 4


def recv_with_fds(
    sock: socket.socket, max_bytes: int, fds: MutableSequence[int], max_fds: int = MAX_FDS
) -> bytes:
    """One ``recvmsg`` of up to ``max_bytes`` bytes; the descriptors passed with them (at most
    ``max_fds``: the kernel closes the rest) are appended to ``fds``, which then owns them."""
    data, ancdata, _flags, _addr = sock.recvmsg(
        max_bytes, socket.CMSG_LEN(max_fds * array.array("i").itemsize)
    )
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds.extend(received)
    return data


def _recv_of(
    sock: socket.socket, fds: MutableSequence[int] | None, max_fds: int
) -> Callable[[int], bytes]:
    """The receive function: ``sock.recv``, or :func:`recv_with_fds` into ``fds``."""
    if fds is None:
        return sock.recv
    return lambda max_bytes: recv_with_fds(sock, max_bytes, fds, max_fds)


class Receiver(Protocol):
    """What the session reads with."""

    async def receive(self, max_bytes: int) -> bytes | None:
        """Up to ``max_bytes`` bytes, at least one; ``b""`` at the end of the stream; ``None``
        when what arrived went to ``serve_now`` (:class:`ReadinessReceiver`) instead."""
        ...

    def close(self) -> None:
        """Stop watching the socket (before it is closed)."""
        ...


class StreamReceiver:
    """anyio's ``receive``, with the end of the stream as ``b""``."""

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream

    async def receive(self, max_bytes: int) -> bytes:
        try:
            return await self._stream.receive(max_bytes)
        except anyio.EndOfStream:
            return b""

    def close(self) -> None:
        pass


#: What the reader's waiter is told when the callback handed the bytes to ``serve_now``.
_SERVED = object()


class Taken(enum.Enum):
    """What ``serve_now`` made of the bytes the readiness callback read for it."""

    #: Not all served: the bytes are the caller's now, and the reader goes on (its
    #: ``receive`` returns ``None``).
    LEFT = enum.auto()
    #: All served, and the registration need not be proven alive (:meth:`ReadinessReceiver.
    #: _wait_on`): the callback wrote to the peer after the event, so the peer had not closed
    #: and the event was no error (a Unix socket reports ``POLLERR`` only once its peer
    #: closed, and a write to a closed peer fails with ``EPIPE``); or nothing is awaited from
    #: the peer before the caller writes to it again, which finds a closed peer out. The
    #: reader sleeps on.
    SERVED = enum.auto()
    #: All served, and more is awaited from the peer (the rest of half a frame, replies still
    #: owed): the reader sleeps on, its registration proven alive once the loop is done with
    #: the event.
    AWAITING = enum.auto()


#: Looked up once: an enum member's lookup costs about 0.1 us (Python 3.11), on the path of
#: every request answered from the callback.
_TAKEN_SERVED = Taken.SERVED
_TAKEN_AWAITING = Taken.AWAITING


class _SocketReceiver:
    """The rules both raw-socket receivers follow (the module's theory of operation): after a
    short ``recv`` wait for readiness first, after a full one try again after a checkpoint.
    Subclasses wait (``_wait``): ``None`` to ``recv`` now, else what to return instead."""

    def __init__(
        self, sock: socket.socket, fds: MutableSequence[int] | None = None, max_fds: int = MAX_FDS
    ) -> None:
        self._sock = sock
        self._recv = _recv_of(sock, fds, max_fds)
        #: The last ``recv`` emptied the socket: wait before the next one.
        self._drained = False
        self._closed = False

    async def receive(self, max_bytes: int) -> bytes | None:
        recv = self._recv
        if self._drained:
            got = await self._wait(max_bytes)
            if got is not None:
                return None if got is _SERVED else cast(bytes, got)
        else:
            await anyio.lowlevel.checkpoint()
        while True:
            try:
                data = recv(max_bytes)
            except (BlockingIOError, InterruptedError):
                # the readiness was spurious: wait for the real one
                got = await self._wait(max_bytes)
                if got is not None:
                    return None if got is _SERVED else cast(bytes, got)
                continue
            self._drained = len(data) < max_bytes
            return data

    async def _wait(self, max_bytes: int) -> object:
        raise NotImplementedError


class ReadinessReceiver(_SocketReceiver):
    """Receives from a non-blocking socket on an asyncio loop whose reader callback stays
    registered between requests, optionally serving from that callback (see the module's
    theory of operation)."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        serve_now: Callable[[bytes], Taken] | None = None,
        fds: MutableSequence[int] | None = None,
        max_fds: int = MAX_FDS,
    ) -> None:
        super().__init__(sock, fds, max_fds)
        self._fd = sock.fileno()
        self._loop = loop
        self._serve_now = serve_now
        #: Told ``None`` (readable: receive), bytes (the callback's ``recv``: b"" at the end),
        #: or ``_SERVED``.
        self._waiter: asyncio.Future[object] | None = None
        #: What the waiting ``receive`` asked for, for the callback's ``recv``.
        self._max_bytes = 0
        #: The loop may stop calling the callback back without a word (:meth:`_wait_on`).
        self._rearms = not isinstance(loop, BaseSelectorEventLoop)

    async def _wait(self, max_bytes: int) -> object:
        if self._closed:
            raise anyio.ClosedResourceError
        waiter = self._loop.create_future()
        self._waiter = waiter
        self._max_bytes = max_bytes
        self._register()
        try:
            return await waiter
        finally:
            self._waiter = None

    def _register(self) -> None:
        """Register the readiness callback. Registered already, this only swaps the callback's
        handle (no system call), and it proves the registration alive: libuv stops a poll
        whose descriptor reports an error (``POLLERR``: a peer that hung up on unread
        replies) after one last call of the callback, and uvloop then refuses the poll
        (``RuntimeError``) until it is removed and made anew."""
        try:
            self._loop.add_reader(self._fd, self._on_readable)
        except RuntimeError:
            self._loop.remove_reader(self._fd)
            self._loop.add_reader(self._fd, self._on_readable)

    def _rearm(self) -> None:
        """After a callback that left the reader waiting: register again if it still waits
        (:meth:`_wait_on` says why)."""
        waiter = self._waiter
        if not self._closed and waiter is not None and not waiter.done():
            self._register()

    def _on_readable(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():  # nobody waits: stop watching until somebody does
            self._loop.remove_reader(self._fd)
            return
        serve_now = self._serve_now
        if serve_now is None:
            waiter.set_result(None)
            return
        max_bytes = self._max_bytes
        try:
            data = self._recv(max_bytes)
        except (BlockingIOError, InterruptedError):
            self._wait_on()  # spurious
            return
        except OSError as exc:
            waiter.set_exception(exc)  # raised by the reader's receive, as its own recv would
            return
        self._drained = len(data) < max_bytes
        if not data:
            waiter.set_result(data)
            return
        try:
            taken = serve_now(data)
        except BaseException as exc:  # not lost in the loop's handler: the reader raises it
            if not waiter.done():
                waiter.set_exception(exc)
            return
        if taken is _TAKEN_SERVED or waiter.done():
            return
        if taken is _TAKEN_AWAITING:
            self._wait_on()
        else:  # the session's now, for the reader to go on
            waiter.set_result(_SERVED)

    def _wait_on(self) -> None:
        """The callback leaves the reader waiting, and nothing proved the peer still there.
        This call may have been libuv's last: on a socket error event (``POLLERR``, which a
        Unix socket reports once its peer closed with bytes unread) libuv stops the poll for
        good and uvloop calls the callback once more before it closes the poll, whatever the
        callback does. If the ``recv`` here took the peer's last bytes (half a frame, or
        replies the caller is not done with), nothing would ever call back again: the end of
        the stream and the error would wait unread, and the reader with them, for ever. So on
        loops other than the selector loop (which is level-triggered through and through) the
        registration is proven alive once the loop is done with this event: a live one costs
        a swap of the callback's handle (about a microsecond), which is why ``serve_now``
        says when it can do without (:attr:`Taken.SERVED`)."""
        if self._rearms:
            self._loop.call_soon(self._rearm)

    def close(self) -> None:
        """Stop watching the socket (idempotent); a ``receive`` waiting meanwhile raises
        ``ClosedResourceError`` (the client closes a connection under its reader)."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(anyio.ClosedResourceError())


class WaitingReceiver(_SocketReceiver):
    """Receives from a non-blocking socket, waiting with anyio's ``wait_readable`` (trio)."""

    async def _wait(self, max_bytes: int) -> object:
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            await anyio.wait_readable(self._sock)
        except Exception as exc:
            # The socket closed under the wait (trio raises its own ClosedResourceError).
            if self._closed:
                raise anyio.ClosedResourceError from exc
            raise
        return None

    def close(self) -> None:
        self._closed = True


def open_receiver(
    stream: ByteStream,
    raw: socket.socket | None,
    serve_now: Callable[[bytes], Taken] | None = None,
    fds: MutableSequence[int] | None = None,
) -> Receiver:
    """The receiver for ``stream``: when the session may use the raw socket ``raw`` directly,
    :class:`ReadinessReceiver` on asyncio (serving with ``serve_now``, when given) and
    :class:`WaitingReceiver` elsewhere (trio); else :class:`StreamReceiver`. With ``fds``
    (raw sockets only), descriptors passed with the bytes go there (:func:`recv_with_fds`)."""
    if raw is None:
        assert fds is None, "a stream receiver takes no descriptors"
        return StreamReceiver(stream)
    if sniffio.current_async_library() == "asyncio":
        return ReadinessReceiver(raw, asyncio.get_running_loop(), serve_now, fds)
    return WaitingReceiver(raw, fds)
