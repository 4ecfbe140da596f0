"""The exception hierarchy, and the one place where errors meet errno values.

Every failure kvtierd reports is a :class:`KvtierError`. Classes are chosen by who is at fault
(h11's ``LocalProtocolError`` vs ``RemoteProtocolError``; trio's ``ClosedResourceError`` vs
``BrokenResourceError``) and, where a standard meaning fits, they also inherit it
(``BlockNotFoundError`` is a ``KeyError``).

On the wire a reply carries ``0`` or a negative errno. :data:`ERRNO_TO_ERROR` maps each errno to
exactly one class, so the client raises what the server meant; :func:`error_from_errno` and
:func:`errno_of` are the two directions of that mapping and the only translation points.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "CONNECTION_ERRORS",
    "ERRNO_TO_ERROR",
    "AccessDeniedError",
    "BlockNotFoundError",
    "BrokenConnectionError",
    "BusyError",
    "ClosedError",
    "ConfigError",
    "ConfigProblem",
    "CorruptBlockError",
    "DaemonNotRunningError",
    "InvalidRequestError",
    "KvtierError",
    "LocalProtocolError",
    "NoSpaceError",
    "NotSupportedError",
    "QuotaError",
    "RemoteProtocolError",
    "StartingError",
    "StorageIOError",
    "TimedOutError",
    "UnknownTenantError",
    "errno_of",
    "error_from_errno",
    "is_connection_loss",
]


class KvtierError(Exception):
    """Root of every kvtierd error. ``errno`` is the value sent on the wire (positive)."""

    errno: int = errno.EIO


class BlockNotFoundError(KvtierError, KeyError):
    """A requested block is in no tier (``ENOENT``)."""

    errno = errno.ENOENT

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable.
        return Exception.__str__(self)


class CorruptBlockError(BlockNotFoundError):
    """A block read from DRAM did not hash to its committed checksum: a client of its tenant
    changed it after COMMIT. A miss (``ENOENT``), raised by the client library; never data."""


class InvalidRequestError(KvtierError, ValueError):
    """A well-formed request asked for something impossible (``EINVAL``)."""

    errno = errno.EINVAL


class NoSpaceError(KvtierError, OSError):
    """No room in the arena or on disk, even after eviction (``ENOSPC``)."""

    errno = errno.ENOSPC

    def __init__(self, *args: object) -> None:
        KvtierError.__init__(self, *args)


class QuotaError(KvtierError, OSError):
    """A limit of the connection or the tenant is reached (``EDQUOT``): what it holds (leases,
    pending writes, namespaces) must be given back first. Never answered by evicting another
    tenant's blocks."""

    errno = errno.EDQUOT

    def __init__(self, *args: object) -> None:
        KvtierError.__init__(self, *args)


class AccessDeniedError(KvtierError, PermissionError):
    """The peer may not use this namespace or operation (``EACCES``)."""

    errno = errno.EACCES

    def __init__(self, *args: object) -> None:
        KvtierError.__init__(self, *args)


class UnknownTenantError(AccessDeniedError):
    """The tenant a namespace names is not one of the daemon's ``[[tenants]]`` (a misspelt
    name, say): refused as any tenant the peer may not use (``EACCES``, so it is alerted on as
    a refusal), with a message that says the tenant does not exist."""


class RemoteProtocolError(KvtierError):
    """The other side broke the wire protocol (``EPROTO``)."""

    errno = errno.EPROTO


class LocalProtocolError(KvtierError):
    """This side was asked to send something the protocol forbids (a bug in the caller)."""

    errno = errno.EPROTO


class BusyError(KvtierError):
    """A limit was reached: too many connections, or the data directory or socket is in use
    by another daemon (``EBUSY``). In-flight request limits apply back-pressure instead."""

    errno = errno.EBUSY


class NotSupportedError(KvtierError):
    """The daemon does not serve this here (``EOPNOTSUPP``): a feature it was not configured
    for, or one its host cannot run (NIXL reads on a daemon without NIXL). The message says
    which and why."""

    errno = errno.EOPNOTSUPP


