"""Golden bytes: a few frames pinned exactly, so an accidental change to the format fails here.

These are the frames ``docs/protocol.md`` walks through. If one of these tests fails, the wire
format changed: that needs a new ``PROTOCOL_VERSION`` (or an appended field with a default, per
the compatibility rule) and the document updated, not a new golden value pasted in.
"""

from __future__ import annotations

from kvtierd.errors import BlockNotFoundError, RemoteProtocolError
from kvtierd.protocol import (
    ClientConnection,
    FrameFlags,
    InvalidRequest,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.messages import (
    InitReply,
    InitRequest,
    LookupReply,
    LookupRequest,
    ReadRequest,
)

KEY_A = bytes(range(16))
KEY_B = bytes(range(16, 32))

INIT_REQUEST = bytes.fromhex(
    "4b565451 0100 0100 31000000 00000000 0100000000000000 00000000 00000000"
    "94 01 00 ce00100000 a8656e67696e652d30"
)
INIT_REPLY = bytes.fromhex(
    "4b565452 0100 0100 39000000 00000000 0100000000000000 01000000 00000000"
    "97 01 00 ce00100000 cd0100 cd2000 ce04000000 a5302e312e30"
)
LOOKUP_REQUEST = bytes.fromhex(
    "4b565451 0100 0300 47000000 00000000 0200000000000000 01000000 00000000"
    "92 92 c410000102030405060708090a0b0c0d0e0f c410101112131415161718191a1b1c1d1e1f c3"
)
LOOKUP_REPLY = bytes.fromhex(
    "4b565452 0100 0300 25000000 00000000 0200000000000000 00000000 00000000 92 01 c40100"
)
ERROR_REPLY = bytes.fromhex(
    "4b565452 0100 0400 3a000000 feffffff 0300000000000000 00000000 00000000"
    "91 b8626c6f636b2066666666206973206e6f742073746f726564"
)
FATAL_REPLY = bytes.fromhex(
    "4b565452 0100 0000 33000000 b9ffffff 0000000000000000 00000000 00000000"
    "91 b1626164206d616769632062275858585827"
)


def test_the_documented_exchange_byte_for_byte() -> None:
    client, server = ClientConnection(), ServerConnection()

    unique, frame = client.request(InitRequest(1, 0, 1 << 20, "engine-0"))
    assert (unique, frame) == (1, INIT_REQUEST)
    server.receive_data(frame)
    init = server.next_event()
    assert isinstance(init, RequestReceived)
    reply = InitReply(1, 0, 1 << 20, 256, 8192, 64 << 20, "0.1.0")
    assert server.reply(init.header, reply, FrameFlags.FD_ATTACHED) == INIT_REPLY
    client.receive_data(INIT_REPLY)
    answer = client.next_event()
    assert isinstance(answer, ReplyReceived)
    assert answer.message == reply

    unique, frame = client.request(LookupRequest([KEY_A, KEY_B]), ns=1)
    assert (unique, frame) == (2, LOOKUP_REQUEST)
    server.receive_data(frame)
    lookup = server.next_event()
    assert isinstance(lookup, RequestReceived)
    assert lookup.message == LookupRequest([KEY_A, KEY_B], promote=True)
    assert server.reply(lookup.header, LookupReply(1, b"\x00")) == LOOKUP_REPLY

    unique, frame = client.request(ReadRequest([b"\xff" * 16]), ns=1)
    server.receive_data(frame)
    read = server.next_event()
    assert isinstance(read, RequestReceived)
    assert server.reply_error(read.header, BlockNotFoundError("block ffff is not stored")) == (
        ERROR_REPLY
    )
    client.receive_data(LOOKUP_REPLY + ERROR_REPLY)
    first, second = client.next_event(), client.next_event()
    assert isinstance(first, ReplyReceived)
    assert first.message == LookupReply(1, b"\x00")
    assert isinstance(second, ReplyReceived)
    assert isinstance(second.error, BlockNotFoundError)
    assert str(second.error) == "block ffff is not stored"


def test_the_fatal_frame() -> None:
    assert ServerConnection().fatal(RemoteProtocolError("bad magic b'XXXX'")) == FATAL_REPLY


def test_golden_requests_decode_on_a_fresh_server() -> None:
    server = ServerConnection()
    server.receive_data(INIT_REQUEST + LOOKUP_REQUEST)
    assert isinstance(server.next_event(), RequestReceived)
    lookup = server.next_event()
    assert isinstance(lookup, RequestReceived)
    assert (lookup.header.ns, lookup.header.unique) == (1, 2)


def test_a_pre_init_lookup_is_refused_by_its_golden_bytes() -> None:
    server = ServerConnection()
    server.receive_data(LOOKUP_REQUEST)
    event = server.next_event()
    assert isinstance(event, InvalidRequest)
    assert isinstance(event.error, RemoteProtocolError)
