"""Connecting the blocking client: :func:`connect` on this host's Unix socket,
:func:`connect_tcp` to another host's daemon, :func:`connect_endpoint` to either.

The client itself is :class:`~kvtierd.client._sync.client.Client`: its API is generated from the
async one (:mod:`kvtierd.client._async.client`), its transport, one thread's turn at a time,
is :mod:`kvtierd.client._sync.connection`. Every method may raise the
:class:`~kvtierd.errors.KvtierError` subclass that matches the daemon's errno,
:class:`~kvtierd.errors.BrokenConnectionError` when the daemon goes away and
:class:`~kvtierd.errors.ClosedError` once the client's own :meth:`Client.close` ran.
"""

from __future__ import annotations

import os
import ssl

from kvtierd.client._sync.client import Client, Namespace
from kvtierd.client.base import resolve_socket
from kvtierd.client.endpoint import Endpoint, TcpEndpoint, UnixEndpoint
from kvtierd.client.reconnect import RECONNECTABLE, Reconnect, gave_up
from kvtierd.protocol import ClientConnection

__all__ = ["Client", "Namespace", "connect", "connect_endpoint", "connect_tcp"]


def connect(
    socket_path: str | os.PathLike[str] | None = None,
    *,
    client_name: str = "",
    timeout_s: float | None = None,
    reconnect: Reconnect | None = None,
) -> Client:
    """Connect to the daemon (default socket: ``$KVTIERD_SOCKET`` or the configured path).
    With ``reconnect`` the client connects again, as that policy allows, when the connection
    breaks (a daemon restart); see ``docs/client.md`` ("Reconnecting")."""
    endpoint = UnixEndpoint(resolve_socket(socket_path))
    return connect_endpoint(
        endpoint, client_name=client_name, timeout_s=timeout_s, reconnect=reconnect
    )


def connect_tcp(
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None,
    server_hostname: str | None = None,
    client_name: str = "",
    timeout_s: float | None = None,
    reconnect: Reconnect | None = None,
) -> Client:
    """Connect to the daemon of another host over TCP (its ``remote.listen``), with ``tls``
    from :func:`kvtierd.client.endpoint.client_tls_context`, or in plaintext with ``None``
    where the daemon allows it. Such a client reads over NIXL
    (:class:`kvtierd.client.nixl.NixlReader`) and cannot write (``docs/remote.md``)."""
    endpoint = TcpEndpoint(host, port, tls, server_hostname)
    return connect_endpoint(
        endpoint, client_name=client_name, timeout_s=timeout_s, reconnect=reconnect
    )


def connect_endpoint(
    endpoint: Endpoint,
    *,
    client_name: str = "",
    timeout_s: float | None = None,
    reconnect: Reconnect | None = None,
) -> Client:
    """Connect to ``endpoint`` (:func:`connect` and :func:`connect_tcp` name one); with
    ``reconnect``, waiting as that policy allows for a daemon that is restarting or starting."""
    if reconnect is None:
        return _connect_once(endpoint, client_name, timeout_s, reconnect)
    made = 0
    try:
        for attempt in reconnect.retrying():
            with attempt:
                made = attempt.retry_state.attempt_number
                return _connect_once(endpoint, client_name, timeout_s, reconnect)
    except RECONNECTABLE as exc:
        raise gave_up(exc, made) from exc
    raise AssertionError("tenacity ends in a return or raises the last error")


def _connect_once(
    endpoint: Endpoint, client_name: str, timeout_s: float | None, reconnect: Reconnect | None
) -> Client:
    sock = endpoint.open(timeout_s)
    client = Client(
        sock,
        ClientConnection(),
        endpoint=endpoint,
        client_name=client_name,
        timeout_s=timeout_s,
        reconnect=reconnect,
    )
    try:
        client._handshake()
    except BaseException:
        sock.close()
        raise
    return client
