"""HINT with query vectors against a real daemon: known-answer sparse retrieval and promotion."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtierd.client import InvalidRequestError, chain_keys, connect
from kvtierd.testing import DaemonProcess

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 4, 1, 8, 4
LAYOUT = {
    "model_id": "toy",
    "layers": LAYERS,
    "kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "dtype": "float32",
    "block_tokens": BLOCK_TOKENS,
}
BLOCK_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * BLOCK_TOKENS * 4
HOT = 5


def _block(position: int, direction: np.ndarray) -> np.ndarray:
    """Layer-major K then V per layer; block HOT's keys point along ``direction``."""
    rng = np.random.default_rng(position)
    kv = rng.normal(0, 0.05, (LAYERS, 2, KV_HEADS, BLOCK_TOKENS, HEAD_DIM)).astype(np.float32)
    if position == HOT:
        kv[:, 0] += 4 * direction
    return kv


def test_hint_ranks_the_block_the_query_attends_to_and_promotes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    direction = np.zeros(HEAD_DIM, np.float32)
    direction[3] = 1.0
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("toy", block_bytes=BLOCK_BYTES, layout=LAYOUT, sparse=True)
        keys = chain_keys(range(BLOCK_TOKENS * 12), BLOCK_TOKENS, ns.key_salt)
        ns.put(keys, [_block(i, direction) for i in range(len(keys))])
        client.fsync()
        client.evict()
        queries = np.tile(direction, (2, 1, 1)).astype(np.float32)  # layers 2 and 3, 1 q head
        ranked, predicted = ns.hint_attention(
            keys, queries, query_layers=[2, 3], budget_blocks=3, session=b"s1"
        )
        assert keys[HOT] in ranked
        assert keys[0] in ranked  # the attention sink is always kept
        assert keys[-1] in ranked  # and the recent window
        assert len(ranked) <= 3 * 2
        assert not set(ranked) & set(predicted)
        deadline = time.monotonic() + 30
        while ns.lookup_tiers([keys[HOT]], promote=False) != ["dram"]:
            assert time.monotonic() < deadline, "the hinted block was never promoted"
            time.sleep(0.02)


def test_hint_with_queries_needs_a_sparse_namespace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("plain", block_bytes=BLOCK_BYTES, layout=LAYOUT)
        keys = chain_keys(range(8), BLOCK_TOKENS, ns.key_salt)
        with pytest.raises(InvalidRequestError, match="sparse=True"):
            ns.hint_attention(
                keys, np.zeros((1, 1, HEAD_DIM), np.float32), query_layers=[2], budget_blocks=2
            )
        with pytest.raises(InvalidRequestError, match="layout"):
            client.namespace("nolayout", block_bytes=BLOCK_BYTES, sparse=True)
        sparse = client.namespace("sp", block_bytes=BLOCK_BYTES, layout=LAYOUT, sparse=True)
        with pytest.raises(InvalidRequestError, match="layout"):
            sparse.hint_attention(
                keys, np.zeros((1, 1, 5), np.float32), query_layers=[2], budget_blocks=2
            )
