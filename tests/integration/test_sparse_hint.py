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


def test_summaries_follow_their_blocks_out_of_the_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 14 row 10: 16,384 blocks through a sparse namespace whose tiers hold far fewer
    kept a summary for every one of them. Now a block that leaves its last tier takes its
    summary along, and all of them stay within ``limits.sparse_summary_bytes``."""
    big = {**LAYOUT, "layers": 16, "head_dim": 64, "block_tokens": 16}
    block_bytes = 2 * 16 * KV_HEADS * 64 * 16 * 4  # 128 KiB
    config = '[limits]\nsparse_summary_bytes = "256K"\n'
    with (
        DaemonProcess(tmp_path, dram_size="16M", nvme_size="0", config_text=config) as d,
        connect(d.socket) as client,
    ):
        ns = client.namespace("toy", block_bytes=block_bytes, layout=big, sparse=True)
        rng = np.random.default_rng(0)
        block = rng.normal(0, 1, block_bytes // 4).astype(np.float32)
        keys = chain_keys(range(16 * 1024), 16, ns.key_salt)
        for start in range(0, len(keys), 32):
            ns.put(keys[start : start + 32], [block] * 32)
        stats = client.stats()
        assert stats["tiers"][0]["blocks"] < len(keys)  # the tier really let blocks go
        assert 0 < stats["sparse_summaries"] <= stats["tiers"][0]["blocks"]  # no orphans
        assert stats["sparse_summary_bytes"] <= 256 << 10


def test_the_selection_comes_back_per_layer_and_kv_head(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``hint_selection`` answers, for each query layer and KV head, the chain positions to
    read: the sink and the newest block first, then the block the query attends to; a budget
    past the chain is the whole chain, never an array the client sized."""
    direction = np.zeros(HEAD_DIM, np.float32)
    direction[3] = 1.0
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("toy", block_bytes=BLOCK_BYTES, layout=LAYOUT, sparse=True)
        keys = chain_keys(range(BLOCK_TOKENS * 12), BLOCK_TOKENS, ns.key_salt)
        ns.put(keys, [_block(i, direction) for i in range(len(keys))])
        queries = np.tile(direction, (2, 1, 1)).astype(np.float32)
        hint = ns.hint_selection(keys, queries, query_layers=[2, 3], budget_blocks=3)
        assert hint.selected.shape == (2, KV_HEADS, 3)
        assert hint.selected.dtype == np.int32
        for row in hint.selected.reshape(-1, 3).tolist():
            assert row[:2] == [0, len(keys) - 1]  # forced: the sink, the newest block
            assert row[2] == HOT
        assert set(hint.ranked) == {keys[p] for p in hint.selected.reshape(-1).tolist()}
        whole = ns.hint_selection(keys, queries, query_layers=[2, 3], budget_blocks=1 << 31)
        assert whole.selected.shape == (2, KV_HEADS, len(keys))
        assert sorted(whole.selected[0, 0].tolist()) == list(range(len(keys)))


