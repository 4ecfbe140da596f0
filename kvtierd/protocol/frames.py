"""Frame headers: the fixed little-endian prefix of every request and reply.

Modelled on the FUSE kernel protocol (``fuse_in_header`` / ``fuse_out_header``): a request names
its opcode, a unique id chosen by the client and the namespace it acts on; the reply echoes the
unique id and carries ``0`` or a negative errno. Both headers are 32 bytes::

    request  <4sHHIIQII  magic "KVTQ", version, opcode, length, flags, unique, ns, reserved
    reply    <4sHHIiQII  magic "KVTR", version, opcode, length, error, unique, flags, reserved

``length`` counts the whole frame, header included. Distinct magics for the two directions make
a client that talks to a client (or reads its own bytes back) fail on the first frame.
"""

from __future__ import annotations

import enum
import struct

import msgspec

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "MAX_KEYS_PER_REQUEST",
    "MIN_CLIENT_MINOR",
    "MIN_MAX_FRAME_BYTES",
    "PROTOCOL_MINOR",
    "PROTOCOL_VERSION",
    "REPLY_MAGIC",
    "REQUEST_MAGIC",
    "FrameFlags",
    "Opcode",
    "ReplyHeader",
    "RequestHeader",
    "pack_reply_header",
    "pack_request_header",
]

REQUEST_MAGIC = b"KVTQ"
REPLY_MAGIC = b"KVTR"
PROTOCOL_VERSION = 1
#: Raised whenever a field is appended to a body (minor 1: ``OpenNsRequest.create``; minor 2:
#: ``OpenNsRequest.sparse`` and HINT's query fields; minor 3: the POOL_STATUS opcode; minor 4:
#: the READ_RESIDENT opcode; minor 5: the DOCTOR opcode; minor 6: memory per tenant: INIT
#: passes no descriptor, OPEN_NS passes its tenant region's, extents are region offsets, and
#: a client must say minor >= 6 in INIT; minor 7: the LIST_KEYS opcode and ``NamespaceInfo``'s
#: counters; minor 8: the NIXL_GRANT and READ_NIXL opcodes; minor 9: STATFS's checkpoint
#: fields; minor 10: ``LookupRequest.each``; minor 11: STATFS's tenants; minor 12: the CONFIG
#: opcode; minor 13: ``TierStatistics.miss_bytes``; minor 14: ``HintReply.selected``, the
#: sparse selection per layer and KV head; minor 15: STATFS's ``sparse_fits``).
PROTOCOL_MINOR = 15
#: The oldest client minor a daemon serves: older clients expect the whole arena at INIT.
MIN_CLIENT_MINOR = 6
HEADER_BYTES = 32
#: A frame may never be larger than this unless INIT negotiated otherwise.
DEFAULT_MAX_FRAME_BYTES = 1 << 20
#: No negotiation may shrink the frame limit below this (an INIT must always fit).
MIN_MAX_FRAME_BYTES = 4096
#: Keys named by one LOOKUP/READ/ALLOC/FORGET, and listed by one LIST_KEYS page.
MAX_KEYS_PER_REQUEST = 8192

_REQUEST = struct.Struct("<4sHHIIQII")
_REPLY = struct.Struct("<4sHHIiQII")
assert _REQUEST.size == _REPLY.size == HEADER_BYTES


class Opcode(enum.IntEnum):
    """Request types. Values are part of the wire format: never renumber."""

    INIT = 1
    OPEN_NS = 2
    LOOKUP = 3
    READ = 4
    RELEASE = 5
    ALLOC = 6
    COMMIT = 7
    FORGET = 8
    FSYNC = 9
    HINT = 10
    STATFS = 11
    DESTROY = 12
    LIST_NS = 13
    EVICT = 14
    POOL_STATUS = 15
    READ_RESIDENT = 16
    DOCTOR = 17
    LIST_KEYS = 18
    NIXL_GRANT = 19
    READ_NIXL = 20
    CONFIG = 21


class FrameFlags(enum.IntFlag):
    """Header flag bits."""

    NONE = 0
    #: Reply: a file descriptor travels with this frame as SCM_RIGHTS ancillary data.
    FD_ATTACHED = 1


class RequestHeader(msgspec.Struct, frozen=True, gc=False):
    """The header of a request frame (a struct, not a dataclass: one is built per frame, and a
    frozen dataclass costs seven times as much to build; only numbers, so never in a cycle and
    never tracked by the garbage collector)."""

    opcode: int
    length: int
    unique: int
    ns: int = 0
    flags: int = 0
    version: int = PROTOCOL_VERSION

    def pack(self) -> bytes:
        return _REQUEST.pack(
            REQUEST_MAGIC,
            self.version,
            self.opcode,
            self.length,
            self.flags,
            self.unique,
            self.ns,
            0,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> tuple[bytes, RequestHeader]:
        """Return ``(magic, header)``; validation is the connection's job."""
        magic, version, opcode, length, flags, unique, ns, _ = _REQUEST.unpack_from(data)
        return magic, cls(opcode, length, unique, ns, flags, version)


class ReplyHeader(msgspec.Struct, frozen=True, gc=False):
    """The header of a reply frame. ``error`` is 0 or a negative errno."""

    opcode: int
    length: int
    unique: int
    error: int = 0
    flags: int = 0
    version: int = PROTOCOL_VERSION

    def pack(self) -> bytes:
        return _REPLY.pack(
            REPLY_MAGIC,
            self.version,
            self.opcode,
            self.length,
            self.error,
            self.unique,
            self.flags,
            0,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> tuple[bytes, ReplyHeader]:
        magic, version, opcode, length, error, unique, flags, _ = _REPLY.unpack_from(data)
        return magic, cls(opcode, length, unique, error, flags, version)


def pack_reply_header(opcode: int, length: int, unique: int, error: int, flags: int) -> bytes:
    """``ReplyHeader(opcode, length, unique, error, flags).pack()`` without the struct: what
    the daemon builds for every reply."""
    return _REPLY.pack(REPLY_MAGIC, PROTOCOL_VERSION, opcode, length, error, unique, flags, 0)


def pack_request_header(opcode: int, length: int, unique: int, ns: int) -> bytes:
    """``RequestHeader(opcode, length, unique, ns).pack()`` without the struct: what a client
    builds for every request."""
    return _REQUEST.pack(REQUEST_MAGIC, PROTOCOL_VERSION, opcode, length, 0, unique, ns, 0)
