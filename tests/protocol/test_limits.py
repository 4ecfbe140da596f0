"""The bounds of messages.py at their edges, and the frame limit negotiated at INIT."""

from __future__ import annotations

import pytest

from kvtierd.errors import InvalidRequestError, RemoteProtocolError
from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    MAX_KEYS_PER_REQUEST,
    ClientConnection,
    FrameFlags,
    InvalidRequest,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.frames import MIN_MAX_FRAME_BYTES
from kvtierd.protocol.messages import (
    Extent,
    HintRequest,
    InitReply,
    InitRequest,
    LookupRequest,
    OpenNsRequest,
    ReadReply,
    ReadRequest,
)
from tests.protocol.peers import INIT_REPLY, drain, handshake


def _serve(server: ServerConnection, frame: bytes) -> object:
    server.receive_data(frame)
    return server.next_event()


def test_the_most_keys_of_the_longest_size_fit_in_a_default_frame() -> None:
    client, server = handshake()
    keys = [bytes([i % 256]) * MAX_KEY_BYTES for i in range(MAX_KEYS_PER_REQUEST)]
    _, frame = client.request(LookupRequest(keys))
    assert len(frame) <= DEFAULT_MAX_FRAME_BYTES
    event = _serve(server, frame)
    assert isinstance(event, RequestReceived)
    assert event.message == LookupRequest(keys)


def test_a_read_reply_for_the_most_keys_fits_in_a_default_frame() -> None:
    client, server = handshake()
    keys = [b"k" * 16] * MAX_KEYS_PER_REQUEST
    event = _serve(server, client.request(ReadRequest(keys))[1])
    assert isinstance(event, RequestReceived)
    big = (1 << 64) - 1
    frame = server.reply(event.header, ReadReply(big, [Extent(big, big, big)] * len(keys)))
    assert len(frame) <= DEFAULT_MAX_FRAME_BYTES
    client.receive_data(frame)
    assert isinstance(client.next_event(), ReplyReceived)


def test_text_bounds_count_characters_not_bytes() -> None:
    client, server = handshake()
    name = "é" * 255  # 510 bytes of UTF-8
    assert isinstance(_serve(server, client.request(OpenNsRequest(name, 1))[1]), RequestReceived)
    event = _serve(server, client.request(OpenNsRequest(name + "é", 1))[1])
    assert isinstance(event, InvalidRequest)


def test_hint_bounds() -> None:
    client, server = handshake()
    ok = HintRequest(b"s" * 64, [[b"k"]] * 256)
    assert isinstance(_serve(server, client.request(ok)[1]), RequestReceived)
    for bad in (HintRequest(b"s" * 65), HintRequest(b"", [[b"k"]] * 257), HintRequest(b"", [[]])):
        event = _serve(server, client.request(bad)[1])
        assert isinstance(event, InvalidRequest)
        assert isinstance(event.error, InvalidRequestError)


def test_the_client_refuses_to_build_a_frame_over_its_limit() -> None:
    client = ClientConnection()
    keys = [b"k" * 32] * 40_000
    with pytest.raises(InvalidRequestError, match="fewer keys"):
        client.request(LookupRequest(keys))
    assert client.pending == 0


@pytest.mark.parametrize("server_limit", [MIN_MAX_FRAME_BYTES, 65536])
def test_the_client_adopts_the_limit_the_server_negotiated(server_limit: int) -> None:
    """The server lowers its limit to INIT's answer; a client that kept its own default would
    send frames the server can only answer by closing the connection."""
    reply = InitReply(1, 0, server_limit, 256, MAX_KEYS_PER_REQUEST, 1 << 26, "test")
    client, server = handshake(server_max_frame_bytes=server_limit, reply=reply)
    assert client.max_request_bytes == server_limit
    keys = [b"k" * 16] * (server_limit // 18 + 1)
    with pytest.raises(InvalidRequestError, match="limit"):
        client.request(LookupRequest(keys))
    # What the client does send still fits.
    fitting = keys[: (server_limit - HEADER_BYTES - 16) // 18]
    event = _serve(server, client.request(LookupRequest(fitting))[1])
    assert isinstance(event, RequestReceived)


def test_a_server_limit_below_the_minimum_is_a_protocol_error() -> None:
    client, server = ClientConnection(), ServerConnection()
    server.receive_data(client.request(InitRequest(1, 0, DEFAULT_MAX_FRAME_BYTES))[1])
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    bad = InitReply(1, 0, MIN_MAX_FRAME_BYTES - 1, 256, 8192, 1 << 26, "test")
    client.receive_data(server.reply(event.header, bad, FrameFlags.FD_ATTACHED))
    assert isinstance(drain(client)[1], RemoteProtocolError)


def test_the_handshake_helper_leaves_the_default_limit() -> None:
    client, _ = handshake(reply=INIT_REPLY)
    assert client.max_request_bytes == DEFAULT_MAX_FRAME_BYTES
