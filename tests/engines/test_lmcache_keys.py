"""LMCache keys and metadata as kvtierd keys and namespaces (pure; needs no LMCache)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.engines.lmcache_keys import (
    BLOCK_ORDER,
    UnsupportedKeyError,
    block_key,
    namespace_spec,
)

LLAMA = {
    "model_name": "meta-llama/Llama-3.1-8B",
    "world_size": 2,
    "worker_id": 1,
    "dtype": "torch.float16",
    "tags": None,
    "kv_shape": (32, 2, 256, 8, 128),
    "chunk_tokens": 256,
    "chunk_bytes": 2 * 32 * 8 * 128 * 256 * 2,
    "hash_algorithm": "sha256_cbor",
    "single_group": True,
}


@given(st.integers(-(2**127), 2**127 - 1), st.integers(-(2**127), 2**127 - 1))
def test_int_hashes_map_one_to_one(a: int, b: int) -> None:
    assert len(block_key(a)) == 16
    assert (block_key(a) == block_key(b)) == (a == b)


def test_signed_and_unsigned_64_bit_hashes_differ() -> None:
    # LMCache's builtin hash is signed, sha256_cbor's 8-byte prefix unsigned: -1 and 2**64 - 1
    # share their low 64 bits but are different chunks.
    assert block_key(-1) != block_key(2**64 - 1)


def test_bytes_hashes_are_kept_and_bounded() -> None:
    assert block_key(b"\x01" * 32) == b"\x01" * 32
    with pytest.raises(UnsupportedKeyError):
        block_key(b"\x01" * 33)
    with pytest.raises(UnsupportedKeyError):
        block_key(b"")
    with pytest.raises(UnsupportedKeyError):
        block_key(2**127)


def test_namespace_carries_rank_group_and_layout() -> None:
    spec = namespace_spec(**LLAMA)
    assert spec.name == "lmcache/meta-llama/Llama-3.1-8B/sha256_cbor"
    assert (spec.rank, spec.world_size, spec.block_bytes) == (1, 2, 32 << 20)
    assert spec.layout is not None
    assert (spec.layout.layers, spec.layout.kv_heads, spec.layout.head_dim) == (32, 8, 128)
    assert (spec.layout.dtype, spec.layout.block_tokens) == ("float16", 256)
    assert spec.layout.order == BLOCK_ORDER


def test_every_identity_part_separates_namespaces() -> None:
    base = namespace_spec(**LLAMA)
    variants = [
        {"model_name": "other/model"},
        {"hash_algorithm": "builtin"},
        {"tags": (("user", "alice"),)},
        {"dtype": "torch.bfloat16"},
        {"worker_id": 0},
        {"world_size": 4, "worker_id": 3},
        {"kv_shape": (32, 2, 256, 4, 128), "chunk_bytes": LLAMA["chunk_bytes"] // 2},
    ]
    for change in variants:
        assert namespace_spec(**{**LLAMA, **change}) != base, change


def test_mla_and_multi_group_shapes_go_into_the_name() -> None:
    mla = namespace_spec(**{**LLAMA, "kv_shape": (61, 1, 256, 1, 576), "chunk_bytes": 123})
    assert mla.layout is None
    assert mla.name.endswith("/float16[61,1,256,1,576]")
    grouped = namespace_spec(**{**LLAMA, "single_group": False})
    assert grouped.layout is None
    assert "[32,2,256,8,128]" in grouped.name
