"""Seeded workload-model traces in Mooncake form, to check the cache policies beyond one trace.

The only real trace at hand is Mooncake's synthetic one, whose arrival times are a Poisson
process laid over the real request order. A policy must not be fitted to it, so its defaults
are also checked on traces with other structure, made by a small, documented model of how
inference requests share prefixes:

* **system prompts**: 20 of 1-5 blocks, popularity Zipf(1.3): every new conversation starts with
  one (a chat product's few templates);
* **documents**: 300 of 4-39 blocks, popularity Zipf(1.2), placed after the system prompt (RAG
  context, a long file an agent keeps reading);
* **sessions**: a request either continues a recent session (its whole history plus 1-3 new
  blocks: the next turn of a conversation, the next step of an agent) or starts a new one
  (system prompt, a document with some probability, 1-7 blocks of its own). Which recent session
  continues is exponential in recency (mean 8 sessions back); at most 400 stay open.

Three mixes (:data:`KINDS`): ``conversation`` (55 % of requests continue a session, 30 % of new
ones carry a document), ``agent`` (80 % continue, arrivals twice as dense) and ``rag`` (30 %
continue, every new session carries a document). Arrivals are Poisson. Block ids follow
Mooncake's rule: an id stands for the block and everything before it, so equal ids are equal
prefixes.

Deterministic given ``(kind, requests, seed)``. These traces are not evidence about production
workloads; they are evidence that a policy's defaults are not fitted to one trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtierd.replay.trace import TraceRequest

__all__ = ["KINDS", "WorkloadMix", "workload_trace"]

#: Tokens per block in the Mooncake format.
BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class WorkloadMix:
    continue_share: float
    """Share of requests that continue an open session."""
    document_share: float
    """Share of new sessions that carry a document after their system prompt."""
    mean_gap_ms: float
    """Mean time between arrivals."""


KINDS: dict[str, WorkloadMix] = {
    "conversation": WorkloadMix(continue_share=0.55, document_share=0.3, mean_gap_ms=60.0),
    "agent": WorkloadMix(continue_share=0.8, document_share=0.3, mean_gap_ms=30.0),
    "rag": WorkloadMix(continue_share=0.3, document_share=1.0, mean_gap_ms=60.0),
}
_SYSTEM_PROMPTS, _DOCUMENTS, _OPEN_SESSIONS = 20, 300, 400


def workload_trace(kind: str, requests: int = 4000, seed: int = 1) -> list[TraceRequest]:
    """``requests`` requests of the ``kind`` mix (a key of :data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload {kind!r}; one of {', '.join(KINDS)}")
    if requests < 1:
        raise ValueError("requests must be >= 1")
    mix = KINDS[kind]
    rng = np.random.default_rng(seed)
    fresh = iter(range(1 << 62))  # block contents never seen before

    def new_blocks(n: int) -> list[int]:
        return [next(fresh) for _ in range(n)]

    prompts = [new_blocks(int(rng.integers(1, 6))) for _ in range(_SYSTEM_PROMPTS)]
    documents = [new_blocks(int(rng.integers(4, 40))) for _ in range(_DOCUMENTS)]
    sessions: list[list[int]] = []
    chains: list[tuple[float, list[int]]] = []
    now = 0.0
    for _ in range(requests):
        now += float(rng.exponential(mix.mean_gap_ms))
        if sessions and rng.random() < mix.continue_share:
            back = min(int(rng.exponential(8.0)), len(sessions) - 1)
            k = len(sessions) - 1 - back
            sessions[k] = sessions[k] + new_blocks(int(rng.integers(1, 4)))
            chain = sessions[k]
        else:
            chain = list(prompts[_zipf_index(rng, 1.3, _SYSTEM_PROMPTS)])
            if rng.random() < mix.document_share:
                chain += documents[_zipf_index(rng, 1.2, _DOCUMENTS)]
            chain += new_blocks(int(rng.integers(1, 8)))
            sessions.append(chain)
            if len(sessions) > _OPEN_SESSIONS:
                sessions.pop(0)
        chains.append((now, chain))
    return _as_prefix_ids(chains)


def _zipf_index(rng: np.random.Generator, a: float, n: int) -> int:
    """An index in ``range(n)`` drawn from Zipf(``a``) truncated to ``n`` values (draws past
    ``n`` are drawn again: folding them back would flatten the tail)."""
    while True:
        rank = int(rng.zipf(a))
        if rank <= n:
            return rank - 1


def _as_prefix_ids(chains: list[tuple[float, list[int]]]) -> list[TraceRequest]:
    """Mooncake ids: one per distinct prefix, so an id names a block and all before it."""
    ids: dict[tuple[int, int], int] = {}  # (id of the prefix before, block) -> id
    out: list[TraceRequest] = []
    for now, chain in chains:
        hash_ids: list[int] = []
        parent = -1
        for block in chain:
            parent = ids.setdefault((parent, block), len(ids))
            hash_ids.append(parent)
        out.append(TraceRequest(float(int(now)), len(chain) * BLOCK_TOKENS, 64, tuple(hash_ids)))
    return out
