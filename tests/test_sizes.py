"""Sizes as the configuration writes them (read by ``humanfriendly``, binary units whatever the
spelling)."""

from __future__ import annotations

import pytest

from kvtierd.config import parse_size, show_size


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        (" 7 ", 7),
        ("4GB", 4 << 30),  # binary: not 4 x 10^9
        ("4 MB", 4 << 20),
        ("10kb", 10 << 10),
        ("1.5 MiB", 3 << 19),
        ("2T", 2 << 40),
        ("1P", 1 << 50),
        ("0.5K", 512),
    ],
)
def test_every_unit_is_binary(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["4 gravy", "4 megs", "1e3", "4 G B", "0x10", "4i", "4 E"])
def test_what_humanfriendly_would_guess_at_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("nbytes", "shown"),
    [(0, "0"), (1000, "1000"), (1 << 10, "1K"), (3 << 10, "3K"), (1 << 20, "1M"),
     (1536 << 10, "1.5M"), (5000, "5000"), (64 << 20, "64M"), (1 << 50, "1P")],
)  # fmt: skip
def test_a_size_is_shown_as_it_would_be_written(nbytes: int, shown: str) -> None:
    assert show_size(nbytes) == shown


@pytest.mark.parametrize("nbytes", [*range(0, 70_000, 997), 1 << 60, (1 << 30) + 1, 12345 << 20])
def test_a_shown_size_reads_back_exactly(nbytes: int) -> None:
    assert parse_size(show_size(nbytes)) == nbytes
