"""CLOCK in replay (the NVMe tier's ClockPolicy over rows of its own) is textbook CLOCK: the
same faults as a ring of frames with a use bit, set on load and on reference, and a hand."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.replay import PolicyName, simulate
from tests.replay.conftest import one_block_requests


def textbook_clock_faults(blocks: Sequence[int], frames: int) -> int:
    ring: list[int] = []
    used: list[bool] = []
    hand = faults = 0
    for block in blocks:
        if block in ring:
            used[ring.index(block)] = True
            continue
        faults += 1
        if len(ring) < frames:
            ring.append(block)
            used.append(True)
            continue
        while used[hand]:
            used[hand] = False
            hand = (hand + 1) % frames
        ring[hand], used[hand] = block, True
        hand = (hand + 1) % frames
    return faults


def clock_faults(blocks: Sequence[int], frames: int) -> int:
    result = simulate(one_block_requests(blocks), PolicyName.CLOCK, frames)
    return result.references - result.hits


def test_clock_textbook_faults() -> None:
    # Silberschatz's string, 3 frames: 14 faults, where LRU has 12 and Belady 8.
    blocks = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    assert clock_faults(blocks, 3) == textbook_clock_faults(blocks, 3) == 14


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.integers(-(1 << 70), 12), max_size=120), frames=st.integers(1, 8))
def test_clock_in_replay_faults_as_a_ring_of_frames(blocks: list[int], frames: int) -> None:
    assert clock_faults(blocks, frames) == textbook_clock_faults(blocks, frames)
