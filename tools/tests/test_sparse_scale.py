"""The scale tool at a small scale: a real daemon holds a synthetic 7B-class context on NVMe,
shared-selection decode steps find the blocks their queries aim at, and the restores run."""

from __future__ import annotations

import argparse
import shutil

import numpy as np
import pytest

from tools import sparse_scale

pytestmark = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")


def test_synthetic_blocks_follow_the_layout_and_their_own_signs() -> None:
    keys = sparse_scale.Keys.make(seed=3)
    block = bytearray(sparse_scale.BLOCK_BYTES)
    keys.fill(5, memoryview(block))
    kv = np.frombuffer(block, np.uint16).reshape(
        sparse_scale.LAYERS, 2, sparse_scale.KV_HEADS, sparse_scale.BLOCK_TOKENS, -1
    )
    negative = (kv[:, 0] >> 15).astype(bool)  # the keys' sign bits, per token
    flipped = keys.signs(5)[:, :, None, :]
    # the mean direction is positive and large against the noise: most keys keep its sign,
    # flipped exactly where the block flips it
    assert ((negative == flipped).mean()) > 0.8
    assert np.array_equal(kv[:, 1], keys.values)


@pytest.mark.timeout(300)
def test_a_small_scale_run_finds_the_aimed_blocks_and_restores() -> None:
    args = argparse.Namespace(
        tokens=[4096, 8192],
        budget_tokens=12 * sparse_scale.BLOCK_TOKENS,  # the 7 aimed-at blocks, sink, recent
        steps=3,
        restore_tokens=6144,
        seed=0,
        dram="512M",
    )
    result = sparse_scale.run(args)
    lengths = result["lengths"]
    assert [r["blocks"] for r in lengths] == [32, 64]
    for r in lengths:
        assert r["budget_blocks"] == 12
        assert r["topic_recall"] == 1.0  # every query head's target is in the shared selection
        assert 0 < r["per_head_union_blocks"] <= r["blocks"]
        assert r["clusters_s"] >= 0  # too short to be clustered: no wait
        assert r["first_step_mib"] == 12 * sparse_scale.BLOCK_BYTES / 2**20  # the budget, cold
    restored = result["restore"]
    assert restored["selected_blocks"] == 12
    assert restored["tokens"] == 6144
    assert restored["all_s"] > 0
    assert restored["fio_s"] > 0
    assert result["growth_per_10x"] is not None
