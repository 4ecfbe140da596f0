"""The vLLM connector's scheduler-side planning (``kvtierd.engines.vllm_plan``): pure, so it is
tested without vLLM or a daemon."""

from __future__ import annotations

import pytest

from kvtierd.engines.vllm_groups import CacheGroups, KvGroup
from kvtierd.engines.vllm_plan import (
    BlockRun,
    ConnectorSettings,
    Promotion,
    RequestPlan,
    loadable_blocks,
)
from kvtierd.protocol.messages import Layout

KEYS = tuple(bytes([i]) * 16 for i in range(8))
LAYOUT = Layout(model_id="m", layers=2, kv_heads=1, head_dim=4, dtype="bfloat16", block_tokens=128)
ONE = CacheGroups((KvGroup(0, ("a", "b"), LAYOUT),), 128)
#: Gemma 3's shape: a group of full attention and one of a 512-token window (4 blocks of 128).
TWO = CacheGroups(
    (KvGroup(0, ("a", "b"), LAYOUT), KvGroup(1, ("c", "d"), LAYOUT, window_tokens=512)), 128
)
NULL = 0


def plan_of(prompt_tokens: int = 1100, cache: CacheGroups = ONE, keys: int = 8) -> RequestPlan:
    per_group = tuple(
        tuple(bytes([g, i]) * 8 for i in range(keys)) for g in range(len(cache.groups))
    )
    if cache is ONE:
        per_group = (KEYS[:keys],)
    return RequestPlan("r", prompt_tokens, per_group, cache, null_block=NULL)


def test_the_last_prompt_token_is_never_loaded() -> None:
    assert loadable_blocks(1024, 128) == 7  # 1024 tokens: block 8 holds the last token
    assert loadable_blocks(1025, 128) == 8
    assert loadable_blocks(128, 128) == 0
    assert loadable_blocks(0, 128) == 0


def test_a_lookup_promises_the_stored_blocks_past_the_local_ones_once() -> None:
    plan = plan_of()
    assert plan.promise(local_blocks=2, stored=6) == 4
    plan.allocated([list(range(10, 19))], promised_tokens=4 * 128, block_tokens=128)
    assert plan.take_load() == [BlockRun("r", 2, KEYS[2:6], (12, 13, 14, 15))]
    assert plan.take_load() == []


def test_vllm_taking_fewer_tokens_shrinks_the_load() -> None:
    plan = plan_of()
    plan.promise(local_blocks=0, stored=5)
    plan.allocated([list(range(9))], promised_tokens=0, block_tokens=128)
    assert plan.take_load() == []


def test_saves_start_after_what_kvtierd_holds_and_cover_each_block_once() -> None:
    plan = plan_of()
    plan.promise(local_blocks=3, stored=2)  # vLLM has 3 itself, kvtierd only 2: save from 2
    plan.allocated([list(range(100, 109))], promised_tokens=0, block_tokens=128)
    first = plan.take_save(computed_tokens=600, block_tokens=128)
    assert first == [BlockRun("r", 2, KEYS[2:4], (102, 103))]
    assert plan.take_save(computed_tokens=600, block_tokens=128) == []
    rest = plan.take_save(computed_tokens=1100 + 50, block_tokens=128)  # decoding past it
    assert rest == [BlockRun("r", 4, KEYS[4:8], (104, 105, 106, 107))]


def test_a_run_needs_one_block_id_per_key() -> None:
    with pytest.raises(ValueError, match="2 keys for 1 block ids"):
        BlockRun("r", 0, KEYS[:2], (1,))


def test_a_load_past_the_allocated_blocks_is_refused() -> None:
    plan = plan_of()
    plan.promise(local_blocks=0, stored=4)
    plan.allocated([[1, 2]], promised_tokens=4 * 128, block_tokens=128)
    with pytest.raises(ValueError, match="allocated"):
        plan.take_load()


def test_promotion_asks_again_while_dram_fills_then_gives_up() -> None:
    promotion = Promotion(first_asked=0.0, max_wait_s=2.0, stall_s=0.5)
    assert promotion.ask_again(resident=0, now=0.0)
    assert promotion.ask_again(resident=3, now=0.4)
    assert promotion.ask_again(resident=3, now=0.8)  # grew 0.4 s ago
    assert not promotion.ask_again(resident=3, now=1.0)  # stalled: DRAM is full
    growing = Promotion(first_asked=0.0, max_wait_s=2.0, stall_s=0.5)
    for step in range(20):
        if not growing.ask_again(resident=step, now=step * 0.15):
            break
    assert step * 0.15 >= 2.0  # gave up at max_wait_s although still growing


