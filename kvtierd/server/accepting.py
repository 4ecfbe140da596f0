"""Accepting connections: the Unix socket's listener, the TCP one's connections
(:mod:`kvtierd.server.remote`), and each connection's admission: served by the daemon once it
is open, or told why not (``EAGAIN`` while it starts, the identity refused, ``EBUSY``).

:func:`listen_unix` binds the socket with the configured mode and group, refusing when another
kvtierd answers there and removing one a crashed daemon left; :func:`serve_connections` accepts
on every listener until its scope is cancelled (the sessions then finish what they have in
flight, in its task group).
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteStream, SocketStream

from kvtierd.config import Config
from kvtierd.errors import BusyError, ConfigError, KvtierError
from kvtierd.protocol import ServerConnection
from kvtierd.server.preflight import socket_answers
from kvtierd.server.readiness import Readiness
from kvtierd.server.remote import RemoteListener

__all__ = ["listen_unix", "refuse", "serve_connections"]

log = logging.getLogger("kvtierd")


async def refuse(stream: ByteStream, error: KvtierError) -> None:
    """Send ``error`` as the fatal frame of a new connection, and close it.

    The client's INIT is read first, when it comes within :data:`_REFUSAL_READ_S`: a Unix
    socket closed with unread data resets the connection, and the peer's next read then fails
    with ``ECONNRESET`` instead of returning the frame that says why."""
    with contextlib.suppress(anyio.BrokenResourceError, OSError):
        await stream.send(ServerConnection().fatal(error))  # one small frame: never waits
    with (
        anyio.move_on_after(_REFUSAL_READ_S),
        contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError),
    ):
        await stream.receive(65536)
    await stream.aclose()


#: How long a refused connection is given to send its INIT before it is closed.
_REFUSAL_READ_S = 1.0


async def _admit(stream: SocketStream, readiness: Readiness) -> None:
    """Hand a new connection to the daemon, or tell it the daemon is still starting."""
    daemon = readiness.daemon
    if daemon is None:
        log.debug("a connection while starting: %s", readiness.progress.describe())
        await refuse(stream, readiness.starting_error())
        return
    await daemon.handle(stream)


async def _admit_remote(stream: SocketStream, readiness: Readiness, remote: RemoteListener) -> None:
    """Hand a TCP connection to the daemon once its handshake says who it is, or tell it why
    not (``docs/remote.md``)."""
    hello = await remote.shake_hands(stream)
    if hello is None:
        return
    try:
        daemon = readiness.daemon
        if daemon is None:
            raise readiness.starting_error()
        peer = remote.identify(hello)
    except KvtierError as exc:
        await refuse(hello.stream, exc)
        return
    await daemon.handle_remote(hello.stream, peer)


@contextlib.asynccontextmanager
async def listen_unix(config: Config) -> AsyncIterator[anyio.abc.SocketListener]:
    """The daemon's Unix socket, bound with its mode and group; removed when the block ends."""
    path = config.socket_path
    await anyio.to_thread.run_sync(_prepare_socket_dir, path)
    listener = await anyio.create_unix_listener(path)
    try:
        os.chmod(path, int(config.daemon.socket_mode, 8))
        if config.daemon.socket_group:
            try:
                os.chown(path, -1, grp.getgrnam(config.daemon.socket_group).gr_gid)
            except KeyError:
                raise ConfigError(
                    f"socket_group {config.daemon.socket_group!r} does not exist"
                ) from None
        yield listener
    finally:
        await listener.aclose()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _prepare_socket_dir(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_socket():
        return
    if socket_answers(path):
        raise BusyError(f"another kvtierd is listening on {path}")
    path.unlink()  # a stale socket left by a daemon that crashed


async def serve_connections(
    listener: anyio.abc.SocketListener,
    readiness: Readiness,
    scope: anyio.CancelScope,
    remote: RemoteListener | None = None,
) -> None:
    """Accept connections on the Unix socket (and on TCP, with ``remote``) until ``scope``
    is cancelled; the sessions then finish what they have in flight."""

    async def admit_local(stream: SocketStream) -> None:
        await _admit(stream, readiness)

    async def admit_remote(stream: SocketStream) -> None:
        assert remote is not None
        await _admit_remote(stream, readiness, remote)

    async with anyio.create_task_group() as sessions:
        with scope:
            async with anyio.create_task_group() as accepting:
                for tcp in remote.listeners if remote is not None else ():
                    accepting.start_soon(_accept, tcp, admit_remote, sessions)
                accepting.start_soon(_accept, listener, admit_local, sessions)
        # accepting stopped: the sessions finish what they have in flight


async def _accept(
    listener: anyio.abc.SocketListener,
    admit: Callable[[SocketStream], Coroutine[Any, Any, None]],
    sessions: anyio.abc.TaskGroup,
) -> None:
    while True:
        stream = await listener.accept()
        sessions.start_soon(admit, stream)
