"""(d) The connection state machine and (f) recovery from a bad body.

Two kinds of failure, by whether the stream is still in sync: a sound header with an
unacceptable request (wrong state, unknown opcode, bad body) is an ``InvalidRequest`` event that
the owner answers, and the next frame is served; a header that cannot be trusted raises
``RemoteProtocolError`` and the owner closes the connection.
"""

from __future__ import annotations

import errno
import struct

import msgspec
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from kvtierd.errors import InvalidRequestError, LocalProtocolError, RemoteProtocolError
from kvtierd.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    NEED_DATA,
    ClientConnection,
    FrameFlags,
    InvalidRequest,
    Opcode,
    ReplyReceived,
    RequestHeader,
    RequestReceived,
    ServerConnection,
    ServerState,
)
from kvtierd.protocol.connection import SERVER_REPLY_TRANSITIONS, SERVER_TRANSITIONS
from kvtierd.protocol.frames import REPLY_MAGIC
from kvtierd.protocol.messages import (
    REQUEST_TYPES,
    DestroyReply,
    DestroyRequest,
    FsyncReply,
    FsyncRequest,
    InitRequest,
    LookupReply,
    LookupRequest,
    Message,
    ReadRequest,
    ReadResidentRequest,
    StatfsRequest,
    encode_body,
)
from tests.protocol.peers import INIT_REPLY, drain, handshake, init_frame
from tests.protocol.strategies import FAST, message_strategy

_DEFAULTS: dict[Opcode, Message] = {
    Opcode.INIT: InitRequest(1, 0, DEFAULT_MAX_FRAME_BYTES),
    Opcode.OPEN_NS: REQUEST_TYPES[Opcode.OPEN_NS]("ns", 4096),
    Opcode.LOOKUP: LookupRequest([b"k"]),
    Opcode.READ: ReadRequest([b"k"]),
    Opcode.READ_RESIDENT: ReadResidentRequest([b"k"]),
    Opcode.RELEASE: REQUEST_TYPES[Opcode.RELEASE]([1]),
    Opcode.ALLOC: REQUEST_TYPES[Opcode.ALLOC]([b"k"]),
    Opcode.COMMIT: REQUEST_TYPES[Opcode.COMMIT](1),
    Opcode.FORGET: REQUEST_TYPES[Opcode.FORGET]([b"k"]),
    Opcode.FSYNC: FsyncRequest(),
    Opcode.HINT: REQUEST_TYPES[Opcode.HINT](),
    Opcode.STATFS: StatfsRequest(),
    Opcode.DESTROY: DestroyRequest(),
    Opcode.LIST_NS: REQUEST_TYPES[Opcode.LIST_NS](),
    Opcode.EVICT: REQUEST_TYPES[Opcode.EVICT](),
    Opcode.POOL_STATUS: REQUEST_TYPES[Opcode.POOL_STATUS](),
    Opcode.DOCTOR: REQUEST_TYPES[Opcode.DOCTOR](),
    Opcode.LIST_KEYS: REQUEST_TYPES[Opcode.LIST_KEYS](1),
    Opcode.NIXL_GRANT: REQUEST_TYPES[Opcode.NIXL_GRANT](),
    Opcode.READ_NIXL: REQUEST_TYPES[Opcode.READ_NIXL]([b"k"]),
    Opcode.CONFIG: REQUEST_TYPES[Opcode.CONFIG](),
}


def raw_request(opcode: int, unique: int, body: bytes, *, length: int | None = None) -> bytes:
    size = HEADER_BYTES + len(body) if length is None else length
    return RequestHeader(opcode, size, unique).pack() + body


def _event(server: ServerConnection, frame: bytes) -> object:
    server.receive_data(frame)
    return server.next_event()


