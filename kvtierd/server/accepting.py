"""Accepting connections: the Unix socket's listener, the TCP one's connections
(:mod:`kvtierd.server.remote`), and each connection's admission: served by the daemon once it
is open, or told why not (``EAGAIN`` while it starts, the identity refused, ``EBUSY``).

:func:`listen_unix` binds the socket with the configured mode and group, refusing when another
kvtierd answers there and removing one a crashed daemon left; :func:`serve_connections` accepts
on every listener until its scope is cancelled (the sessions then finish what they have in
flight, in its task group).

Theory of operation: a connection's failure ends that connection only. Each accepted
connection runs in a task of its own, and whatever it raises (an EOF or a reset in the TLS
handshake, a TLS alert, a timeout, a bug) ends that task and closes that connection: nothing a
peer does reaches the task group that would end the daemon. ``accept`` itself fails for the
listener's sake only on a listener that is gone; ``EMFILE``, ``ENFILE``, ``ENOBUFS`` and
``ENOMEM`` (the process or the host out of descriptors or memory) pause that listener, longer
at each failure up to :data:`_PAUSE_MAX_S`, and the pending connection waits in the backlog;
the network errors Linux reports through ``accept`` are retried at once. Failures are logged
at most once a minute per listener (:class:`~kvtierd.server.throttle.Throttle`).

Each listener holds at most its share of the descriptor budget (:mod:`kvtierd.server.budget`):
the Unix socket ``daemon.max_connections`` sessions and ``UNIX_REFUSALS`` refusals, of which
one uid holds at most its share (:func:`~kvtierd.server.budget.unix_uid_share`: its sessions
and a few refusals, so that a uid refused again and again leaves the others room), TCP
``remote.max_handshakes`` connections before their session (and ``remote.max_connections``
sessions, counted by the daemon). A connection past its listener's cap is closed at once: on
the Unix socket after a non-blocking write of an ``EBUSY`` frame, on TCP unanswered (no TLS
record can be written before a handshake).

Within TCP's caps, no one peer takes all: one source host holds at most
``remote.max_handshakes_per_host`` of the connections before their session (its next one is
closed at once, unanswered: a host trickling ClientHellos leaves the others room), and one
client uid at most ``remote.max_connections_per_uid`` sessions (``EBUSY`` past it, unless one
of its own is idle: :mod:`kvtierd.server.admission`), so that one tenant never takes every
remote session from another.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import ByteStream, SocketAttribute, SocketStream, UNIXSocketStream

from kvtierd.config import Config
from kvtierd.errors import BusyError, ConfigError, KvtierError
from kvtierd.host import unix_listening
from kvtierd.protocol import ServerConnection
from kvtierd.server.activation import take_unix_listener
from kvtierd.server.readiness import Readiness
from kvtierd.server.remote import HandshakeError, RemoteListener, peer_address
from kvtierd.server.session import peer_credentials
from kvtierd.server.throttle import Throttle
from kvtierd.store.namespaces import PeerCredentials

if TYPE_CHECKING:
    from kvtierd.server.session import Session

__all__ = ["Admission", "Entrance", "listen_unix", "refuse", "serve_connections"]

log = logging.getLogger("kvtierd")

#: ``accept`` errors of a process or host short of descriptors or memory: the listener pauses.
_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: ``accept`` errors that say the listener itself is gone: nothing to retry.
_LISTENER_GONE = frozenset({errno.EBADF, errno.EFAULT, errno.EINVAL, errno.ENOTSOCK})
#: The first and the longest pause of a listener after a shortage.
_PAUSE_MIN_S = 0.01
_PAUSE_MAX_S = 1.0
#: What a connection's own failure may raise (logged at debug level: the peer's doing).
_CONNECTION_ERRORS = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    ssl.SSLError,
    OSError,
)


async def refuse(stream: ByteStream, error: KvtierError) -> None:
    """Send ``error`` as the fatal frame of a new connection, and close it.

    The client's INIT is read first, when it comes within :data:`_REFUSAL_READ_S`: a Unix
    socket closed with unread data resets the connection, and the peer's next read then fails
    with ``ECONNRESET`` instead of returning the frame that says why."""
    try:
        with contextlib.suppress(*_CONNECTION_ERRORS), anyio.move_on_after(_REFUSAL_READ_S):
            await stream.send(ServerConnection().fatal(error))  # one small frame
            await stream.receive(65536)
    finally:
        await stream.aclose()


#: How long a refused connection is given to send its INIT before it is closed.
_REFUSAL_READ_S = 1.0


class _Slots:
    """The connections a listener holds: at most ``cap``, and at most ``per_key`` of one key
    (a source host) when it is given."""

    def __init__(self, cap: int, per_key: int | None = None) -> None:
        self.cap = cap
        self.per_key = per_key
        self.held = 0
        #: The slots each key holds (keys holding none are forgotten).
        self.of_key: dict[str, int] = {}

    def refusal(self, key: str) -> str | None:
        """Why a new connection of ``key`` gets no slot (the key of the cap it would break:
        ``"cap"`` or ``key``), or ``None`` when one is free."""
        if self.held >= self.cap:
            return "cap"
        if self.per_key is not None and self.of_key.get(key, 0) >= self.per_key:
            return key
        return None

    def take(self, key: str) -> _Slot:
        """A slot for a new connection of ``key`` (:meth:`refusal` said there is one)."""
        self.held += 1
        self.of_key[key] = self.of_key.get(key, 0) + 1
        return _Slot(self, key)


class _Slot:
    """One connection's place in its listener's :class:`_Slots`."""

    def __init__(self, slots: _Slots, key: str) -> None:
        self._slots: _Slots | None = slots
        self._key = key

    def give_back(self) -> None:
        """Free the slot (again: nothing)."""
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.held -= 1
            left = slots.of_key.pop(self._key) - 1
            if left:
                slots.of_key[self._key] = left


class Admission(Protocol):
    """What the listeners hand connections to: the daemon, once it serves."""

    async def handle(self, stream: SocketStream) -> None:
        """Serve a connection to the Unix socket, or tell it why not."""

    def admit(self, stream: ByteStream, peer: PeerCredentials, *, direct: bool) -> Session:
        """A session for ``stream`` of ``peer``; raises :class:`BusyError` when it does not
        fit."""

    async def serve(self, session: Session) -> None:
        """Run an admitted session to its end."""


class Entrance:
    """Where the listeners take their connections: while the daemon starts, each is told the
    start-up's progress (``EAGAIN``); once it serves (:meth:`open`), each is handed to it."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness
        self.host: Admission | None = None

    def open(self, host: Admission) -> None:
        self.host = host


