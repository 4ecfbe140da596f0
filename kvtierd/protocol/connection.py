"""Sans-IO connection state: bytes in, events out; messages in, bytes out.

Theory of operation (after h11's ``_connection.py``). A :class:`ServerConnection` or
:class:`ClientConnection` never touches a socket, a clock or an event loop. The owner feeds it
whatever bytes arrived (``receive_data``; ``b""`` means end of stream) and pulls events out with
``next_event()`` until it returns :data:`NEED_DATA`; to send, it asks for the bytes of a message
and writes them itself. That makes the protocol testable byte by byte and fuzzable.

Errors come in two kinds, by whether the byte stream is still in sync:

* a frame whose header is sound but whose body is not (bad MessagePack, a field out of bounds,
  an opcode not allowed in the current state) becomes an :class:`InvalidRequest` event: the
  server answers that request's unique id with an errno and carries on;
* a header that is not a header (wrong magic or version, a length outside the bounds, a reused
  unique id, end of stream inside a frame) raises :class:`RemoteProtocolError`; the stream can
  no longer be trusted and the owner closes it, after sending :meth:`ServerConnection.fatal`.

Legal opcodes per state are the table :data:`SERVER_TRANSITIONS`. Two ways lead to
``CLOSED``, after which any request is a :class:`RemoteProtocolError`: receiving DESTROY (the
table), and answering the INIT that opened the connection with an error
(:data:`SERVER_REPLY_TRANSITIONS`: the daemon refused the client, so that reply is the
connection's last frame).
"""

from __future__ import annotations

import enum
import errno
import itertools
import struct
from typing import Final

import msgspec

from kvtierd.errors import (
    InvalidRequestError,
    KvtierError,
    LocalProtocolError,
    RemoteProtocolError,
    errno_of,
    error_from_errno,
)
from kvtierd.protocol.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    REPLY_MAGIC,
    REQUEST_MAGIC,
    FrameFlags,
    Opcode,
    ReplyHeader,
    RequestHeader,
    pack_reply_header,
    pack_request_header,
)
from kvtierd.protocol.messages import (
    REPLY_TYPES,
    REQUEST_TYPES,
    ErrorReply,
    InitReply,
    InitRequest,
    Message,
    decode_body,
    encode_body,
)

__all__ = [
    "NEED_DATA",
    "SERVER_REPLY_TRANSITIONS",
    "SERVER_TRANSITIONS",
    "ClientConnection",
    "ConnectionClosed",
    "InvalidRequest",
    "NeedData",
    "ReplyReceived",
    "RequestReceived",
    "ServerConnection",
    "ServerState",
]


class NeedData(enum.Enum):
    """Sentinel type: no complete frame is buffered."""

    NEED_DATA = enum.auto()


NEED_DATA: Final = NeedData.NEED_DATA


class RequestReceived(msgspec.Struct, frozen=True):
    header: RequestHeader
    message: Message


class InvalidRequest(msgspec.Struct, frozen=True):
    """A request frame arrived intact but cannot be served; answer it with ``error``."""

    header: RequestHeader
    error: KvtierError


class ReplyReceived(msgspec.Struct, frozen=True):
    """A reply: ``message`` on success, ``error`` (a :class:`KvtierError`) otherwise.

    A reply with unique id 0 is the server's last word before it closes the connection.
    """

    header: ReplyHeader
    message: Message | None
    error: KvtierError | None


class ConnectionClosed(msgspec.Struct, frozen=True):
    """The peer ended the stream at a frame boundary."""


class ServerState(enum.Enum):
    AWAIT_INIT = enum.auto()
    READY = enum.auto()
    CLOSED = enum.auto()


#: (state, opcode) -> next state. A pair not in the table is answered with EPROTO.
SERVER_TRANSITIONS: Final[dict[tuple[ServerState, Opcode], ServerState]] = {
    (ServerState.AWAIT_INIT, Opcode.INIT): ServerState.READY,
    **{
        (ServerState.READY, op): ServerState.READY
        for op in Opcode
        if op not in (Opcode.INIT, Opcode.DESTROY)
    },
    (ServerState.READY, Opcode.DESTROY): ServerState.CLOSED,
}


