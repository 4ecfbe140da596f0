"""Sparse decode on the real SmolLM2-135M against a real daemon: the engine's pool holds
byte-exact copies of the selected blocks, a budget of every block decodes as full attention
does, a dropped pool is read again and counted as misses, and a daemon restart mid-decode
does not stop the decode: the daemon summarises the chain's blocks again as it promotes them.

The model runs in float32 here: there the sparse path over every block matches stock
attention to the last bits that matter (top-1 equal, TV below 1e-4), so any difference is the
decoder's; bf16 adds its own rounding (``docs/slsap-sparse.md``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtierd.testing import smollm2
from tests.engines.test_hf import TEXT

_REASON = smollm2.unavailable_reason()
pytestmark = [
    pytest.mark.model,
    pytest.mark.timeout(300),
    pytest.mark.skipif(_REASON is not None, reason=f"SmolLM2 model stack absent: {_REASON}"),
]

BLOCK_TOKENS = 16
CHAIN = 8  # full blocks stored; the prompt has a 5-token tail besides
MODEL_ID = "test/SmolLM2-135M-Instruct/sparse"
STEPS = 6


@pytest.fixture(scope="module")
def loaded() -> smollm2.LoadedModel:
    return smollm2.load_smollm2(smollm2.ModelDType.FLOAT32)


@pytest.fixture(scope="module")
def prompt(loaded: smollm2.LoadedModel) -> list[int]:
    ids = [int(t) for t in loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]]
    assert len(ids) >= CHAIN * BLOCK_TOKENS + 5
    return ids[: CHAIN * BLOCK_TOKENS + 5]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Any]:
    from kvtierd.testing import DaemonProcess

    with DaemonProcess(tmp_path / "kvtierd", dram_size="64M", nvme_size="256M") as d:
        yield d


def _adapter(loaded: smollm2.LoadedModel, client: Any) -> Any:
    from kvtierd.engines.hf import HfKvAdapter

    return HfKvAdapter.open(
        client, loaded.model, model_id=MODEL_ID, block_tokens=BLOCK_TOKENS, sparse=True
    )


def _reference(loaded: smollm2.LoadedModel, prompt: list[int]) -> tuple[Any, list[Any]]:
    """Stock full attention: the prompt's cache, and the logits of ``STEPS`` greedy steps."""
    import torch
    from transformers.cache_utils import DynamicCache

    model = loaded.model
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=torch.tensor([prompt]),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        prompt_cache = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        logits = [out.logits[0, -1]]
        for _ in range(STEPS):
            token = int(torch.argmax(logits[-1]))
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return prompt_cache, logits


def _block_of(prompt_cache: list[Any], position: int) -> np.ndarray:
    """Block ``position`` as the adapter stores it: ``[layers, 2, kv_heads, bt, head_dim]``."""
    import torch

    span = slice(position * BLOCK_TOKENS, (position + 1) * BLOCK_TOKENS)
    planes = [torch.stack([k[0, :, span], v[0, :, span]]) for k, v in prompt_cache]
    return torch.stack(planes).numpy()


def _assert_pool_holds(decoder: Any, prompt_cache: list[Any]) -> None:
    """Every block of ``decoder``'s pool is, byte for byte, the prompt's K/V at its position."""
    for position, slot in decoder._slot_of.items():
        assert np.array_equal(decoder._pool[slot].numpy(), _block_of(prompt_cache, position))


def _tv(a: Any, b: Any) -> float:
    import torch

    return 0.5 * float((torch.softmax(a.float(), -1) - torch.softmax(b.float(), -1)).abs().sum())


def test_the_pool_holds_byte_exact_copies_of_the_selected_blocks(
    loaded: smollm2.LoadedModel, prompt: list[int], daemon: Any
) -> None:
    from kvtierd.client import connect
    from kvtierd.engines.hf_sparse import SparseDecoder

    prompt_cache, reference = _reference(loaded, prompt)
    with connect(daemon.socket) as client:
        decoder = SparseDecoder(_adapter(loaded, client), budget_blocks=3)
        first = decoder.start(prompt)
        assert len(decoder.chain) == CHAIN
        selection = decoder._selection
        assert selection is not None
        assert selection.shape == (loaded.layers, loaded.kv_heads, 3)
        for row in selection.reshape(-1, 3).tolist():
            assert 0 in row  # the sink
            assert CHAIN - 1 in row  # the newest block
        held = dict(decoder._slot_of)
        assert set(held) == {int(p) for p in np.unique(selection)}
        for position, slot in held.items():
            assert np.array_equal(decoder._pool[slot].numpy(), _block_of(prompt_cache, position))
        assert _tv(first, reference[0]) == 0.0  # the prompt is stock prefill
        decoder.step(int(first.argmax()))
        assert decoder.stats.steps == 1
        assert decoder.stats.misses == 0  # read after the HINT, ahead of the step
        block_bytes = decoder.adapter.namespace.block_bytes
        assert decoder.stats.bytes_read == decoder.stats.blocks_read * block_bytes
        # the same decoder on another prompt holds that prompt's blocks, none of the first's
        other = prompt[BLOCK_TOKENS:] + prompt[:BLOCK_TOKENS]
        other_cache, _ = _reference(loaded, other)
        decoder.start(other)
        _assert_pool_holds(decoder, other_cache)