async def _admit(stream: SocketStream, entrance: Entrance) -> None:
    """Hand a new connection to the daemon, or tell it the daemon is still starting."""
    daemon = entrance.host
    if daemon is None:
        log.debug("a connection while starting: %s", entrance.readiness.progress.describe())
        await refuse(stream, entrance.readiness.starting_error())
        return
    await daemon.handle(stream)


async def _admit_remote(
    stream: SocketStream, slot: _Slot, where: str, entrance: Entrance, remote: RemoteListener
) -> None:
    """Hand a TCP connection to the daemon once its handshake says who it is, or tell it why
    not (``docs/remote.md``). It holds its handshake slot until its session starts."""
    try:
        hello = await remote.shake_hands(stream, where)
    except HandshakeError:
        return
    try:
        daemon = entrance.host
        if daemon is None:
            raise entrance.readiness.starting_error()
        peer = remote.identify(hello)
        try:
            # Written through the stream only: a TLS socket carries records, not frames, and on
            # asyncio a TCP stream's socket is its transport's, which cannot be sent on.
            session = daemon.admit(hello.stream, peer, direct=False)
        except BusyError as exc:
            key = f"uid {peer.uid}"
            remote.failures.report(log, logging.WARNING, key, "refusing %s: %s", peer, exc)
            raise
    except KvtierError as exc:
        await refuse(hello.stream, exc)
        return
    slot.give_back()
    await daemon.serve(session)


