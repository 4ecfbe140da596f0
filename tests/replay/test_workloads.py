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
        """Share of requests that extend an earlier request's whole chain."""
        requests = workload_trace(kind, 2000, seed=1)
        seen: set[int] = set()
        extended = 0
        for request in requests:
            extended += len(request.hash_ids) > 1 and request.hash_ids[-2] in seen
            seen.update(request.hash_ids)
        return extended / len(requests)

    assert continued("rag") < continued("conversation") < continued("agent")


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        workload_trace("batch")
    with pytest.raises(ValueError, match="requests"):
        workload_trace("rag", 0)
