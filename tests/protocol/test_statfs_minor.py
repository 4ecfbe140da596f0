"""STATFS's checkpoint fields (minor 9), tenants (minor 11), each tier's miss bytes (minor
13) and the sparse fits running (minor 15) go only to clients that know them: a client whose
INIT said minor 6 to 8 gets the 22 fields it decodes (it refuses a longer array), one of minor 9
or 10 the 27, each tier of 9 fields before minor 13, one before minor 15 no ``sparse_fits``,
and a reply of an older daemon decodes with the defaults."""

from __future__ import annotations

import msgspec
import pytest

from kvtierd.protocol.frames import MIN_CLIENT_MINOR, PROTOCOL_MINOR
from kvtierd.protocol.messages import (
    StatfsReply,
    StatfsRequest,
    TenantStatistics,
    TierStatistics,
)
from tests.protocol.peers import reply_body_to

_TIER = TierStatistics("nvme", 3, 12288, 1 << 20, 5, 1, 0, 4096, 8192, miss_bytes=4096)
#: The tier as a client before minor 13 reads it.
_TIER_BEFORE_13 = msgspec.structs.replace(_TIER, miss_bytes=0)
_REPLY = StatfsReply(
    "0.1.0", 1.5, "io_uring", 1, 9, 1, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, [_TIER],
    "host", 0, 0, 0, 0,
    checkpoints="on", checkpoints_written=2, checkpoint_age_s=1.5,
    bytes_since_checkpoint=4096, checkpoint_longest_slice_s=0.002,
    tenants=[TenantStatistics("alpha", 1, 2, 8192, 1 << 20, 3, 12288, 4, 5, 0, 1, 2, 16384, 8192)],
    sparse_fits=1,
)  # fmt: skip
_BEFORE_MINOR_9 = 22
_BEFORE_MINOR_11 = 27


def _statfs_reply_to(minor: int) -> bytes:
    """The body of the STATFS reply a server sends a client whose INIT said ``minor``."""
    return reply_body_to(minor, StatfsRequest(), _REPLY)


@pytest.mark.parametrize("minor", range(MIN_CLIENT_MINOR, 9))
def test_an_older_client_gets_statfs_without_the_checkpoint_fields(minor: int) -> None:
    body = _statfs_reply_to(minor)
    fields = msgspec.msgpack.decode(body)
    assert len(fields) == _BEFORE_MINOR_9
    assert fields[:16] == list(msgspec.structs.astuple(_REPLY))[:16]
    assert fields[16] == [list(msgspec.structs.astuple(_TIER))[:9]]
    decoded = msgspec.msgpack.decode(body, type=StatfsReply)  # as a newer client reads it
    assert decoded == msgspec.structs.replace(
        _REPLY,
        tiers=[_TIER_BEFORE_13],
        checkpoints="off",
        checkpoints_written=0,
        checkpoint_age_s=-1.0,
        bytes_since_checkpoint=0,
        checkpoint_longest_slice_s=0.0,
        tenants=[],
        sparse_fits=0,
    )


def test_a_minor_9_client_gets_the_checkpoint_fields() -> None:
    assert PROTOCOL_MINOR >= 9
    body = _statfs_reply_to(PROTOCOL_MINOR)
    assert len(msgspec.msgpack.decode(body)) == len(msgspec.structs.fields(StatfsReply))
    assert msgspec.msgpack.decode(body, type=StatfsReply) == _REPLY


@pytest.mark.parametrize("minor", [9, 10])
def test_a_minor_9_or_10_client_gets_statfs_without_the_tenants(minor: int) -> None:
    fields = msgspec.msgpack.decode(_statfs_reply_to(minor))
    assert len(fields) == _BEFORE_MINOR_11
    decoded = msgspec.msgpack.decode(_statfs_reply_to(minor), type=StatfsReply)
    assert decoded == msgspec.structs.replace(
        _REPLY, tenants=[], tiers=[_TIER_BEFORE_13], sparse_fits=0
    )


def test_a_minor_11_client_gets_the_tenants() -> None:
    assert PROTOCOL_MINOR >= 11
    decoded = msgspec.msgpack.decode(_statfs_reply_to(11), type=StatfsReply)
    assert decoded.tenants == _REPLY.tenants


@pytest.mark.parametrize("minor", [11, 12])
def test_a_client_before_minor_13_gets_tiers_without_their_miss_bytes(minor: int) -> None:
    fields = msgspec.msgpack.decode(_statfs_reply_to(minor))
    assert [len(tier) for tier in fields[16]] == [9]
    decoded = msgspec.msgpack.decode(_statfs_reply_to(minor), type=StatfsReply)
    assert decoded.tiers == [_TIER_BEFORE_13]
    assert decoded.tenants == _REPLY.tenants


def test_a_minor_13_client_gets_each_tiers_miss_bytes() -> None:
    assert PROTOCOL_MINOR >= 13
    decoded = msgspec.msgpack.decode(_statfs_reply_to(13), type=StatfsReply)
    assert decoded.tiers == [_TIER]


@pytest.mark.parametrize("minor", [11, 14])
def test_a_client_before_minor_15_gets_statfs_without_the_sparse_fits(minor: int) -> None:
    fields = msgspec.msgpack.decode(_statfs_reply_to(minor))
    assert len(fields) == len(msgspec.structs.fields(StatfsReply)) - 1
    decoded = msgspec.msgpack.decode(_statfs_reply_to(minor), type=StatfsReply)
    assert decoded.sparse_fits == 0
    assert decoded.tenants == _REPLY.tenants


def test_a_minor_15_client_gets_the_sparse_fits() -> None:
    assert PROTOCOL_MINOR >= 15
    decoded = msgspec.msgpack.decode(_statfs_reply_to(15), type=StatfsReply)
    assert decoded.sparse_fits == 1
