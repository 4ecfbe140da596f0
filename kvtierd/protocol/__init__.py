"""The wire protocol, sans-IO: bytes in, events out; messages in, bytes out.

``frames`` holds the fixed headers and opcodes, ``messages`` the typed bodies and
``connection`` the per-connection state machines. Nothing here touches a socket. The byte-level
specification is ``docs/protocol.md``.
"""

from kvtierd.protocol.connection import (
    NEED_DATA,
    ClientConnection,
    ConnectionClosed,
    InvalidRequest,
    NeedData,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
    ServerState,
)
from kvtierd.protocol.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    MAX_KEYS_PER_REQUEST,
    PROTOCOL_VERSION,
    FrameFlags,
    Opcode,
    ReplyHeader,
    RequestHeader,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "MAX_KEYS_PER_REQUEST",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "ClientConnection",
    "ConnectionClosed",
    "FrameFlags",
    "InvalidRequest",
    "NeedData",
    "Opcode",
    "ReplyHeader",
    "ReplyReceived",
    "RequestHeader",
    "RequestReceived",
    "ServerConnection",
    "ServerState",
]
