"""Connecting the async client (anyio: asyncio or trio): :func:`connect_async` on this host's
Unix socket, :func:`connect_tcp_async` to another host's daemon.

The client itself is :class:`~kvtierd.client._async.client.AsyncClient`: its API is written once
(and the blocking :class:`~kvtierd.client.Client` generated from it), its transport, pipelined
with a reader task and a janitor that this module's context managers own, is
:mod:`kvtierd.client._async.connection`.
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import AsyncIterator

import anyio

from kvtierd.client._async.client import AsyncClient, AsyncNamespace
from kvtierd.client.base import resolve_socket
from kvtierd.client.endpoint import Endpoint, TcpEndpoint, UnixEndpoint
from kvtierd.client.reconnect import RECONNECTABLE, Reconnect, gave_up
from kvtierd.protocol import ClientConnection

__all__ = [
    "AsyncClient",
    "AsyncNamespace",
    "connect_async",
    "connect_endpoint_async",
    "connect_tcp_async",
]


def connect_async(
    socket_path: str | os.PathLike[str] | None = None,
    *,
    client_name: str = "",
    reconnect: Reconnect | None = None,
) -> contextlib.AbstractAsyncContextManager[AsyncClient]:
    """Connect and yield a client (``async with connect_async() as client``); closes
    everything on exit. With ``reconnect`` the client connects again, as that policy allows,
    when the connection breaks (a daemon restart); see ``docs/client.md`` ("Reconnecting")."""
    endpoint = UnixEndpoint(resolve_socket(socket_path))
    return connect_endpoint_async(endpoint, client_name=client_name, reconnect=reconnect)


def connect_tcp_async(
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None,
    server_hostname: str | None = None,
    client_name: str = "",
    reconnect: Reconnect | None = None,
) -> contextlib.AbstractAsyncContextManager[AsyncClient]:
    """:func:`kvtierd.client.connect_tcp` for the async client: another host's daemon over
    TCP, with ``tls`` from :func:`kvtierd.client.endpoint.client_tls_context` (``None``:
    plaintext, where the daemon allows it). Such a client reads over NIXL and cannot write
    (``docs/remote.md``)."""
    endpoint = TcpEndpoint(host, port, tls, server_hostname)
    return connect_endpoint_async(endpoint, client_name=client_name, reconnect=reconnect)


async def _connect_once(
    endpoint: Endpoint, client_name: str, reconnect: Reconnect | None
) -> AsyncClient:
    """A client on a new connection to ``endpoint``, INIT answered."""
    stream = await endpoint.open_async()
    client = AsyncClient(
        stream, ClientConnection(), endpoint=endpoint, client_name=client_name, reconnect=reconnect
    )
    try:
        await client._handshake()
    except BaseException:
        client._abandon()
        await anyio.aclose_forcefully(stream)
        raise
    return client


@contextlib.asynccontextmanager
async def connect_endpoint_async(
    endpoint: Endpoint, *, client_name: str = "", reconnect: Reconnect | None = None
) -> AsyncIterator[AsyncClient]:
    """Connect to ``endpoint`` (:func:`connect_async` and :func:`connect_tcp_async` name
    one) and yield the client, its reader and janitor running in a task group of its own; with
    ``reconnect``, waiting as that policy allows for a daemon that is restarting or starting."""
    if reconnect is None:
        client = await _connect_once(endpoint, client_name, reconnect)
    else:
        made = 0
        try:
            async for attempt in reconnect.retrying_async():
                with attempt:
                    made = attempt.retry_state.attempt_number
                    client = await _connect_once(endpoint, client_name, reconnect)
        except RECONNECTABLE as exc:
            raise gave_up(exc, made) from exc
    try:
        async with anyio.create_task_group() as tg:
            client._start(tg)
            try:
                yield client
            finally:
                await client.aclose()
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The task group wraps what the caller's block raised; give the caller its exception.
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise
