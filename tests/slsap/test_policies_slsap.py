"""SlsapPolicy meets the CachePolicy contract, and learns to keep shared prefixes."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.slsap import SlsapConfig, SlsapPolicy
from tests.support.dirty_puts import questions_asked

SMALL = SlsapConfig(min_ghosts=8, min_refit_events=16, ghost_ratio=2.0)


def test_is_a_cache_policy() -> None:
    assert isinstance(SlsapPolicy(), CachePolicy)


def test_admits_into_an_empty_tier() -> None:
    assert SlsapPolicy().admit("a", 0.0)


def test_victims_are_residents_and_evictable_only() -> None:
    policy = SlsapPolicy(SMALL)
    for block in "abcdef":
        policy.inserted(block, 0.0)
    chosen = policy.victims(10, lambda b: b != "c")
    assert set(chosen) == set("abdef")
    assert policy.victims(2, lambda b: True)[:2] == chosen[:2]
    assert policy.victims(3, lambda b: False) == []
    assert policy.victims(0, lambda b: True) == []


def test_removed_forgets_the_place_but_keeps_history() -> None:
    policy = SlsapPolicy(SMALL)
    policy.inserted("a", 0.0)
    policy.inserted("b", 0.0)
    policy.removed("a")
    policy.removed("zz")  # unknown: ignored
    assert len(policy) == 1
    assert policy.victims(5, lambda b: True) == ["b"]
    assert policy.statistics().ghosts == 1


def test_observe_request_then_access_counts_once() -> None:
    policy = SlsapPolicy(SMALL)
    policy.observe_request(["a", "b"], 0.0, request_id=1)
    context = AccessContext(request_id=1)
    policy.inserted("a", 0.0, context)
    policy.accessed("a", 0.0, context)
    assert policy.statistics().references == 2


def test_access_without_observation_is_telemetry_too() -> None:
    policy = SlsapPolicy(SMALL)
    policy.inserted("a", 0.0)
    policy.accessed("a", 1.0)
    policy.accessed("a", 2.0, AccessContext(request_id=0))
    assert policy.statistics().references == 3


def _train(policy: SlsapPolicy, rounds: int) -> None:
    """A shared 4-block prefix read by every request, each with 2 unique tail blocks."""
    shared = [f"sys{i}" for i in range(4)]
    for r in range(rounds):
        blocks = [*shared, f"q{r}a", f"q{r}b"]
        policy.observe_request(blocks, float(r), request_id=r)
        for block in blocks:
            context = AccessContext(request_id=r)
            if policy.admit(block, float(r), context) or len(policy) < 8:
                policy.inserted(block, float(r), context)
        while len(policy) > 8:
            for victim in policy.victims(1, lambda b: True):
                policy.removed(victim)


def test_learns_to_evict_unique_tails_before_the_shared_prefix() -> None:
    policy = SlsapPolicy(SMALL)
    _train(policy, 300)
    stats = policy.statistics()
    assert stats.refits > 0
    victims = policy.victims(4, lambda b: True)
    assert victims
    assert not any(str(v).startswith("sys") for v in victims)
    assert policy.density("sys0") > policy.density("q299b")


def test_refuses_a_tail_block_once_trained() -> None:
    policy = SlsapPolicy(SMALL)
    _train(policy, 300)
    for victim in policy.victims(8, lambda b: not str(b).startswith("sys")):
        policy.removed(victim)
    assert len(policy) == 4  # only the shared prefix is left
    blocks = [f"sys{i}" for i in range(4)] + ["new-a", "new-b"]
    policy.observe_request(blocks, 400.0, request_id=1000)
    assert not policy.admit("new-b", 400.0, AccessContext(request_id=1000))


def test_promotion_candidates_are_dense_ghosts() -> None:
    policy = SlsapPolicy(SMALL)
    _train(policy, 300)
    policy.removed("sys0")
    assert policy.promotion_candidates(3) == ["sys0"]
    assert policy.promotion_candidates(0) == []


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="ghost"):
        SlsapConfig(ghost_ratio=-1)
    with pytest.raises(ValueError, match="refit"):
        SlsapConfig(refit_ratio=0)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="horizon_turnovers"):
            SlsapConfig(horizon_turnovers=bad)


def test_horizons_start_at_the_measured_turnover(monkeypatch: pytest.MonkeyPatch) -> None:
    # Little's law between refits: residents * references / insertions, times the config's
    # number of turnovers; a period without insertions counts one.
    policy = SlsapPolicy(SlsapConfig(min_refit_events=100, refit_ratio=1e-9, horizon_turnovers=2))
    horizons: list[float] = []
    refit = policy._model.refit
    monkeypatch.setattr(
        policy._model,
        "refit",
        lambda *args, min_horizon: horizons.append(min_horizon) or refit(*args),
    )
    for i in range(50):  # 50 references, 50 insertions
        policy.inserted(f"b{i}", 0.0)
    for i in range(50):  # 50 references, no insertion
        policy.accessed(f"b{i}", 0.0)
    assert horizons == [2 * 50 * 100 / 50]
    for i in range(100):  # a period with no insertion at all
        policy.accessed(f"b{i % 50}", 0.0)
    assert horizons == [200.0, 2 * 50 * 100 / 1]


def test_held_residents_are_never_offered_until_released() -> None:
    policy = SlsapPolicy(SMALL)
    for block in "abcd":
        policy.inserted(block, 0.0)
    policy.hold("a")
    policy.hold("c")
    assert set(policy.victims(4, lambda b: True)) == {"b", "d"}
    policy.release("a")
    assert set(policy.victims(4, lambda b: True)) == {"a", "b", "d"}
    policy.removed("c")  # a removal ends the hold: a new residence starts evictable
    policy.inserted("c", 0.0)
    assert set(policy.victims(4, lambda b: True)) == {"a", "b", "c", "d"}
    policy.hold("c")
    policy.inserted("c", 0.0)  # so does a new insertion
    assert "c" in policy.victims(4, lambda b: True)


def test_an_allocation_among_dirty_residents_visits_no_more_than_it_takes() -> None:
    # one question per put (the block released); walking the residents asks millions
    puts = 2000
    assert questions_asked(SlsapPolicy(), puts=puts) <= 2 * puts


class ContractMachine(RuleBasedStateMachine):
    """Random inserts, reads, holds, removals and victim requests against a plain set of
    residents."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = SlsapPolicy(SMALL)
        self.resident: set[Hashable] = set()
        self.held: set[Hashable] = set()
        self.request = 0

    @rule(block=st.integers(0, 30), dirty=st.booleans())
    def insert(self, block: int, dirty: bool) -> None:
        if block not in self.resident:
            self.policy.inserted(block, 0.0)
            self.resident.add(block)
            if dirty:
                self.policy.hold(block)
                self.held.add(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.held, key=str)))
        self.policy.release(block)
        self.held.discard(block)

    @rule(blocks=st.lists(st.integers(0, 30), min_size=1, max_size=6))
    def request_arrives(self, blocks: list[int]) -> None:
        self.request += 1
        self.policy.observe_request(blocks, 0.0, self.request)
        for block in blocks:
            if block in self.resident:
                self.policy.accessed(block, 0.0, AccessContext(request_id=self.request))

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.resident, key=str)))
        self.policy.removed(block)
        self.resident.discard(block)
        self.held.discard(block)

    @rule(count=st.integers(0, 5), banned=st.sets(st.integers(0, 30), max_size=10))
    def victims(self, count: int, banned: set[int]) -> None:
        chosen = self.policy.victims(count, lambda b: b not in banned)
        assert len(chosen) <= count
        assert len(set(chosen)) == len(chosen)
        assert set(chosen) <= self.resident - banned - self.held
        assert len(chosen) == min(count, len(self.resident - banned - self.held))

    @invariant()
    def sizes_agree(self) -> None:
        assert len(self.policy) == len(self.resident)


ContractMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestContract = ContractMachine.TestCase
