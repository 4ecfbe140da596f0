"""Golden bytes: the frames of the worked example in ``docs/protocol.md``, pinned exactly, so an
accidental change to the format fails here.

They were captured from a real daemon (``--dram-size 64M``) at protocol minor 1 and brought to
minor 6 by hand where minor 6 changed them (INIT's minor, the INIT reply without a descriptor,
the OPEN_NS reply's region and its descriptor); they are replayed here through the sans-IO
connections. If one of these tests fails the wire format changed: that needs the
compatibility rule of ``docs/protocol.md`` (an appended field with a default, or a new
``PROTOCOL_VERSION``) and the document updated, not just a new golden value pasted in.
"""

from __future__ import annotations

from kvtierd.errors import BlockNotFoundError, InvalidRequestError, RemoteProtocolError
from kvtierd.keys import chain_keys
from kvtierd.protocol import (
    ClientConnection,
    FrameFlags,
    InvalidRequest,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.messages import (
    HintRequest,
    InitReply,
    InitRequest,
    LookupReply,
    LookupRequest,
    Message,
    OpenNsReply,
    OpenNsRequest,
    ReadRequest,
)
from tests.protocol.peers import handshake

SALT = bytes.fromhex("d700654d3bffa7c422d10f5996ecc926")
DIGEST = bytes.fromhex("8a730622a43be5fde4c7c5fe4d32f84f")
KEYS = chain_keys(range(32), 16, SALT)

INIT = bytes.fromhex(
    "4b565451 0100 0100 31000000 00000000 0100000000000000 00000000 00000000"
    "94 01 06 ce00100000 a8656e67696e652d30"
)
INIT_REPLY = bytes.fromhex(
    "4b565452 0100 0100 35000000 00000000 0100000000000000 00000000 00000000"
    "97 01 06 ce00100000 cd0100 cd2000 00 a5302e312e30"
)
OPEN_NS = bytes.fromhex(
    "4b565451 0100 0200 3b000000 00000000 0200000000000000 00000000 00000000"
    "99 a464656d6f cd1000 c0 00 01 a764656661756c74 a46e6f6e65 c3 c2"
)
OPEN_NS_REPLY = bytes.fromhex(
    "4b565452 0100 0200 4c000000 00000000 0200000000000000 01000000 00000000"
    "95 01 c410d700654d3bffa7c422d10f5996ecc926 c4108a730622a43be5fde4c7c5fe4d32f84f"
    "01 ce04000000"
)
LOOKUP = bytes.fromhex(
    "4b565451 0100 0300 47000000 00000000 0300000000000000 01000000 00000000"
    "92 92 c410a635c33f876273d2614b3194bbf3effe c41091c93d7769e9faad687d68f7e6a6210c c3"
)
LOOKUP_REPLY = bytes.fromhex(
    "4b565452 0100 0300 25000000 00000000 0300000000000000 00000000 00000000 92 01 c40100"
)
READ = bytes.fromhex(
    "4b565451 0100 0400 34000000 00000000 0400000000000000 01000000 00000000"
    "91 91 c41091c93d7769e9faad687d68f7e6a6210c"
)
READ_ENOENT = bytes.fromhex(
    "4b565452 0100 0400 57000000 feffffff 0400000000000000 00000000 00000000"
    "91 d934 626c6f636b203931633933643737363965396661616436383764363866376536613632313063"
    "206973206e6f742073746f726564"
)
FATAL = bytes.fromhex(
    "4b565452 0100 0000 33000000 b9ffffff 0000000000000000 00000000 00000000"
    "91 b1 626164206d616769632062274745542027"
)


def test_the_keys_of_the_example() -> None:
    assert [k.hex() for k in KEYS] == [
        "a635c33f876273d2614b3194bbf3effe",
        "91c93d7769e9faad687d68f7e6a6210c",
    ]


def _exchange(
    client: ClientConnection, server: ServerConnection, request: Message, ns: int, frame: bytes
) -> RequestReceived:
    unique, sent = client.request(request, ns)
    assert sent == frame
    server.receive_data(sent)
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    assert event.message == request
    assert event.header.unique == unique
    return event


def _answer(client: ClientConnection, frame: bytes) -> ReplyReceived:
    client.receive_data(frame)
    event = client.next_event()
    assert isinstance(event, ReplyReceived)
    return event


def test_the_documented_exchange_byte_for_byte() -> None:
    client, server = ClientConnection(), ServerConnection()

    init = _exchange(client, server, InitRequest(1, 6, 1 << 20, "engine-0"), 0, INIT)
    init_reply = InitReply(1, 6, 1 << 20, 256, 8192, 0, "0.1.0")
    assert server.reply(init.header, init_reply) == INIT_REPLY
    assert _answer(client, INIT_REPLY).message == init_reply

    open_ns = _exchange(client, server, OpenNsRequest("demo", 4096), 0, OPEN_NS)
    opened = OpenNsReply(1, SALT, DIGEST, 1, 64 << 20)
    assert server.reply(open_ns.header, opened, FrameFlags.FD_ATTACHED) == OPEN_NS_REPLY
    assert _answer(client, OPEN_NS_REPLY).message == opened

    lookup = _exchange(client, server, LookupRequest(KEYS), 1, LOOKUP)
    assert server.reply(lookup.header, LookupReply(1, b"\x00")) == LOOKUP_REPLY
    assert _answer(client, LOOKUP_REPLY).message == LookupReply(1, b"\x00")

    read = _exchange(client, server, ReadRequest(KEYS[1:]), 1, READ)
    missing = BlockNotFoundError(f"block {KEYS[1].hex()} is not stored")
    assert server.reply_error(read.header, missing) == READ_ENOENT
    error = _answer(client, READ_ENOENT).error
    assert isinstance(error, BlockNotFoundError)
    assert str(error) == str(missing)


def test_the_fatal_frame() -> None:
    assert ServerConnection().fatal(RemoteProtocolError("bad magic b'GET '")) == FATAL
    client = ClientConnection()
    client.receive_data(FATAL)
    event = client.next_event()
    assert isinstance(event, ReplyReceived)
    assert event.header.unique == 0
    assert isinstance(event.error, RemoteProtocolError)


def test_a_lookup_before_init_is_refused_by_its_golden_bytes() -> None:
    server = ServerConnection()
    server.receive_data(LOOKUP)
    event = server.next_event()
    assert isinstance(event, InvalidRequest)
    assert isinstance(event.error, RemoteProtocolError)


#: A HINT of two chains of 4096 and 4097 one-byte keys ``k``: 8193 keys in all, one more than a
#: HINT's queue holds (issue 31). The body is MessagePack ``[b"", [chain, chain]]``, each chain
#: an array16 of ``c4 01 6b``.
HINT_OVER = (
    bytes.fromhex("4b565451 0100 0a00 2d600000 00000000 0200000000000000 01000000 00000000")
    + bytes.fromhex("92 c400 92 dc1000")
    + bytes.fromhex("c4016b") * 4096
    + bytes.fromhex("dc1001")
    + bytes.fromhex("c4016b") * 4097
)
HINT_EINVAL = bytes.fromhex(
    "4b565452 0100 0a00 60000000 eaffffff 0200000000000000 00000000 00000000"
    "91 d93d 48494e543a2074686520717565756520686f6c64732038313933206b65797320696e20616c6c3b"
    "206174206d6f73742038313932207065722048494e54"
)


def test_a_hint_over_the_queue_bound_is_refused_by_its_golden_bytes() -> None:
    """The server answers EINVAL (-22) for that HINT alone and goes on serving (``handshake``
    leaves the client's next unique id at 2)."""
    client, server = handshake()
    server.receive_data(HINT_OVER)
    event = server.next_event()
    assert isinstance(event, InvalidRequest)
    assert server.reply_error(event.header, event.error) == HINT_EINVAL
    unique, _ = client.request(HintRequest(b""), 1)  # the client's HINT that had unique id 2
    assert unique == event.header.unique == 2
    error = _answer(client, HINT_EINVAL).error
    assert isinstance(error, InvalidRequestError)
    assert str(error) == "HINT: the queue holds 8193 keys in all; at most 8192 per HINT"
    _, frame = client.request(LookupRequest(KEYS), 1)
    server.receive_data(frame)
    assert isinstance(server.next_event(), RequestReceived)
