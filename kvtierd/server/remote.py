"""Control connections over TCP, for engines on other hosts (``docs/remote.md``).

The Unix socket is the daemon's front door for the engines of its own host: the kernel says who
a peer is (``SO_PEERCRED``) and the socket passes the tenant region's descriptor, so blocks are
read out of shared memory. An engine on another host has neither. With ``remote.listen`` set,
the daemon also listens on TCP, and a connection there differs in three ways:

* **Who it is** comes from TLS: the client presents a certificate signed by ``remote.ca_file``
  (a handshake without one fails), and the certificate's subject common name must be listed in
  ``remote.clients``, which gives the uid it acts as for tenant checks and connection limits.
  A name not listed is refused with ``EACCES`` after the handshake. Plaintext TCP, with every
  client acting as ``remote.plaintext_uid``, exists only where ``remote.allow_plaintext`` says so.
* **What it may ask** is the read path only (:data:`REMOTE_OPCODES`): INIT, OPEN_NS (whose reply
  passes no descriptor), LOOKUP, HINT, STATFS, NIXL_GRANT, READ_NIXL, RELEASE, DESTROY. Anything
  else (writes, shared-memory reads, admin requests) is answered ``EOPNOTSUPP``.
* **How bytes move**: over NIXL (:mod:`kvtierd.client.nixl`), between the daemon's agent and the
  client's, never through this connection. Only frames cross it: keys, leases, checksums, and
  the NIXL metadata and descriptors of the client's own tenant region.

This module is the listener's set-up and the admission of one connection (the TLS handshake,
within ``daemon.handshake_timeout_s``, then the identity, whose refusal the daemon sends); the
daemon then serves it as any other :class:`~kvtierd.server.session.Session`.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import ByteStream, SocketAttribute, SocketListener, SocketStream
from anyio.streams.tls import TLSAttribute, TLSStream

from kvtierd.config import RemoteConfig
from kvtierd.errors import AccessDeniedError, ConfigError
from kvtierd.protocol import Opcode
from kvtierd.server.throttle import Throttle
from kvtierd.store.namespaces import PeerCredentials

__all__ = [
    "REMOTE_OPCODES",
    "Handshake",
    "HandshakeError",
    "RemoteListener",
    "open_remote_listener",
    "peer_address",
]

log = logging.getLogger("kvtierd.remote")

#: What a TCP connection may ask: the read path over NIXL, and nothing that needs the arena's
#: descriptor or an administrator.
REMOTE_OPCODES = frozenset(
    {
        Opcode.INIT,
        Opcode.OPEN_NS,
        Opcode.LOOKUP,
        Opcode.HINT,
        Opcode.STATFS,
        Opcode.NIXL_GRANT,
        Opcode.READ_NIXL,
        Opcode.RELEASE,
        Opcode.DESTROY,
    }
)


class HandshakeError(Exception):
    """A TCP connection's TLS handshake failed (logged, its stream closed): there is no session
    to answer, so nothing goes on the wire."""


@dataclass(frozen=True, slots=True)
class Handshake:
    """A TCP connection through its TLS handshake (or a plaintext one): the stream to serve,
    where it comes from, and its certificate's common name (``None`` without TLS)."""

    stream: ByteStream
    where: str
    name: str | None


