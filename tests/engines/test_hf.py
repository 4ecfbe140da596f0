"""The transformers adapter on the real SmolLM2-135M against a real daemon, on a short real text.

Every comparison is between a restored cache and the same cache kept in memory on the same
computation path (prefix, then a forward of the rest): the adapter must add no difference at
all, so logits are compared bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtierd.testing import smollm2

_REASON = smollm2.unavailable_reason()
pytestmark = [
    pytest.mark.model,
    pytest.mark.timeout(300),
    pytest.mark.skipif(_REASON is not None, reason=f"SmolLM2 model stack absent: {_REASON}"),
]

# Charles Dickens, "A Tale of Two Cities" (1859), opening paragraphs: public domain.
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way - in short, the period was so far like "
    "the present period, that some of its noisiest authorities insisted on its being received, "
    "for good or for evil, in the superlative degree of comparison only. There were a king with "
    "a large jaw and a queen with a plain face, on the throne of England; there were a king with "
    "a large jaw and a queen with a fair face, on the throne of France. In both countries it was "
    "clearer than crystal to the lords of the State preserves of loaves and fishes, that things "
    "in general were settled for ever. It was the year of Our Lord one thousand seven hundred "
    "and seventy-five. Spiritual revelations were conceded to England at that favoured period, "
    "as at this. Mrs. Southcott had recently attained her five-and-twentieth blessed birthday, "
    "of whom a prophetic private in the Life Guards had heralded the sublime appearance by "
    "announcing that arrangements were made for the swallowing up of London and Westminster."
)
BLOCK_TOKENS = 16
MODEL_ID = "test/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def loaded() -> smollm2.LoadedModel:
    return smollm2.load_smollm2(smollm2.ModelDType.BFLOAT16)


@pytest.fixture(scope="module")
def prompt(loaded: smollm2.LoadedModel) -> list[int]:
    ids = [int(t) for t in loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]]
    assert len(ids) >= 8 * BLOCK_TOKENS
    return ids[: 8 * BLOCK_TOKENS]  # a multiple of the block size: the last block is whole


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Any]:
    from kvtierd.client import connect
    from kvtierd.testing import DaemonProcess

    # No idle-disk reuse promotions: after an EVICT they would bring blocks back into DRAM
    # within a tick, and the tests name the tier each restore must come from.
    no_reuse = "[dram]\nprefetch_bytes_per_s = 0\n"
    with (
        DaemonProcess(tmp_path / "kvtierd", config_text=no_reuse) as daemon,
        connect(daemon.socket) as client,
    ):
        yield client


@pytest.fixture
def adapter(loaded: smollm2.LoadedModel, client: Any) -> Any:
    from kvtierd.engines.hf import HfKvAdapter

    return HfKvAdapter.open(client, loaded.model, model_id=MODEL_ID, block_tokens=BLOCK_TOKENS)


def _resident(adapter: Any, full_cache: Any, prompt: list[int], tokens: int) -> tuple[Any, Any]:
    """Logits and cache of the prefix ``tokens`` kept in memory, then the rest forwarded."""
    from kvtierd.engines.hf_cache import prefix_cache

    cache = prefix_cache(adapter.model.config, full_cache, tokens)
    return adapter.forward(prompt[tokens:], cache), cache


def _assert_same_cache(a: Any, b: Any) -> None:
    import torch

    assert a.get_seq_length() == b.get_seq_length()
    for x, y in zip(a.layers, b.layers, strict=True):
        assert torch.equal(x.keys, y.keys)
        assert torch.equal(x.values, y.values)


@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_restored_logits_equal_resident(adapter: Any, prompt: list[int], tier: str) -> None:
    import torch

    from kvtierd.testing.hf_fidelity import compare, greedy_continue

    first = adapter.prefill(prompt)
    assert first.cached_tokens == 0
    assert first.stored_blocks == len(prompt) // BLOCK_TOKENS
    if tier == "nvme":
        adapter.namespace.client.fsync()
        adapter.namespace.client.evict()
    restored = adapter.prefill(prompt, store=False)
    # Every block is cached; the last token is still forwarded for its logits.
    assert restored.cached_tokens == len(prompt) - 1
    assert restored.computed_tokens == 1
    assert restored.blocks_by_tier == {tier: len(prompt) // BLOCK_TOKENS}
    logits, cache = _resident(adapter, first.cache, prompt, len(prompt) - 1)
    assert restored.logits.dtype == torch.bfloat16  # the model's dtype, never cast
    assert torch.equal(restored.logits, logits)
    _assert_same_cache(restored.cache, cache)
    # And the continuation: restored (teacher-forced) against resident, bit for bit.
    resident = greedy_continue(adapter.model, cache, logits, 4)
    replay = greedy_continue(
        adapter.model, restored.cache, restored.logits, 4, forced=resident.tokens
    )
    report = compare(resident, replay)
    assert report.bitwise_equal
    assert report.tokens_equal
    assert report.tv_max == 0.0


def test_partial_prefix_hit(adapter: Any, prompt: list[int]) -> None:
    import torch

    stored_part = 5 * BLOCK_TOKENS + 7  # the trailing part block is never stored
    first = adapter.prefill(prompt[:stored_part])
    assert first.stored_blocks == 5
    result = adapter.prefill(prompt)
    assert result.hit_blocks == 5
    assert result.cached_tokens == 5 * BLOCK_TOKENS
    assert result.computed_tokens == len(prompt) - 5 * BLOCK_TOKENS
    logits, _ = _resident(adapter, first.cache, prompt, 5 * BLOCK_TOKENS)
    assert torch.equal(result.logits, logits)
    # The new full blocks were stored: the whole prompt hits now.
    assert adapter.lookup(prompt) == len(prompt)


def test_missing_block_mid_prefix_is_a_shorter_hit(adapter: Any, prompt: list[int]) -> None:
    import torch

    first = adapter.prefill(prompt)
    keys = adapter.keys(prompt)
    assert adapter.namespace.forget([keys[3]]) == 1
    result = adapter.prefill(prompt, store=False)
    assert result.hit_blocks == 3
    assert result.cached_tokens == 3 * BLOCK_TOKENS
    logits, _ = _resident(adapter, first.cache, prompt, 3 * BLOCK_TOKENS)
    assert torch.equal(result.logits, logits)


def test_block_scribbled_after_commit_is_a_shorter_hit(adapter: Any, prompt: list[int]) -> None:
    """The restore verifies each block in the pass that copies it into the slab's runs: the
    block a client of the tenant changed after COMMIT, and those after it, are recomputed."""
    import torch

    from tests.support.scribble import scribble

    first = adapter.prefill(prompt)
    keys = adapter.keys(prompt)
    client = adapter.namespace.client
    before = client.corrupt_reads
    scribble(adapter.namespace, [keys[4]], at=5000, count=64)
    result = adapter.prefill(prompt, store=False)
    assert result.hit_blocks == 4
    assert result.cached_tokens == 4 * BLOCK_TOKENS
    assert client.corrupt_reads == before + 1
    logits, cache = _resident(adapter, first.cache, prompt, 4 * BLOCK_TOKENS)
    assert torch.equal(result.logits, logits)
    _assert_same_cache(result.cache, cache)


def test_block_vanishing_between_lookup_and_read_is_retried(
    adapter: Any, prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from kvtierd.engines import hf
    from kvtierd.protocol.messages import ForgetRequest

    first = adapter.prefill(prompt)
    keys = adapter.keys(prompt)
    real_read = hf.ops.read
    calls = []

    def racing_read(ns: int, read_keys: Any, max_keys: int) -> Any:
        calls.append(len(read_keys))
        if len(calls) == 1:  # another client forgets block 6 after our LOOKUP
            yield ForgetRequest([keys[6]]), ns
        return (yield from real_read(ns, read_keys, max_keys))

    monkeypatch.setattr(hf.ops, "read", racing_read)
    result = adapter.prefill(prompt, store=False)
    assert calls == [len(keys), 6]
    assert result.retries == 1
    assert result.cached_tokens == 6 * BLOCK_TOKENS
    logits, _ = _resident(adapter, first.cache, prompt, 6 * BLOCK_TOKENS)
    assert torch.equal(result.logits, logits)


def test_namespace_of_another_layout_is_refused(loaded: Any, client: Any) -> None:
    from kvtierd.client import Layout
    from kvtierd.engines.hf import HfKvAdapter, LayoutMismatchError, model_layout

    own = model_layout(loaded.model, model_id=MODEL_ID, block_tokens=BLOCK_TOKENS)
    assert own.dtype == "bfloat16"
    assert (own.layers, own.kv_heads, own.head_dim) == (30, 3, 64)
    others = {
        "dtype": Layout(MODEL_ID, 30, 3, 64, "float16", BLOCK_TOKENS),
        "heads": Layout(MODEL_ID, 30, 1, 192, "bfloat16", BLOCK_TOKENS),
        "model": Layout("another/model", 30, 3, 64, "bfloat16", BLOCK_TOKENS),
        "order": Layout(MODEL_ID, 30, 3, 64, "bfloat16", BLOCK_TOKENS, "token-major"),
    }
    block_bytes = 2 * 30 * 3 * 64 * BLOCK_TOKENS * 2
    for name, layout in others.items():
        namespace = client.namespace(f"other-{name}", block_bytes=block_bytes, layout=layout)
        with pytest.raises(LayoutMismatchError, match="not the model's"):
            HfKvAdapter(loaded.model, namespace, model_id=MODEL_ID)
    bare = client.namespace("no-layout", block_bytes=block_bytes)
    with pytest.raises(LayoutMismatchError, match="no layout"):
        HfKvAdapter(loaded.model, bare, model_id=MODEL_ID)


def test_cache_in_another_dtype_is_refused(adapter: Any, prompt: list[int]) -> None:
    from transformers import DynamicCache

    from kvtierd.engines.hf import LayoutMismatchError

    first = adapter.prefill(prompt, store=False)
    as_fp32 = DynamicCache(config=adapter.model.config)
    for index, layer in enumerate(first.cache.layers):
        as_fp32.update(layer.keys.float(), layer.values.float(), index)
    with pytest.raises(LayoutMismatchError, match="float32"):
        adapter.store(prompt, as_fp32)
    assert adapter.lookup(prompt) == 0


def test_prompts_have_the_exact_length_and_follow_ups_extend_them(loaded: Any) -> None:
    from kvtierd.testing.hf_prompts import document_prompt, follow_up

    tokenizer = loaded.tokenizer
    prompt = document_prompt(tokenizer, TEXT, "Which year is it?", tokens=200)
    assert len(prompt) == 200
    text = tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system")
    assert text.endswith("Question: Which year is it?<|im_end|>\n<|im_start|>assistant\n")
    answer = [int(t) for t in tokenizer("1775.", add_special_tokens=False)["input_ids"]]
    second = follow_up(tokenizer, prompt, answer, "And where?")
    assert second[: len(prompt) + len(answer)] == prompt + answer
    assert tokenizer.decode(second[len(prompt) :]).endswith(
        "1775.<|im_end|>\n<|im_start|>user\nAnd where?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="document has"):
        document_prompt(tokenizer, TEXT, None, tokens=5000)


def test_cache_outgrows_its_slab(adapter: Any, prompt: list[int]) -> None:
    """Decode steps past the slab's capacity move a layer to a larger buffer, same bits."""
    from kvtierd.testing.hf_fidelity import compare, greedy_continue

    first = adapter.prefill(prompt)
    adapter.headroom_tokens = 2
    restored = adapter.prefill(prompt, store=False)
    assert restored.cache.kvtierd_slab.capacity == len(prompt) + 2
    logits, cache = _resident(adapter, first.cache, prompt, len(prompt) - 1)
    resident = greedy_continue(adapter.model, cache, logits, 6)
    replay = greedy_continue(
        adapter.model, restored.cache, restored.logits, 6, forced=resident.tokens
    )
    assert compare(resident, replay).bitwise_equal
    assert restored.cache.get_seq_length() == len(prompt) + 5
    _assert_same_cache(restored.cache, cache)