#: (state, opcode answered with an error) -> next state, for the request that made the state:
#: a refused INIT closes the connection (an INIT refused as not allowed in READY does not).
SERVER_REPLY_TRANSITIONS: Final[dict[tuple[ServerState, Opcode], ServerState]] = {
    (ServerState.READY, Opcode.INIT): ServerState.CLOSED,
}

#: :data:`SERVER_TRANSITIONS` by state, then by the header's opcode number: what every request
#: looks up (no ``Opcode`` built, no tuple of enums hashed).
_FOLLOWING: Final[dict[ServerState, dict[int, ServerState]]] = {
    state: {int(op): nxt for (at, op), nxt in SERVER_TRANSITIONS.items() if at is state}
    for state in ServerState
}
_OPCODES: Final = frozenset(int(op) for op in Opcode)
_REQUEST_TYPE: Final[dict[int, type[Message]]] = {int(op): c for op, c in REQUEST_TYPES.items()}
_REPLY_TYPE: Final[dict[int, type[Message]]] = {int(op): c for op, c in REPLY_TYPES.items()}
#: Request and reply structs by type, to their opcode number.
_REQUEST_OPCODE: Final[dict[type[Message], int]] = {c: int(op) for op, c in REQUEST_TYPES.items()}
_REPLY_OPCODE: Final[dict[type[Message], int]] = {c: int(op) for op, c in REPLY_TYPES.items()}
#: magic, version, opcode, length: the first 12 bytes of either header.
_PREFIX = struct.Struct("<4sHHI")


#: Bodies up to this size are sliced off their frame as a copy, which costs less than a view.
_COPIED_BODY_BYTES = 4096


def _body(frame: bytes) -> bytes | memoryview:
    """``frame``'s body: a small one copied, a large one (READ's extents) as a view."""
    if len(frame) <= _COPIED_BODY_BYTES:
        return frame[HEADER_BYTES:]
    return memoryview(frame)[HEADER_BYTES:]


class _FrameBuffer:
    """Accumulates bytes and cuts complete frames off the front.

    The usual arrival, one ``bytes`` holding exactly one whole frame into an empty buffer, is
    kept as it came (``_whole``) and handed back as that frame with no copy in and out of the
    ``bytearray``; anything else (part of a frame, several, a tail) goes through the buffer."""

    def __init__(self, magic: bytes, max_frame_bytes: int) -> None:
        self._buffer = bytearray()
        self._whole: bytes | None = None
        self._magic = magic
        self._eof = False
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("data received after end of stream")
        if self._whole is None and not self._buffer and type(data) is bytes:
            self._whole = data
            return
        self._buffer_whole()
        self._buffer += data

    def _buffer_whole(self) -> None:
        if self._whole is not None:
            self._buffer += self._whole
            self._whole = None

    def next_frame(self) -> bytes | ConnectionClosed | None:
        """A whole frame, ``None`` when more bytes are needed, or ``ConnectionClosed``."""
        whole = self._whole
        if whole is not None:
            if len(whole) >= HEADER_BYTES:
                magic, version, _, length = _PREFIX.unpack_from(whole)
                if (
                    length == len(whole)
                    and magic == self._magic
                    and version == PROTOCOL_VERSION
                    and length <= self.max_frame_bytes
                ):
                    self._whole = None
                    return whole
            self._buffer_whole()  # not exactly one sound frame: the general path judges it
        buffer = self._buffer
        buffered = len(buffer)
        if buffered >= HEADER_BYTES:
            magic, version, _, length = _PREFIX.unpack_from(buffer)
            if magic != self._magic or version != PROTOCOL_VERSION:
                self._check_prefix()
            if not HEADER_BYTES <= length <= self.max_frame_bytes:
                raise RemoteProtocolError(
                    f"frame length {length} outside [{HEADER_BYTES}, {self.max_frame_bytes}]"
                )
            if buffered == length:  # one whole frame, nothing after it
                frame = bytes(buffer)
                buffer.clear()
                return frame
            if buffered > length:
                frame = bytes(buffer[:length])
                del buffer[:length]
                return frame
        elif buffered >= 8:
            self._check_prefix()
        if self._eof:
            if buffered:
                raise RemoteProtocolError(f"stream ended inside a frame ({buffered} bytes)")
            return ConnectionClosed()
        return None

    def _check_prefix(self) -> None:
        if self._buffer[:4] != self._magic:
            raise RemoteProtocolError(f"bad magic {bytes(self._buffer[:4])!r}")
        version = int.from_bytes(self._buffer[4:6], "little")
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(f"unsupported protocol version {version}")


