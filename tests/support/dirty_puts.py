"""A burst of puts into a DRAM full of dirty blocks, played against a DRAM policy.

Each put needs a victim; only the block write-back just cleaned is evictable, and a new dirty
block comes in. The store refuses dirty blocks (and holds them in the policy): a policy must not
ask about (or re-rank) every resident for each put. Shared by the SLSAP and LRU policies' tests.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtierd.policy import CachePolicy


def questions_asked(policy: CachePolicy, residents: int = 4096, puts: int = 2000) -> int:
    """How many times ``policy`` asked whether a block is evictable over ``puts`` puts among
    ``residents`` held blocks (each put's victim checked to be the block just released)."""
    dirty: set[Hashable] = set()
    for i in range(residents):
        policy.inserted(i, 0.0)
        policy.hold(i)
        dirty.add(i)
    asked = 0

    def evictable(block: Hashable) -> bool:
        nonlocal asked
        asked += 1
        return block not in dirty

    assert policy.victims(16, evictable) == []
    for i in range(puts):
        dirty.discard(i)  # write-back cleaned the oldest
        policy.release(i)
        chosen = policy.victims(16, evictable) or policy.victims(1, evictable)
        assert chosen == [i]
        policy.removed(i)
        policy.inserted(residents + i, 0.0)
        policy.hold(residents + i)
        dirty.add(residents + i)
    assert len(policy) == residents
    return asked
