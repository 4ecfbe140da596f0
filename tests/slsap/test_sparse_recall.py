"""The recall measure on constructed sequences: bounds that must hold, and a planted answer."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.errors import InvalidRequestError
from kvtierd.slsap.sparse import SparseConfig
from kvtierd.slsap.sparse.recall import attention_block_mass, evaluate_sequence

DIM, BLOCK = 16, 8


def _sequence(
    n: int, steps: int, seed: int = 0, planted: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Keys ``[3 layers, 2 kv, n, DIM]`` and queries ``[3, 4, steps, DIM]``; with ``planted``,
    blocks 5 and 9 hold keys aligned with every query."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((3, 2, n, DIM)).astype(np.float32)
    direction = rng.standard_normal(DIM).astype(np.float32)
    direction /= np.linalg.norm(direction)
    queries = rng.standard_normal((3, 4, steps, DIM)).astype(np.float32) * 0.5
    if planted:
        for b in (5, 9):
            keys[:, :, b * BLOCK : (b + 1) * BLOCK] += 5 * direction
        queries += 5 * direction
    return queries, keys


def test_block_mass_is_a_distribution_over_past_blocks() -> None:
    queries, keys = _sequence(100, 4, planted=False)
    mass = attention_block_mass(queries[0], keys[0], BLOCK)
    assert mass.shape == (4, 4, 13)
    np.testing.assert_allclose(mass.sum(axis=-1), 1, rtol=1e-5)
    assert np.all(mass >= 0)


@pytest.mark.parametrize("planted", [True, False])
def test_oracle_bounds_every_method(planted: bool) -> None:
    queries, keys = _sequence(160, 6, planted=planted)
    config = SparseConfig(layers=(1, 2), q_heads=4, kv_heads=2, head_dim=DIM)
    result = evaluate_sequence(queries, keys, config, block_tokens=BLOCK, budget=0.25)
    recall = result.recall
    for name, value in recall.items():
        assert 0 <= value <= 1 + 1e-6, name
        if name != "oracle_per_head":
            assert value <= recall["oracle"] + 1e-6, name
    assert recall["oracle_per_head"] >= recall["oracle"] - 1e-6
    assert 0 <= result.lead_time_selection_only <= result.lead_time <= 1
    assert len(result.recall_per_layer["slsap"]) == 2
    if planted:
        assert recall["slsap"] >= 0.95 * recall["oracle"]
        assert recall["slsap"] > recall["recency"] + 0.2


def test_rejects_sequences_without_a_full_block() -> None:
    queries, keys = _sequence(12, 6, planted=False)
    config = SparseConfig(layers=(1,), q_heads=4, kv_heads=2, head_dim=DIM)
    with pytest.raises(InvalidRequestError):
        evaluate_sequence(queries, keys, config, block_tokens=BLOCK)
