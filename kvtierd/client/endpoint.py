"""Where a client connects: the daemon's Unix socket on this host, or its TCP listener on another.

A :class:`UnixEndpoint` is the usual one: the socket passes each tenant region's descriptor, so
blocks are read out of shared memory. A :class:`TcpEndpoint` reaches a daemon on another host
(``remote.listen``, ``docs/remote.md``): TLS with a client certificate unless the daemon allows
plaintext, no descriptors, and blocks pulled over NIXL (:class:`kvtierd.client.nixl.NixlReader`).
Both open a connected, blocking socket (``socket.socket`` or ``ssl.SSLSocket``) for the
blocking client (``open``) and an anyio stream for the async one (``open_async``); opening
again is how a client reconnects.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import ByteStream
from anyio.streams.tls import TLSStream

from kvtierd.client.base import check_socket_path, connect_error
from kvtierd.errors import AccessDeniedError, DaemonNotRunningError, KvtierError

__all__ = ["Endpoint", "TcpEndpoint", "UnixEndpoint", "client_tls_context"]


@dataclass(frozen=True, slots=True)
class UnixEndpoint:
    """The daemon's Unix socket at ``path``."""

    path: Path

    #: The connection passes descriptors: the client maps its tenant regions.
    passes_descriptors = True
    #: What a connection closed before INIT's reply may mean, beyond what the daemon said.
    refusal_hint = ""

    def __str__(self) -> str:
        return str(self.path)

    def open(self, timeout_s: float | None) -> socket.socket:
        """A socket connected to the daemon, or the error that says why not."""
        check_socket_path(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise connect_error(self.path, exc) from None
        return sock

    async def open_async(self) -> ByteStream:
        """:meth:`open` for the async client."""
        check_socket_path(self.path)
        try:
            return await anyio.connect_unix(self.path)
        except OSError as exc:
            raise connect_error(self.path, exc) from None


@dataclass(frozen=True, slots=True)
class TcpEndpoint:
    """A daemon's TCP listener at ``host``:``port``; ``tls`` from :func:`client_tls_context`
    (``None``: plaintext, which the daemon refuses unless it allows it)."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    #: The name the daemon's certificate must carry (default: ``host``).
    server_hostname: str | None = None

    passes_descriptors = False

    @property
    def refusal_hint(self) -> str:
        if self.tls is None:
            return " (does the daemon's remote.listen want TLS? it closes plaintext connections)"
        return (
            " during the TLS handshake (is this client's certificate signed by the daemon's "
            "remote.ca_file?)"
        )

    def __str__(self) -> str:
        return f"{'tls' if self.tls else 'tcp'}://{self.host}:{self.port}"

    def open(self, timeout_s: float | None) -> socket.socket:
        """A connection to the daemon, through its TLS handshake, or the error that says why
        not."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        except OSError as exc:
            raise DaemonNotRunningError(f"cannot connect to kvtierd at {self}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is None:
            return sock
        try:
            return self.tls.wrap_socket(sock, server_hostname=self.server_hostname or self.host)
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            raise self._tls_error(exc) from None

    async def open_async(self) -> ByteStream:
        """:meth:`open` for the async client (anyio sets ``TCP_NODELAY`` itself)."""
        try:
            stream = await anyio.connect_tcp(self.host, self.port)
        except OSError as exc:
            raise DaemonNotRunningError(f"cannot connect to kvtierd at {self}: {exc}") from None
        if self.tls is None:
            return stream
        try:
            return await TLSStream.wrap(
                stream,
                hostname=self.server_hostname or self.host,
                ssl_context=self.tls,
                standard_compatible=False,
            )
        except (ssl.SSLError, OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            await anyio.aclose_forcefully(stream)
            raise self._tls_error(exc) from None
        except BaseException:  # cancelled during the handshake: the stream is not the caller's
            await anyio.aclose_forcefully(stream)
            raise

    def _tls_error(self, exc: BaseException) -> KvtierError:
        """What a failed TLS handshake (``exc``) means."""
        if isinstance(exc, ssl.SSLCertVerificationError):
            return AccessDeniedError(
                f"kvtierd at {self} failed certificate verification: {exc.verify_message}"
            )
        return AccessDeniedError(
            f"the TLS handshake with kvtierd at {self} failed (is this client's certificate "
            f"signed by the daemon's remote.ca_file?): {exc}"
        )


def client_tls_context(
    ca_file: str | Path, cert_file: str | Path, key_file: str | Path
) -> ssl.SSLContext:
    """TLS 1.2+ verifying the daemon against ``ca_file``, presenting this client's certificate
    (whose common name the daemon's ``remote.clients`` maps to a uid)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert_file), str(key_file))
    return context


#: What a client connects to.
Endpoint = UnixEndpoint | TcpEndpoint
