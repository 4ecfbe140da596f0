"""Mooncake parsing and the causal arrival feed."""

from __future__ import annotations

import pytest

from kvtierd.replay import (
    ArrivalFeed,
    CausalityError,
    PolicyName,
    TraceFormatError,
    TraceRequest,
    capacity_in_blocks,
    distinct_blocks,
    parse_mooncake,
    registry,
    simulate,
)


def test_parse_sorts_by_timestamp_stably() -> None:
    lines = [
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}',
        "",
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [3]}',
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [4]}',
    ]
    requests = parse_mooncake(lines)
    assert [r.hash_ids for r in requests] == [(3,), (1, 2), (4,)]
    assert requests[1].arrival_s == 0.005
    assert distinct_blocks(requests) == 4


def test_parse_names_the_bad_line() -> None:
    lines = ['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "{oops"]
    with pytest.raises(TraceFormatError, match="line 2"):
        parse_mooncake(lines)


def test_capacity_fraction_or_blocks() -> None:
    requests = [TraceRequest(0.0, 1, 1, tuple(range(200)))]
    assert capacity_in_blocks(0.10, requests) == 20
    assert capacity_in_blocks(0.001, requests) == 1
    assert capacity_in_blocks(37, requests) == 37
    with pytest.raises(ValueError, match="whole number"):
        capacity_in_blocks(2.5, requests)
    with pytest.raises(ValueError, match="positive"):
        capacity_in_blocks(0, requests)


def _requests() -> list[TraceRequest]:
    return [TraceRequest(float(t), 1, 1, (t,)) for t in (0, 10, 10, 20)]


def test_feed_releases_only_arrived_requests() -> None:
    feed = ArrivalFeed(_requests())
    assert [i for i, _ in feed.advance(9.0)] == [0]
    assert [i for i, _ in feed.advance(10.0)] == [1, 2]
    assert feed.advance(15.0) == []
    with pytest.raises(CausalityError, match="clock moved back"):
        feed.advance(14.0)


def test_feed_refuses_a_request_before_its_timestamp() -> None:
    requests = _requests()
    feed = ArrivalFeed(requests)
    feed.advance(10.0)
    feed.check_visible(requests[2])
    with pytest.raises(CausalityError, match="20"):
        feed.check_visible(requests[3])


def test_feed_refuses_a_trace_that_goes_back_in_time() -> None:
    requests = _requests()
    with pytest.raises(CausalityError, match="back in time"):
        ArrivalFeed([requests[1], requests[0]])


def test_arrivals_advance_the_clock_to_each_request() -> None:
    feed = ArrivalFeed(_requests())
    clocks = []
    for _, request in feed.arrivals():
        feed.check_visible(request)
        clocks.append(feed.now_ms)
    assert clocks == [0.0, 10.0, 10.0, 20.0]


@pytest.mark.parametrize("name", [p for p in PolicyName if not p.offline])
def test_online_policies_are_not_given_the_trace(
    name: PolicyName, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[object] = []
    real = registry.make_policy

    def spy(policy: PolicyName, capacity: int, requests: object = ()) -> object:
        seen.append(requests)
        return real(policy, capacity)

    monkeypatch.setattr(registry, "make_policy", spy)
    simulate(_requests(), name, 2)
    assert seen == [()]


def test_belady_is_given_the_trace_and_labelled_offline() -> None:
    result = simulate(_requests(), PolicyName.BELADY, 2)
    assert result.offline
    assert not simulate(_requests(), PolicyName.SLSAP, 2).offline
