"""(a) Every message of every opcode round-trips through the real connections, and the
compatibility rule of ``messages.py`` (fields appended with defaults) holds for the encoding."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.protocol import (
    HEADER_BYTES,
    ClientConnection,
    Opcode,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.messages import (
    APPENDED_REQUEST_FIELDS,
    OPCODE_OF,
    REPLY_TYPES,
    REQUEST_TYPES,
    InitRequest,
    LookupRequest,
    Message,
    OpenNsRequest,
    decode_body,
    encode_body,
)
from tests.protocol.peers import handshake
from tests.protocol.strategies import FAST, message_strategy, reply_pairs, requests


def test_every_opcode_has_a_request_and_a_reply_type() -> None:
    assert set(REQUEST_TYPES) == set(REPLY_TYPES) == set(Opcode)
    assert len({*REQUEST_TYPES.values(), *REPLY_TYPES.values()}) == 2 * len(Opcode)


@FAST
@given(message=requests, ns=st.integers(0, 0xFFFF_FFFF))
def test_request_round_trips_to_the_server_event(message: Message, ns: int) -> None:
    if isinstance(message, InitRequest):
        client, server = ClientConnection(), ServerConnection()
    else:
        client, server = handshake()
    unique, frame = client.request(message, ns)
    server.receive_data(frame)
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    assert type(event.message) is type(message)
    assert event.message == message
    assert event.header.opcode == OPCODE_OF[type(message)]
    assert (event.header.unique, event.header.ns, event.header.length) == (unique, ns, len(frame))


@FAST
@given(pair=reply_pairs())
def test_reply_round_trips_to_the_client_event(pair: tuple[Message, Message]) -> None:
    request, reply = pair
    if isinstance(request, InitRequest):
        client, server = ClientConnection(), ServerConnection()
    else:
        client, server = handshake()
    unique, frame = client.request(request)
    server.receive_data(frame)
    received = server.next_event()
    assert isinstance(received, RequestReceived)
    client.receive_data(server.reply(received.header, reply))
    event = client.next_event()
    assert isinstance(event, ReplyReceived)
    assert event.error is None
    assert type(event.message) is type(reply)
    assert event.message == reply
    assert (event.header.unique, event.header.opcode, event.header.error) == (
        unique,
        OPCODE_OF[type(request)],
        0,
    )
    assert client.pending == 0
    assert server.in_flight == 0


@pytest.mark.parametrize("cls", [*REQUEST_TYPES.values(), *REPLY_TYPES.values()])
@FAST
@given(data=st.data())
def test_body_encoding_is_an_array_of_the_fields_in_order(
    cls: type[Message], data: st.DataObject
) -> None:
    message = data.draw(message_strategy(cls))
    body = encode_body(message)
    plain = msgspec.msgpack.decode(body)
    assert isinstance(plain, list)
    fields = msgspec.structs.astuple(message)
    before = APPENDED_REQUEST_FIELDS.get(cls, len(fields))
    # every field, but a request's appended fields at their defaults at the end (left out)
    assert before <= len(plain) <= len(fields)
    assert plain == msgspec.msgpack.decode(msgspec.msgpack.encode(fields[: len(plain)]))
    if len(plain) < len(fields):
        defaults = [f.default for f in msgspec.structs.fields(cls)]
        assert fields[len(plain) :] == tuple(defaults[len(plain) :])
    assert decode_body(cls, body) == message


def test_a_request_leaves_out_appended_fields_at_their_defaults() -> None:
    """A LOOKUP that does not ask for ``each`` (minor 10) is the bytes a minor-9 daemon
    decodes; one that asks sends the field."""
    keys = [b"k" * 16]
    assert msgspec.msgpack.decode(encode_body(LookupRequest(keys))) == [keys, True]
    assert msgspec.msgpack.decode(encode_body(LookupRequest(keys, False))) == [keys, False]
    each = LookupRequest(keys, True, each=True)
    assert msgspec.msgpack.decode(encode_body(each)) == [keys, True, True]
    assert decode_body(LookupRequest, encode_body(each)) == each


def test_a_shorter_array_from_an_older_peer_takes_the_defaults() -> None:
    body = msgspec.msgpack.encode(["ns", 4096])
    assert decode_body(OpenNsRequest, body) == OpenNsRequest("ns", 4096)
    assert decode_body(LookupRequest, msgspec.msgpack.encode([[b"k"]])) == LookupRequest([b"k"])


def test_an_unknown_trailing_field_is_rejected_not_ignored() -> None:
    body = msgspec.msgpack.encode([[b"k"], True, "from the future"])
    with pytest.raises(msgspec.ValidationError):
        decode_body(LookupRequest, body)


def test_header_length_counts_the_header() -> None:
    client, _ = handshake()
    _, frame = client.request(LookupRequest([b"k"]))
    assert int.from_bytes(frame[8:12], "little") == len(frame) > HEADER_BYTES
