"""The workload-model traces (``kvtierd.replay.workloads``): deterministic, causal, and with
Mooncake's id rule (an id stands for a block and everything before it)."""

from __future__ import annotations

import pytest

from kvtierd.replay import ArrivalFeed, distinct_blocks
from kvtierd.replay.workloads import KINDS, workload_trace


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_workload_trace_follows_the_mooncake_rules(kind: str) -> None:
    requests = workload_trace(kind, 500, seed=3)
    assert requests == workload_trace(kind, 500, seed=3)
    assert requests != workload_trace(kind, 500, seed=4)
    ArrivalFeed(requests)  # refuses a trace that goes back in time
    parent: dict[int, int] = {}
    for request in requests:
        assert request.input_length == 512 * len(request.hash_ids)
        for before, block in zip((-1, *request.hash_ids), request.hash_ids, strict=False):
            # one parent per id: equal ids are equal prefixes
            assert parent.setdefault(block, before) == before
    assert distinct_blocks(requests) == len(parent)


def test_the_mixes_differ_as_documented() -> None:
    def continued(kind: str) -> float:
        """Share of requests that extend an earlier request's whole chain (a session's next
        turn: 1-3 new blocks after a chain some request ended with)."""
        requests = workload_trace(kind, 2000, seed=1)
        chain_ends: set[int] = set()
        extended = 0
        for request in requests:
            ids = request.hash_ids
            extended += any(ids[-k - 1] in chain_ends for k in range(1, min(3, len(ids) - 1) + 1))
            chain_ends.add(ids[-1])
        return extended / len(requests)

    for kind, mix in KINDS.items():
        assert continued(kind) == pytest.approx(mix.continue_share, abs=0.05), kind


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        workload_trace("batch")
    with pytest.raises(ValueError, match="requests"):
        workload_trace("rag", 0)
