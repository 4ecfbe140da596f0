"""The benchmarks' percentiles: numpy's, linear interpolation."""

from __future__ import annotations

import argparse

import pytest

from tools import benchlib


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([4.0, 1.0, 3.0, 2.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 25, 1.75),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([10.0, 20.0, 30.0], 90, 28.0),
        ([5.0], 99, 5.0),
    ],
)
def test_percentiles_interpolate_linearly(values: list[float], q: float, expected: float) -> None:
    assert benchlib.percentile(values, q) == pytest.approx(expected)


def test_no_values_have_no_percentile() -> None:
    with pytest.raises(ValueError, match="no values"):
        benchlib.percentile([], 50)


def test_rounds_are_whole_numbers_of_at_least_one() -> None:
    assert benchlib.positive_int("4") == 4
    for bad in ("0", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            benchlib.positive_int(bad)
    with pytest.raises(ValueError):
        benchlib.positive_int("four")
