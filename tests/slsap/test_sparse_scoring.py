"""Scores from boxes: the bound bounds, the estimate is exact for one key, shares add up."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvtierd.slsap.sparse.scoring import (
    box_log_mass,
    box_spread,
    group_mass,
    mean_logit,
    quest_bound,
)

finite = st.floats(-8, 8, allow_nan=False, width=32)


def _boxes(keys: np.ndarray) -> np.ndarray:
    """``[n, 3, d]`` boxes of keys ``[n, tokens, d]``."""
    return np.stack([keys.min(axis=1), keys.max(axis=1), keys.mean(axis=1)], axis=1)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, (3, 4, 8), elements=finite), arrays(np.float32, (2, 8), elements=finite))
def test_quest_bound_is_an_upper_bound_and_the_estimate_is_in_between(
    keys: np.ndarray, queries: np.ndarray
) -> None:
    boxes = _boxes(keys)  # [3 blocks, 3, 8]
    true = np.einsum("hd,ntd->nht", queries, keys) / np.sqrt(8)  # [n, heads, tokens]
    bound = quest_bound(queries[None], boxes)  # [n, heads]
    assert np.all(bound >= true.max(axis=2) - 1e-4)
    estimate = box_log_mass(queries[None], boxes)
    centre = (boxes[:, 0] + boxes[:, 1]) / 2
    at_centre = np.einsum("hd,nd->nh", queries, centre) / np.sqrt(8)
    # Jensen: the mean of exp over the box is at least exp at its centre; and never above max.
    assert np.all(estimate >= at_centre - 1e-3)
    assert np.all(estimate <= bound + 1e-3)


def test_box_estimate_is_exact_for_a_single_key() -> None:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((6, 1, 16)).astype(np.float32)
    q = rng.standard_normal((3, 16)).astype(np.float32)
    boxes = _boxes(keys)
    expect = np.einsum("hd,nd->nh", q, keys[:, 0]) / 4
    np.testing.assert_allclose(box_log_mass(q[None], boxes), expect, atol=1e-4)
    np.testing.assert_allclose(mean_logit(q[None], boxes), expect, atol=1e-5)
    np.testing.assert_allclose(quest_bound(q[None], boxes), expect, atol=1e-5)


def test_group_mass_sums_shares_over_heads() -> None:
    logits = np.array([[[0.0, 0.0, 1000.0], [5.0, 5.0, 5.0]]], dtype=np.float32)
    mass = group_mass(logits)
    np.testing.assert_allclose(mass, [[1 / 3, 1 / 3, 1 + 1 / 3]], rtol=1e-6)
    masked = group_mass(logits, valid=np.array([[True, True, False]]))
    np.testing.assert_allclose(masked, [[1.0, 1.0, 0.0]], rtol=1e-6)


def test_box_spread_is_the_estimate_minus_the_bound() -> None:
    """The index scores candidates as Quest's bound plus ``box_spread`` (many groups at once):
    the same figure as ``box_log_mass``."""
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2, 5, 4, 16)).astype(np.float32) * 2  # [groups, n, tokens, d]
    q = rng.standard_normal((2, 3, 16)).astype(np.float32)  # [groups, heads, d]
    boxes = np.stack([_boxes(k) for k in keys])  # [groups, n, 3, d]
    radius = (boxes[:, :, 1] - boxes[:, :, 0]) / 2
    spread = box_spread(np.abs(q) / 4, radius)  # [groups, heads, n]
    for g in range(2):
        want = box_log_mass(q[g][None], boxes[g]) - quest_bound(q[g][None], boxes[g])  # [n, h]
        np.testing.assert_allclose(spread[g].T, want, atol=1e-4)
    assert np.all(spread <= 0)
