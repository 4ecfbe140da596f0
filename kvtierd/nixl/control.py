"""The control channel between the daemon and a region's exporter process (no I/O).

The daemon and each exporter (:mod:`kvtierd.nixl.exporter`) talk over a Unix stream socket pair.
Every message is one frame: a 4-byte little-endian length, then a MessagePack map tagged with
the message's kind (``msgspec``'s tagged union). Nothing in it is pickled, and a frame longer
than :data:`MAX_FRAME_BYTES` or one that does not decode as a message of the expected direction
is a :class:`~kvtierd.errors.RemoteProtocolError` (whoever sent it is broken: the daemon kills
such an exporter and starts another).

Exporter to daemon: :class:`Ready` once, when the region is mapped and registered (everything
the daemon needs to answer NIXL_GRANT and READ_NIXL without a round trip), then one
:class:`Pulled` per :class:`Pull`. Daemon to exporter: :class:`Stir` (peers may be reading:
drive UCX's progress for the exporter's linger from now) and :class:`Pull` (read a peer's
extents into the exporter's landing buffer, for a peer restore: the region itself is mapped
read-only there, and the daemon copies the landed bytes into the arena slot).
"""

from __future__ import annotations

import struct
from typing import Any, Generic, TypeVar

import msgspec

from kvtierd.errors import RemoteProtocolError

__all__ = [
    "MAX_FRAME_BYTES",
    "FrameDecoder",
    "FromExporter",
    "Pull",
    "Pulled",
    "Ready",
    "Stir",
    "ToExporter",
    "encode",
]

#: The longest frame either side sends: a Ready or Pull carries NIXL metadata (a few KiB) and
#: descriptors (at most a READ_NIXL's, about 20 bytes per extent).
MAX_FRAME_BYTES = 4 << 20
_LENGTH = struct.Struct("<I")


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """The exporter is serving: its agent's name, the address of the region's first byte in
    the exporter, the region's size, and the metadata of the region's registration (what a
    client of the tenant loads)."""

    agent: str
    address: int
    size_bytes: int
    metadata: bytes


class Stir(msgspec.Struct, frozen=True, tag="stir"):
    """Drive UCX's progress from now until the exporter's linger has passed."""


class Pull(msgspec.Struct, frozen=True, tag="pull"):
    """Read ``descriptors`` (a peer agent's, :mod:`kvtierd.nixl.descriptors`) into ``length``
    bytes at ``offset`` of the exporter's landing buffer (never the region), loading
    ``metadata`` (the peer agent ``agent``'s) first when the exporter has not; answered by a
    :class:`Pulled` of the same ``id``."""

    id: int
    agent: str
    metadata: bytes
    descriptors: bytes
    offset: int
    length: int
    timeout_s: float


class Pulled(msgspec.Struct, frozen=True, tag="pulled"):
    """The end of :class:`Pull` ``id``: ``errno`` 0, or the error's errno and message."""

    id: int
    errno: int = 0
    message: str = ""


#: What the daemon sends, and what an exporter sends.
ToExporter = Stir | Pull
FromExporter = Ready | Pulled

M = TypeVar("M")


def encode(message: ToExporter | FromExporter) -> bytes:
    """``message`` as one frame."""
    body = msgspec.msgpack.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a {len(body)}-byte control message is over {MAX_FRAME_BYTES}")
    return _LENGTH.pack(len(body)) + body


class FrameDecoder(Generic[M]):
    """Frames in, messages of type ``kind`` (:data:`ToExporter` or :data:`FromExporter`) out,
    fed any split of the byte stream."""

    def __init__(self, kind: Any) -> None:  # a union type: no ``type[M]`` spells it
        self._decoder = msgspec.msgpack.Decoder(kind)
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[M]:
        """The messages completed by ``data``; raises
        :class:`~kvtierd.errors.RemoteProtocolError` for an oversized frame or one that is no
        such message (the stream is then unusable)."""
        self._buffer += data
        out: list[M] = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise RemoteProtocolError(f"a {length}-byte control frame is over the limit")
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            try:
                out.append(self._decoder.decode(self._buffer[_LENGTH.size : end]))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise RemoteProtocolError(f"not a control message: {exc}") from exc
            del self._buffer[:end]
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buffer)
