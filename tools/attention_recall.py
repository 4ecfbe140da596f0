"""Recall of real attention by sparse block selection, on SmolLM2-135M and LooGLE-format text.

    python -m tools.attention_recall --data ../shared/data/loogle/shortdep_qa.jsonl \
        --budget 0.125 --json [--tokens 4096] [--docs 5] [--queries 32]
    python -m tools.attention_recall --data FILE --sweep 0.0625,0.125,0.25 --record

For each of the first ``--docs`` documents: tokenise ``input``, keep the first ``--tokens``
tokens, prefill the real model once, and capture the post-RoPE keys of every layer (from the KV
cache, which stores exactly what attention reads) and the post-RoPE queries of the last
``--queries`` positions (recomputed in a pre-hook on each attention module from its input hidden
states with the module's own ``q_proj`` and the model's rotary embedding). The capture is checked
on one layer per document: ``softmax(q K^T / sqrt(d)) V`` from the captured tensors must equal the
attention output the model fed to ``o_proj`` (``capture_check_max_abs_err`` in the output).

Recall is then measured by :func:`kvtierd.slsap.sparse.recall.evaluate_sequence` (its docstring
defines the methods, the budget and the lead-time figures). Prints ONE JSON object whose
``recall`` maps ``oracle``, ``slsap``, ``quest_full_scan``, ``mean_key`` and ``recency`` (and
two extras) to the mean over documents. ``--sweep`` (or ``--record``) also draws recall against
budget into ``docs/benchmarks/sparse_recall.png`` and writes section ``sparse_recall`` of
``docs/benchmarks.md``. Needs the model stack (see ``kvtierd/testing/smollm2.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from kvtierd.slsap.sparse import SparseConfig
from kvtierd.slsap.sparse.recall import METHODS, SequenceRecall, evaluate_sequence
from kvtierd.testing.hf_prompts import read_qa_documents
from kvtierd.testing.smollm2 import LoadedModel, ModelDType, load_smollm2
from tools import benchlib

MAIN_METHODS = ("oracle", "slsap", "quest_full_scan", "mean_key", "recency")


def capture(
    loaded: LoadedModel, ids: list[int], queries: int, check_layer: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Prefill ``ids``; return (queries ``[layers, q_heads, queries, d]``, keys ``[layers,
    kv_heads, n, d]``, both float32 post-RoPE, and the capture check's max abs error)."""
    import torch

    model = loaded.model
    attn_modules = [layer.self_attn for layer in model.model.layers]
    rotary = sys.modules[type(attn_modules[0]).__module__].apply_rotary_pos_emb
    qs: dict[int, np.ndarray] = {}
    out_check: list[np.ndarray] = []
    hooks = []

    def pre_hook(i: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)[:, -queries:]
            cos, sin = kwargs["position_embeddings"]
            q = module.q_proj(hidden).view(1, queries, -1, loaded.head_dim).transpose(1, 2)
            q, _ = rotary(q, q, cos[:, -queries:], sin[:, -queries:])
            qs[i] = q[0].float().numpy().copy()

        return hook

    for i, attn in enumerate(attn_modules):
        hooks.append(attn.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
    hooks.append(
        attn_modules[check_layer].o_proj.register_forward_pre_hook(
            lambda _m, args: out_check.append(args[0][0, -queries:].float().numpy().copy())
        )
    )
    try:
        tokens = torch.tensor([ids])
        with torch.no_grad():
            out = model(
                input_ids=tokens,
                attention_mask=torch.ones_like(tokens),
                use_cache=True,
                logits_to_keep=1,
            )
    finally:
        for h in hooks:
            h.remove()
    cache = getattr(out, "cache", None) or out.past_key_values
    keys = np.stack([cache.layers[i].keys[0].float().numpy() for i in range(loaded.layers)])
    values = cache.layers[check_layer].values[0].float().numpy()
    q_all = np.stack([qs[i] for i in range(loaded.layers)])
    err = _check(q_all[check_layer], keys[check_layer], values, out_check[0])
    return q_all, keys, err


def _check(q: np.ndarray, k: np.ndarray, v: np.ndarray, attn_out: np.ndarray) -> float:
    """Max abs difference between attention recomputed from captured tensors and the model's."""
    heads, steps, d = q.shape
    group = heads // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    n = k.shape[1]
    s = q @ k.transpose(0, 2, 1) / np.sqrt(d)
    s[:, np.arange(n)[None, :] > np.arange(n - steps, n)[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    mine = (p @ v).transpose(1, 0, 2).reshape(steps, -1)
    return float(np.abs(mine - attn_out).max())


def _mean(results: list[SequenceRecall], field: str) -> Any:
    values = [getattr(r, field) for r in results]
    if isinstance(values[0], dict):
        return {k: round(float(np.mean([v[k] for v in values])), 4) for k in values[0]}
    return round(float(np.mean(values)), 4)


def summarise(results: list[SequenceRecall]) -> dict[str, Any]:
    recall = _mean(results, "recall")
    return {
        "recall": {
            m: recall[m] for m in (*MAIN_METHODS, *[x for x in METHODS if x not in MAIN_METHODS])
        },
        "recall_vs_oracle": {m: round(recall[m] / recall["oracle"], 4) for m in METHODS},
        "lead_time_prediction": _mean(results, "lead_time"),
        "lead_time_selection_only": _mean(results, "lead_time_selection_only"),
        "lead_time_blocks": _mean(results, "lead_time_blocks"),
        "candidate_share": _mean(results, "candidate_share"),
        "budget_blocks": _mean(results, "budget_blocks"),
        "context_blocks": _mean(results, "context_blocks"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    budgets = sorted({args.budget, *args.sweep})
    loaded = load_smollm2(ModelDType(args.dtype), threads=args.threads)
    config = SparseConfig.for_model(loaded.layers, loaded.q_heads, loaded.kv_heads, loaded.head_dim)
    per_budget: dict[float, list[SequenceRecall]] = {b: [] for b in budgets}
    docs_out: list[dict[str, Any]] = []
    for doc in read_qa_documents(args.data)[: args.docs]:
        ids = loaded.tokenizer(doc.text)["input_ids"][: min(args.tokens, loaded.max_positions)]
        started = time.perf_counter()
        q, k, err = capture(loaded, ids, args.queries, check_layer=min(5, loaded.layers - 1))
        prefill_s = time.perf_counter() - started
        entry: dict[str, Any] = {
            "title": doc.title,
            "tokens": len(ids),
            "prefill_s": round(prefill_s, 2),
            "capture_check_max_abs_err": err,
        }
        for b in budgets:
            res = evaluate_sequence(q, k, config, block_tokens=args.block_tokens, budget=b)
            per_budget[b].append(res)
            if b == args.budget:
                entry.update(summarise([res]))
        docs_out.append(entry)
    if not docs_out:
        raise SystemExit(f"{args.data}: no documents")
    result: dict[str, Any] = {
        **summarise(per_budget[args.budget]),
        "budget": args.budget,
        "tokens": args.tokens,
        "queries": args.queries,
        "block_tokens": args.block_tokens,
        "layers": list(config.layers),
        "model": loaded.path.name,
        "dtype": args.dtype,
        "capture_check_max_abs_err": max(d["capture_check_max_abs_err"] for d in docs_out),
        "config": {
            k: (v.value if hasattr(v, "value") else v)
            for k, v in asdict(config).items()
            if k != "layers"
        },
        "documents": docs_out,
    }
    if len(budgets) > 1:
        result["sweep"] = {str(b): summarise(per_budget[b]) for b in budgets}
    return result


def plot_and_record(result: dict[str, Any], data: str) -> None:
    """Draw recall against budget and record section ``sparse_recall`` of the benchmarks page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result.get("sweep", {str(result["budget"]): result})
    budgets = sorted(sweep, key=float)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("box_full_scan", *MAIN_METHODS):  # slsap is drawn over the scan it matches
        ax.plot(
            [float(b) for b in budgets],
            [sweep[b]["recall"][m] for b in budgets],
            marker="s" if m == "box_full_scan" else "o",
            markersize=9 if m == "box_full_scan" else 5,
            linestyle="--" if m == "box_full_scan" else "-",
            label=m,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (share of blocks per layer and KV head)")
    ax.set_ylabel("share of attention mass captured")
    ax.set_title(f"SmolLM2-135M, {result['tokens']} tokens, {len(result['documents'])} documents")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    benchlib.save_figure(fig, "sparse_recall.png")
    rows = [
        "| budget | " + " | ".join(MAIN_METHODS) + " | slsap / oracle | lead time |",
        "|---|" + "---|" * (len(MAIN_METHODS) + 2),
    ]
    for b in budgets:
        r = sweep[b]
        rows.append(
            f"| {float(b):.4g} | "
            + " | ".join(f"{r['recall'][m]:.3f}" for m in MAIN_METHODS)
            + f" | {r['recall_vs_oracle']['slsap']:.3f} | {r['lead_time_prediction']:.3f} |"
        )
    md = "\n".join(
        [
            "## Sparse attention recall (SLSAP)",
            "",
            f"`python -m tools.attention_recall --data {data} --tokens {result['tokens']} "
            f"--queries {result['queries']} --sweep {','.join(budgets)} --record`: share of the "
            "true attention mass of the last queries held by the selected blocks, averaged over "
            f"layers >= {result['layers'][0]}, query heads, queries and documents "
            f"({result['block_tokens']}-token blocks; sink and recent window kept; one selection "
            "per KV head, shared by its query heads). Lead time: share of step t+1's selected "
            "blocks named at step t.",
            "",
            *rows,
            "",
            "Capture check (max abs error of attention recomputed from the captured q, K, V): "
            f"{result['capture_check_max_abs_err']:.2e}.",
            "",
            "![recall vs budget](benchmarks/sparse_recall.png)",
            "",
            benchlib.machine_line(benchlib.machine()),
        ]
    )
    benchlib.record("sparse_recall", md, result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="LooGLE-format JSONL (documents in 'input')")
    parser.add_argument("--budget", type=float, default=0.125, help="share of blocks kept")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per document (max 8192)")
    parser.add_argument("--docs", type=int, default=5, help="first documents to use")
    parser.add_argument("--queries", type=int, default=32, help="last positions used as queries")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=[d.value for d in ModelDType], default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--sweep",
        type=lambda s: [float(x) for x in s.split(",") if x],
        default=[],
        help="comma-separated budgets to sweep (draws the plot)",
    )
    parser.add_argument("--record", action="store_true", help="write docs/benchmarks.md section")
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 1 or any(not 0 < b <= 1 for b in args.sweep):
        parser.error("budgets must be in (0, 1]")
    result = run(args)
    result["machine"] = benchlib.machine()
    if args.sweep or args.record:
        plot_and_record(result, args.data)
    benchlib.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
