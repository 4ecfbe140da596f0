"""Which prefixes a hybrid model's pools allow (``kvtierd.engines.sglang_hits``, pure): checked
against the loops of SGLang 0.5.23's own file backend (``HiCacheFile.batch_exists_v2``),
rewritten here as the definition, on every pattern hypothesis draws."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.engines.sglang_hits import (
    ALL_PAGES,
    TRAILING_PAGES,
    PoolHits,
    hit_policy,
    pool_hits,
    usable_prefix,
)


def reference(policy: str, present: list[bool], window: int) -> PoolHits:
    """``HiCacheFile.batch_exists_v2``'s loop for one pool, as SGLang wrote it."""
    kv_pages = len(present)
    if policy == ALL_PAGES:
        boundary = next((i for i in range(kv_pages) if not present[i]), kv_pages)
        return PoolHits(boundary, frozenset(range(1, boundary + 1)))
    trailing = max(1, window)
    restorable = {
        p for p in range(1, kv_pages + 1) if all(present[i] for i in range(max(0, p - trailing), p))
    }
    return PoolHits(max(restorable, default=0), frozenset(restorable))


@given(
    policy=st.sampled_from([ALL_PAGES, TRAILING_PAGES]),
    present=st.lists(st.booleans(), max_size=64),
    window=st.integers(0, 9),
)
def test_a_pool_allows_what_sglangs_own_backend_allows(
    policy: str, present: list[bool], window: int
) -> None:
    assert pool_hits(policy, present, window) == reference(policy, present, window)


@given(
    kv_pages=st.integers(0, 32),
    pools=st.lists(
        st.tuples(st.sampled_from([ALL_PAGES, TRAILING_PAGES]), st.integers(1, 4)), max_size=3
    ),
    data=st.data(),
)
def test_the_usable_prefix_is_the_largest_length_every_pool_allows(
    kv_pages: int, pools: list[tuple[str, int]], data: st.DataObject
) -> None:
    verdicts = [
        pool_hits(
            policy, data.draw(st.lists(st.booleans(), min_size=kv_pages, max_size=kv_pages)), w
        )
        for policy, w in pools
    ]
    final, restorable = usable_prefix(kv_pages, verdicts)
    allowed = [p for p in range(1, kv_pages + 1) if all(p in v.restorable for v in verdicts)]
    assert restorable == allowed
    assert final == (allowed[-1] if allowed else 0)


def test_a_trailing_window_allows_the_ends_of_stored_spans_only() -> None:
    # a Mamba state (window 1) stored at the ends of two spans, pages 4 and 8
    present = [False, False, False, True, False, False, False, True]
    assert pool_hits(TRAILING_PAGES, present, 1) == PoolHits(8, frozenset({4, 8}))
    # a sliding window of 2 pages: only where both pages before the end are stored
    present = [False, False, True, True, False, True, True, True]
    assert pool_hits(TRAILING_PAGES, present, 2) == PoolHits(8, frozenset({4, 7, 8}))
    assert usable_prefix(6, [pool_hits(TRAILING_PAGES, present[:6], 2)]) == (4, [4])


def test_policies_other_than_sglangs_two_are_refused_by_name() -> None:
    assert hit_policy("all_pages") == ALL_PAGES
    with pytest.raises(ValueError, match="not 'block_groups'"):
        hit_policy("block_groups")
    with pytest.raises(ValueError, match="not 'block_groups'"):
        pool_hits("block_groups", [True], 1)