def test_a_budget_of_every_block_decodes_as_full_attention(
    loaded: smollm2.LoadedModel, prompt: list[int], daemon: Any
) -> None:
    from kvtierd.client import connect
    from kvtierd.engines.hf_sparse import SparseDecoder

    _, reference = _reference(loaded, prompt)
    with connect(daemon.socket) as client:
        decoder = SparseDecoder(_adapter(loaded, client), budget_blocks=CHAIN)
        logits = [decoder.start(prompt)]
        for step in range(STEPS):
            logits.append(decoder.step(int(reference[step].argmax())))
    for ours, theirs in zip(logits, reference, strict=True):
        assert int(ours.argmax()) == int(theirs.argmax())
        assert _tv(ours, theirs) < 1e-4


def test_a_dropped_pool_is_read_again_and_counted_as_misses(
    loaded: smollm2.LoadedModel, prompt: list[int], daemon: Any
) -> None:
    import torch

    from kvtierd.client import connect
    from kvtierd.engines.hf_sparse import SparseDecoder

    with connect(daemon.socket) as client:
        adapter = _adapter(loaded, client)
        adapter.recycle(adapter.prefill(prompt).cache)  # both decoders restore the same prefix
        kept = SparseDecoder(adapter, budget_blocks=3, session=b"kept")
        dropped = SparseDecoder(adapter, budget_blocks=3, session=b"dropped")
        token = int(kept.start(prompt).argmax())
        dropped.start(prompt)
        client.fsync()
        client.evict()  # the blocks come back from NVMe
        selection = dropped._selection
        assert selection is not None
        assert kept._selection is not None
        assert np.array_equal(selection, kept._selection)
        dropped.drop_pool()
        assert dropped.held_blocks == 0
        ours = dropped.step(token)
        assert dropped.stats.misses == len(np.unique(selection))
        assert dropped.stats.miss_s > 0
        assert torch.equal(ours, kept.step(token))  # the same selection over the same bytes


def test_a_daemon_restart_mid_decode_keeps_decoding(
    loaded: smollm2.LoadedModel, prompt: list[int], daemon: Any
) -> None:
    from kvtierd.client import Reconnect, connect
    from kvtierd.engines.hf_sparse import SparseDecoder

    policy = Reconnect(attempts=40, first_backoff_s=0.05, max_backoff_s=0.5)
    prompt_cache, _ = _reference(loaded, prompt)
    with connect(daemon.socket, reconnect=policy) as client:
        decoder = SparseDecoder(_adapter(loaded, client), budget_blocks=3)
        token = int(decoder.start(prompt).argmax())
        token = int(decoder.step(token).argmax())
        client.fsync()
        daemon.stop()
        daemon.start()
        token = int(decoder.step(token).argmax())
        # the restarted daemon kept the blocks (FSYNC) but not their summaries, which live in
        # memory: it cannot rank the chain yet, so the decoder keeps the selection it has and
        # says so, and the daemon promotes the chain's blocks to summarise them again
        assert decoder.stats.stale_selections == 1
        namespace = decoder.adapter.namespace
        deadline = time.monotonic() + 60
        while namespace.lookup_tiers(decoder.chain, promote=False) != ["dram"] * CHAIN:
            assert time.monotonic() < deadline, "the chain was never promoted to be summarised"
            time.sleep(0.05)
        for _ in range(2):
            token = int(decoder.step(token).argmax())
        assert decoder.stats.steps == 4
        assert decoder.stats.stale_selections == 1  # ranked afresh again
        _assert_pool_holds(decoder, prompt_cache)


def test_a_shared_selection_holds_its_budget_of_blocks_for_every_group(
    loaded: smollm2.LoadedModel, prompt: list[int], daemon: Any
) -> None:
    from kvtierd.client import connect
    from kvtierd.engines.hf_sparse import SparseDecoder

    prompt_cache, _ = _reference(loaded, prompt)
    with connect(daemon.socket) as client:
        decoder = SparseDecoder(_adapter(loaded, client), budget_blocks=3, shared=True)
        token = int(decoder.start(prompt).argmax())
        for _ in range(3):
            selection = decoder._selection
            assert selection is not None
            assert (selection == selection[0, 0]).all()  # one choice for every group
            assert {0, CHAIN - 1} <= set(selection[0, 0].tolist())
            assert decoder.held_blocks == 3
            token = int(decoder.step(token).argmax())
        assert decoder.stats.peak_blocks == 3
        assert decoder.stats.bytes_read == decoder.stats.bytes_needed  # no amplification
        _assert_pool_holds(decoder, prompt_cache)