def test_the_transition_table() -> None:
    assert SERVER_TRANSITIONS[(ServerState.AWAIT_INIT, Opcode.INIT)] is ServerState.READY
    assert SERVER_TRANSITIONS[(ServerState.READY, Opcode.DESTROY)] is ServerState.CLOSED
    for op in Opcode:
        assert ((ServerState.AWAIT_INIT, op) in SERVER_TRANSITIONS) == (op is Opcode.INIT)
        assert ((ServerState.READY, op) in SERVER_TRANSITIONS) == (op is not Opcode.INIT)
        assert (ServerState.CLOSED, op) not in SERVER_TRANSITIONS


@pytest.mark.parametrize("opcode", [op for op in Opcode if op is not Opcode.INIT])
def test_requests_before_init_get_eproto_and_init_still_works(opcode: Opcode) -> None:
    server = ServerConnection()
    event = _event(server, raw_request(opcode, 5, encode_body(_DEFAULTS[opcode])))
    assert isinstance(event, InvalidRequest)
    assert isinstance(event.error, RemoteProtocolError)
    assert event.error.errno == errno.EPROTO
    assert server.state is ServerState.AWAIT_INIT
    reply = server.reply_error(event.header, event.error)
    assert struct.unpack_from("<i", reply, 12)[0] == -errno.EPROTO
    assert isinstance(_event(server, init_frame(ClientConnection())), RequestReceived)
    assert server.state is ServerState.READY


def test_init_twice_gets_eproto_and_the_connection_goes_on() -> None:
    client, server = handshake()
    event = _event(server, init_frame(client))
    assert isinstance(event, InvalidRequest)
    assert isinstance(event.error, RemoteProtocolError)
    assert server.state is ServerState.READY
    server.reply_error(event.header, event.error)
    assert isinstance(_event(server, client.request(StatfsRequest())[1]), RequestReceived)


def test_a_refused_init_closes_the_connection() -> None:
    client, server = ClientConnection(), ServerConnection()
    event = _event(server, init_frame(client))
    assert isinstance(event, RequestReceived)
    assert server.state is ServerState.READY
    server.reply_error(event.header, InvalidRequestError("protocol major version 9"))
    assert server.state is ServerState.CLOSED  # the refusal was the connection's last frame
    server.receive_data(client.request(StatfsRequest())[1])
    with pytest.raises(RemoteProtocolError, match="refused INIT"):
        server.next_event()


def test_an_error_reply_to_a_later_request_keeps_the_connection() -> None:
    client, server = handshake()
    event = _event(server, client.request(StatfsRequest())[1])
    assert isinstance(event, RequestReceived)
    server.reply_error(event.header, InvalidRequestError("no"))
    assert server.state is ServerState.READY


def test_requests_after_destroy_are_a_protocol_error() -> None:
    client, server = handshake()
    destroy = _event(server, client.request(DestroyRequest())[1])
    assert isinstance(destroy, RequestReceived)
    assert server.state is ServerState.CLOSED
    server.receive_data(client.request(StatfsRequest())[1])
    with pytest.raises(RemoteProtocolError, match="after DESTROY"):
        server.next_event()
    # DESTROY itself is still answered.
    client.receive_data(server.reply(destroy.header, DestroyReply()))
    answer = client.next_event()
    assert isinstance(answer, ReplyReceived)
    assert answer.message == DestroyReply()


def test_a_unique_id_may_not_be_in_flight_twice_but_may_be_reused_after_its_reply() -> None:
    _, server = handshake()
    first = _event(server, raw_request(Opcode.FSYNC, 7, encode_body(FsyncRequest())))
    assert isinstance(first, RequestReceived)
    server.receive_data(raw_request(Opcode.STATFS, 7, encode_body(StatfsRequest())))
    with pytest.raises(RemoteProtocolError, match="already in flight"):
        server.next_event()
    _, server = handshake()
    first = _event(server, raw_request(Opcode.FSYNC, 7, encode_body(FsyncRequest())))
    assert isinstance(first, RequestReceived)
    server.reply(first.header, FsyncReply(0))
    assert isinstance(
        _event(server, raw_request(Opcode.FSYNC, 7, encode_body(FsyncRequest()))), RequestReceived
    )


