"""The bounds of messages.py at their edges, and the frame limit negotiated at INIT."""

from __future__ import annotations

import errno

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.client import ops
from kvtierd.errors import InvalidRequestError, RemoteProtocolError
from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    MAX_KEYS_PER_REQUEST,
    ClientConnection,
    FrameFlags,
    InvalidRequest,
    Opcode,
    ReplyReceived,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.frames import MIN_MAX_FRAME_BYTES, RequestHeader
from kvtierd.protocol.messages import (
    MAX_QUEUE_KEYS,
    Extent,
    HintReply,
    HintRequest,
    InitReply,
    InitRequest,
    LookupRequest,
    OpenNsRequest,
    ReadReply,
    ReadRequest,
)
from tests.protocol.peers import INIT_REPLY, drain, handshake
from tests.protocol.strategies import FAST


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


def _hint_frame(unique: int, chain_lengths: list[int], key_bytes: int = 16) -> bytes:
    """A HINT frame whose queue has chains of these lengths, built from raw MessagePack (a
    ``HintRequest`` over the bound cannot be constructed, so the client could not send it)."""
    body = msgspec.msgpack.encode([b"", [[b"k" * key_bytes] * n for n in chain_lengths]])
    header = RequestHeader(Opcode.HINT, HEADER_BYTES + len(body), unique, ns=1)
    return header.pack() + body


def test_a_hint_queue_holds_at_most_max_queue_keys_in_all() -> None:
    """Issue 31: 40 chains of 8192 keys (983 KB, under the frame limit) were legal and held the
    daemon's loop for 250 ms. The bound is on the keys of all chains together."""
    assert MAX_QUEUE_KEYS == MAX_KEYS_PER_REQUEST
    _, server = handshake()
    half = MAX_QUEUE_KEYS // 2
    event = _serve(server, _hint_frame(10, [half, half]))
    assert isinstance(event, RequestReceived)
    assert sum(map(len, event.message.queue)) == MAX_QUEUE_KEYS
    for unique, lengths in enumerate(([half, half + 1], [MAX_QUEUE_KEYS + 1], [8192] * 40), 11):
        event = _serve(server, _hint_frame(unique, lengths, key_bytes=1))  # the 983 KB
        assert isinstance(event, InvalidRequest), lengths
        assert isinstance(event.error, InvalidRequestError)
        assert event.error.errno == errno.EINVAL
        assert "8192" in str(event.error)  # the per-chain bound or the total one
        assert event.header.unique == unique  # answered, and the connection goes on
    with pytest.raises(InvalidRequestError, match="at most 8192"):
        HintRequest(b"", [[b"k"] * half, [b"k"] * (half + 1)])


@FAST
@given(st.lists(st.integers(1, 3000), max_size=8))
def test_a_hint_queue_is_accepted_exactly_when_its_keys_fit(lengths: list[int]) -> None:
    _, server = handshake()
    event = _serve(server, _hint_frame(5, lengths))
    fits = sum(lengths) <= MAX_QUEUE_KEYS
    assert isinstance(event, RequestReceived if fits else InvalidRequest)


def _sent_hints(queue: list[list[bytes]], max_keys: int) -> tuple[list[HintRequest], int]:
    """Drive ``ops.hint`` as a client does, answering each HINT with ``planned`` = its keys."""
    op = ops.hint(1, queue, b"s", max_keys)
    sent: list[HintRequest] = []
    call = next(op)
    try:
        while True:
            request, ns = call
            assert ns == 1
            assert isinstance(request, HintRequest)
            sent.append(request)
            call = op.send(HintReply(sum(map(len, request.queue))))
    except StopIteration as stop:
        return sent, stop.value


def test_the_client_splits_a_long_queue_into_hints_of_whole_chains_in_order() -> None:
    queue = [[bytes([i]) + j.to_bytes(2, "little") for j in range(3000)] for i in range(7)]
    sent, planned = _sent_hints(queue, MAX_KEYS_PER_REQUEST)
    assert [len(h.queue) for h in sent] == [2, 2, 2, 1]
    assert [chain for h in sent for chain in h.queue] == queue
    assert all(h.session == b"s" for h in sent)
    assert planned == 7 * 3000
    # the daemon's max_keys (lower for a small frame limit) decides, and so does the chain bound
    assert [len(h.queue) for h in _sent_hints(queue, 3000)[0]] == [1] * 7
    many = [[bytes([i % 256, i // 256])] for i in range(600)]
    assert [len(h.queue) for h in _sent_hints(many, MAX_KEYS_PER_REQUEST)[0]] == [256, 256, 88]
    assert _sent_hints([], MAX_KEYS_PER_REQUEST)[0] == [HintRequest(b"s")]


def test_the_client_refuses_a_chain_longer_than_a_hint_carries() -> None:
    for queue, match in (
        ([[b"k" * 16] * (MAX_KEYS_PER_REQUEST + 1)], "hint its first 8192"),
        ([[b"k"], []], "chain 1 has no keys"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            _sent_hints(queue, MAX_KEYS_PER_REQUEST)


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
