"""Which blocks of each vLLM KV cache group a hit needs and a group keeps
(``kvtierd.engines.vllm_groups``), and how vLLM's specs become groups or are refused
(``kvtierd.engines.vllm_link.cache_groups``): pure, no engine, no daemon."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtierd.engines.vllm_groups import CacheGroups, KvGroup, runs
from kvtierd.engines.vllm_link import UnsupportedEngineError, cache_groups, namespace_name
from kvtierd.protocol.messages import Layout

B = 128


def layout(layers: int = 3) -> Layout:
    return Layout(
        model_id="m", layers=layers, kv_heads=1, head_dim=256, dtype="bfloat16", block_tokens=B
    )


FULL = KvGroup(0, ("l5", "l11", "l17"), layout())
WINDOW = KvGroup(1, ("l0", "l6", "l12"), layout(), window_tokens=512)
GEMMA = CacheGroups((FULL, WINDOW), B)


def store(held: dict[int, set[int]]) -> Any:
    """A LOOKUP over ``held`` (group -> blocks kvtierd holds): leading blocks held."""
    asked: list[tuple[int, int, int]] = []

    def stored(group: KvGroup, start: int, stop: int) -> int:
        asked.append((group.index, start, stop))
        n = 0
        while start + n < stop and start + n in held[group.index]:
            n += 1
        return n

    stored.asked = asked  # type: ignore[attr-defined]
    return stored


# -- the window's arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("computed", "first"),
    [(0, 0), (511, 0), (512, 0), (639, 1), (1408, 7), (1535, 8), (1536, 8), (1663, 9)],
)
def test_a_window_group_needs_the_blocks_vllm_does_not_skip(computed: int, first: int) -> None:
    # vLLM's SlidingWindowManager.get_num_skipped_tokens: max(0, c - window + 1), whole blocks
    assert WINDOW.first_needed(computed) == first
    assert FULL.first_needed(computed) == 0


def test_tokens_vllm_retains_below_the_window_are_needed_too() -> None:
    mtp = KvGroup(1, ("l0", "l6", "l12"), layout(), window_tokens=512, retained_tokens=128)
    assert mtp.first_needed(1408) == 6  # (1408 - 511 - 128) // 128


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize(("window", "block"), [(512, 128), (4096, 128), (1024, 16), (129, 128)])
def test_a_hit_needs_as_many_window_blocks_as_vllms_own_hit(window: int, block: int) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    group = KvGroup(0, ("a",), _layout(block), window)
    cache = CacheGroups((group,), block)
    want = SlidingWindowManager._contiguous_blocks_for_hit(window, block, False)
    for hit in range(want, want + 40):
        assert len(cache.needed(group, hit, prompt_tokens=hit * block + 1)) == want


def _layout(block: int) -> Layout:
    return Layout(
        model_id="m", layers=1, kv_heads=1, head_dim=8, dtype="bfloat16", block_tokens=block
    )


def test_a_hit_of_the_whole_prompt_needs_the_window_of_its_last_token() -> None:
    # 12 whole blocks loaded: vLLM computes token 1,535 again, which reads from 1,024.
    assert GEMMA.needed(WINDOW, 12, prompt_tokens=1536) == range(8, 12)
    assert GEMMA.needed(FULL, 12, prompt_tokens=1536) == range(12)
    assert GEMMA.needed(WINDOW, 3, prompt_tokens=1536) == range(0, 3)  # all inside the window


# -- the longest hit ---------------------------------------------------------------------------


def test_a_hit_is_as_long_as_the_full_groups_prefix_when_every_window_is_there() -> None:
    stored = store({0: set(range(11)), 1: set(range(7, 11))})
    assert GEMMA.longest_hit(11, 0, 1500, stored) == 11
    assert (1, 7, 11) in stored.asked  # only the window is looked up


def test_a_missing_window_block_shortens_the_hit_to_before_it() -> None:
    # The window group lacks block 9: no hit can end after it; the hit of 9 blocks needs 5..8.
    stored = store({0: set(range(11)), 1: {5, 6, 7, 8, 10}})
    assert GEMMA.longest_hit(11, 0, 1500, stored) == 9
    stored = store({0: set(range(11)), 1: {7, 8, 10}})  # and 5..8 are not all there
    assert GEMMA.longest_hit(11, 0, 1500, stored) == 0


def test_the_full_group_bounds_the_hit_and_the_window_follows_it() -> None:
    stored = store({0: set(range(6)), 1: set(range(11))})
    assert GEMMA.longest_hit(11, 0, 1500, stored) == 6
    assert (1, 2, 6) in stored.asked


def test_blocks_vllm_holds_itself_are_never_looked_up() -> None:
    stored = store({0: {9, 10}, 1: {9, 10}})  # vLLM holds 9 blocks, the window's 5..8 too
    assert GEMMA.longest_hit(11, 9, 1500, stored) == 11
    assert all(start >= 9 for _, start, _ in stored.asked)
    assert GEMMA.longest_hit(11, 9, 1500, store({0: set(), 1: set()})) == 9


def test_one_group_is_a_plain_prefix() -> None:
    one = CacheGroups((FULL,), B)
    assert one.longest_hit(8, 2, 1100, store({0: set(range(5))})) == 5


# -- what a group keeps ------------------------------------------------------------------------


def test_a_full_group_keeps_every_block_and_a_window_group_its_hits_windows() -> None:
    assert GEMMA.kept(FULL, 1500) == range(11)
    assert GEMMA.kept(WINDOW, 1500) == frozenset(range(7, 11))  # the 11-block hit's window
    # whole blocks: the default hit (11) and the whole-prompt or continuing hit (12)
    assert GEMMA.kept(WINDOW, 1536) == frozenset(range(7, 12))
    assert GEMMA.kept(WINDOW, 300) == frozenset({0, 1})


def test_vllms_retention_interval_adds_windows_and_none_keeps_all() -> None:
    periodic = CacheGroups(GEMMA.groups, B, retention_tokens=1024)
    assert periodic.kept(WINDOW, 2200) == frozenset({4, 5, 6, 7, 12, 13, 14, 15, 16})
    dense = CacheGroups(GEMMA.groups, B, retention_tokens=None)
    assert dense.kept(WINDOW, 1500) == range(11)


def test_runs_cut_blocks_into_consecutive_stretches() -> None:
    assert list(runs([])) == []
    assert list(runs([3])) == [range(3, 4)]
    assert list(runs([0, 1, 2, 5, 6, 9])) == [range(0, 3), range(5, 7), range(9, 10)]


# -- names and checks --------------------------------------------------------------------------


def test_each_group_has_a_namespace_of_its_own() -> None:
    names = {namespace_name(g.layout, 1, "cpu", g) for g in GEMMA.groups}
    assert len(names) == 2
    assert namespace_name(WINDOW.layout, 1, "cpu", WINDOW).startswith("vllm/m/bfloat16/128t/tp1/")
    assert "/g1-sw512-" in namespace_name(WINDOW.layout, 1, "cpu", WINDOW)
    # another window, other layers, another index: another name
    other = [
        KvGroup(1, WINDOW.layer_names, layout(), window_tokens=1024),
        KvGroup(1, ("l1", "l7", "l13"), layout(), window_tokens=512),
        KvGroup(2, WINDOW.layer_names, layout(), window_tokens=512),
    ]
    assert len({g.tag() for g in [WINDOW, *other]}) == 4
    # one plain full-attention group keeps the name it always had
    assert namespace_name(FULL.layout, 1, "cpu") == "vllm/m/bfloat16/128t/tp1/cpu"


def test_groups_are_checked() -> None:
    with pytest.raises(ValueError, match="2 layers for a layout of 3"):
        KvGroup(0, ("a", "b"), layout())
    with pytest.raises(ValueError, match="numbered"):
        CacheGroups((WINDOW,), B)
    with pytest.raises(ValueError, match="not whole blocks"):
        CacheGroups(GEMMA.groups, B, retention_tokens=100)


# -- vLLM's specs ------------------------------------------------------------------------------


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


class MLAAttentionSpec(SimpleNamespace):
    pass


def spec(cls: type = FullAttentionSpec, **changes: Any) -> Any:
    fields: dict[str, Any] = {
        "block_size": B,
        "num_kv_heads": 1,
        "head_size": 256,
        "head_size_v": 256,
        "dtype": torch.bfloat16,
        "kv_quant_mode": SimpleNamespace(name="NONE"),
        "sliding_window": None,
    }
    return cls(**{**fields, **changes})


def config(*specs: Any, retention: int | None = 0) -> tuple[Any, Any]:
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(use_mla=False, model="/m", revision=None, quantization=None),
        parallel_config=SimpleNamespace(),
        cache_config=SimpleNamespace(prefix_cache_retention_interval=retention),
    )
    groups = [
        SimpleNamespace(kv_cache_spec=s, layer_names=[f"g{i}.l{j}" for j in range(3)])
        for i, s in enumerate(specs)
    ]
    return vllm_config, SimpleNamespace(kv_cache_groups=groups)


def test_full_and_sliding_window_groups_are_read_from_vllms_specs() -> None:
    cache = cache_groups(
        *config(spec(SlidingWindowSpec, sliding_window=512, extra_retained_tokens=0), spec()),
        None,
    )
    window, full = cache.groups
    assert (window.window_tokens, full.window_tokens) == (512, None)
    assert window.layout == Layout(
        model_id="/m", layers=3, kv_heads=1, head_dim=256, dtype="bfloat16", block_tokens=B
    )
    assert full.layer_names == ("g1.l0", "g1.l1", "g1.l2")
    assert cache.retention_tokens == 0
    # vLLM without its hybrid manager: one full group whose spec names a window
    (one,) = cache_groups(*config(spec(sliding_window=512)), "m").groups
    assert not one.windowed


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ((spec(), spec(MambaSpec)), "group 1 is MambaSpec; only FullAttentionSpec and"),
        ((spec(MLAAttentionSpec),), "group 0 is MLAAttentionSpec"),
        ((spec(kv_quant_mode=SimpleNamespace(name="FP8")),), "quantised KV"),
        ((spec(head_size_v=128),), "K and V head sizes differ"),
        ((spec(dtype=torch.int8),), "no kvtierd dtype"),
        ((spec(), spec(SlidingWindowSpec, sliding_window=512, block_size=64)), "block sizes"),
        ((), "no KV cache group"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_spec(specs: Any, match: str) -> None:
    with pytest.raises(UnsupportedEngineError, match=match):
        cache_groups(*config(*specs), None)


def test_a_retention_interval_of_partial_blocks_is_refused() -> None:
    with pytest.raises(UnsupportedEngineError, match="prefix_cache_retention_interval 100"):
        cache_groups(*config(spec(), retention=100), None)
