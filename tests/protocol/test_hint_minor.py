"""HINT's selection (minor 14) goes only to clients that know it: a client of an older minor
gets the three fields it decodes, a reply of an older daemon decodes with no selection, and
the library asks an older daemon for none."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvtierd.client import ops
from kvtierd.errors import NotSupportedError, RemoteProtocolError
from kvtierd.protocol.frames import MIN_CLIENT_MINOR, PROTOCOL_MINOR
from kvtierd.protocol.messages import HintReply, HintRequest
from tests.protocol.peers import reply_body_to

_SELECTED = np.array([[0, 7, 3], [0, 7, 5]], "<i4")
_REPLY = HintReply(2, [b"k" * 16, b"j" * 16], [b"p" * 16], _SELECTED.tobytes())


@pytest.mark.parametrize("minor", range(MIN_CLIENT_MINOR, 14))
def test_an_older_client_gets_the_hint_reply_without_the_selection(minor: int) -> None:
    body = reply_body_to(minor, HintRequest(), _REPLY)
    assert len(msgspec.msgpack.decode(body)) == 3
    decoded = msgspec.msgpack.decode(body, type=HintReply)  # as a newer client reads it
    assert decoded == msgspec.structs.replace(_REPLY, selected=b"")


def test_a_minor_14_client_gets_the_selection() -> None:
    assert PROTOCOL_MINOR >= 14
    body = reply_body_to(PROTOCOL_MINOR, HintRequest(), _REPLY)
    decoded = msgspec.msgpack.decode(body, type=HintReply)
    assert np.array_equal(np.frombuffer(decoded.selected, "<i4").reshape(2, 3), _SELECTED)


def _hint_selection(daemon_minor: int, reply: HintReply, chain: list[bytes]) -> ops.SparseHint:
    op = ops.hint_selection(
        1, chain, np.zeros((2, 1, 4), np.float32), [2, 3], 3, b"", 1, daemon_minor
    )
    request, ns = next(op)
    assert isinstance(request, HintRequest)
    assert ns == 1
    try:
        op.send(reply)
    except StopIteration as done:
        result: ops.SparseHint = done.value
        return result
    raise AssertionError("hint_selection asked twice")


def test_the_library_asks_an_older_daemon_for_no_selection() -> None:
    op = ops.hint_selection(1, [b"k" * 16], np.zeros((1, 1, 4)), [0], 1, b"", 1, 13)
    with pytest.raises(NotSupportedError, match="minor 14"):
        next(op)


def test_the_selection_is_shaped_per_query_layer_and_kv_head() -> None:
    chain = [bytes([i]) * 16 for i in range(8)]
    hint = _hint_selection(14, _REPLY, chain)
    assert hint.selected.shape == (2, 1, 3)
    assert hint.selected[:, 0].tolist() == _SELECTED.tolist()


@pytest.mark.parametrize(
    "selected",
    [np.zeros(5, "<i4").tobytes(), np.array([0, 7, 8, 0, 1, 2], "<i4").tobytes(), b"\x00"],
)
def test_a_selection_that_does_not_fit_the_request_is_a_protocol_error(selected: bytes) -> None:
    chain = [bytes([i]) * 16 for i in range(8)]
    with pytest.raises(RemoteProtocolError):
        _hint_selection(14, msgspec.structs.replace(_REPLY, selected=selected), chain)


def test_a_hint_without_promote_blocks_is_the_bytes_an_older_daemon_decodes() -> None:
    from kvtierd.protocol.messages import encode_body

    plain = HintRequest(b"", [], [b"k" * 16], b"\0" * 16, [1, 1, 4], [2], 3)
    assert len(msgspec.msgpack.decode(encode_body(plain))) == 7
    limited = msgspec.structs.replace(plain, promote_blocks=5)
    fields = msgspec.msgpack.decode(encode_body(limited))
    assert len(fields) == 8
    assert fields[7] == 5
