"""Helpers for replay tests: hand-made traces and the real trace's first requests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtierd.replay import TraceRequest, read_mooncake

TRACE = (
    Path(__file__).resolve().parents[2]
    / "../shared/data/traces/mooncake_fast25_synthetic_trace.jsonl"
)


def one_block_requests(blocks: Sequence[int]) -> list[TraceRequest]:
    """One request per block, 1 ms apart: classic page-reference strings."""
    return [TraceRequest(float(i), 512, 1, (b,)) for i, b in enumerate(blocks)]


@pytest.fixture(scope="session")
def trace_slice() -> list[TraceRequest]:
    """The first 400 requests of the Mooncake synthetic trace."""
    if not TRACE.exists():
        pytest.skip(f"shared data missing: {TRACE} (see ../shared/data/README.md)")
    return read_mooncake(TRACE)[:400]