class ServerConnection:
    """The daemon's side of one connection."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._frames = _FrameBuffer(REQUEST_MAGIC, max_frame_bytes)
        self.state = ServerState.AWAIT_INIT
        self._in_flight: set[int] = set()
        #: The minor the client's INIT said: replies leave out fields appended after it.
        self.peer_minor = PROTOCOL_MINOR
        self._init_unique = 0  # the INIT that took the connection to READY

    @property
    def max_frame_bytes(self) -> int:
        return self._frames.max_frame_bytes

    def negotiate(self, max_frame_bytes: int) -> None:
        """Lower (never raise) the frame limit after INIT."""
        self._frames.max_frame_bytes = min(self._frames.max_frame_bytes, max_frame_bytes)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._frames.feed(data)

    def next_event(self) -> RequestReceived | InvalidRequest | ConnectionClosed | NeedData:
        frame = self._frames.next_frame()
        if frame is None:
            return NEED_DATA
        if isinstance(frame, ConnectionClosed):
            return frame
        _, header = RequestHeader.unpack(frame)
        unique = header.unique
        in_flight = self._in_flight
        if unique == 0 or unique in in_flight:
            raise RemoteProtocolError(f"unique id {unique} is zero or already in flight")
        if self.state is ServerState.CLOSED:
            raise RemoteProtocolError("request after DESTROY or a refused INIT")
        in_flight.add(unique)
        return self._decode(header, _body(frame))

    def _decode(
        self, header: RequestHeader, body: bytes | memoryview
    ) -> RequestReceived | InvalidRequest:
        opcode = header.opcode
        following = _FOLLOWING[self.state].get(opcode)
        if following is None:
            if opcode not in _OPCODES:
                return InvalidRequest(header, InvalidRequestError(f"unknown opcode {opcode}"))
            name = Opcode(opcode).name
            error = RemoteProtocolError(f"{name} not allowed in state {self.state.name}")
            return InvalidRequest(header, error)
        try:
            message = decode_body(_REQUEST_TYPE[opcode], body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            name = Opcode(opcode).name
            return InvalidRequest(header, InvalidRequestError(f"{name}: {exc}"))
        self.state = following
        if isinstance(message, InitRequest):
            self.peer_minor = message.minor
            self._init_unique = header.unique
        return RequestReceived(header, message)

    def reply(
        self, request: RequestHeader, message: Message, flags: FrameFlags = FrameFlags.NONE
    ) -> bytes:
        """Bytes of the successful reply to ``request``."""
        if _REPLY_OPCODE.get(type(message)) != request.opcode:
            raise LocalProtocolError(f"{type(message).__name__} does not answer {request.opcode}")
        body = encode_body(message, peer_minor=self.peer_minor)  # may fail: then reply_error
        if request.unique == self._init_unique:
            self._init_unique = 0
        return self._frame(request, 0, body, flags)

    def reply_error(self, request: RequestHeader, exc: BaseException) -> bytes:
        """Bytes of an error reply to ``request`` carrying ``-errno_of(exc)``."""
        frame = self._frame(request, -errno_of(exc), encode_body(ErrorReply(str(exc)[:4096])))
        if request.unique == self._init_unique:
            self._init_unique = 0
            key = (self.state, Opcode(request.opcode))
            self.state = SERVER_REPLY_TRANSITIONS.get(key, self.state)
        return frame

    def fatal(self, exc: BaseException) -> bytes:
        """Bytes of the last frame before closing: unique id 0 and the error."""
        self.state = ServerState.CLOSED
        body = encode_body(ErrorReply(str(exc)[:4096]))
        return ReplyHeader(0, HEADER_BYTES + len(body), 0, -errno_of(exc)).pack() + body

    def _frame(self, request: RequestHeader, error: int, body: bytes, flags: int = 0) -> bytes:
        unique = request.unique
        try:
            self._in_flight.remove(unique)
        except KeyError:
            raise LocalProtocolError(f"unique id {unique} is not awaiting a reply") from None
        # packed here, not through a ReplyHeader built per reply (the same bytes)
        length = HEADER_BYTES + len(body)
        return pack_reply_header(request.opcode, length, unique, error, flags) + body


class ClientConnection:
    """The engine's side of one connection: numbers requests and matches replies to them.

    ``max_frame_bytes`` bounds the replies it accepts and, until INIT is answered, the requests
    it builds; INIT's reply then lowers :attr:`max_request_bytes` to the limit the daemon
    negotiated, so a request the daemon would refuse fails here, before it is sent.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._frames = _FrameBuffer(REPLY_MAGIC, max_frame_bytes)
        self._uniques = itertools.count(1)
        self._pending: dict[int, int] = {}
        self.max_request_bytes = max_frame_bytes

    @property
    def pending(self) -> int:
        return len(self._pending)

    def request(self, message: Message, ns: int = 0) -> tuple[int, bytes]:
        """``(unique, frame bytes)`` for ``message`` sent on namespace ``ns``."""
        opcode = _REQUEST_OPCODE.get(type(message))
        if opcode is None:
            raise LocalProtocolError(f"{type(message).__name__} is not a request")
        unique = next(self._uniques)
        body = encode_body(message)
        if HEADER_BYTES + len(body) > self.max_request_bytes:
            raise InvalidRequestError(
                f"{Opcode(opcode).name} frame of {HEADER_BYTES + len(body)} bytes exceeds the "
                f"{self.max_request_bytes}-byte limit: send fewer keys per call"
            )
        self._pending[unique] = opcode
        return unique, pack_request_header(opcode, HEADER_BYTES + len(body), unique, ns) + body

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._frames.feed(data)

    def next_event(self) -> ReplyReceived | ConnectionClosed | NeedData:
        frame = self._frames.next_frame()
        if frame is None:
            return NEED_DATA
        if isinstance(frame, ConnectionClosed):
            return frame
        _, header = ReplyHeader.unpack(frame)
        body = _body(frame)
        if header.unique == 0:
            return ReplyReceived(header, None, self._error(header, body))
        opcode = self._pending.pop(header.unique, None)
        if opcode is None or opcode != header.opcode:
            raise RemoteProtocolError(f"reply {header.unique} answers no pending request")
        if header.error:
            return ReplyReceived(header, None, self._error(header, body))
        try:
            message = decode_body(_REPLY_TYPE[opcode], body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            name = Opcode(opcode).name
            raise RemoteProtocolError(f"malformed {name} reply: {exc}") from exc
        if isinstance(message, InitReply):
            self.max_request_bytes = min(self.max_request_bytes, message.max_frame_bytes)
        return ReplyReceived(header, message, None)

    @staticmethod
    def _error(header: ReplyHeader, body: bytes | memoryview) -> KvtierError:
        if header.error >= 0:
            return RemoteProtocolError("a reply with unique id 0 must carry an errno")
        try:
            text = decode_body(ErrorReply, body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            text = ErrorReply(errno.errorcode.get(-header.error, "error"))
        assert isinstance(text, ErrorReply)
        return error_from_errno(header.error, text.message)
