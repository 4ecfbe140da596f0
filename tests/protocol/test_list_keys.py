"""LIST_KEYS (minor 7) on the wire: its bytes as ``docs/protocol.md`` shows them, its bounds, and
the reply fields appended in minor 7 left out for a client of minor 6."""

from __future__ import annotations

import errno

import msgspec
import pytest

from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_KEYS_PER_REQUEST,
    InvalidRequest,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.frames import Opcode, RequestHeader
from kvtierd.protocol.messages import (
    KeyRecord,
    Layout,
    ListKeysReply,
    ListKeysRequest,
    ListNsReply,
    ListNsRequest,
    NamespaceInfo,
    encode_body,
)
from tests.protocol.peers import handshake, reply_body_to

KEY = bytes.fromhex("a635c33f876273d2614b3194bbf3effe")

LIST_KEYS = bytes.fromhex(
    "4b565451 0100 1200 25000000 00000000 0200000000000000 00000000 00000000 93 01 c400 02"
)
LIST_KEYS_REPLY = bytes.fromhex(
    "4b565452 0100 1200 3e000000 00000000 0200000000000000 00000000 00000000"
    "93 91 96 c410a635c33f876273d2614b3194bbf3effe c3 c3 c2 cd1000 c2 c3 02"
)


def _received(server: ServerConnection, frame: bytes) -> RequestReceived | InvalidRequest:
    server.receive_data(frame)
    event = server.next_event()
    assert isinstance(event, RequestReceived | InvalidRequest)
    return event


def test_a_page_request_and_its_reply_byte_for_byte() -> None:
    client, server = handshake()
    request = ListKeysRequest(1, b"", 2)
    _, frame = client.request(request)
    assert frame == LIST_KEYS
    event = _received(server, frame)
    assert isinstance(event, RequestReceived)
    assert event.message == request
    reply = ListKeysReply([KeyRecord(KEY, True, True, False, 4096, False)], True, 2)
    assert server.reply(event.header, reply) == LIST_KEYS_REPLY
    client.receive_data(LIST_KEYS_REPLY)
    answer = client.next_event()
    assert isinstance(answer, ReplyReceived)
    assert answer.message == reply


@pytest.mark.parametrize(
    "body",
    [
        [1, b"", 0],  # a page of nothing
        [1, b"", MAX_KEYS_PER_REQUEST + 1],  # beyond the cap
        [0, b"", 10],  # no namespace has id 0
        [1, b"k" * (MAX_KEY_BYTES + 1), 10],  # no key is that long
        [1, b"", -1],
    ],
)
def test_out_of_bounds_pages_are_refused_with_einval(body: list[object]) -> None:
    _, server = handshake()
    payload = msgspec.msgpack.encode(body)
    frame = RequestHeader(Opcode.LIST_KEYS, 32 + len(payload), 7).pack() + payload
    event = _received(server, frame)
    assert isinstance(event, InvalidRequest)
    assert event.error.errno == errno.EINVAL


def test_the_largest_page_fits_in_a_default_frame() -> None:
    client, server = handshake()
    event = _received(server, client.request(ListKeysRequest(1, limit=MAX_KEYS_PER_REQUEST))[1])
    assert isinstance(event, RequestReceived)
    records = [
        KeyRecord(bytes([i % 256]) * MAX_KEY_BYTES, True, True, True, (1 << 64) - 1, True)
        for i in range(MAX_KEYS_PER_REQUEST)
    ]
    frame = server.reply(event.header, ListKeysReply(records, True, (1 << 64) - 1))
    assert len(frame) <= DEFAULT_MAX_FRAME_BYTES
    client.receive_data(frame)
    answer = client.next_event()
    assert isinstance(answer, ReplyReceived)
    assert answer.message is not None


class _NamespaceInfoMinor6(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """``NamespaceInfo`` as a minor-6 client decodes it: it rejects a longer array."""

    ns: int
    name: str
    tenant: str
    rank: int
    world_size: int
    block_bytes: int
    dram_blocks: int
    nvme_blocks: int
    layout: Layout | None = None


_INFO = NamespaceInfo(
    3, "chat", "default", 0, 1, 4096, 5, 7, None, 9, 10, 8, 6, 6 * 4096, 9, 9 * 4096
)


def _list_ns_reply_to(minor: int) -> bytes:
    """The body of the LIST_NS reply a server sends a client whose INIT said ``minor``."""
    return reply_body_to(minor, ListNsRequest(), ListNsReply([_INFO]))


def test_a_minor_6_client_gets_namespace_info_without_the_minor_7_counters() -> None:
    body = _list_ns_reply_to(6)
    old = msgspec.msgpack.decode(body, type=tuple[list[_NamespaceInfoMinor6]])
    assert old[0][0].nvme_blocks == 7
    decoded = msgspec.msgpack.decode(body, type=ListNsReply)
    assert decoded.namespaces[0] == msgspec.structs.replace(
        _INFO,
        blocks=0,
        lookup_blocks=0,
        hit_blocks=0,
        read_blocks=0,
        read_bytes=0,
        committed_blocks=0,
        committed_bytes=0,
    )


def test_a_minor_7_client_gets_every_field() -> None:
    body = _list_ns_reply_to(7)
    assert body == encode_body(ListNsReply([_INFO]))
    assert msgspec.msgpack.decode(body, type=ListNsReply).namespaces == [_INFO]
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(body, type=tuple[list[_NamespaceInfoMinor6]])
