"""Fidelity of restored KV: 64 greedy tokens from a cache restored through kvtierd (cold, from
the NVMe tier) against the same cache kept in memory, on the real SmolLM2-135M and real text.

For each context length: prefill the prompt and store its blocks, make them durable and empty
the DRAM tier; then continue from the resident cache, and from the cache the adapter restores
(prefix from NVMe + forward of the last token), teacher-forced with the resident tokens. Prints
``tokens_equal``, ``bitwise_equal``, ``tv_max``, ``tv_mean`` (total variation between top-20
distributions, per step) and ``max_abs_logit_diff``: per length under ``results`` and, at the
top level, over all lengths. Lossless storage must be bitwise equal. A run of the default
lengths rewrites the "fidelity" section of ``docs/benchmarks.md``; ``--tokens`` runs one length
and records nothing.

Run: ``python -m tools.fidelity --json [--tokens N] [--data FILE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvtierd.client import Client, connect
from kvtierd.testing import DaemonProcess
from kvtierd.testing.smollm2 import (
    GGUF_FILE,
    LoadedModel,
    ModelDType,
    load_smollm2,
    unavailable_reason,
)
from tools.benchlib import ROOT, emit, log, machine, machine_line, record

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "loogle" / "shortdep_qa.jsonl"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
MODEL_ID = f"HuggingFaceTB/SmolLM2-135M-Instruct/{GGUF_FILE}"
STEPS = 64


def check_inputs(data: Path) -> str | None:
    """Why the tools cannot run here (no model stack, no data), or ``None``."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if not data.is_file():
        return (
            f"no LooGLE data at {data}: expected ../shared/data/loogle/shortdep_qa.jsonl next to "
            "the checkout, or pass --data FILE (one JSON object per line with 'input')"
        )
    return None


def open_model(dtype: str, threads: int | None) -> LoadedModel:
    """Load SmolLM2 and warm it up (the first forward carries one-time costs)."""
    import torch

    loaded = load_smollm2(ModelDType(dtype), threads=threads)
    with torch.no_grad():
        loaded.model(input_ids=torch.arange(100, 164)[None], logits_to_keep=1)
    return loaded


@contextlib.contextmanager
def bench_daemon(dram: str = "1G", nvme: str = "2G") -> Iterator[tuple[DaemonProcess, Client]]:
    """A daemon of our own in a temporary directory on the root file system (a real disk, not
    tmpfs), and a client of it."""
    with (
        tempfile.TemporaryDirectory(prefix="kvtierd-bench-", dir="/var/tmp") as directory,
        DaemonProcess(Path(directory), dram_size=dram, nvme_size=nvme) as daemon,
        connect(daemon.socket) as client,
    ):
        yield daemon, client


def prompt_for(loaded: LoadedModel, data: Path, tokens: int) -> tuple[str, list[int]]:
    """A chat prompt of exactly ``tokens`` tokens about the first document of ``data`` long
    enough for it, asking that document's first question: ``(title, token ids)``.

    Raises:
        ValueError: no document of ``data`` is long enough.
    """
    from kvtierd.testing.hf_prompts import document_prompt, read_qa_documents

    for document in read_qa_documents(data):
        question = document.questions[0] if document.questions else None
        try:
            return document.title, document_prompt(
                loaded.tokenizer, document.text, question, tokens=tokens
            )
        except ValueError:
            continue
    raise ValueError(f"no document in {data} is long enough for a {tokens}-token prompt")


def lengths_for(args: argparse.Namespace) -> list[int]:
    return [args.tokens] if args.tokens else list(DEFAULT_LENGTHS)


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, help="run this context length only")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LooGLE-format JSONL")
    parser.add_argument("--dtype", default="bfloat16", choices=[d.value for d in ModelDType])
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--no-record", action="store_true", help="leave docs/ untouched")


