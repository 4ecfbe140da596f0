"""LruPolicy offers exactly the least recently used blocks not held, against a plain recency
list, and finds a victim among many held blocks without asking about each of them."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.store.policy import LruPolicy
from tests.support.dirty_puts import questions_asked


class LruMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = LruPolicy()
        self.order: list[int] = []  # oldest first
        self.held: set[int] = set()

    @rule(block=st.integers(0, 20), dirty=st.booleans())
    def insert(self, block: int, dirty: bool) -> None:
        self.policy.inserted(block, 0.0)
        if block in self.order:
            self.order.remove(block)
        self.order.append(block)
        self.held.discard(block)
        if dirty:
            self.policy.hold(block)
            self.held.add(block)

    @rule(block=st.integers(0, 20))
    def access(self, block: int) -> None:
        self.policy.accessed(block, 0.0)
        if block in self.order:
            self.order.remove(block)
            self.order.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.held)))
        self.policy.release(block)
        self.held.discard(block)

    @rule(block=st.integers(0, 20))
    def remove(self, block: int) -> None:
        self.policy.removed(block)
        if block in self.order:
            self.order.remove(block)
        self.held.discard(block)

    @rule(count=st.integers(0, 6), banned=st.sets(st.integers(0, 20), max_size=8))
    def victims(self, count: int, banned: set[int]) -> None:
        expected = [b for b in self.order if b not in self.held and b not in banned][:count]
        assert self.policy.victims(count, lambda b: b not in banned) == expected

    @invariant()
    def sizes_agree(self) -> None:
        assert len(self.policy) == len(self.order)


LruMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestLru = LruMachine.TestCase


def test_an_allocation_among_dirty_residents_visits_no_more_than_it_takes() -> None:
    # one question per put (the block released); walking the residents asks millions
    puts = 2000
    assert questions_asked(LruPolicy(), puts=puts) <= 2 * puts
