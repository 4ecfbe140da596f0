"""Block summaries: the layout contract with the store, and the min/max/mean they compute."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.errors import InvalidRequestError
from kvtierd.slsap.sparse import (
    BlockLayout,
    BlockSummary,
    keys_from_block,
    summarize_block,
    summarize_keys,
    summarize_sequence,
)


def _pack(keys: np.ndarray, values: np.ndarray, dtype: str) -> bytes:
    """Lay out K and V as the documented memory order: per layer, K then V."""
    planes = np.stack([keys, values], axis=1)  # [layers, 2, kv_heads, tokens, dim]
    if dtype == "bfloat16":
        return (planes.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return planes.astype(dtype).tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_keys_from_block_reads_only_the_k_planes(dtype: str) -> None:
    layout = BlockLayout(layers=3, kv_heads=2, head_dim=8, block_tokens=4, dtype=dtype)
    rng = np.random.default_rng(0)
    # Values exactly representable in bfloat16 (and so in float16): small dyadic numbers.
    keys = rng.integers(-64, 64, (3, 2, 4, 8)).astype(np.float32) / 8
    values = np.full_like(keys, 1000.0)
    data = _pack(keys, values, dtype)
    assert len(data) == layout.block_bytes
    np.testing.assert_array_equal(keys_from_block(data, layout), keys)
    summary = summarize_block(data, layout)
    np.testing.assert_array_equal(summary.minimum, keys.min(axis=2))
    np.testing.assert_array_equal(summary.maximum, keys.max(axis=2))
    np.testing.assert_allclose(summary.mean, keys.mean(axis=2), rtol=1e-6)


def test_keys_from_block_rejects_a_wrong_length() -> None:
    layout = BlockLayout(layers=2, kv_heads=1, head_dim=4, block_tokens=2, dtype="float32")
    with pytest.raises(InvalidRequestError):
        keys_from_block(b"\0" * (layout.block_bytes - 4), layout)


def test_layout_rejects_bad_dimensions_and_dtypes() -> None:
    with pytest.raises(InvalidRequestError):
        BlockLayout(layers=0, kv_heads=1, head_dim=4, block_tokens=2)
    with pytest.raises(InvalidRequestError):
        BlockLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=2, dtype="int8")


def test_summarize_keys_partial_block_and_shapes() -> None:
    keys = np.arange(2 * 1 * 4 * 3, dtype=np.float32).reshape(2, 1, 4, 3)
    summary = summarize_keys(keys, tokens=2)
    assert summary.tokens == 2
    np.testing.assert_array_equal(summary.maximum, keys[:, :, 1])
    np.testing.assert_array_equal(summary.minimum, keys[:, :, 0])
    assert summary.stacked().shape == (2, 1, 3, 3)
    with pytest.raises(InvalidRequestError):
        summarize_keys(keys[0])
    with pytest.raises(InvalidRequestError):
        summarize_keys(keys, tokens=0)
    with pytest.raises(InvalidRequestError):
        BlockSummary(summary.minimum, summary.maximum[:1], summary.mean, 2)


def test_summarize_sequence_matches_block_by_block() -> None:
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((3, 2, 37, 8)).astype(np.float32)
    boxes = summarize_sequence(keys, block_tokens=8)
    assert boxes.shape == (4, 3, 2, 3, 8)  # the trailing 5 tokens are a partial block
    for b in range(4):
        expect = summarize_keys(keys[:, :, 8 * b : 8 * b + 8]).stacked()
        np.testing.assert_allclose(boxes[b], expect, rtol=1e-6)
