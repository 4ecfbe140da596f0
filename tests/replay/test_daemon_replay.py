"""The daemon mode of trace replay, against real daemons, on a slice of the real trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.replay import TraceRequest, capacity_in_blocks, read_mooncake
from kvtierd.replay.daemon import DaemonReplay

TRACE = (
    Path(__file__).resolve().parents[2].parent
    / "shared/data/traces/mooncake_fast25_synthetic_trace.jsonl"
)


@pytest.fixture(scope="module")
def requests() -> list[TraceRequest]:
    if not TRACE.exists():
        pytest.skip(f"the Mooncake trace is not at {TRACE} (see ../shared/data/README.md)")
    return read_mooncake(TRACE)[:60]


def test_both_modes_read_the_same_blocks_and_off_never_prefetches(
    tmp_path: Path, requests: list[TraceRequest]
) -> None:
    capacity = capacity_in_blocks(0.10, requests)
    results = {
        prefetch: DaemonReplay(
            tmp_path / str(prefetch), capacity_blocks=capacity, speed=50.0, prefetch=prefetch
        ).replay(requests)
        for prefetch in (False, True)
    }
    off, on = results[False], results[True]
    assert off.requests == on.requests == len(requests)
    # The NVMe tier holds every stored block, so both runs find the same hits.
    assert off.blocks_read == on.blocks_read > 0
    assert 0.0 <= off.dram_fraction_at_read <= 1.0
    assert 0.0 <= on.dram_fraction_at_read <= 1.0
    assert off.daemon["prefetch_promoted"] == 0  # prefetch off really is off
    assert on.daemon["prefetch_used"] <= on.daemon["prefetch_promoted"]
