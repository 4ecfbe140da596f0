"""Sparse decode on kvtierd against full attention: real SmolLM2, a real daemon, LooGLE text.

    python -m tools.sparse_decode --data ../shared/data/loogle/shortdep_qa.jsonl \
        --tokens 4096 --budget 0.125 --json
    python -m tools.sparse_decode --record     # budgets 1/4, 1/8, 1/16 at 4K and 8K tokens

For each of the first ``--questions`` answerable questions of the first ``--docs`` documents
(a question is answerable at a length when the passage its answer rests on lies inside the
document's first ``--tokens`` tokens): a chat prompt of exactly ``--tokens`` tokens (the
document cut to fit, then the question), then

* **full attention**: the model's own prefill and ``--generate`` greedy one-token steps on its
  own cache (stock transformers ``sdpa``): the reference tokens, logits and tokens/s;
* **sparse, per budget**: :class:`~kvtierd.engines.hf_sparse.SparseDecoder` computes the prompt
  through the adapter and stores its blocks in a real daemon; the daemon's DRAM is then
  written back and emptied (``FSYNC``, ``EVICT``) and the engine's pool dropped, so decoding
  starts with the context on cold NVMe; teacher-forced with the reference tokens, each step's
  distribution is compared with the reference's (top-1 agreement; TV over the union of both
  top-20s, renormalised, as :mod:`kvtierd.testing.hf_fidelity` takes it), and the costs are
  counted: bytes the engine read per generated token against a full restore of the context,
  the daemon's NVMe reads, the share of step time spent waiting for blocks (``stall_share``),
  the HINT round trip, tokens/s;
* **answers**: both decode freely (greedy) and each answer is scored: LooGLE questions by token
  F1 against the reference answer (correct at F1 >= 0.5: ``qa_accuracy``); a *needle* (a
  sentence with an access code planted halfway into the first document: found or not); an
  *aggregation* (list every year the document mentions, where top-k selection is known to
  fail: F1 of the years listed against those in the prompt); and the two answers against each
  other (``answer_agreement``).

A budget of ``1.0`` (every block) is the sparse path's own noise floor against stock attention:
its packed attention adds the blocks in another order of operations, never another selection.
Prints one JSON object; ``--record`` writes section ``sparse_decode`` of docs/benchmarks.md
with a plot. Needs the model stack (``kvtierd/testing/smollm2.py``) and the LooGLE file.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvtierd.client import Client
from kvtierd.engines.hf import HfKvAdapter
from kvtierd.engines.hf_sparse import SparseDecoder, SparseStats
from kvtierd.testing.hf_fidelity import Continuation, compare, continue_with, greedy_continue
from kvtierd.testing.hf_prompts import QaDocument, document_prompt, read_qa_documents
from kvtierd.testing.smollm2 import LoadedModel
from tools import benchlib
from tools.fidelity import DEFAULT_DATA, MODEL_ID, bench_daemon, check_inputs, open_model

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Setting:
    """A budget (share of the chain's blocks per layer and KV head) and whether every group
    attends to the same blocks (:class:`~kvtierd.engines.hf_sparse.SparseDecoder`'s
    ``shared``)."""

    fraction: float
    shared: bool = False

    @property
    def key(self) -> str:
        return f"{self.fraction:g} shared" if self.shared else f"{self.fraction:g}"


RECORD_TOKENS = (4096, 8192)
RECORD_BUDGETS = (1.0, 0.25, 0.125, 0.0625)
#: The selections recorded: each group its own, and one for all of them.
RECORD_SHARED = (False, True)
#: Above this token F1 against the reference answer, an answer counts as correct.
CORRECT_F1 = 0.5


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def token_f1(answer: str, reference: str) -> float:
    """SQuAD's token F1 of ``answer`` against ``reference`` (words, case folded)."""
    a, r = _words(answer), _words(reference)
    common = sum((Counter(a) & Counter(r)).values())
    if not common:
        return 0.0
    precision, recall = common / len(a), common / len(r)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class Probe:
    """One prompt and how its answer is scored (0..1): ``kind`` is ``qa`` (token F1 against
    LooGLE's reference answer), ``needle`` (1 when the answer holds the planted value) or
    ``aggregation`` (F1 of the years the answer lists against those the prompt holds)."""

    kind: str
    label: str
    prompt: list[int]
    score: Callable[[str], float]


#: The needle: a sentence planted halfway into the document, and what the answer must hold.
NEEDLE = " The archive's access code, for anyone who asks later, is 7319-OSPREY."
NEEDLE_VALUE = "7319"
NEEDLE_QUESTION = "What is the archive's access code given in the document?"
AGGREGATION_QUESTION = (
    "List every year (four-digit number) that the document mentions, separated by commas."
)
_YEAR = re.compile(r"\b(1[5-9]\d\d|20\d\d)\b")


def _year_f1(answer: str, years: set[str]) -> float:
    said = set(_YEAR.findall(answer))
    common = len(said & years)
    if not common:
        return 0.0
    return 2 * common / (len(said) + len(years))


def probes_for(
    loaded: LoadedModel, documents: list[QaDocument], tokens: int, questions: int
) -> list[Probe]:
    """Up to ``questions`` answerable LooGLE questions (their evidence inside the prompt's
    part of the document), then a needle and an aggregation probe on the first document."""
    tokenizer = loaded.tokenizer
    probes: list[Probe] = []
    for document in documents:
        kept = tokenizer.decode(tokenizer(document.text)["input_ids"][:tokens])
        for i, question in enumerate(document.questions):
            passage = document.evidence[i] if i < len(document.evidence) else ""
            answer = document.answers[i] if i < len(document.answers) else ""
            if not passage or passage[:80] not in kept or not answer:
                continue
            try:
                prompt = document_prompt(tokenizer, document.text, question, tokens=tokens)
            except ValueError:
                break  # the document is too short for this length
            probes.append(
                Probe(
                    "qa", f"{document.title[:24]} q{i}", prompt, partial(token_f1, reference=answer)
                )
            )
            if len([p for p in probes if p.kind == "qa"]) == questions:
                break
        if len(probes) == questions:
            break
    first = documents[0]
    kept = tokenizer.decode(tokenizer(first.text)["input_ids"][: tokens - 200])
    middle = kept.rfind(". ", 0, len(kept) // 2) + 1 or len(kept) // 2
    planted = first.text[:middle] + NEEDLE + first.text[middle:]
    probes.append(
        Probe(
            "needle",
            f"{first.title[:24]} needle",
            document_prompt(tokenizer, planted, NEEDLE_QUESTION, tokens=tokens),
            lambda answer: float(NEEDLE_VALUE in answer),
        )
    )
    years = set(_YEAR.findall(kept))
    probes.append(
        Probe(
            "aggregation",
            f"{first.title[:24]} years",
            document_prompt(tokenizer, first.text, AGGREGATION_QUESTION, tokens=tokens),
            partial(_year_f1, years=years),
        )
    )
    return probes


def full_attention(
    loaded: LoadedModel, prompt: list[int], steps: int
) -> tuple[Continuation, float]:
    """The reference: stock prefill and ``steps`` greedy steps; (continuation, tokens/s)."""
    from transformers.cache_utils import DynamicCache

    model = loaded.model
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1)
        started = time.perf_counter()
        continuation = greedy_continue(model, cache, out.logits[0, -1], steps)
    elapsed = time.perf_counter() - started
    return continuation, (len(continuation.tokens) - 1) / elapsed


def sparse_run(
    adapter: HfKvAdapter,
    client: Client,
    prompt: list[int],
    budget_blocks: int,
    steps: int,
    *,
    forced: list[int] | None,
    stop_token: int | None,
    shared: bool,
    session: bytes,
) -> tuple[Continuation, SparseDecoder, dict[str, float]]:
    """Decode ``steps`` tokens sparsely, the context on cold NVMe; the daemon's figures."""
    decoder = SparseDecoder(adapter, budget_blocks=budget_blocks, session=session, shared=shared)
    logits = decoder.start(prompt)
    client.fsync()
    client.evict()
    decoder.stats = SparseStats()  # decode's costs from here: what start() read goes
    decoder.drop_pool()
    before = _nvme_bytes_read(client)
    started = time.perf_counter()
    continuation = continue_with(decoder.step, logits, steps, forced=forced, stop_token=stop_token)
    wall = time.perf_counter() - started
    figures = {"wall_s": wall, "nvme_bytes": float(_nvme_bytes_read(client) - before)}
    return continuation, decoder, figures


def _nvme_bytes_read(client: Client) -> int:
    tiers = client.stats()["tiers"]
    return sum(int(t["bytes_read"]) for t in tiers if t["name"] == "nvme")


def measure(
    loaded: LoadedModel,
    client: Client,
    probe: Probe,
    settings: list[Setting],
    steps: int,
    label: str,
) -> dict[str, Any]:
    """Every figure of one prompt: the reference, then each budget."""
    tokenizer = loaded.tokenizer
    prompt = probe.prompt
    stop = tokenizer.eos_token_id
    full, full_tps = full_attention(loaded, prompt, steps)  # greedy: also the full answer
    full_answer = tokenizer.decode(_until(full.tokens, stop), skip_special_tokens=True)
    adapter = HfKvAdapter.open(
        client, loaded.model, model_id=MODEL_ID, block_tokens=BLOCK_TOKENS, sparse=True
    )
    chain_blocks = (len(prompt) - 1) // BLOCK_TOKENS
    result: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "chain_blocks": chain_blocks,
        "block_bytes": adapter.namespace.block_bytes,
        "tokens_per_s_full_attention": full_tps,
        "answer_full": full_answer,
        "kind": probe.kind,
        "score_full": probe.score(full_answer),
        "budgets": {},
    }
    for setting in settings:
        budget = max(2, round(setting.fraction * chain_blocks))
        benchlib.log(f"{label}: budget {setting.key} ({budget} of {chain_blocks} blocks)")
        forced, decoder, figures = sparse_run(
            adapter,
            client,
            prompt,
            budget,
            steps,
            forced=full.tokens,
            stop_token=None,
            shared=setting.shared,
            session=f"{label}/{setting.key}/forced".encode(),
        )
        report = compare(full, forced)
        agree = sum(a == b for a, b in zip(full.tokens, forced.tokens, strict=False))
        free, _, _ = sparse_run(
            adapter,
            client,
            prompt,
            budget,
            steps,
            forced=None,
            stop_token=stop,
            shared=setting.shared,
            session=f"{label}/{setting.key}/free".encode(),
        )
        answer = tokenizer.decode(_until(free.tokens, stop), skip_special_tokens=True)
        s = decoder.stats
        generated = max(1, s.steps)
        result["budgets"][setting.key] = {
            "budget_blocks": budget,
            "agreement_top1": agree / report.steps,
            "tv_mean": report.tv_mean,
            "tv_max": report.tv_max,
            "first_divergence": report.first_divergence,
            "answer_sparse": answer,
            "score_sparse": probe.score(answer),
            "answer_agreement": float(_until(free.tokens, stop) == _until(full.tokens, stop)),
            "bytes_per_token_sparse": s.bytes_read / generated,
            "bytes_per_token_full_restore": chain_blocks
            * adapter.namespace.block_bytes
            / generated,
            "nvme_bytes_per_token": figures["nvme_bytes"] / generated,
            "read_amplification": s.bytes_read / max(1, s.bytes_needed),
            "stall_share": s.stall_s / figures["wall_s"],
            "hint_ms_per_step": 1e3 * s.hint_s / generated,
            "forward_ms_per_step": 1e3 * s.forward_s / generated,
            "misses": s.misses,
            "peak_pool_blocks": s.peak_blocks,
            "tokens_per_s_sparse": generated / figures["wall_s"],
        }
    return result