@dataclass(frozen=True, slots=True)
class RemoteListener:
    """The TCP listeners (one per address ``remote.listen`` names) and what admitting one of
    their connections needs."""

    listeners: Sequence[SocketListener]
    config: RemoteConfig
    tls: ssl.SSLContext | None
    #: ``daemon.handshake_timeout_s``: the TLS handshake must end within it.
    handshake_timeout_s: float
    #: Failed handshakes and refused identities, logged at most once a minute per address.
    failures: Throttle = field(default_factory=Throttle)

    async def shake_hands(self, stream: SocketStream, where: str) -> Handshake:
        """TLS on ``stream`` (nothing in plaintext); raises :class:`HandshakeError`, the stream
        closed, when the handshake fails (the peer closes or resets the connection, sends what is
        not TLS or an alert, presents no certificate or one ``remote.ca_file`` did not sign) or
        takes longer than :attr:`handshake_timeout_s`. Failures are logged at most once a minute per
        peer address, with how many were not. ``where``: :func:`peer_address`, taken as the
        connection was accepted."""
        host = where.rpartition(":")[0] or where
        if self.tls is None:
            return Handshake(stream, where, None)
        try:
            with anyio.fail_after(self.handshake_timeout_s):
                secure = await TLSStream.wrap(
                    stream, server_side=True, ssl_context=self.tls, standard_compatible=False
                )
        except (
            TimeoutError,
            ssl.SSLError,
            OSError,
            anyio.EndOfStream,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
        ) as exc:
            self.failures.report(
                log, logging.WARNING, host, "TLS handshake with %s failed: %s", where,
                self._failure(exc),
            )  # fmt: skip
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise HandshakeError(where) from exc
        name = _common_name(secure.extra(TLSAttribute.peer_certificate, None))
        return Handshake(secure, where, name)

    def _failure(self, exc: BaseException) -> str:
        """Why a handshake failed, in words (anyio's own errors carry none)."""
        if isinstance(exc, TimeoutError):
            return f"not done within {self.handshake_timeout_s:g} s"
        if isinstance(exc, anyio.EndOfStream):
            return "the peer closed the connection"
        cause = exc.__cause__ if isinstance(exc, anyio.BrokenResourceError) else None
        return str(cause or exc) or type(cause or exc).__name__

    def identify(self, hello: Handshake) -> PeerCredentials:
        """Who the connection acts as; raises :class:`~kvtierd.errors.AccessDeniedError` for
        a certificate ``remote.clients`` does not list."""
        if self.tls is None:
            where = f"{hello.where} (plaintext)"
            return PeerCredentials(0, self.config.plaintext_uid, -1, where)
        uid = self.config.uid_of(hello.name) if hello.name is not None else None
        if uid is None:
            self.failures.report(
                log, logging.WARNING, hello.where.rpartition(":")[0],
                "refusing %s: certificate %r is unlisted", hello.where, hello.name,
            )  # fmt: skip
            raise AccessDeniedError(f"certificate {hello.name!r} is not a client of this daemon")
        return PeerCredentials(0, uid, -1, f"{hello.where} ({hello.name})")


def peer_address(stream: SocketStream) -> str:
    """Where a TCP ``stream`` comes from, host:port; ``"?"`` for a peer already gone (taken
    as the connection is accepted, it is rarely gone: later, a reset may have taken it)."""
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except (OSError, LookupError, AttributeError):  # asyncio: a reset took the transport's
        return "?"  # socket away, and anyio's lookup fails in one of these ways
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)


def _common_name(certificate: Mapping[str, Any] | None) -> str | None:
    """The subject's common name of a certificate as ``ssl`` decodes it."""
    if not certificate:
        return None
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def server_tls_context(config: RemoteConfig) -> ssl.SSLContext:
    """TLS 1.2+ with the daemon's certificate, requiring a client certificate signed by
    ``config.ca_file``; raises :class:`ConfigError` naming the file that cannot be loaded."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(config.cert_file, config.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"remote.cert_file/key_file cannot be loaded: {exc}") from None
    try:
        context.load_verify_locations(cafile=config.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"remote.ca_file {config.ca_file!r} cannot be loaded: {exc}") from None
    return context


@contextlib.asynccontextmanager
async def open_remote_listener(
    config: RemoteConfig, *, handshake_timeout_s: float
) -> AsyncIterator[RemoteListener | None]:
    """Listen on ``config.listen`` (``None`` when it is empty) until the block ends."""
    if not config.listen:
        yield None
        return
    tls = await anyio.to_thread.run_sync(server_tls_context, config) if config.tls else None
    host, port = config.address()
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as exc:
        raise ConfigError(f"remote.listen {config.listen!r}: cannot listen: {exc}") from None
    if tls is None:
        log.warning("remote.listen %s is plaintext (remote.allow_plaintext)", config.listen)
    try:
        sockets = [each for each in listener.listeners if isinstance(each, SocketListener)]
        yield RemoteListener(sockets, config, tls, handshake_timeout_s)
    finally:
        await listener.aclose()
