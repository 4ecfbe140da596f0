"""The statistics records: built from the counter dicts by field name, summed field by field."""

from __future__ import annotations

import pytest

from kvtierd.store.counts import StoreCounts, TrafficCounts, zeroed
from kvtierd.store.regions import COUNTERS


def test_a_record_reads_its_fields_from_a_counter_dict() -> None:
    counters = zeroed(StoreCounts)
    counters["dram_hits"] = 3
    counters["lost"] = 2
    record = StoreCounts.of(counters)
    assert (record.dram_hits, record.lost, record.misses) == (3, 2, 0)
    assert TrafficCounts.of(counters).dram_hits == 3  # a wider dict serves a narrower record


def test_a_misspelt_counter_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        TrafficCounts.of({"dram_hit": 1})


def test_tenant_records_sum_field_by_field() -> None:
    a, b = TrafficCounts(dram_hits=1, bytes_read=10), TrafficCounts(dram_hits=2, misses=5)
    assert a + b == TrafficCounts(dram_hits=3, misses=5, bytes_read=10)
    assert sum((a, b), TrafficCounts()) == a + b
    assert StoreCounts(lost=1) + StoreCounts(lost=2) == StoreCounts(lost=3)


def test_records_of_different_kinds_do_not_add() -> None:
    with pytest.raises(TypeError):
        _ = StoreCounts() + TrafficCounts()


def test_the_per_region_counters_are_the_traffic_record() -> None:
    assert tuple(zeroed(TrafficCounts)) == COUNTERS
