"""The pool's value format: every damaged or foreign value is refused, never served."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.pool.values import (
    HEADER_BYTES,
    CorruptValue,
    PoolNames,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtierd.store.records import checksum
from kvtierd.store.tier import BlockRef

NS = bytes(range(16))


def _ref(payload: bytes, key: bytes = b"k" * 16, seq: int = 7) -> BlockRef:
    return BlockRef(NS, key, len(payload), checksum(payload), seq)


@given(st.binary(min_size=0, max_size=4096), st.binary(min_size=1, max_size=32))
def test_round_trip(payload: bytes, key: bytes) -> None:
    ref = _ref(payload, key)
    value = encode_header(ref, len(payload), False) + payload
    compressed, body = decode_header(ref, value)
    assert not compressed
    assert bytes(body) == payload
    verify_payload(ref, body)


def _decode_and_verify(ref: BlockRef, value: bytes) -> None:
    _, body = decode_header(ref, value)
    verify_payload(ref, body)


def test_every_single_byte_flip_is_refused() -> None:
    payload = bytes(range(256)) * 4
    ref = _ref(payload)
    value = bytearray(encode_header(ref, len(payload), False) + payload)
    for i in range(len(value)):
        damaged = bytearray(value)
        damaged[i] ^= 0x40
        with pytest.raises(CorruptValue):
            _decode_and_verify(ref, bytes(damaged))


def test_truncated_and_extended_values_are_refused() -> None:
    payload = b"x" * 100
    ref = _ref(payload)
    value = encode_header(ref, len(payload), False) + payload
    for cut in (0, 1, HEADER_BYTES - 1, HEADER_BYTES, len(value) - 1):
        with pytest.raises(CorruptValue):
            decode_header(ref, value[:cut])
    with pytest.raises(CorruptValue):
        decode_header(ref, value + b"\0")


def test_another_blocks_value_is_refused() -> None:
    payload = b"y" * 64
    value = encode_header(_ref(payload, b"a" * 16), len(payload), False) + payload
    with pytest.raises(CorruptValue, match="another block"):
        decode_header(_ref(payload, b"b" * 16), value)


def test_another_version_of_the_block_is_refused() -> None:
    old, new = b"1" * 64, b"2" * 64
    value = encode_header(_ref(old), len(old), False) + old
    with pytest.raises(CorruptValue, match="another version"):
        decode_header(_ref(new), value)


def test_unknown_format_version_is_refused() -> None:
    payload = b"z" * 32
    ref = _ref(payload)
    value = bytearray(encode_header(ref, len(payload), False) + payload)
    struct.pack_into("<H", value, 4, 99)
    with pytest.raises(CorruptValue, match="version 99"):
        decode_header(ref, bytes(value))


def test_names_keep_group_keys_in_one_cluster_slot_and_blocks_apart() -> None:
    names = PoolNames("kvt", "tp-7", 1)
    assert names.manifest() == b"kvt:{tp-7}:m:1"
    assert names.manifest(0) == b"kvt:{tp-7}:m:0"
    assert names.intents() == b"kvt:{tp-7}:i:1"
    assert names.namespaces == b"kvt:{tp-7}:ns"
    assert names.block(NS, b"key") == b"kvt:b:" + NS + b"key"
    assert b"{" not in names.block(NS, b"key")  # blocks spread over the cluster's slots
