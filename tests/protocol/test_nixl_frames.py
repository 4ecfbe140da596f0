"""NIXL_GRANT and READ_NIXL (minor 8) on the wire: their request frames as ``docs/protocol.md``
shows them, read out of the page itself and compared with what kvtierd's encoder makes, so a
change to either the format or the page fails here.

The frames continue the worked example's connection (unique 5 and 6, namespace 1, the
example's first key). If a test here fails because the encoder changed, that needs the
compatibility rule of ``docs/protocol.md``, not just the page's hex replaced.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import msgspec
import pytest

from kvtierd.keys import chain_keys
from kvtierd.protocol import (
    MAX_KEYS_PER_REQUEST,
    ClientConnection,
    InvalidRequest,
    RequestReceived,
    ServerConnection,
)
from kvtierd.protocol.frames import Opcode, RequestHeader
from kvtierd.protocol.messages import (
    LookupRequest,
    NixlGrantRequest,
    OpenNsRequest,
    ReadNixlRequest,
    ReadRequest,
)
from tests.protocol.peers import handshake

PAGE = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
KEYS = chain_keys(range(32), 16, bytes.fromhex("d700654d3bffa7c422d10f5996ecc926"))

NIXL_GRANT = bytes.fromhex(
    "4b565451 0100 1300 21000000 00000000 0500000000000000 01000000 00000000 90"
)
READ_NIXL = bytes.fromhex(
    "4b565451 0100 1400 34000000 00000000 0600000000000000 01000000 00000000"
    "91 91 c410a635c33f876273d2614b3194bbf3effe"
)


def documented_requests(opcode: Opcode) -> list[bytes]:
    """Every request frame of ``opcode`` the page shows byte for byte: the hex before the first
    run of two spaces on each line of a fenced block, a blank line ending a frame. Frames
    abbreviated there (``...``) or annotated within the header are skipped."""
    frames: list[bytes] = []
    for block in re.findall(r"^```\n(.*?)^```$", PAGE.read_text(), flags=re.M | re.S):
        for text in re.split(r"\n\s*\n", block):
            columns = [re.split(r"\s{2,}", line.strip())[0] for line in text.splitlines()]
            try:
                frame = bytes.fromhex(" ".join(columns))
            except ValueError:
                continue
            if frame[:4] == b"KVTQ" and int.from_bytes(frame[6:8], "little") == opcode:
                frames.append(frame)
    return frames


def _after_the_worked_example() -> tuple[ClientConnection, ServerConnection]:
    """A client whose next unique id is 5: INIT (1), then the worked example's OPEN_NS (2),
    LOOKUP (3) and READ (4)."""
    client, server = handshake()
    client.request(OpenNsRequest("demo", 4096))
    client.request(LookupRequest(KEYS), ns=1)
    client.request(ReadRequest([KEYS[1]]), ns=1)
    return client, server


def _received(server: ServerConnection, frame: bytes) -> RequestReceived | InvalidRequest:
    server.receive_data(frame)
    event = server.next_event()
    assert isinstance(event, RequestReceived | InvalidRequest)
    return event


def test_the_page_shows_each_request_once_with_the_pinned_bytes() -> None:
    assert documented_requests(Opcode.NIXL_GRANT) == [NIXL_GRANT]
    assert documented_requests(Opcode.READ_NIXL) == [READ_NIXL]


def test_the_encoder_makes_the_documented_frames_and_the_daemon_reads_them() -> None:
    client, server = _after_the_worked_example()
    grant = NixlGrantRequest()
    read = ReadNixlRequest([KEYS[0]])
    for message, expected in ((grant, NIXL_GRANT), (read, READ_NIXL)):
        _, frame = client.request(message, ns=1)
        assert frame == expected
        event = _received(server, frame)
        assert isinstance(event, RequestReceived)
        assert event.message == message
        assert event.header.ns == 1


@pytest.mark.parametrize(
    ("opcode", "body"),
    [
        (Opcode.NIXL_GRANT, [1]),  # NIXL_GRANT has no fields
        (Opcode.READ_NIXL, []),
        (Opcode.READ_NIXL, [[]]),
        (Opcode.READ_NIXL, [[b""]]),
        (Opcode.READ_NIXL, [[b"k" * 33]]),
        (Opcode.READ_NIXL, [[b"k"] * (MAX_KEYS_PER_REQUEST + 1)]),
        (Opcode.READ_NIXL, [[b"k"], 1]),
    ],
)
def test_bodies_out_of_bounds_are_refused_with_einval(opcode: Opcode, body: list[object]) -> None:
    _, server = handshake()
    payload = msgspec.msgpack.encode(body)
    frame = RequestHeader(opcode, 32 + len(payload), 7, 1).pack() + payload
    event = _received(server, frame)
    assert isinstance(event, InvalidRequest)
    assert event.error.errno == errno.EINVAL
