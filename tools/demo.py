"""The README's main job: a two-turn conversation about a real long document with the real
SmolLM2-135M, where the second turn starts from KV that kvtierd brought back from disk.

It starts kvtierd on its embedded defaults (socket and data under the checkout's
``.kvtierd/``) and loads the model. Turn 1 asks a question about a LooGLE document
(``../shared/data/loogle/shortdep_qa.jsonl``): the prompt is computed, its KV blocks and the
answer's are stored and made durable. Then the daemon is restarted, so its DRAM tier starts
empty and it recovers the blocks from its NVMe tier. Turn 2 (the conversation so far plus a
new question) restores the cached prefix from NVMe and computes only the new tokens. It prints
both turns' time to first token, their ratio, where the blocks came from, and whether the
restored cache answers exactly as the cache kept in memory does; then it stops the daemon.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtierd.client import Client, connect
from kvtierd.testing import DaemonProcess
from tools.fidelity import DEFAULT_DATA, MODEL_ID, check_inputs

ANSWER_TOKENS = 32
SECOND_QUESTION = "Summarise what the document says about this in one sentence."


def progress(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def answer(adapter: Any, loaded: Any, prefill: Any, console: Console, label: str) -> Any:
    """Greedy answer from a prefill, with a progress bar; a ``Continuation``."""
    import torch

    from kvtierd.testing.hf_fidelity import Continuation

    eos = loaded.tokenizer.eos_token_id
    tokens: list[int] = []
    rows: list[Any] = []
    logits = prefill.logits
    with progress(console) as bar:
        task = bar.add_task(f"{label}: generating", total=ANSWER_TOKENS)
        for _ in range(ANSWER_TOKENS):
            rows.append(logits)
            tokens.append(int(torch.argmax(logits)))
            bar.advance(task)
            if tokens[-1] == eos or len(tokens) == ANSWER_TOKENS:
                break
            logits = adapter.forward([tokens[-1]], prefill.cache)
    return Continuation(tokens, torch.stack(rows))


def turn(adapter: Any, prompt: list[int], console: Console, label: str) -> Any:
    """Prefill ``prompt`` through the adapter (restore + compute) under a spinner."""
    # No LOOKUP ahead of the prefill: it would start the disk reads before the clock does.
    what = f"{len(prompt):,}-token prompt, restoring what kvtierd holds and computing the rest"
    with console.status(f"{label}: {what} ...", spinner="dots"):
        return adapter.prefill(prompt, store=False)


def tier_hits(client: Client) -> dict[str, dict[str, int]]:
    return {t["name"]: t for t in client.stats()["tiers"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3072, help="turn-1 prompt length")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LooGLE-format JSONL")
    args = parser.parse_args()
    console = Console()
    reason = check_inputs(args.data)
    if reason is not None:
        console.print(f"[bold red]The demo cannot run:[/] {reason}")
        return 2
    from kvtierd.engines.hf import HfKvAdapter
    from kvtierd.testing.hf_fidelity import compare
    from kvtierd.testing.hf_prompts import document_prompt, follow_up, read_qa_documents
    from kvtierd.testing.smollm2 import ModelDType, load_smollm2

    document = next(d for d in read_qa_documents(args.data) if len(d.text) > 8 * args.tokens)
    question = document.questions[0] if document.questions else "What is this document about?"
    with console.status("Loading SmolLM2-135M-Instruct (bf16) ...", spinner="dots"):
        loaded = load_smollm2(ModelDType.BFLOAT16)
        prompt1 = document_prompt(loaded.tokenizer, document.text, question, tokens=args.tokens)
        import torch

        with torch.no_grad():  # the first forward carries one-time costs: not a turn's
            loaded.model(input_ids=torch.tensor([prompt1[:64]]), logits_to_keep=1)
    console.print(
        Panel.fit(
            f"Document: [bold]{document.title}[/] ({len(document.text):,} characters, cut to a "
            f"{args.tokens:,}-token prompt)\nTurn 1: {question}\nTurn 2: {SECOND_QUESTION}",
            title="kvtierd demo: resume a conversation from NVMe",
        )
    )
    daemon = DaemonProcess(None, dram_size=None, nvme_size=None)
    console.print(f"[bold]Starting kvtierd[/] on its defaults (socket {daemon.socket})")
    with daemon:
        with connect(daemon.socket) as client:
            adapter = HfKvAdapter.open(client, loaded.model, model_id=MODEL_ID)
            adapter.namespace.forget(adapter.keys(prompt1))  # turn 1 starts cold every run
            first = turn(adapter, prompt1, console, "Turn 1")
            reply1 = answer(adapter, loaded, first, console, "Turn 1")
            conversation = prompt1 + reply1.tokens
            stored = adapter.store(conversation, first.cache)
            client.fsync()
        console.print(
            f"[bold cyan]Turn 1[/] ({first.computed_tokens:,} tokens computed): "
            f"{loaded.tokenizer.decode(reply1.tokens, skip_special_tokens=True)}"
        )
        console.print(
            f"  stored {stored} blocks ({stored * adapter.namespace.block_bytes >> 20} "
            "MiB) and made them durable"
        )
        console.print(
            "[bold]Restarting kvtierd[/]: DRAM starts empty, blocks are recovered "
            "from the NVMe tier"
        )
        daemon.stop()
        daemon.start()
        prompt2 = follow_up(loaded.tokenizer, prompt1, reply1.tokens, SECOND_QUESTION)
        with connect(daemon.socket) as client:
            adapter = HfKvAdapter.open(client, loaded.model, model_id=MODEL_ID)
            second = turn(adapter, prompt2, console, "Turn 2")
            tiers = tier_hits(client)
            reply2 = answer(adapter, loaded, second, console, "Turn 2")
        console.print(
            f"[bold cyan]Turn 2[/] ({second.computed_tokens:,} tokens computed): "
            f"{loaded.tokenizer.decode(reply2.tokens, skip_special_tokens=True)}"
        )
        with console.status(
            "Checking: the same turn 2 from the cache kept in memory ...", spinner="dots"
        ):
            from kvtierd.engines.hf_cache import prefix_cache

            resident_cache = prefix_cache(loaded.model.config, first.cache, second.cached_tokens)
            logits = adapter.forward(prompt2[second.cached_tokens :], resident_cache)
            resident = dataclasses.replace(second, cache=resident_cache, logits=logits)
            reply2_resident = answer(adapter, loaded, resident, Console(quiet=True), "check")
        report = compare(reply2_resident, reply2)
    console.print("kvtierd stopped.")
    show(console, first, second, tiers, report, adapter.namespace.block_bytes)
    return 0 if report.bitwise_equal and second.blocks_by_tier.get("nvme") else 1


def show(console: Console, first: Any, second: Any, tiers: Any, report: Any, block: int) -> None:
    table = Table(title="Time to first token")
    table.add_column("")
    table.add_column("prompt", justify="right")
    table.add_column("restored", justify="right")
    table.add_column("computed", justify="right")
    table.add_column("TTFT", justify="right")
    table.add_row(
        "Turn 1 (cold)",
        f"{first.prompt_tokens:,}",
        f"{first.cached_tokens:,}",
        f"{first.computed_tokens:,}",
        f"{first.ttft_s:.2f} s",
    )
    table.add_row(
        "Turn 2 (after restart)",
        f"{second.prompt_tokens:,}",
        f"{second.cached_tokens:,}",
        f"{second.computed_tokens:,}",
        f"{second.ttft_s:.3f} s",
    )
    console.print(table)
    ratio = first.ttft_s / second.ttft_s
    console.print(
        f"Turn 2 started [bold green]{ratio:.0f}x faster[/] than turn 1, with a longer prompt."
    )
    origin = ", ".join(f"{n} from {k.upper()}" for k, n in second.blocks_by_tier.items())
    nvme = tiers.get("nvme", {})
    console.print(
        f"Blocks: {origin or 'none'} (LOOKUP {second.lookup_s * 1e3:.1f} ms, READ "
        f"{second.read_s * 1e3:.1f} ms, forward {second.forward_s * 1e3:.0f} ms); NVMe tier: "
        f"{nvme.get('hits', 0)} hits, {nvme.get('bytes_read', 0) / 2**20:.0f} MiB read "
        f"({second.hit_blocks * block / 2**20:.0f} MiB restored)"
    )
    verdict = "[bold green]identical[/]" if report.bitwise_equal else "[bold red]DIFFERENT[/]"
    console.print(
        f"Fidelity: turn 2 from the restored cache vs the cache kept in memory: {verdict} "
        f"(tokens equal {report.tokens_equal}, bitwise-equal logits {report.bitwise_equal}, "
        f"TV max {report.tv_max:.1e}, max |Δlogit| {report.max_abs_logit_diff:.3g}, "
        f"{report.steps} steps)"
    )


if __name__ == "__main__":
    sys.exit(main())
