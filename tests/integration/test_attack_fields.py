"""Every field of every request, one at a time, at the values a hostile client would try (issue
32's msgspec bodies and headers), on the real daemon, on asyncio and trio.

For each request type but INIT and DESTROY (which end or change the connection), a sound
template is sent with one field replaced by: numbers at and past every bound (negative, 2**63,
2**64 - 1, a float, NaN, a bool), every other type (None, strings and bytes empty and 4 KiB,
maps, arrays empty and deep), one existing key named 8,192 times; then the template with a
field too many, the empty body and a deeply nested body. Opcodes 15-20 (POOL_STATUS to
READ_NIXL), newer than the random frames of ``test_bad_input.py``, are covered too.

Each must be answered, on the connection that sent it, with a reply or an errno: never an
internal error, never the end of the connection. Afterwards the daemon serves its blocks, holds
no lease and logged no failure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.protocol import MAX_KEYS_PER_REQUEST
from kvtierd.protocol.frames import HEADER_BYTES, RequestHeader
from kvtierd.protocol.messages import (
    OPCODE_OF,
    AllocRequest,
    CommitRequest,
    DoctorRequest,
    EvictRequest,
    ForgetRequest,
    FsyncRequest,
    HintRequest,
    ListKeysRequest,
    ListNsRequest,
    LookupRequest,
    Message,
    NixlGrantRequest,
    OpenNsRequest,
    PoolStatusRequest,
    ReadNixlRequest,
    ReadRequest,
    ReadResidentRequest,
    ReleaseRequest,
    StatfsRequest,
)
from kvtierd.testing import DaemonProcess
from tests.support.attacks import unharmed
from tests.support.rawpeer import DEADLINE_S, RawPeer

pytestmark = pytest.mark.timeout(600)

BLOCK = 16 << 10
KEYS = [b"field-%04d" % i for i in range(8)]
BLOCKS = [np.full(BLOCK, i, np.uint8).tobytes() for i in range(len(KEYS))]

#: A MessagePack array nested this deep (``0x91``: an array of one), ending in nil.
_DEEP = msgspec.Raw(b"\x91" * 4000 + b"\xc0")

EXTREMES: list[object] = [
    -1,
    -(2**63),
    2**63,
    2**64 - 1,
    0,
    1.5,
    math.nan,
    True,
    None,
    "",
    "x" * 4096,
    b"",
    b"\xff" * 4096,
    {},
    {"keys": [b"k"]},
    [],
    [b""],
    [2**64 - 1],
    [[b"k"]],
    [KEYS[0]] * MAX_KEYS_PER_REQUEST,
    _DEEP,
]


def _templates(ns: int) -> list[Message]:
    return [
        OpenNsRequest("fields-other", BLOCK),
        LookupRequest(KEYS[:4]),
        ReadRequest(KEYS[:4]),
        ReleaseRequest([1]),
        AllocRequest([b"new-key"]),
        CommitRequest(1, [0]),
        ForgetRequest([b"never-stored"]),
        FsyncRequest(),
        HintRequest(b"session", [KEYS[:2]]),
        StatfsRequest(),
        ListNsRequest(),
        EvictRequest(),
        PoolStatusRequest(),
        DoctorRequest(),
        ReadResidentRequest(KEYS[:4]),
        ListKeysRequest(ns),
        NixlGrantRequest(),
        ReadNixlRequest(KEYS[:4]),
    ]


def _bodies(template: Message) -> Iterator[tuple[str, bytes]]:
    fields = list(msgspec.structs.astuple(template))
    for i, name in enumerate(template.__struct_fields__):
        for value in EXTREMES:
            changed = [*fields[:i], value, *fields[i + 1 :]]
            yield f"{name}={value!r:.40}", msgspec.msgpack.encode(changed)
    yield "a field too many", msgspec.msgpack.encode([*fields, 0])
    yield "the empty body", b""
    yield "a deep body", msgspec.msgpack.encode(_DEEP)
    yield "a map body", msgspec.msgpack.encode(dict(enumerate(fields)))


@pytest.fixture(params=["asyncio", "trio"])
def daemon(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DaemonProcess]:
    process = DaemonProcess(tmp_path / "kvtierd", runtime=str(request.param))
    process.start(120)
    try:
        with connect(process.socket, timeout_s=DEADLINE_S) as client:
            ns = client.namespace("fields", block_bytes=BLOCK)
            assert ns.put(KEYS, BLOCKS) == len(KEYS)
        yield process
    finally:
        process.kill()


def test_every_field_at_its_extremes_is_answered(daemon: DaemonProcess) -> None:
    peer = RawPeer(daemon.socket, "fields", BLOCK)
    internal: list[str] = []
    sent = 0
    for template in _templates(peer.ns):
        opcode = int(OPCODE_OF[type(template)])
        for what, body in _bodies(template):
            unique = 1_000_000 + sent
            header = RequestHeader(opcode, HEADER_BYTES + len(body), unique, peer.ns)
            peer.conn._pending[unique] = opcode  # sent by hand: the reply must match it
            peer.sock.sendall(header.pack() + body)
            event = peer.next_reply()
            assert event.header.unique == unique, (type(template).__name__, what, event)
            if event.error is not None and "internal error" in str(event.error):
                internal.append(f"{type(template).__name__} {what}: {event.error}")
            sent += 1
    peer.sock.close()
    assert internal == []

    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        ns = client.namespace("fields", block_bytes=BLOCK)
        with ns.get(KEYS[1:]) as views:  # FORGET of KEYS[0] 8,192 times forgot it
            assert [bytes(v) for v in views] == BLOCKS[1:]
        deadline = time.monotonic() + DEADLINE_S
        while (stats := client.stats())["connections"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats["leases"] == 0
        assert stats["pending_writes"] == 0
    unharmed(daemon)
