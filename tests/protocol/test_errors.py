"""(e) Error replies: each errno maps to exactly one exception class, and back."""

from __future__ import annotations

import errno

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import (
    ERRNO_TO_ERROR,
    AccessDeniedError,
    BlockNotFoundError,
    BusyError,
    ConfigError,
    DaemonNotRunningError,
    InvalidRequestError,
    KvtierError,
    LocalProtocolError,
    NoSpaceError,
    RemoteProtocolError,
    StorageIOError,
    TimedOutError,
    errno_of,
    error_from_errno,
)
from kvtierd.protocol import HEADER_BYTES, ReplyReceived, RequestReceived
from kvtierd.protocol.frames import REPLY_MAGIC
from kvtierd.protocol.messages import LookupRequest
from tests.protocol.peers import handshake
from tests.protocol.strategies import FAST

#: The table docs/protocol.md prints; a change here is a change to the wire contract.
DOCUMENTED = {
    errno.ENOENT: BlockNotFoundError,
    errno.EINVAL: InvalidRequestError,
    errno.ENOSPC: NoSpaceError,
    errno.EACCES: AccessDeniedError,
    errno.EPROTO: RemoteProtocolError,
    errno.EBUSY: BusyError,
    errno.ETIMEDOUT: TimedOutError,
    errno.EIO: StorageIOError,
}


def test_the_table_is_one_to_one_and_each_class_carries_its_errno() -> None:
    assert len(set(ERRNO_TO_ERROR.values())) == len(ERRNO_TO_ERROR)
    for number, cls in ERRNO_TO_ERROR.items():
        assert cls.errno == number
    assert DOCUMENTED.items() <= ERRNO_TO_ERROR.items()


def _error_reply(exc: BaseException) -> ReplyReceived:
    client, server = handshake()
    server.receive_data(client.request(LookupRequest([b"k"]))[1])
    event = server.next_event()
    assert isinstance(event, RequestReceived)
    client.receive_data(server.reply_error(event.header, exc))
    reply = client.next_event()
    assert isinstance(reply, ReplyReceived)
    assert reply.message is None
    assert client.pending == 0
    return reply


@FAST
@given(number=st.sampled_from(sorted(ERRNO_TO_ERROR)), text=st.text(max_size=80))
def test_every_errno_reaches_the_client_as_its_class(number: int, text: str) -> None:
    cls = ERRNO_TO_ERROR[number]
    reply = _error_reply(cls(text))
    assert reply.header.error == -number
    assert type(reply.error) is cls
    assert str(reply.error) == (text or errno.errorcode[number])
    assert errno_of(reply.error) == number


@pytest.mark.parametrize("number", sorted(ERRNO_TO_ERROR))
def test_error_from_errno_and_errno_of_are_inverse(number: int) -> None:
    for wire in (number, -number):
        error = error_from_errno(wire, "why")
        assert type(error) is ERRNO_TO_ERROR[number]
        assert errno_of(error) == number


@pytest.mark.parametrize(
    ("raised", "received"),
    [
        (LocalProtocolError("x"), RemoteProtocolError),  # shares EPROTO
        (ConfigError("x"), InvalidRequestError),  # shares EINVAL
        (ValueError("a bug"), StorageIOError),  # not a kvtierd error: EIO
        (KeyError("a bug"), StorageIOError),
        (DaemonNotRunningError("x"), StorageIOError),  # ECONNREFUSED never travels
    ],
)
def test_classes_that_do_not_travel_arrive_as_their_wire_class(
    raised: BaseException, received: type[KvtierError]
) -> None:
    assert type(_error_reply(raised).error) is received


@pytest.mark.parametrize("wire", [-9999, -errno.ENOTTY, 7])
def test_an_unknown_errno_is_a_storage_io_error(wire: int) -> None:
    assert type(error_from_errno(wire, "")) is StorageIOError


def test_the_message_is_cut_to_4096_characters() -> None:
    reply = _error_reply(InvalidRequestError("x" * 10_000))
    assert str(reply.error) == "x" * 4096


@pytest.mark.parametrize("body", [b"", b"\xc1", b"\x91\x01", b"\x92\xa1x\xa1y"])
def test_an_error_reply_with_a_broken_body_still_raises_by_errno(body: bytes) -> None:
    client, _ = handshake()
    unique, _ = client.request(LookupRequest([b"k"]))
    header = REPLY_MAGIC + (1).to_bytes(2, "little") + (3).to_bytes(2, "little")
    header += (HEADER_BYTES + len(body)).to_bytes(4, "little")
    header += (-errno.ENOSPC).to_bytes(4, "little", signed=True)
    header += unique.to_bytes(8, "little") + bytes(8)
    client.receive_data(header + body)
    reply = client.next_event()
    assert isinstance(reply, ReplyReceived)
    assert type(reply.error) is NoSpaceError
    assert str(reply.error) == "ENOSPC"


def test_stdlib_meanings_are_kept() -> None:
    assert issubclass(BlockNotFoundError, KeyError)
    assert issubclass(InvalidRequestError, ValueError)
    assert issubclass(NoSpaceError, OSError)
    assert issubclass(AccessDeniedError, PermissionError)
    assert issubclass(TimedOutError, TimeoutError)
