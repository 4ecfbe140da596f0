"""The library engines link: ``connect()`` (blocking) and ``connect_async()`` (anyio), and
``connect_tcp()`` / ``connect_tcp_async()`` to another host's daemon.

Both faces have one API, written once (:mod:`kvtierd.client._async.client`, from which the
blocking one is generated), with the same methods and errors: every daemon errno raises its own
:mod:`kvtierd.errors` class. See ``docs/client.md``.
"""

from kvtierd.client.aio import AsyncClient, AsyncNamespace, connect_async, connect_tcp_async
from kvtierd.client.blocks import BlockLease, BlockWrite
from kvtierd.client.endpoint import client_tls_context
from kvtierd.client.ops import SparseHint
from kvtierd.client.reconnect import Reconnect
from kvtierd.client.sync import Client, Namespace, connect, connect_tcp
from kvtierd.errors import (
    AccessDeniedError,
    BlockNotFoundError,
    BrokenConnectionError,
    BusyError,
    ClosedError,
    CorruptBlockError,
    DaemonNotRunningError,
    InvalidRequestError,
    KvtierError,
    NoSpaceError,
    NotSupportedError,
    QuotaError,
    RemoteProtocolError,
    StartingError,
    StorageIOError,
    TimedOutError,
)
from kvtierd.keys import chain_keys
from kvtierd.protocol.messages import Layout

__all__ = [
    "AccessDeniedError",
    "AsyncClient",
    "AsyncNamespace",
    "BlockLease",
    "BlockNotFoundError",
    "BlockWrite",
    "BrokenConnectionError",
    "BusyError",
    "Client",
    "ClosedError",
    "CorruptBlockError",
    "DaemonNotRunningError",
    "InvalidRequestError",
    "KvtierError",
    "Layout",
    "Namespace",
    "NoSpaceError",
    "NotSupportedError",
    "QuotaError",
    "Reconnect",
    "RemoteProtocolError",
    "SparseHint",
    "StartingError",
    "StorageIOError",
    "TimedOutError",
    "chain_keys",
    "client_tls_context",
    "connect",
    "connect_async",
    "connect_tcp",
    "connect_tcp_async",
]