def test_a_selection_past_the_reply_bound_is_refused_before_it_is_made(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """4 bytes per query layer, KV head and budgeted block: the library refuses to ask for a
    selection past ``MAX_SELECTED_BYTES``; the daemon answers such a HINT (an older client's
    ``hint_attention``) with its ranked keys alone, as before minor 14, and serves on."""
    wide = {**LAYOUT, "layers": 64, "kv_heads": 8, "head_dim": 2, "block_tokens": 1}
    block_bytes = 2 * 64 * 8 * 2 * 1 * 4
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("wide", block_bytes=block_bytes, layout=wide, sparse=True)
        keys = chain_keys(range(300), 1, ns.key_salt)
        rng = np.random.default_rng(1)
        ns.put(keys, [rng.normal(0, 1, block_bytes // 4).astype(np.float32) for _ in keys])
        queries = rng.normal(0, 1, (64, 8, 2)).astype(np.float32)
        with pytest.raises(InvalidRequestError, match="reply bound"):
            ns.hint_selection(keys, queries, query_layers=range(64), budget_blocks=300)
        ranked, _ = ns.hint_attention(keys, queries, query_layers=range(64), budget_blocks=300)
        assert len(ranked) == len(keys)  # a budget of the whole chain ranks all of it
        hint = ns.hint_selection(keys, queries, query_layers=range(64), budget_blocks=200)
        assert hint.selected.shape == (64, 8, 200)
        assert (hint.selected >= 0).all()


def test_many_sessions_over_one_chain_stay_within_the_index_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each session indexes the chain's summaries again: a client naming session after
    session cannot make the daemon hold an index for each; the least recently used go, at
    twice ``limits.sparse_summary_bytes`` for all of them, and a dropped one starts afresh."""
    big = {**LAYOUT, "layers": 16, "head_dim": 64, "block_tokens": 16}
    block_bytes = 2 * 16 * KV_HEADS * 64 * 16 * 4
    config = '[limits]\nsparse_summary_bytes = "256K"\n'
    with (
        DaemonProcess(tmp_path, dram_size="64M", config_text=config) as d,
        connect(d.socket) as client,
    ):
        ns = client.namespace("toy", block_bytes=block_bytes, layout=big, sparse=True)
        rng = np.random.default_rng(2)
        keys = chain_keys(range(16 * 40), 16, ns.key_salt)
        ns.put(keys, [rng.normal(0, 1, block_bytes // 4).astype(np.float32) for _ in keys])
        queries = rng.normal(0, 1, (16, 1, 64)).astype(np.float32)
        for n in range(8):
            hint = ns.hint_selection(
                keys, queries, query_layers=range(16), budget_blocks=4, session=b"s%d" % n
            )
            assert (hint.selected >= 0).all()
        assert "dropped the index of session b's0'" in d.log()
        again = ns.hint_selection(
            keys, queries, query_layers=range(16), budget_blocks=4, session=b"s0"
        )
        assert again.selected.shape == (16, KV_HEADS, 4)


def test_a_restarted_daemon_summarises_the_chain_again_as_it_promotes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Summaries live in memory: after a restart a HINT finds none and selects nothing, asks
    for the chain's blocks to be promoted, and once they are, ranks them as before."""
    direction = np.zeros(HEAD_DIM, np.float32)
    direction[3] = 1.0
    queries = np.tile(direction, (2, 1, 1)).astype(np.float32)
    with DaemonProcess(tmp_path) as d:
        with connect(d.socket) as client:
            ns = client.namespace("toy", block_bytes=BLOCK_BYTES, layout=LAYOUT, sparse=True)
            keys = chain_keys(range(BLOCK_TOKENS * 12), BLOCK_TOKENS, ns.key_salt)
            ns.put(keys, [_block(i, direction) for i in range(len(keys))])
            client.fsync()
        d.stop()
        d.start()
        with connect(d.socket) as client:
            ns = client.namespace("toy", block_bytes=BLOCK_BYTES, layout=LAYOUT, sparse=True)
            first = ns.hint_selection(keys, queries, query_layers=[2, 3], budget_blocks=3)
            assert (first.selected == -1).all()
            assert first.ranked == []
            deadline = time.monotonic() + 30
            while ns.lookup_tiers(keys, promote=False) != ["dram"] * len(keys):
                assert time.monotonic() < deadline, "the chain was never promoted"
                time.sleep(0.02)
            again = ns.hint_selection(keys, queries, query_layers=[2, 3], budget_blocks=3)
            for row in again.selected.reshape(-1, 3).tolist():
                assert row == [0, len(keys) - 1, HOT]


def test_a_hint_promotes_no_more_than_it_is_asked_to(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``promote_blocks``: an engine that reads only the best of the ranking has the daemon
    promote those, not every block some layer and head chose."""
    direction = np.zeros(HEAD_DIM, np.float32)
    direction[3] = 1.0
    queries = np.tile(direction, (2, 1, 1)).astype(np.float32)
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("toy", block_bytes=BLOCK_BYTES, layout=LAYOUT, sparse=True)
        keys = chain_keys(range(BLOCK_TOKENS * 12), BLOCK_TOKENS, ns.key_salt)
        ns.put(keys, [_block(i, direction) for i in range(len(keys))])
        client.fsync()
        client.evict()
        assert ns.lookup_tiers(keys, promote=False) == ["nvme"] * len(keys)
        two = ns.hint_selection(
            keys, queries, query_layers=[2, 3], budget_blocks=4, promote_blocks=2
        )
        assert two.planned == 2
        deadline = time.monotonic() + 30
        while ns.lookup_tiers(keys, promote=False).count("dram") < 2:
            assert time.monotonic() < deadline, "the two promotions never landed"
            time.sleep(0.02)
        tiers = ns.lookup_tiers(keys, promote=False)
        assert {k for k, tier in zip(keys, tiers, strict=True) if tier == "dram"} == set(
            two.ranked[:2]
        )
        every = ns.hint_selection(
            keys, queries, query_layers=[2, 3], budget_blocks=4, session=b"every"
        )
        assert every.ranked == two.ranked  # the same answer; only the promotions differ
        assert every.planned == len(every.ranked) + len(every.predicted) - 2


def test_a_chain_that_repeats_a_key_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A sequence's chained keys are distinct; one key repeated 8192 times was indexed once per
    position (the summaries' bound counts it once): about 2 GB held by one HINT."""
    direction = np.zeros(HEAD_DIM, np.float32)
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("toy", block_bytes=BLOCK_BYTES, layout=LAYOUT, sparse=True)
        keys = chain_keys(range(BLOCK_TOKENS * 2), BLOCK_TOKENS, ns.key_salt)
        ns.put(keys, [_block(i, direction) for i in range(len(keys))])
        queries = np.zeros((2, 1, HEAD_DIM), np.float32)
        with pytest.raises(InvalidRequestError, match="each block once"):
            ns.hint_selection([keys[1]] * 8192, queries, query_layers=[2, 3], budget_blocks=4)
        hint = ns.hint_selection(keys, queries, query_layers=[2, 3], budget_blocks=4)
        assert hint.selected.shape == (2, KV_HEADS, 2)