def test_connector_settings_take_the_documented_keys() -> None:
    settings = ConnectorSettings.from_extra(
        {"socket": "/run/k.sock", "tenant": "t", "model_id": "m", "wait_for_promotion_s": 0.5}
    )
    assert settings == ConnectorSettings("/run/k.sock", "t", "m", None, 0.5, 30.0, False)
    assert ConnectorSettings.from_extra({}) == ConnectorSettings()
    # whole_prompt is opt-in: by default a restore is bitwise vLLM's own prefix hit
    assert ConnectorSettings.from_extra({"whole_prompt": True}).whole_prompt


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"sockett": "/x"}, r"unknown kvtierd connector option\(s\) \['sockett'\]"),
        ({"socket": ""}, "'socket' must be a non-empty string"),
        ({"tenant": 7}, "'tenant' must be a non-empty string"),
        ({"wait_for_promotion_s": -1}, "within 0..600"),
        ({"timeout_s": 0}, "timeout_s must be seconds within 0.1..600"),
        ({"whole_prompt": "yes"}, "whole_prompt must be true or false"),
        ({"wait_for_promotion_s": "2"}, "within 0..600, got '2'"),
        ({"wait_for_promotion_s": True}, "within 0..600"),
    ],
)
def test_bad_connector_settings_are_refused_with_the_reason(
    extra: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ConnectorSettings.from_extra(extra)


def test_a_request_asked_again_after_preemption_loads_again() -> None:
    plan = plan_of()
    plan.promise(local_blocks=0, stored=6)
    plan.allocated([list(range(9))], promised_tokens=6 * 128, block_tokens=128)
    assert plan.take_load()
    # Preempted: its blocks are freed; on resume vLLM asks again and allocates anew.
    assert plan.promise(local_blocks=0, stored=6) == 6
    plan.allocated([list(range(20, 29))], promised_tokens=6 * 128, block_tokens=128)
    (again,) = plan.take_load()
    assert again.block_ids == (20, 21, 22, 23, 24, 25)


# -- several KV cache groups -----------------------------------------------------------------


def test_a_window_group_loads_only_the_blocks_its_window_needs() -> None:
    # 1,500 tokens: an 11-block hit; the next token (1,408) reads tokens 897.. of the window,
    # so blocks 7..10 of the window group, as vLLM's own hit (4 = ceil(511 / 128)).
    plan = plan_of(1500, TWO, keys=11)
    assert plan.promise(local_blocks=0, stored=11, before_forward=True) == 11
    window_ids = [NULL] * 7 + [107, 108, 109, 110, 111]  # vLLM nulls what the window skips
    plan.allocated([list(range(1, 13)), window_ids], promised_tokens=11 * 128, block_tokens=128)
    full, window = plan.take_load()
    assert (full.group, full.first, full.block_ids) == (0, 0, tuple(range(1, 12)))
    assert (window.group, window.first, window.block_ids) == (1, 7, (107, 108, 109, 110))
    assert window.keys == plan.keys[1][7:11]
    assert full.before_forward
    assert window.before_forward


def test_a_window_group_loads_nothing_vllm_holds_itself() -> None:
    plan = plan_of(1500, TWO, keys=11)
    plan.promise(local_blocks=9, stored=11, before_forward=True)
    plan.allocated(
        [list(range(1, 13)), [NULL] * 7 + [107, 108, 109, 110, 111]], 2 * 128, block_tokens=128
    )
    full, window = plan.take_load()
    assert (full.first, full.block_ids) == (9, (10, 11))
    assert (window.first, window.block_ids) == (9, (109, 110))


def test_a_window_group_saves_the_windows_of_the_prompts_hits_only() -> None:
    # 1,536 tokens (12 whole blocks): the default hit is 11 blocks (window 7..10) and a
    # whole-prompt or continuing hit 12 (its last token, 1,535, reads from 1,024: blocks 8..11).
    plan = plan_of(1536, TWO, keys=12)
    plan.allocated([list(range(1, 13)), list(range(100, 112))], 0, block_tokens=128)
    full, window = plan.take_save(computed_tokens=1536, block_tokens=128)
    assert full.block_ids == tuple(range(1, 13))
    assert (window.group, window.first, window.block_ids) == (1, 7, tuple(range(107, 112)))
    assert window.keys == plan.keys[1][7:12]


def test_a_window_group_never_saves_a_block_vllm_already_dropped() -> None:
    plan = plan_of(1536, TWO, keys=12)
    plan.allocated([list(range(1, 13)), [NULL] * 8 + list(range(108, 112))], 0, block_tokens=128)
    _, window = plan.take_save(computed_tokens=1536, block_tokens=128)
    assert (window.first, window.block_ids) == (8, (108, 109, 110, 111))


def test_retention_checkpoints_save_a_window_every_interval() -> None:
    cache = CacheGroups(TWO.groups, 128, retention_tokens=1024)  # a window every 8 blocks
    plan = plan_of(2200, cache, keys=17)  # hits at 17 blocks (default and whole) and 8, 16
    plan.allocated([list(range(1, 19)), list(range(100, 118))], 0, block_tokens=128)
    saves = plan.take_save(computed_tokens=2200, block_tokens=128)
    windows = [run.block_ids for run in saves if run.group == 1]
    assert windows == [(104, 105, 106, 107), tuple(range(112, 117))]
