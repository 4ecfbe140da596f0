"""SparseIndex: known answers on planted keys, forced blocks, budgets, errors, prediction."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.errors import BlockNotFoundError, ConfigError, InvalidRequestError
from kvtierd.slsap.sparse import BlockSummary, SparseConfig, SparseIndex, summarize_keys

DIM, TOKENS = 16, 4


def _config(**kw: object) -> SparseConfig:
    base: dict[str, object] = {"layers": (0, 1), "q_heads": 4, "kv_heads": 2, "head_dim": DIM}
    base.update(kw)
    return SparseConfig(**base)  # type: ignore[arg-type]


def _planted(blocks: int, needles: dict[int, np.ndarray], seed: int = 0) -> np.ndarray:
    """Boxes ``[blocks, 2 layers, 2 kv heads, 3, DIM]`` of small random keys, except the needle
    positions whose keys all point along the given direction (every layer and head)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((blocks, 2, 2, TOKENS, DIM)).astype(np.float32) * 0.3
    for pos, direction in needles.items():
        keys[pos] = 6 * direction + keys[pos] * 0.1
    return np.stack([keys.min(axis=3), keys.max(axis=3), keys.mean(axis=3)], axis=3)


def _query(direction: np.ndarray) -> np.ndarray:
    return np.broadcast_to(direction * 4, (2, 4, DIM)).astype(np.float32).copy()


@pytest.mark.parametrize("blocks", [40, 3000])  # all candidates / the LSH path
def test_needle_blocks_are_selected(blocks: int) -> None:
    rng = np.random.default_rng(5)
    direction = rng.standard_normal(DIM).astype(np.float32)
    direction /= np.linalg.norm(direction)
    needles = {blocks // 3: direction, blocks // 2: direction, blocks - 9: direction}
    index = SparseIndex(_config())
    index.insert_many(np.arange(blocks) + 100, np.arange(blocks), _planted(blocks, needles))
    selection = index.select(_query(direction), budget_blocks=5)
    want = {pos + 100 for pos in needles}
    for row in selection.block_ids:
        assert row[0] == 100  # the sink
        assert row[1] == blocks - 1 + 100  # the newest block
        assert set(row[2:].tolist()) == want
    assert set(selection.blocks()[:5].tolist()) == want | {100, blocks - 1 + 100}
    if blocks > 1000:
        assert selection.candidates < blocks * 4  # four groups, far from all blocks


def test_forced_blocks_budget_and_padding() -> None:
    index = SparseIndex(_config(sink_blocks=2, recent_blocks=3))
    boxes = _planted(20, {})
    index.insert_many(np.arange(20), np.arange(20), boxes)
    assert index.forced().tolist() == [0, 1, 19, 18, 17]
    q = np.random.default_rng(1).standard_normal((2, 4, DIM)).astype(np.float32)
    for budget in (1, 3, 5, 8, 20, 30):
        ids = index.select(q, budget).block_ids
        assert ids.shape == (4, budget)
        for row in ids:
            valid = row[row >= 0]
            assert len(set(valid.tolist())) == len(valid)
            assert len(valid) == min(budget, 20)
            assert valid.tolist()[:5] == [0, 1, 19, 18, 17][: min(budget, 5)]
    index.remove(19)
    assert index.forced().tolist() == [0, 1, 18, 17, 16]  # the window follows the newest


def test_insert_remove_and_errors() -> None:
    index = SparseIndex(_config())
    keys = np.random.default_rng(2).standard_normal((4, 2, TOKENS, DIM)).astype(np.float32)
    index.insert(7, 0, summarize_keys(keys))
    assert 7 in index
    assert len(index) == 1
    with pytest.raises(InvalidRequestError):
        index.insert(7, 1, summarize_keys(keys))
    with pytest.raises(InvalidRequestError):
        index.insert(8, 0, summarize_keys(keys))
    with pytest.raises(InvalidRequestError):
        index.insert(9, 1, summarize_keys(keys[:, :1]))
    with pytest.raises(InvalidRequestError):
        index.select(np.zeros((2, 3, DIM), np.float32), 4)
    with pytest.raises(InvalidRequestError):
        index.select(np.zeros((2, 4, DIM), np.float32), 0)
    index.remove(7)
    with pytest.raises(BlockNotFoundError):
        index.remove(7)
    with pytest.raises(KeyError):
        index.remove(7)
    assert len(index) == 0
    assert index.select(np.zeros((2, 4, DIM), np.float32), 3).block_ids.tolist() == [[-1] * 3] * 4


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        _config(q_heads=3)
    with pytest.raises(ConfigError):
        _config(layers=())
    with pytest.raises(ConfigError):
        _config(shortlist_radius=1.5)
    with pytest.raises(ConfigError):
        _config(candidate_factor=32.0)
    assert SparseConfig.for_model(30, 9, 3, 64).layers == tuple(range(2, 30))


def test_prediction_names_the_selection_and_its_reserve() -> None:
    index = SparseIndex(_config(reserve_factor=0.5))
    index.insert_many(np.arange(300), np.arange(300), _planted(300, {}))
    q = np.random.default_rng(3).standard_normal((2, 4, DIM)).astype(np.float32)
    selection = index.select(q, 10)
    predicted = index.predict_next(selection)
    assert predicted.shape == (4, 10 + 4)
    assert np.array_equal(predicted[:, :10], selection.block_ids)
    for chosen, spare in zip(selection.block_ids, selection.reserve_ids, strict=True):
        assert not np.isin(spare[spare >= 0], chosen).any()
    # Several steps at once share one selection.
    steps = np.stack([q, q], axis=2)
    assert index.select(steps, 10).block_ids.shape == (4, 10)
    assert selection.for_layer(1).shape == (2, 10)


def test_many_removals_compact_without_losing_blocks() -> None:
    index = SparseIndex(_config())
    n = 600
    index.insert_many(np.arange(n), np.arange(n), _planted(n, {}))
    for block in range(1, n, 2):
        index.remove(block)
    live = set(range(0, n, 2))
    q = np.random.default_rng(4).standard_normal((2, 4, DIM)).astype(np.float32)
    full = index.select(q, n, exhaustive=True).block_ids
    for row in full:
        assert set(row[row >= 0].tolist()) == live
    assert set(index.select(q, 40).blocks().tolist()) <= live


def test_blocks_added_after_clustering_are_found_and_selection_is_deterministic() -> None:
    """Blocks inserted one at a time after the clusters were fitted (the unsorted delta, then
    merged lists) are pooled like the others; two indices fed the same calls agree exactly."""
    rng = np.random.default_rng(6)
    direction = rng.standard_normal(DIM).astype(np.float32)
    direction /= np.linalg.norm(direction)
    n, late = 2000, 300
    boxes = _planted(n + late, {n + 17: direction, n + 250: direction, 700: direction})
    indices = [SparseIndex(_config()) for _ in range(2)]
    for index in indices:
        index.insert_many(np.arange(n), np.arange(n), boxes[:n])
        for i in range(n, n + late):
            index.insert(i, i, _summary(boxes[i]))
    a, b = (index.select(_query(direction), budget_blocks=5) for index in indices)
    assert np.array_equal(a.block_ids, b.block_ids)
    for row in a.block_ids:
        assert set(row[2:].tolist()) == {n + 17, n + 250, 700}


def _summary(box: np.ndarray) -> BlockSummary:
    """A BlockSummary of the 2 indexed layers from a stacked ``[2, 2, 3, DIM]`` box."""
    return BlockSummary(box[:, :, 0], box[:, :, 1], box[:, :, 2], TOKENS)
