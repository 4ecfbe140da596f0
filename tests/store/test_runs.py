"""plan_runs (which promotions of a READ share one request) against a plain model, and the
staging pages a run's header pages come from."""

from __future__ import annotations

import itertools

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.store.records import PAGE_BYTES
from kvtierd.store.runs import plan_runs
from kvtierd.store.staging import StagingPages

#: (offset, size) extents; an extent follows another when it starts where that one ends.
extents = st.lists(
    st.tuples(st.integers(0, 64), st.integers(1, 8)).map(lambda t: (t[0] * 8, t[1])), max_size=40
)


def follows(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] + a[1] == b[0]


@given(extents, st.integers(1, 40), st.integers(1, 6))
def test_runs_keep_order_and_join_only_following_items_within_bounds(
    items: list[tuple[int, int]], max_bytes: int, max_items: int
) -> None:
    runs = plan_runs(items, follows, lambda e: e[1], max_bytes=max_bytes, max_items=max_items)
    assert [item for run in runs for item in run] == items
    for run in runs:
        assert len(run) == 1 or (
            len(run) <= max_items
            and sum(e[1] for e in run) <= max_bytes
            and all(follows(a, b) for a, b in itertools.pairwise(run))
        )
    for before, after in itertools.pairwise(runs):  # each cut had a reason
        joined = [*before, after[0]]
        assert (
            not follows(before[-1], after[0])
            or len(joined) > max_items
            or sum(e[1] for e in joined) > max_bytes
        )


def test_a_sequence_in_order_is_cut_by_the_bounds() -> None:
    items = [(i * 4, 4) for i in range(10)]
    runs = plan_runs(items, follows, lambda e: e[1], max_bytes=12, max_items=16)
    assert [len(run) for run in runs] == [3, 3, 3, 1]
    runs = plan_runs(items, follows, lambda e: e[1], max_bytes=100, max_items=4)
    assert [len(run) for run in runs] == [4, 4, 2]
    assert plan_runs(items[::-1], follows, lambda e: e[1], max_bytes=100, max_items=4) == [
        [item] for item in items[::-1]
    ]


def test_bounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_runs([], follows, lambda e: e[1], max_bytes=0, max_items=1)
    with pytest.raises(ValueError):
        plan_runs([], follows, lambda e: e[1], max_bytes=1, max_items=0)


@pytest.mark.anyio
async def test_several_pages_at_once_never_deadlock_with_single_pages() -> None:
    """Callers taking several pages and callers taking one, all at once, on few pages: every
    one gets distinct pages (what each writes stays its own while it holds them), and all
    pages come back."""
    pages = StagingPages(memoryview(bytearray(4 * PAGE_BYTES)), 4)

    async def take(caller: int, n: int) -> None:
        if n == 1:
            async with pages.page() as page:
                got = [page]
                page[:8] = caller.to_bytes(8, "little")
                await anyio.lowlevel.checkpoint()
        else:
            async with pages.pages(n) as got:
                assert len(got) == n
                for page in got:
                    page[:8] = caller.to_bytes(8, "little")
                await anyio.lowlevel.checkpoint()
                assert all(int.from_bytes(page[:8], "little") == caller for page in got)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for caller, n in enumerate([3, 1, 4, 2, 1, 3, 4, 1, 2, 1]):
                tg.start_soon(take, caller, n)
    async with pages.pages(4) as every:
        assert len(every) == 4
    with pytest.raises(ValueError):
        async with pages.pages(5):
            pass
