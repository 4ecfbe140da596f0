"""The reuse model: age buckets, classes, and the hit-density table it learns."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.slsap.reuse import (
    _EDGES,
    AGE_BUCKETS,
    NUM_CLASSES,
    SUB_BUCKETS,
    ReuseModel,
    _horizon_density,
    _shrink,
    age_bucket,
    age_bucket_of,
    block_class,
    request_block_classes,
)


@given(st.floats(0, 1e12, allow_nan=False))
def test_scalar_and_vector_buckets_agree(age: float) -> None:
    assert age_bucket_of(age) == int(age_bucket([age])[0])


def test_buckets_are_monotonic_and_bounded() -> None:
    ages = np.array([-5.0, 0.0, 1.0, 2.0, 10.0, 1e3, 1e9, 1e30])
    buckets = age_bucket(ages)
    assert buckets[0] == buckets[1] == 0
    assert np.all(np.diff(buckets) >= 0)
    assert buckets[-1] == AGE_BUCKETS - 1


def test_classes_cover_the_range_and_separate_signals() -> None:
    counts = np.array([1, 1, 1, 2, 20])
    tails = np.array([0, 1, -1, 0, 0])
    lengths = np.array([2, 20, 0, 2, 2])
    classes = block_class(counts, tails, lengths)
    assert np.all((classes >= 0) & (classes < NUM_CLASSES))
    assert len(set(classes.tolist())) == 5
    # Length matters only for blocks named once.
    assert block_class(2, 0, 2) == block_class(2, 0, 100)
    assert block_class(1, 0, 2) != block_class(1, 0, 100)


@given(
    st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), min_size=1, max_size=20),
    st.integers(-5, 200),
)
def test_request_classes_agree_with_block_class(blocks: list[tuple[int, int]], length: int) -> None:
    counts, tails = np.array(blocks, dtype=np.int32).T
    expected = block_class(counts, tails, length)
    assert request_block_classes(counts, tails, length).tolist() == expected.tolist()


def test_untrained_model_is_neutral() -> None:
    model = ReuseModel()
    assert np.all(model.density([0, 5], [0, 100]) == 1.0)


def test_reused_class_is_denser_than_a_dead_one() -> None:
    model = ReuseModel()
    hot, dead = int(block_class(4, 5, 0)), int(block_class(1, 0, 2))
    model.record_reuse([hot] * 50, [100.0] * 50)
    model.record_end([dead] * 50, [5000.0] * 50)
    model.record_reuse([dead] * 2, [4000.0] * 2)
    model.refit()
    assert model.density_of(hot, 0.0) > model.density_of(dead, 0.0)
    assert model.reuse_probability([hot], [0.0])[0] > model.reuse_probability([dead], [0.0])[0]


def test_open_blocks_count_as_censored() -> None:
    # Without the open blocks the class looks always reused; with them it does not.
    closed, censored = ReuseModel(), ReuseModel()
    cls = int(block_class(1, 3, 0))
    for model in (closed, censored):
        model.record_reuse([cls] * 10, [50.0] * 10)
    closed.refit()
    censored.refit([cls] * 90, [10_000.0] * 90)
    assert censored.reuse_probability([cls], [0.0])[0] < closed.reuse_probability([cls], [0.0])[0]


def test_density_past_the_last_reuse_is_zero() -> None:
    model = ReuseModel(prior_events=0.0)
    cls = int(block_class(2, 3, 0))
    model.record_reuse([cls] * 10, [10.0] * 10)
    model.record_end([cls] * 10, [1000.0] * 10)
    model.refit()
    assert model.density_of(cls, 5.0) > 0
    assert model.density_of(cls, 500.0) == 0.0


def test_refit_decays_history() -> None:
    model = ReuseModel(decay=0.5)
    model.record_reuse([0, 0], [1.0, 1.0])
    model.refit()
    assert model.observations() == 1.0
    assert model.refits == 1


def test_same_inputs_same_table() -> None:
    rng = np.random.default_rng(7)
    classes = rng.integers(0, NUM_CLASSES, 500)
    ages = rng.exponential(1000, 500)
    tables = []
    for _ in range(2):
        model = ReuseModel()
        model.record_reuse(classes[:300], ages[:300])
        model.record_end(classes[300:], ages[300:])
        model.refit(classes[:50], ages[:50])
        tables.append(model.density(classes, ages))
    assert np.array_equal(tables[0], tables[1])


def test_a_class_read_soon_or_never_is_worth_a_short_trial() -> None:
    # Half of "soon" blocks are read again 10 references on, the rest never (tracked until
    # 20,000); 60 % of "slow" blocks are read again 5,000 references on. Kept until reused,
    # "slow" earns more per reference of residence; kept for a short trial, "soon" does.
    soon, slow = int(block_class(1, 0, 2)), int(block_class(1, 1, 2))

    def fitted(min_horizon: float) -> ReuseModel:
        model = ReuseModel(prior_events=0.0)
        model.record_reuse([soon] * 50, [10.0] * 50)
        model.record_end([soon] * 50, [20_000.0] * 50)
        model.record_reuse([slow] * 60, [5_000.0] * 60)
        model.record_end([slow] * 40, [20_000.0] * 40)
        model.refit(min_horizon=min_horizon)
        return model

    short, forever = fitted(0.0), fitted(1e12)
    assert short.density_of(soon, 0.0) > short.density_of(slow, 0.0)
    assert forever.density_of(soon, 0.0) < forever.density_of(slow, 0.0)
    # Past its trial a "soon" block is worth little: its reuses are behind it.
    assert short.density_of(soon, 100.0) < short.density_of(slow, 100.0)


@pytest.mark.parametrize("min_horizon", [0.0, 40.0, 3_000.0])
def test_density_is_the_best_horizon_by_brute_force(min_horizon: float) -> None:
    # One class, no prior: the broadcast table against the definition, horizon by horizon.
    rng = np.random.default_rng(3)
    reuse_ages = rng.exponential(300, 80)
    end_ages = rng.exponential(3000, 40)
    model = ReuseModel(prior_events=0.0)
    model.record_reuse([0] * 80, reuse_ages)
    model.record_end([0] * 40, end_ages)
    model.refit(min_horizon=min_horizon)
    # An end's residual life is its age: as an event it sits one octave later.
    events = [(int(b), 1) for b in age_bucket(reuse_ages)]
    events += [(min(int(b) + SUB_BUCKETS, AGE_BUCKETS - 1), 0) for b in age_bucket(end_ages)]
    last = max(b for b, _ in events)
    mids = (_EDGES[:-1] + _EDGES[1:]) / 2
    for a in range(last + 1):
        best = 0.0
        for h in range(a, last + 1):
            if h < last and _EDGES[h + 1] < mids[a] + min_horizon:
                continue
            hits = sum(hit for b, hit in events if a <= b <= h)
            life = sum(mids[b] - mids[a] + 1 for b, _ in events if a <= b <= h)
            life += sum(1 for b, _ in events if b > h) * (_EDGES[h + 1] + 1 - mids[a])
            if life > 0:
                best = max(best, hits / life)
        assert model.density([0], [mids[a]])[0] == pytest.approx(best, rel=1e-4, abs=1e-9)


def test_negative_horizon_is_refused() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="min_horizon"):
            ReuseModel().refit(min_horizon=bad)


@pytest.mark.parametrize("seed", range(20))
def test_densities_stay_in_range_at_any_magnitude(seed: int) -> None:
    # Heavy young classes with a few stragglers at ages near 2**30: the running sums are huge
    # beside the tails' differences, and rounding must not turn a residence into 0 (a density
    # of 1e30 once did) nor a density below 0.
    rng = np.random.default_rng(seed)
    model = ReuseModel(prior_events=float(rng.choice([0.0, 40.0])))
    classes = rng.integers(0, NUM_CLASSES, 20_000)
    model.record_reuse(classes, rng.exponential(300, 20_000) * rng.choice([1, 1e4], 20_000))
    model.record_end(classes[:5_000], rng.exponential(3e6, 5_000))
    model.record_reuse([int(classes[0])] * 5, [3e7] * 5)
    model.refit(min_horizon=float(rng.choice([0.0, 1e3, 1e6])))
    table = model.density(
        np.repeat(np.arange(NUM_CLASSES), AGE_BUCKETS),
        np.tile(np.exp2(np.arange(AGE_BUCKETS) / SUB_BUCKETS) - 1, NUM_CLASSES),
    )
    assert np.all(np.isfinite(table))
    assert table.min() >= 0.0
    assert table.max() <= 1.0


def test_classes_without_data_share_their_parents_fit() -> None:
    # refit fits each distinct shape once; the table must be the one fitted class by class.
    rng = np.random.default_rng(11)
    model = ReuseModel()
    classes = block_class(rng.integers(1, 40, 400), rng.integers(0, 6, 400), 30)
    model.record_reuse(classes[:300], rng.exponential(500, 300))
    model.record_end(classes[300:], rng.exponential(5000, 100))
    reuses, ends = model._reuses.copy(), model._ends.copy()
    model.refit(min_horizon=200.0)
    expected, _ = _horizon_density(*_shrink(reuses, ends, model.prior_events), 200.0)
    assert np.array_equal(model._density, expected)