def test_an_invalid_request_keeps_its_unique_in_flight_until_answered() -> None:
    _, server = handshake()
    event = _event(server, raw_request(Opcode.LOOKUP, 9, b"\xc1"))
    assert isinstance(event, InvalidRequest)
    assert server.in_flight == 1
    server.receive_data(raw_request(Opcode.LOOKUP, 9, encode_body(LookupRequest([b"k"]))))
    with pytest.raises(RemoteProtocolError):
        server.next_event()


def test_unique_zero_is_reserved_for_the_fatal_frame() -> None:
    _, server = handshake()
    server.receive_data(raw_request(Opcode.STATFS, 0, encode_body(StatfsRequest())))
    with pytest.raises(RemoteProtocolError, match="unique id 0"):
        server.next_event()


@pytest.mark.parametrize("limit", [4096, 65536, DEFAULT_MAX_FRAME_BYTES])
def test_frame_length_above_the_negotiated_limit_raises(limit: int) -> None:
    _, server = handshake()
    server.negotiate(limit)
    assert server.max_frame_bytes == limit
    # A frame of exactly the limit is accepted (its body is junk: framing is what is tested).
    at_limit = raw_request(Opcode.LOOKUP, 3, b"\xc1" * (limit - HEADER_BYTES))
    assert len(at_limit) == limit
    assert isinstance(_event(server, at_limit), InvalidRequest)
    # Only the header is needed to refuse a frame that is too long.
    server.receive_data(RequestHeader(Opcode.LOOKUP, limit + 1, 4).pack())
    with pytest.raises(RemoteProtocolError, match="outside"):
        server.next_event()


def test_negotiation_only_lowers_the_limit() -> None:
    server = ServerConnection(65536)
    server.negotiate(DEFAULT_MAX_FRAME_BYTES)
    assert server.max_frame_bytes == 65536


@pytest.mark.parametrize("length", [0, 1, HEADER_BYTES - 1])
def test_frame_length_below_the_header_raises(length: int) -> None:
    server = ServerConnection()
    server.receive_data(RequestHeader(Opcode.INIT, length, 1).pack())
    with pytest.raises(RemoteProtocolError, match="outside"):
        server.next_event()


@pytest.mark.parametrize(
    "prefix",
    [b"KVTX\x01\x00", b"kvtq\x01\x00", REPLY_MAGIC + b"\x01\x00", b"KVTQ\x00\x00", b"KVTQ\x02\x00"],
)
def test_bad_magic_or_version_raises_after_eight_bytes(prefix: bytes) -> None:
    server = ServerConnection()
    frame = prefix + init_frame(ClientConnection())[6:]
    server.receive_data(frame[:7])
    assert server.next_event() is NEED_DATA
    server.receive_data(frame[7:])
    with pytest.raises(RemoteProtocolError):
        server.next_event()


def test_bad_reply_magic_or_version_raises_on_the_client() -> None:
    client, server = handshake()
    server.receive_data(client.request(StatfsRequest())[1])
    assert isinstance(server.next_event(), RequestReceived)
    client.receive_data(init_frame(ClientConnection()))  # a request where a reply belongs
    with pytest.raises(RemoteProtocolError, match="bad magic"):
        client.next_event()


def test_unknown_opcode_is_einval_and_the_connection_goes_on() -> None:
    client, server = handshake()
    event = _event(server, raw_request(999, 5, b"\x90"))
    assert isinstance(event, InvalidRequest)
    assert isinstance(event.error, InvalidRequestError)
    server.reply_error(event.header, event.error)
    assert isinstance(_event(server, client.request(StatfsRequest())[1]), RequestReceived)


_BAD_BODIES = [
    b"\xc1",  # the one byte MessagePack never uses
    b"\x91",  # an array that promises an element and ends
    b"\x80",  # a map where an array belongs
    b"\x9f" + b"\xc0" * 15,  # more fields than any struct
    b"\x91\xa2\xc3\x28",  # a string that is not UTF-8
    b"\x90\x90",  # a valid body followed by one more value
]