def test_reserved_and_recycled_slabs_are_reused(adapter: Any, prompt: list[int]) -> None:
    import torch

    adapter.reserve(len(prompt))
    spare = adapter._spare
    first = adapter.prefill(prompt)
    assert first.cache.kvtierd_slab is spare
    assert adapter._spare is None
    adapter.recycle(first.cache)
    assert adapter._spare is spare
    again = adapter.prefill(prompt, store=False)  # restored into the recycled slab
    assert again.cache.kvtierd_slab is spare
    fresh = adapter.prefill(prompt, store=False)  # into a new one: the same bits
    assert torch.equal(again.logits, fresh.logits)
    _assert_same_cache(again.cache, fresh.cache)


def test_packed_decode_attention(loaded: Any, prompt: list[int]) -> None:
    """Prompts compute exactly what transformers' sdpa computes; a one-token step differs only
    by rounding (transformers' pack_gqa arithmetic instead of SDPA's enable_gqa)."""
    import torch
    from transformers import DynamicCache

    from kvtierd.engines.hf_attention import PACKED_SDPA, use_packed_decode_attention

    model = loaded.model

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            ids = torch.tensor([prompt])
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            token = torch.tensor([[int(logits[0, -1].argmax())]])
            step = model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1]
        return logits, step

    before = model.config._attn_implementation
    try:
        model.set_attn_implementation("sdpa")
        stock_prompt, stock_step = run()
        assert use_packed_decode_attention(model)
        assert model.config._attn_implementation == PACKED_SDPA
        packed_prompt, packed_step = run()
        assert torch.equal(packed_prompt, stock_prompt)
        assert int(packed_step.argmax()) == int(stock_step.argmax())
        assert float((packed_step.float() - stock_step.float()).abs().max()) < 1.0
    finally:
        model.set_attn_implementation(before)