@contextlib.asynccontextmanager
async def listen_unix(config: Config) -> AsyncIterator[anyio.abc.SocketListener]:
    """The daemon's Unix socket, bound with its mode and group; removed when the block ends.
    Under socket activation (:mod:`kvtierd.server.activation`) the one systemd passed, with the
    mode and group its ``.socket`` unit gave it, left in place at the end: the connections
    made until the next start wait in it."""
    path = config.socket_path
    passed = take_unix_listener(path)
    if passed is not None:
        passed.setblocking(False)
        listener = await anyio.abc.SocketListener.from_socket(passed)
        log.info(
            "listening on %s, passed by systemd (socket activation): connections made while "
            "the daemon restarts wait in its backlog",
            path,
        )
        try:
            yield listener
        finally:
            await listener.aclose()
        return
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
    if unix_listening(path):  # read from /proc: connecting to systemd's socket would start a daemon
        raise BusyError(
            f"another process listens on {path} (a kvtierd, or systemd's kvtierd.socket: start "
            "the daemon through the unit then)"
        )
    path.unlink()  # a stale socket left by a daemon that crashed


async def serve_connections(
    listener: anyio.abc.SocketListener,
    entrance: Entrance,
    scope: anyio.CancelScope,
    remote: RemoteListener | None = None,
    *,
    unix_cap: int,
    unix_per_uid: int,
) -> None:
    """Accept connections on the Unix socket (at most ``unix_cap`` at once, ``unix_per_uid``
    of one uid) and on TCP (with ``remote``) until ``scope`` is cancelled; the sessions then
    finish what they have in flight."""

    async def admit_local(stream: SocketStream, slot: _Slot, where: str) -> None:
        await _admit(stream, entrance)  # holding its slot to its end

    doors = [
        _Door(
            listener,
            "the Unix socket",
            _Slots(unix_cap, unix_per_uid),
            admit_local,
            _turn_away,
            where_from=_uid_of,
            key_of=lambda where: where,
            crowded="%s holds %d connections of %s (its share: sessions and refusals "
            "together): closing new ones at once",
        )
    ]
    if remote is not None:

        async def admit_remote(stream: SocketStream, slot: _Slot, where: str) -> None:
            await _admit_remote(stream, slot, where, entrance, remote)

        # Shared by its addresses; ``max_handshakes_per_host`` of them per source host.
        handshakes = _Slots(remote.config.max_handshakes, remote.config.max_handshakes_per_host)
        where = f"TCP {remote.config.listen}"
        doors += [
            _Door(tcp, where, handshakes, admit_remote, _close, peer_address, _host)
            for tcp in remote.listeners
        ]
    async with anyio.create_task_group() as sessions:
        with scope:
            async with anyio.create_task_group() as accepting:
                for door in doors:
                    accepting.start_soon(_accept, door, sessions)
        # accepting stopped: the sessions finish what they have in flight


@dataclass(eq=False)
class _Door:
    """A listener, its cap, and what becomes of the connections it accepts."""

    listener: anyio.abc.SocketListener
    #: The listener in log records.
    where: str
    slots: _Slots
    #: Serves a connection that got a slot, given where it comes from.
    admit: Callable[[SocketStream, _Slot, str], Coroutine[Any, Any, None]]
    #: Closes a connection that got none.
    overflow: Callable[[SocketStream], Coroutine[Any, Any, None]]
    #: Where a connection comes from, taken as it is accepted (a reset may take it later).
    where_from: Callable[[SocketStream], str] = lambda stream: ""
    #: The key of ``slots``' per-key cap, given where it comes from: its host.
    key_of: Callable[[str], str] = lambda where: ""
    #: The log record of a connection past the per-key cap: where, the cap, the key.
    crowded: str = (
        "%s holds %d connections before their session from %s (its cap per host): "
        "closing new ones from it at once"
    )
    #: Its failures and refusals, logged at most once a minute each.
    failures: Throttle = field(default_factory=Throttle)