@pytest.mark.parametrize("opcode", list(Opcode))
@pytest.mark.parametrize("body", _BAD_BODIES)
def test_a_body_that_does_not_decode_is_einval_and_the_next_frame_is_served(
    opcode: Opcode, body: bytes
) -> None:
    client, server = (
        (ClientConnection(), ServerConnection()) if opcode is Opcode.INIT else handshake()
    )
    event = _event(server, raw_request(opcode, 1000, body))
    assert isinstance(event, InvalidRequest)
    assert type(event.error) is InvalidRequestError
    assert event.error.errno == errno.EINVAL
    server.reply_error(event.header, event.error)
    follow_up = _DEFAULTS[Opcode.INIT] if opcode is Opcode.INIT else StatfsRequest()
    assert isinstance(_event(server, client.request(follow_up)[1]), RequestReceived)


@pytest.mark.parametrize("opcode", [op for op in Opcode if op is not Opcode.INIT])
def test_an_empty_body_is_einval_even_for_opcodes_without_fields(opcode: Opcode) -> None:
    # A request without fields is the empty array 0x90, never zero bytes.
    _, server = handshake()
    event = _event(server, raw_request(opcode, 1000, b""))
    assert isinstance(event, InvalidRequest)
    assert type(event.error) is InvalidRequestError


@pytest.mark.parametrize(
    "fields",
    [
        [[]],  # no keys
        [[b""]],  # an empty key
        [[b"k" * 33]],  # a key of 33 bytes
        [[b"k" * 16] * 8193],  # one key too many
        [["text"]],  # a str where bytes belong
        [[b"k"], 1],  # an int where a bool belongs
    ],
)
def test_a_lookup_that_breaks_a_bound_is_einval(fields: list[object]) -> None:
    _, server = handshake()
    event = _event(server, raw_request(Opcode.LOOKUP, 3, msgspec.msgpack.encode(fields)))
    assert isinstance(event, InvalidRequest)
    assert type(event.error) is InvalidRequestError


def test_the_client_refuses_replies_it_did_not_ask_for() -> None:
    client, server = handshake()
    unique, frame = client.request(LookupRequest([b"k"]))
    server.receive_data(frame)
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    reply = server.reply(event.header, LookupReply(0))
    wrong_unique = reply[:16] + (unique + 1).to_bytes(8, "little") + reply[24:]
    client.receive_data(wrong_unique)
    with pytest.raises(RemoteProtocolError, match="no pending request"):
        client.next_event()
    client, server = handshake()
    server.receive_data(client.request(LookupRequest([b"k"]))[1])
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    wrong_opcode = bytearray(server.reply(event.header, LookupReply(0)))
    wrong_opcode[6:8] = int(Opcode.READ).to_bytes(2, "little")
    client.receive_data(bytes(wrong_opcode))
    with pytest.raises(RemoteProtocolError):
        client.next_event()


def test_a_successful_reply_whose_body_does_not_decode_is_a_protocol_error() -> None:
    client, _ = handshake()
    unique, _ = client.request(LookupRequest([b"k"]))
    client.receive_data(
        struct.pack("<4sHHIiQII", REPLY_MAGIC, 1, Opcode.LOOKUP, HEADER_BYTES + 1, 0, unique, 0, 0)
        + b"\xc1"
    )
    with pytest.raises(RemoteProtocolError, match="malformed LOOKUP reply"):
        client.next_event()


def test_local_misuse_is_a_local_protocol_error() -> None:
    client, server = handshake()
    with pytest.raises(LocalProtocolError):
        client.request(LookupReply(0))  # a reply is not a request
    server.receive_data(client.request(LookupRequest([b"k"]))[1])
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    with pytest.raises(LocalProtocolError):
        server.reply(event.header, FsyncReply(0))  # the wrong reply type
    server.reply(event.header, LookupReply(0))
    with pytest.raises(LocalProtocolError):
        server.reply(event.header, LookupReply(0))  # answered twice
    server.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        server.receive_data(b"more")  # data after end of stream


