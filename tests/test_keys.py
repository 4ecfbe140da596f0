"""Prefix-chained keys: equal keys exactly when the salted prefixes are equal."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.keys import KEY_BYTES, chain_keys, validate_key

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)


@given(tokens, tokens)
def test_keys_are_equal_exactly_for_equal_prefixes(a: list[int], b: list[int]) -> None:
    ka, kb = chain_keys(a, 4), chain_keys(b, 4)
    for i, (x, y) in enumerate(zip(ka, kb, strict=False)):
        assert (x == y) == (a[: 4 * (i + 1)] == b[: 4 * (i + 1)])


@given(tokens)
def test_only_full_blocks_get_keys_of_16_bytes(a: list[int]) -> None:
    keys = chain_keys(a, 4)
    assert len(keys) == len(a) // 4
    assert all(len(k) == KEY_BYTES for k in keys)


def test_salt_separates_namespaces() -> None:
    assert chain_keys(range(8), 4, b"a") != chain_keys(range(8), 4, b"b")


def test_numpy_and_list_inputs_agree() -> None:
    assert chain_keys(np.arange(32, dtype=np.int64), 8) == chain_keys(list(range(32)), 8)


@pytest.mark.parametrize(("tokens", "block"), [([1, 2], 0), ([-1, 2], 1), ([2**32], 1)])
def test_invalid_input_is_refused(tokens: list[int], block: int) -> None:
    with pytest.raises(ValueError):
        chain_keys(tokens, block)


def test_validate_key_bounds() -> None:
    assert validate_key(b"x" * 32) == b"x" * 32
    for bad in (b"", b"x" * 33):
        with pytest.raises(ValueError):
            validate_key(bad)