async def _accept(door: _Door, sessions: anyio.abc.TaskGroup) -> None:
    """Accept on ``door`` for ever: each connection admitted in a task of ``sessions`` while
    its slots have room, turned away when they have none."""
    pause_s = 0.0
    while True:
        try:
            stream = await door.listener.accept()
        except (OSError, anyio.BrokenResourceError) as exc:
            error = exc if isinstance(exc, OSError) else exc.__cause__
            code = error.errno if isinstance(error, OSError) else None
            if code in _LISTENER_GONE:
                raise
            shortage = code in _SHORTAGE
            pause_s = min(max(2 * pause_s, _PAUSE_MIN_S), _PAUSE_MAX_S) if shortage else 0.0
            remedy = " (lower the connection caps or raise LimitNOFILE: docs/operations.md)"
            door.failures.report(
                log,
                logging.ERROR if shortage else logging.WARNING,
                "accept",
                "cannot accept on %s: %s%s",
                door.where,
                error or repr(exc),
                remedy if shortage else "",
            )
            await anyio.sleep(pause_s)
            continue
        pause_s = 0.0
        where = door.where_from(stream)
        key = door.key_of(where)
        refusal = door.slots.refusal(key)
        if refusal == "cap":
            door.failures.report(
                log, logging.WARNING, "cap",
                "%s holds %d connections (its cap): closing new ones at once",
                door.where, door.slots.cap,
            )  # fmt: skip
            await door.overflow(stream)
        elif refusal is not None:
            door.failures.report(
                log, logging.WARNING, f"key {key}", door.crowded,
                door.where, door.slots.per_key, key,
            )  # fmt: skip
            await door.overflow(stream)
        else:
            sessions.start_soon(_contained, door, stream, door.slots.take(key), where)


async def _contained(door: _Door, stream: SocketStream, slot: _Slot, where: str) -> None:
    """Admit ``stream``; whatever that raises ends this connection only."""
    try:
        await door.admit(stream, slot, where)
    except _CONNECTION_ERRORS as exc:
        log.debug("a connection on %s ended: %r", door.where, exc)
    except Exception as exc:  # a bug must cost one connection, never the daemon
        door.failures.report(
            log, logging.ERROR, "bug", "serving a connection on %s failed", door.where,
            exc_info=exc,
        )  # fmt: skip
    finally:
        slot.give_back()
        await _close(stream)


def _uid_of(stream: SocketStream) -> str:
    """``"uid N"`` of a Unix connection's peer (``SO_PEERCRED``), taken as it is accepted;
    ``""`` when the socket cannot say (a peer gone at once: it is refused like any other)."""
    if not isinstance(stream, UNIXSocketStream):
        return ""
    try:
        return f"uid {peer_credentials(stream).uid}"
    except OSError:
        return ""


def _host(where: str) -> str:
    """The host of ``host:port`` (:func:`peer_address`)."""
    return where.rpartition(":")[0] or where


async def _turn_away(stream: SocketStream) -> None:
    """Close a Unix connection past the cap at once, after the ``EBUSY`` frame if the socket
    takes it without waiting (its INIT is not waited for: the peer may read ``ECONNRESET``)."""
    frame = ServerConnection().fatal(BusyError("too many connections on the socket"))
    with contextlib.suppress(OSError):
        stream.extra(SocketAttribute.raw_socket).send(frame)
    await _close(stream)


async def _close(stream: SocketStream) -> None:
    with anyio.CancelScope(shield=True):
        await stream.aclose()
