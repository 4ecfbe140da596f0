"""Does a restored KV cache give the answers the cache kept in memory gives?

Both caches continue greedily from the same prompt-token logits on the same computation path
(prefix cache, then a forward of the uncached tokens, then one-token decode steps): comparing a
restored cache against a one-shot prefill would measure the arithmetic of chunked prefill,
not storage. The restored side is teacher-forced with the resident side's tokens, so every step
compares distributions over the same context; ``tokens_equal`` says whether the restored side
would have chosen the same token at every step.

Per step, the total-variation distance is taken between the two top-20 distributions:
probabilities over the union of both sides' 20 most likely tokens, renormalised on that set.
Lossless storage must give bitwise-equal logits (TV 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["Continuation", "FidelityReport", "compare", "continue_with", "greedy_continue"]

TOP_K = 20


@dataclass(frozen=True)
class Continuation:
    """``tokens[i]`` is the argmax of ``logits[i]`` (``[steps, vocab]``, the model's dtype)."""

    tokens: list[int]
    logits: torch.Tensor


@dataclass(frozen=True)
class FidelityReport:
    """The comparison of two continuations of ``steps`` tokens."""

    steps: int
    tokens_equal: bool
    bitwise_equal: bool
    tv_max: float
    tv_mean: float
    max_abs_logit_diff: float
    first_divergence: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def greedy_continue(
    model: Any,
    cache: Any,
    first_logits: torch.Tensor,
    steps: int,
    *,
    forced: Sequence[int] | None = None,
    stop_token: int | None = None,
) -> Continuation:
    """Continue ``steps`` tokens from ``first_logits`` (the prompt's last logits) on ``cache``
    (one-token forwards that extend it); see :func:`continue_with`."""

    def step(token: int) -> torch.Tensor:
        out = model(
            input_ids=torch.tensor([[token]]),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    return continue_with(step, first_logits, steps, forced=forced, stop_token=stop_token)


def continue_with(
    step: Callable[[int], torch.Tensor],
    first_logits: torch.Tensor,
    steps: int,
    *,
    forced: Sequence[int] | None = None,
    stop_token: int | None = None,
) -> Continuation:
    """Continue ``steps`` tokens from ``first_logits``, ``step(token)`` giving the next logits.

    Step ``i`` records its logits and feeds its argmax, or ``forced[i]`` when given, to
    ``step``. Stops early after ``stop_token``.
    """
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    logits = first_logits
    with torch.no_grad():
        for i in range(steps):
            rows.append(logits)
            tokens.append(int(torch.argmax(logits)))
            fed = tokens[-1] if forced is None else int(forced[i])
            if i == steps - 1 or (stop_token is not None and fed == stop_token):
                break
            logits = step(fed)
    return Continuation(tokens, torch.stack(rows))


def _top_k_tv(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row TV between the renormalised top-``k`` distributions of logits ``a`` and ``b``."""
    pa, pb = torch.softmax(a.float(), dim=-1), torch.softmax(b.float(), dim=-1)
    support = torch.zeros_like(pa, dtype=torch.bool)
    support.scatter_(1, torch.topk(pa, k, dim=-1).indices, True)
    support.scatter_(1, torch.topk(pb, k, dim=-1).indices, True)
    qa, qb = pa * support, pb * support
    qa = qa / qa.sum(dim=-1, keepdim=True)
    qb = qb / qb.sum(dim=-1, keepdim=True)
    return 0.5 * (qa - qb).abs().sum(dim=-1)


def compare(
    resident: Continuation, restored: Continuation, *, top_k: int = TOP_K
) -> FidelityReport:
    """Compare ``restored`` (teacher-forced with ``resident.tokens``) against ``resident``."""
    steps = min(len(resident.tokens), len(restored.tokens))
    a, b = resident.logits[:steps], restored.logits[:steps]
    divergence = next((i for i in range(steps) if resident.tokens[i] != restored.tokens[i]), None)
    tv = _top_k_tv(a, b, top_k) if steps else torch.zeros(0)
    return FidelityReport(
        steps=steps,
        tokens_equal=divergence is None and len(resident.tokens) == len(restored.tokens),
        bitwise_equal=bool(a.dtype == b.dtype and torch.equal(a, b)),
        tv_max=float(tv.max()) if steps else 0.0,
        tv_mean=float(tv.mean()) if steps else 0.0,
        max_abs_logit_diff=float((a.float() - b.float()).abs().max()) if steps else 0.0,
        first_divergence=divergence,
    )
