"""What the sync and async clients share: the handshake, namespace options and reply handling.

Everything here is synchronous and does no I/O; the two clients differ only in how they move
bytes (:mod:`kvtierd.client.sync`, :mod:`kvtierd.client.aio`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from kvtierd import __version__
from kvtierd.client import ops
from kvtierd.client.arena import ClientArena
from kvtierd.client.blocks import BlockLease
from kvtierd.config import default_socket_path
from kvtierd.errors import (
    AccessDeniedError,
    DaemonNotRunningError,
    InvalidRequestError,
    KvtierError,
    RemoteProtocolError,
)
from kvtierd.protocol import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, ReplyReceived
from kvtierd.protocol.messages import (
    Extent,
    InitReply,
    InitRequest,
    Layout,
    Message,
    OpenNsReply,
    OpenNsRequest,
)


class ClientState(Protocol):
    """What a namespace reads of its client, sync or async, once connected."""

    max_keys: int
    daemon_minor: int

    @property
    def arena(self) -> ClientArena: ...


ClientT = TypeVar("ClientT", bound=ClientState)

__all__ = [
    "NamespaceBase",
    "NamespaceHandle",
    "as_dict",
    "handle_of",
    "init_request",
    "message_of",
    "namespace_request",
    "not_running",
    "resolve_socket",
]


@dataclass(frozen=True, slots=True)
class NamespaceHandle:
    """What a client keeps about an open namespace."""

    ns: int
    name: str
    block_bytes: int
    key_salt: bytes
    digest: bytes
    layout: Layout | None
    rank: int
    world_size: int


def handle_of(request: OpenNsRequest, reply: Message) -> NamespaceHandle:
    """The handle of the namespace ``reply`` opened for ``request``."""
    if not isinstance(reply, OpenNsReply):
        raise RemoteProtocolError("OPEN_NS was not answered with OPEN_NS")
    return NamespaceHandle(
        reply.ns,
        request.name,
        request.block_bytes,
        reply.key_salt,
        reply.digest,
        request.layout,
        request.rank,
        request.world_size,
    )


class NamespaceBase(Generic[ClientT]):
    """What the sync and async namespaces share: their client and handle."""

    def __init__(self, client: ClientT, handle: NamespaceHandle) -> None:
        self.client = client
        self.handle = handle

    @property
    def key_salt(self) -> bytes:
        """Pass as ``salt`` to :func:`kvtierd.keys.chain_keys`."""
        return self.handle.key_salt

    @property
    def block_bytes(self) -> int:
        return self.handle.block_bytes

    @property
    def layout(self) -> Layout | None:
        """The layout the namespace was opened with."""
        return self.handle.layout

    def _lease_op(
        self, keys: Sequence[bytes], resident_only: bool
    ) -> ops.Op[tuple[list[int], list[Extent]]]:
        c = self.client
        return ops.lease(
            self.handle.ns,
            keys,
            c.max_keys,
            resident_only=resident_only,
            daemon_minor=c.daemon_minor,
        )

    def _block_lease(
        self,
        keys: Sequence[bytes],
        extents: list[Extent],
        release: Callable[[], object] | None = None,
    ) -> BlockLease:
        """The lease of ``keys``' leading ``len(extents)`` blocks, viewed in the arena."""
        views = [self.client.arena.view(e.offset, e.length) for e in extents]
        return BlockLease(list(keys[: len(extents)]), extents, views, release)


def resolve_socket(socket_path: str | os.PathLike[str] | None) -> Path:
    return Path(socket_path) if socket_path is not None else default_socket_path()


def init_request(client_name: str) -> InitRequest:
    name = client_name or f"kvtierd-client/{__version__} pid {os.getpid()}"
    return InitRequest(PROTOCOL_VERSION, 0, DEFAULT_MAX_FRAME_BYTES, name[:255])


def check_init(reply: Message, fds: list[int]) -> InitReply:
    if not isinstance(reply, InitReply):
        raise RemoteProtocolError("INIT was not answered with INIT")
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise RemoteProtocolError("the daemon did not pass the arena descriptor")
    return reply


def namespace_request(
    name: str,
    block_bytes: int,
    layout: Layout | dict[str, Any] | None,
    rank: int,
    world_size: int,
    tenant: str,
    compression: str,
    create: bool = True,
    sparse: bool = False,
) -> OpenNsRequest:
    if isinstance(layout, dict):
        try:
            layout = Layout(**layout)  # Layout travels as an array: build it by field name
        except TypeError as exc:
            raise InvalidRequestError(f"invalid layout: {exc}") from exc
    try:
        request = OpenNsRequest(
            name, block_bytes, layout, rank, world_size, tenant, compression, create, sparse
        )
        # Validate bounds here so a bad argument fails like the daemon would, before sending.
        return msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=OpenNsRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid namespace options: {exc}") from exc


def as_dict(value: Any) -> Any:
    """Structs as dicts with their field names, recursively (wire structs are arrays)."""
    if isinstance(value, msgspec.Struct):
        return {k: as_dict(v) for k, v in msgspec.structs.asdict(value).items()}
    if isinstance(value, list):
        return [as_dict(v) for v in value]
    return value


def message_of(event: ReplyReceived) -> Message:
    """The reply's message, or raise the error it carries."""
    if event.error is not None:
        raise event.error
    assert event.message is not None
    return event.message


def not_running(path: Path, exc: OSError) -> KvtierError:
    if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
        return DaemonNotRunningError(f"kvtierd is not running (no daemon on {path})")
    if exc.errno == errno.EACCES:
        return AccessDeniedError(f"permission denied on {path} (join the daemon's group)")
    return DaemonNotRunningError(f"cannot connect to {path}: {exc.strerror}")
