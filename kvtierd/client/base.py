"""What the sync and async clients share: the handshake, namespace options and reply handling.

Everything here is synchronous and does no I/O; the two clients differ only in how they move
bytes (:mod:`kvtierd.client.sync`, :mod:`kvtierd.client.aio`).
"""

from __future__ import annotations

import contextlib
import errno
import operator
import os
import select
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from kvtierd import __version__
from kvtierd.client import ops
from kvtierd.client.arena import ClientArena, verified_prefix
from kvtierd.client.blocks import BlockLease, release_views
from kvtierd.config import default_socket_path
from kvtierd.errors import (
    AccessDeniedError,
    BrokenConnectionError,
    ClosedError,
    CorruptBlockError,
    DaemonNotRunningError,
    InvalidRequestError,
    KvtierError,
    NotSupportedError,
    RemoteProtocolError,
)
from kvtierd.layouts import layout_block_bytes
from kvtierd.protocol import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, ReplyReceived
from kvtierd.protocol.frames import PROTOCOL_MINOR
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
    #: Blocks whose bytes did not match their checksum when read (each was a miss).
    corrupt_reads: int

    def region(self, region: int) -> ClientArena: ...


ClientT = TypeVar("ClientT", bound=ClientState)

__all__ = [
    "NamespaceBase",
    "NamespaceHandle",
    "as_dict",
    "close_all",
    "closed_error",
    "connect_error",
    "handle_of",
    "init_request",
    "message_of",
    "namespace_request",
    "peer_open",
    "resolve_socket",
]

#: The longest path ``connect`` can take: ``sun_path`` holds 108 bytes with the NUL.
MAX_SOCKET_PATH_BYTES = 107


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
    region: int
    tenant: str
    #: What opened it: a reconnecting client sends it again to the restarted daemon.
    request: OpenNsRequest


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
        reply.region,
        request.tenant,
        request,
    )


class Regions:
    """The tenant regions a client has mapped, by id (both clients keep one)."""

    def __init__(self, *, maps: bool = True) -> None:
        self._mapped: dict[int, ClientArena] = {}
        self._closed = False
        #: ``False`` on a connection that passes no descriptors (TCP): nothing is mapped.
        self._maps = maps

    def adopt(self, reply: OpenNsReply, fds: list[int]) -> None:
        """Map the region an OPEN_NS reply passed (``fds``), unless it is mapped already (then
        the descriptor is closed: every OPEN_NS reply carries its region)."""
        if not self._maps:
            close_all(fds)
            return
        if not fds:
            if reply.region not in self._mapped:
                raise RemoteProtocolError(f"the daemon did not pass region {reply.region}")
            return
        for extra in fds[1:]:
            os.close(extra)
        if reply.region in self._mapped:
            os.close(fds[0])
            return
        self._mapped[reply.region] = ClientArena(fds[0], reply.region_bytes)  # closes on error

    def get(self, region: int) -> ClientArena:
        """The mapping of ``region``; ``ClosedError`` once closed, also for a caller that
        looked while another thread was closing."""
        try:
            return self._mapped[region]
        except KeyError:
            if self._closed:
                raise closed_error() from None
            if not self._maps:
                raise NotSupportedError(
                    "a TCP connection maps no tenant region: read its blocks over NIXL "
                    "(kvtierd.client.nixl.NixlReader, docs/remote.md)"
                ) from None
            raise RemoteProtocolError(f"region {region} is not mapped") from None

    def close(self, why: KvtierError | None = None) -> None:
        """Unmap every region; using one later raises ``why`` (default ``ClosedError``)."""
        self._closed = True
        for arena in self._mapped.values():
            arena.close(why)
        self._mapped.clear()


class NamespaceBase(Generic[ClientT]):
    """What the sync and async namespaces share: their client and handle."""

    def __init__(self, client: ClientT, handle: NamespaceHandle) -> None:
        self.client = client
        self.handle = handle
        #: Why a reconnected client could not open this namespace again; then every call
        #: raises it.
        self.lost: KvtierError | None = None

    def __repr__(self) -> str:
        h = self.handle
        rank = f" rank={h.rank}/{h.world_size}" if h.world_size > 1 else ""
        layout = f" layout={h.layout.model_id!r}/{h.layout.dtype}" if h.layout else ""
        lost = " lost" if self.lost else ""
        return (
            f"<{type(self).__name__} {h.name!r} tenant={h.tenant!r} "
            f"block_bytes={h.block_bytes}{layout}{rank}{lost}>"
        )

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def tenant(self) -> str:
        return self.handle.tenant

    @property
    def rank(self) -> int:
        return self.handle.rank

    @property
    def world_size(self) -> int:
        return self.handle.world_size

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

    @property
    def arena(self) -> ClientArena:
        """The mapping of this namespace's tenant region."""
        return self.client.region(self.handle.region)

    def arena_buffer(self) -> memoryview:
        """This namespace's whole tenant region, read-only (index it with lease extents)."""
        return self.arena.buffer()

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
        *,
        partial: bool = False,
        verify_on_copy: bool = False,
    ) -> BlockLease:
        """The lease of ``keys``' leading ``len(extents)`` blocks, viewed in the region and
        verified (unless ``verify_on_copy``: then each :meth:`BlockLease.copy_into` verifies its
        copy). A block that fails its checksum is a miss: with ``partial`` the lease stops
        before it, else the lease is given back (``release``) and ``BlockNotFoundError`` raised."""
        arena = self.arena
        views = [arena.view(e.offset, e.length) for e in extents]
        if verify_on_copy:
            return BlockLease(list(keys[: len(views)]), extents, views, release, verified=False)
        good = verified_prefix(views, extents)
        if good < len(views):
            self.client.corrupt_reads += 1
            release_views(views[good:])
            if not partial:
                release_views(views)
                if release is not None:
                    release()
                raise CorruptBlockError(
                    f"block {keys[good].hex()} failed its checksum in DRAM (changed after "
                    "commit by a client of its tenant): a miss"
                )
        return BlockLease(list(keys[:good]), extents[:good], views[:good], release)