def _until(tokens: list[int], stop: int | None) -> list[int]:
    return tokens[: tokens.index(stop)] if stop is not None and stop in tokens else tokens


def _scores(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The answers' scores by kind of probe: QA accuracy (F1 >= :data:`CORRECT_F1`) and F1,
    the needle found, the aggregation's F1; sparse and full attention each."""

    def of(kind: str, side: str, judge: Callable[[float], float] = float) -> float | None:
        mine = [r for r in runs if r["kind"] == kind]
        if not mine:
            return None
        scores: list[float] = [
            r["score_full"] if side == "full" else r["budgets"][key]["score_sparse"] for r in mine
        ]
        return statistics.fmean(judge(score) for score in scores)

    def correct(f1: float) -> float:
        return float(f1 >= CORRECT_F1)

    return {
        "qa_accuracy": {side: of("qa", side, correct) for side in ("sparse", "full")},
        "qa_f1": {side: of("qa", side) for side in ("sparse", "full")},
        "needle": {side: of("needle", side) for side in ("sparse", "full")},
        "aggregation_f1": {side: of("aggregation", side) for side in ("sparse", "full")},
    }


def summarise(runs: list[dict[str, Any]], settings: list[Setting]) -> dict[str, Any]:
    """Means over prompts, per budget, under the names the issue asks for."""

    def mean(name: str, key: str) -> float:
        return statistics.fmean(r["budgets"][key][name] for r in runs)

    out: dict[str, Any] = {}
    for setting in settings:
        fraction = setting.key
        out[fraction] = {
            "agreement_top1": mean("agreement_top1", fraction),
            "tv_mean": mean("tv_mean", fraction),
            "tv_max": max(r["budgets"][fraction]["tv_max"] for r in runs),
            **_scores(runs, fraction),
            "answer_agreement": mean("answer_agreement", fraction),
            "bytes_per_token": {
                "sparse": mean("bytes_per_token_sparse", fraction),
                "full_restore": mean("bytes_per_token_full_restore", fraction),
                "nvme": mean("nvme_bytes_per_token", fraction),
            },
            "read_amplification": mean("read_amplification", fraction),
            "stall_share": mean("stall_share", fraction),
            "hint_ms_per_step": mean("hint_ms_per_step", fraction),
            "tokens_per_s": {
                "sparse": mean("tokens_per_s_sparse", fraction),
                "full_attention": statistics.fmean(r["tokens_per_s_full_attention"] for r in runs),
            },
            "misses": sum(r["budgets"][fraction]["misses"] for r in runs),
            "peak_pool_blocks": mean("peak_pool_blocks", fraction),
            "chain_blocks": statistics.fmean(r["chain_blocks"] for r in runs),
        }
    return out


def run(args: argparse.Namespace, tokens: int, settings: list[Setting]) -> dict[str, Any]:
    loaded = open_model("bfloat16", args.threads)
    length = min(tokens, loaded.max_positions - args.generate)
    documents = read_qa_documents(args.data)[: args.docs]
    probes = probes_for(loaded, documents, length, args.questions)
    runs = []
    with bench_daemon(dram="512M", nvme="2G") as (_daemon, client):
        for probe in probes:
            label = f"{probe.label} {length}"
            benchlib.log(f"{label}: full attention")
            runs.append(measure(loaded, client, probe, settings, args.generate, label))
            runs[-1]["label"] = probe.label
    return {"tokens": length, "generate": args.generate, "runs": runs, **summarise(runs, settings)}


def plot_and_record(result: dict[str, Any], data: str, settings: list[Setting]) -> None:
    """Draw fidelity and cost against budget and record section ``sparse_decode``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (fid, cost) = plt.subplots(1, 2, figsize=(11, 4.2))
    for shared in sorted({s.shared for s in settings}):
        drawn = [s for s in settings if s.shared == shared and s.fraction < 1.0]
        x = [s.fraction for s in drawn]
        mode = "shared" if shared else "per head"
        for length in result["lengths"]:
            t = length["tokens"]
            (line,) = fid.plot(
                x, [length[s.key]["agreement_top1"] for s in drawn], "o-", label=f"{mode}, {t}"
            )
            cost.plot(
                x,
                [length[s.key]["bytes_per_token"]["sparse"] / 2**20 for s in drawn],
                "o-",
                color=line.get_color(),
                label=f"{mode}, {t}",
            )
    for length in result["lengths"]:
        first = next(iter(s for s in settings if s.fraction < 1.0))
        cost.axhline(
            length[first.key]["bytes_per_token"]["full_restore"] / 2**20,
            linestyle=":",
            color="grey",
        )
        cost.annotate(
            f"full restore, {length['tokens']}",
            (
                min(s.fraction for s in settings),
                length[first.key]["bytes_per_token"]["full_restore"] / 2**20,
            ),
            fontsize=7,
        )
        fid.axhline(
            length[Setting(1.0).key]["agreement_top1"] if Setting(1.0).key in length else 1.0,
            linestyle=":",
            color="grey",
        )
    for ax in (fid, cost):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (share of the context's blocks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fid.set_ylabel("top-1 agreement with full attention (teacher-forced)")
    fid.set_title("fidelity (dotted: every block, the bf16 floor)")
    cost.set_ylabel("MiB the engine read per generated token")
    cost.set_yscale("log")
    cost.set_title("bytes moved (dotted: a full restore)")
    path = benchlib.save_figure(fig, "sparse_decode.png")
    rows = [
        "| tokens | budget | top-1 agreement | TV mean | TV max | answers equal "
        "| QA F1 | needle | years F1 | MiB/token sparse / full restore | NVMe MiB/token "
        "| engine pool (blocks) | amplification | stall share | HINT ms/step "
        "| tokens/s sparse / full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pair(figures: dict[str, float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:.2f}" for v in figures.values())

    for length in result["lengths"]:
        for setting in settings:
            r = length[setting.key]
            rows.append(
                f"| {length['tokens']} | {setting.key} | {r['agreement_top1']:.3f} | "
                f"{r['tv_mean']:.4f} | {r['tv_max']:.3f} | {r['answer_agreement']:.2f} | "
                f"{pair(r['qa_f1'])} | {pair(r['needle'])} | {pair(r['aggregation_f1'])} | "
                f"{r['bytes_per_token']['sparse'] / 2**20:.2f} / "
                f"{r['bytes_per_token']['full_restore'] / 2**20:.2f} | "
                f"{r['bytes_per_token']['nvme'] / 2**20:.2f} | "
                f"{r['peak_pool_blocks']:.0f} of {r['chain_blocks']:.0f} | "
                f"{r['read_amplification']:.2f} | {r['stall_share']:.3f} | "
                f"{r['hint_ms_per_step']:.1f} | "
                f"{r['tokens_per_s']['sparse']:.1f} / {r['tokens_per_s']['full_attention']:.1f} |"
            )
    first = result["lengths"][0]
    md = "\n".join(
        [
            "## Sparse decode on kvtierd (SLSAP on an engine's path)",
            "",
            f"`python -m tools.sparse_decode --data {os.path.relpath(data, benchlib.ROOT)} "
            "--record`: SmolLM2-135M (bf16) decodes "
            f"{first['generate']} tokens after a LooGLE prompt whose {BLOCK_TOKENS}-token blocks "
            "live in kvtierd, the context on cold NVMe at the first step (FSYNC, EVICT, the "
            "engine's pool dropped), attending only to the blocks the daemon's HINT selects "
            "(sink and newest included) plus its own tail: per head, each layer and KV head "
            "its own budget of blocks; shared, the same blocks for all (the best of the union). "
            "Teacher-forced with full attention's tokens for the per-step figures (TV: top-20 "
            "union, renormalised), free for the answers, each as sparse / full attention: QA "
            "F1 against LooGLE's reference answer (questions whose evidence lies inside the "
            "prompt), the needle (a sentence planted halfway: 1 when the answer gives its code), "
            "the years F1 (an aggregation: list every year the document mentions; top-k "
            f"selection is known to fail there). {len(first['runs'])} prompts per length, one "
            "document (the tool takes more with `--docs`). Budget 1 is every block: the sparse "
            "path's own bf16 rounding against stock attention (in float32 it gives TV 0.0000). "
            "Bytes per token: what the engine read from the daemon's DRAM per generated token "
            "(blocks read again when a selection comes back to them included), against "
            "restoring the whole context once; NVMe: what the daemon read from disk meanwhile. "
            "Engine pool: the most blocks the engine held at once (mean over prompts). "
            "Amplification: whole blocks read over the (layer, KV head) slices the selections "
            "newly named. Stall: share of decode time spent waiting for blocks.",
            "",
            *rows,
            "",
            f"![sparse decode]({path})",
            "",
            benchlib.machine_line(result["machine"]),
        ]
    )
    benchlib.record("sparse_decode", md, result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LooGLE-format JSONL")
    parser.add_argument(
        "--tokens", help="context lengths, comma-separated (default 4096; --record: 4096,8192)"
    )
    parser.add_argument(
        "--budget",
        help="budgets (share of blocks), comma-separated (default 0.125; --record: 1,1/4,1/8,1/16)",
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="one selection for every layer and KV head (--record: both ways)",
    )
    parser.add_argument("--generate", type=benchlib.positive_int, default=128)
    parser.add_argument("--docs", type=benchlib.positive_int, default=1)
    parser.add_argument("--questions", type=benchlib.positive_int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--record", action="store_true", help="write docs/benchmarks.md section")
    args = parser.parse_args()
    reason = check_inputs(args.data)
    if reason is not None:
        print(f"sparse_decode: cannot run: {reason}", file=sys.stderr)
        return 2
    tokens, fractions = (RECORD_TOKENS, RECORD_BUDGETS) if args.record else ((4096,), (0.125,))
    lengths = [int(t) for t in args.tokens.split(",")] if args.tokens else list(tokens)
    budgets = [float(b) for b in args.budget.split(",")] if args.budget else list(fractions)
    if not all(0 < b <= 1 for b in budgets):
        parser.error("a budget is a share of the blocks: above 0, at most 1")
    ways = RECORD_SHARED if args.record else (args.shared,)
    settings = [Setting(b, shared) for shared in ways for b in budgets if not (shared and b == 1)]
    results = [run(args, t, settings) for t in lengths]
    result: dict[str, Any]
    if len(results) == 1 and len(settings) == 1 and not args.record:  # one figure each, flat
        result = {**results[0][settings[0].key], **results[0]}
    else:
        result = {"lengths": results}
    result["machine"] = benchlib.machine()
    if args.record:
        plot_and_record(result, str(args.data), settings)
    benchlib.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