class ServerStateMachine(RuleBasedStateMachine):
    """A ServerConnection against a model: the state, and the set of uniques in flight."""

    uniques = Bundle("uniques")

    def __init__(self) -> None:
        super().__init__()
        self.server = ServerConnection()
        self.state = ServerState.AWAIT_INIT
        self.in_flight: dict[int, RequestHeader] = {}
        self.next_unique = 1
        self.opening_init = 0  # the INIT that took the connection to READY, until answered

    def _reset(self) -> None:
        """The connection raised: its owner would close it. Carry on with a fresh one."""
        self.server = ServerConnection()
        self.state = ServerState.AWAIT_INIT
        self.in_flight = {}
        self.opening_init = 0

    def _send(self, unique: int, opcode: int, body: bytes) -> object:
        self.server.receive_data(raw_request(opcode, unique, body))
        try:
            return self.server.next_event()
        except RemoteProtocolError as exc:
            return exc

    @rule(
        target=uniques,
        opcode=st.sampled_from(list(Opcode)),
        valid=st.booleans(),
        data=st.data(),
    )
    def request(self, opcode: Opcode, valid: bool, data: st.DataObject) -> int:
        unique = self.next_unique
        self.next_unique += 1
        body = encode_body(data.draw(message_strategy(REQUEST_TYPES[opcode]))) if valid else b"\xc1"
        event = self._send(unique, opcode, body)
        if self.state is ServerState.CLOSED:
            assert isinstance(event, RemoteProtocolError)
            self._reset()
            return unique
        assert isinstance(event, RequestReceived | InvalidRequest)
        self.in_flight[unique] = event.header
        following = SERVER_TRANSITIONS.get((self.state, opcode))
        if following is None:
            assert isinstance(event, InvalidRequest)
            assert isinstance(event.error, RemoteProtocolError)
        elif not valid:
            assert isinstance(event, InvalidRequest)
            assert isinstance(event.error, InvalidRequestError)
        else:
            assert isinstance(event, RequestReceived)
            if self.state is ServerState.AWAIT_INIT:
                self.opening_init = unique
            self.state = following
        return unique

    @rule(unique=uniques)
    def reuse_a_unique(self, unique: int) -> None:
        event = self._send(unique, Opcode.STATFS, encode_body(StatfsRequest()))
        if unique in self.in_flight or self.state is ServerState.CLOSED:
            assert isinstance(event, RemoteProtocolError)
            self._reset()
        else:
            assert isinstance(event, InvalidRequest | RequestReceived)
            self.in_flight[unique] = event.header

    @rule(unique=consumes(uniques))
    def answer(self, unique: int) -> None:
        header = self.in_flight.pop(unique, None)
        if header is None:
            return
        self.server.reply_error(header, InvalidRequestError("answered"))
        if unique == self.opening_init:  # a refused INIT closes the connection
            self.state = SERVER_REPLY_TRANSITIONS.get((self.state, Opcode.INIT), self.state)
            self.opening_init = 0
        with pytest.raises(LocalProtocolError):
            self.server.reply_error(header, InvalidRequestError("again"))

    @invariant()
    def matches_the_model(self) -> None:
        assert self.server.state is self.state
        assert self.server.in_flight == len(self.in_flight)


ServerStateMachine.TestCase.settings = FAST
test_server_state_machine = ServerStateMachine.TestCase


def test_init_reply_comes_back_with_its_flag() -> None:
    client, server = ClientConnection(), ServerConnection()
    server.receive_data(init_frame(client))
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    client.receive_data(server.reply(event.header, INIT_REPLY, FrameFlags.FD_ATTACHED))
    answer = client.next_event()
    assert isinstance(answer, ReplyReceived)
    assert answer.header.flags == FrameFlags.FD_ATTACHED
    assert drain(client) == ([], NEED_DATA)