def resolve_socket(socket_path: str | os.PathLike[str] | None) -> Path:
    return Path(socket_path) if socket_path is not None else default_socket_path()


def init_request(client_name: str) -> InitRequest:
    name = client_name or f"kvtierd-client/{__version__} pid {os.getpid()}"
    return InitRequest(PROTOCOL_VERSION, PROTOCOL_MINOR, DEFAULT_MAX_FRAME_BYTES, name[:255])


def check_init(reply: Message) -> InitReply:
    """INIT's reply, checked: a daemon (or a peer posing as one) that allows no key per
    request, or a frame too small for a reply, is not one to talk to."""
    if not isinstance(reply, InitReply):
        raise RemoteProtocolError("INIT was not answered with INIT")
    if reply.max_keys < 1:
        raise RemoteProtocolError(f"INIT's reply allows {reply.max_keys} keys per request")
    return reply


def namespace_request(
    name: str,
    block_bytes: int | None,
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
    try:  # any integer (a numpy one, a subclass of int) as a plain int; a float is refused
        rank, world_size = operator.index(rank), operator.index(world_size)
        block_bytes = _sized(None if block_bytes is None else operator.index(block_bytes), layout)
    except TypeError as exc:
        raise InvalidRequestError(f"invalid namespace options: {exc}") from None
    try:
        request = OpenNsRequest(
            name, block_bytes, layout, rank, world_size, tenant, compression, create, sparse
        )
        # Validate bounds here so a bad argument fails like the daemon would, before sending.
        return msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=OpenNsRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid namespace options: {exc}") from exc


def _sized(block_bytes: int | None, layout: Layout | None) -> int:
    """``block_bytes``, derived from ``layout`` when not given, and checked against it."""
    derived = layout_block_bytes(layout) if isinstance(layout, Layout) else None
    if block_bytes is None:
        if derived is not None:
            return derived
        if layout is None:
            raise InvalidRequestError("pass block_bytes, or a layout to derive it from")
        raise InvalidRequestError(
            f"the size of dtype {layout.dtype!r} is not known: pass block_bytes"
        )
    if derived is not None and derived != block_bytes:
        raise InvalidRequestError(
            f"block_bytes is {block_bytes} but the layout gives {derived} (2 x layers x "
            "kv_heads x head_dim x block_tokens x dtype size): leave block_bytes out"
        )
    return block_bytes


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


def closed_error() -> ClosedError:
    """What a call raises once the client's own ``close()`` (``aclose()``) ran, in both
    clients; a connection the daemon ended raises ``BrokenConnectionError`` instead."""
    return ClosedError("the client is closed")


def check_socket_path(path: Path) -> None:
    """Refuse a path no Unix socket can have, before trying it."""
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise InvalidRequestError(
            f"socket path is {size} bytes; a Unix socket path is at most {MAX_SOCKET_PATH_BYTES}"
        )


def connect_error(path: Path, exc: OSError) -> KvtierError:
    """What a failed ``connect`` to ``path`` means, for a person to read."""
    if exc.errno == errno.EACCES:
        return AccessDeniedError(f"permission denied on {path} (join the daemon's group)")
    try:
        mode = path.stat().st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        return DaemonNotRunningError(f"{path} is a directory, not the daemon's socket")
    if mode is not None and not stat.S_ISSOCK(mode):
        return DaemonNotRunningError(f"{path} is not a socket (kvtierd listens on a socket)")
    if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
        return DaemonNotRunningError(f"kvtierd is not running (no daemon on {path})")
    return DaemonNotRunningError(f"cannot connect to {path}: {exc.strerror or exc}")


def in_flight_error(blocks: int) -> BrokenConnectionError:
    return BrokenConnectionError(
        f"the connection to kvtierd broke while a write of {blocks} blocks was in flight: it "
        "was not acknowledged, so its blocks may be missing; write them again"
    )


def broken_error(exc: BaseException) -> BrokenConnectionError:
    """The connection broke under a call (``exc``: what the transport raised)."""
    return BrokenConnectionError(f"connection to kvtierd lost: {exc}")


def peer_open(fd: int) -> bool:
    """Whether the connection on socket ``fd`` is still open at both ends, without reading
    from it (a ``poll`` for hang-up, which sees the daemon's close even behind unread replies).
    Leases last as long as the connection: an engine that keeps views across calls checks this
    (``connected()``) before it trusts them."""
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    return not any(
        events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL)
        for _, events in poller.poll(0)
    )


def close_all(fds: list[int]) -> None:
    """Close descriptors the daemon passed with a reply nobody will use."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