class StartingError(KvtierError):
    """The daemon is starting (pre-faulting its arena, recovering its index) and serves nothing
    yet (``EAGAIN``); the message says what it is doing. Try again in a moment."""

    errno = errno.EAGAIN


class TimedOutError(KvtierError, TimeoutError):
    """An operation did not finish within its deadline (``ETIMEDOUT``)."""

    errno = errno.ETIMEDOUT

    def __init__(self, *args: object) -> None:
        KvtierError.__init__(self, *args)


class StorageIOError(KvtierError):
    """A storage device or backend failed (``EIO``)."""

    errno = errno.EIO


class ClosedError(KvtierError):
    """The resource was closed by this side and cannot be used any more."""

    errno = errno.EBADF


class BrokenConnectionError(KvtierError, ConnectionError):
    """The connection to the daemon broke (the daemon died or closed it)."""

    errno = errno.EPIPE

    def __init__(self, *args: object) -> None:
        KvtierError.__init__(self, *args)


class DaemonNotRunningError(BrokenConnectionError):
    """No daemon listens on the socket path."""

    errno = errno.ECONNREFUSED


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with the configuration: ``where`` is the field (``dram.size``), the
    command-line flag that set it (``--dram-size``) or ``""``; ``message`` says what is wrong."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class ConfigError(KvtierError, ValueError):
    """The configuration is invalid; :attr:`problems` says where and what, one per problem.

    ``ConfigError(message)`` is one problem with no ``where``, and ``str()`` is the message.
    ``ConfigError(heading, problems)`` carries them all; ``str()`` is the heading, then each
    problem on its own line, indented two spaces, as ``where: message``.
    """

    errno = errno.EINVAL

    def __init__(self, message: str, problems: Iterable[ConfigProblem] = ()) -> None:
        listed = tuple(problems)
        self.problems: tuple[ConfigProblem, ...] = listed or (ConfigProblem("", message),)
        super().__init__(message + "".join(f"\n  {problem}" for problem in listed))


#: errno -> the class the client raises. One class per errno: subclasses that share an errno
#: with a more general class (``LocalProtocolError``, ``ConfigError``, ``DaemonNotRunningError``)
#: never travel on the wire.
ERRNO_TO_ERROR: dict[int, type[KvtierError]] = {
    cls.errno: cls
    for cls in (
        BlockNotFoundError,
        InvalidRequestError,
        NoSpaceError,
        QuotaError,
        AccessDeniedError,
        RemoteProtocolError,
        BusyError,
        NotSupportedError,
        StartingError,
        TimedOutError,
        StorageIOError,
        ClosedError,
        BrokenConnectionError,
    )
}


def error_from_errno(err: int, message: str) -> KvtierError:
    """Build the exception for a wire errno (negative or positive); unknown values become EIO."""
    cls = ERRNO_TO_ERROR.get(abs(err), StorageIOError)
    return cls(message or errno.errorcode.get(abs(err), "error"))


def errno_of(exc: BaseException) -> int:
    """The positive errno to send for ``exc``: its own for kvtierd errors, EIO for the rest."""
    if isinstance(exc, KvtierError):
        return exc.errno
    return errno.EIO


#: The errors after which a client's connection is unusable (gone, closed, out of step, or cut
#: by a timeout mid-reply): reconnect. Every other ``KvtierError`` refuses one request on a
#: connection that stays usable.
CONNECTION_ERRORS: tuple[type[KvtierError], ...] = (
    BrokenConnectionError,
    ClosedError,
    RemoteProtocolError,
    TimedOutError,
)


def is_connection_loss(exc: BaseException) -> bool:
    """Whether ``exc`` left a client's connection unusable (:data:`CONNECTION_ERRORS`, or the
    socket's own ``OSError``): drop it and connect anew. Any other error refused one request on
    a connection that stays usable."""
    return isinstance(exc, CONNECTION_ERRORS) or (
        isinstance(exc, OSError) and not isinstance(exc, KvtierError)
    )