def measure(
    loaded: LoadedModel, client: Client, prompt: list[int], *, block_tokens: int, steps: int
) -> dict[str, Any]:
    """Resident vs restored-from-NVMe continuation of ``prompt``; the report as a dict."""
    from kvtierd.engines.hf import HfKvAdapter
    from kvtierd.engines.hf_cache import prefix_cache
    from kvtierd.testing.hf_fidelity import compare, greedy_continue

    adapter = HfKvAdapter.open(client, loaded.model, model_id=MODEL_ID, block_tokens=block_tokens)
    adapter.namespace.forget(adapter.keys(prompt))
    first = adapter.prefill(prompt)
    client.fsync()
    client.evict()
    restored = adapter.prefill(prompt, store=False)
    cached = restored.cached_tokens
    resident_cache = prefix_cache(loaded.model.config, first.cache, cached)
    resident_logits = adapter.forward(prompt[cached:], resident_cache)
    resident = greedy_continue(loaded.model, resident_cache, resident_logits, steps)
    replay = greedy_continue(
        loaded.model, restored.cache, restored.logits, steps, forced=resident.tokens
    )
    report = compare(resident, replay).as_dict()
    adapter.namespace.forget(adapter.keys(prompt))
    report.update(
        prompt_tokens=len(prompt),
        cached_tokens=cached,
        blocks_by_tier=restored.blocks_by_tier,
        continuation=loaded.tokenizer.decode(resident.tokens),
    )
    return report


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = list(results.values())
    return {
        "tokens_equal": all(r["tokens_equal"] for r in rows),
        "bitwise_equal": all(r["bitwise_equal"] for r in rows),
        "tv_max": max(r["tv_max"] for r in rows),
        "tv_mean": sum(r["tv_mean"] * r["steps"] for r in rows) / sum(r["steps"] for r in rows),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "## Fidelity of restored KV (`tools/fidelity.py`)",
        "",
        f"SmolLM2-135M-Instruct ({result['dtype']}, lossless blocks of "
        f"{result['block_tokens']} tokens): {result['steps']} greedy tokens continued from the "
        "cache restored cold from the NVMe tier against the same cache kept in memory, same "
        "computation path (prefix cache + forward of the last prompt token; the resident side a "
        "plain `DynamicCache`, the restored side the adapter's in-place cache, both on the "
        f"model's `{result.get('attn_implementation', 'sdpa')}` attention), restored side "
        "teacher-forced. TV: total variation between the top-20 distributions of each step. "
        "The 8K prompt is 8128 tokens so that the 64 continued tokens stay inside the model's "
        "8192-token context.",
        "",
        "| context | restored from | tokens equal | bitwise equal | TV max | TV mean "
        "| max abs logit diff |",
        "|---:|---|:-:|:-:|---:|---:|---:|",
    ]
    for row in result["results"].values():
        tiers = ", ".join(f"{n} {k}" for k, n in row["blocks_by_tier"].items()) or "-"
        lines.append(
            f"| {row['prompt_tokens']} | {tiers} blocks | {row['tokens_equal']} | "
            f"{row['bitwise_equal']} | {row['tv_max']:.2e} | {row['tv_mean']:.2e} | "
            f"{row['max_abs_logit_diff']:.3g} |"
        )
    lines += ["", machine_line(result["machine"])]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    reason = check_inputs(args.data)
    if reason is not None:
        log(f"fidelity: cannot run: {reason}")
        return 2
    log(f"loading SmolLM2-135M ({args.dtype}) ...")
    loaded = open_model(args.dtype, args.threads)
    results: dict[str, dict[str, Any]] = {}
    with bench_daemon() as (_, client):
        for tokens in lengths_for(args):
            # Positions beyond the model's context would not be a fair continuation.
            length = min(tokens, loaded.max_positions - args.steps)
            title, prompt = prompt_for(loaded, args.data, length)
            started = time.perf_counter()
            row = measure(loaded, client, prompt, block_tokens=args.block_tokens, steps=args.steps)
            row["document"] = title
            results[str(tokens)] = row
            log(
                f"{tokens:>6} tokens: tokens_equal={row['tokens_equal']} "
                f"bitwise_equal={row['bitwise_equal']} tv_max={row['tv_max']:.2e} "
                f"({time.perf_counter() - started:.0f} s)"
            )
    result: dict[str, Any] = {
        "benchmark": "fidelity",
        "model": MODEL_ID,
        "dtype": args.dtype,
        "block_tokens": args.block_tokens,
        "steps": args.steps,
        "attn_implementation": loaded.model.config._attn_implementation,
        **summary(results),
        "results": results,
        "machine": machine(),
    }
    if not args.tokens and not args.no_record:
        record("fidelity", markdown(result), result)
    emit(result, args.json)
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
