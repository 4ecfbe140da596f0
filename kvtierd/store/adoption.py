"""Start-up: the store indexes what the local lower tier recovered when it opened.

A tier that keeps its records as rows (:meth:`~kvtierd.store.tier.LowerTier.cold_rows`, the
NVMe tier) is adopted in bulk, with no ``Block`` made and no Python step per block: each
namespace's counts come from one ``bincount`` over the rows, its keys go to the listing order
as the rows' key columns (:meth:`~kvtierd.store.index.BlockIndex.adopt_keys`, one sort), and
the disk's policy, CLOCK by default, keeps its state in the rows themselves (only an LRU or
SLSAP chosen for the disk is told of each key); a ``Block`` is made only when one is asked
for (:class:`~kvtierd.store.index.BlockIndex`). At 1M blocks a ``Block`` each cost the start
13.5 s (docs/architecture.md, "The index at scale").
Any other tier lists its blocks (:meth:`~kvtierd.store.tier.LowerTier.recovered`) and gets a
``Block`` each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.store.coldrefs import ColdRows
from kvtierd.store.index import Block, BlockIndex
from kvtierd.store.namespaces import NamespaceRegistry
from kvtierd.store.tier import LowerTier
from kvtierd.store.tracking import TierPolicy

__all__ = ["adopt_recovered"]

log = logging.getLogger("kvtierd.store")


def adopt_recovered(
    lower: LowerTier,
    registry: NamespaceRegistry,
    index: BlockIndex,
    policy: TierPolicy,
    saw_seq: Callable[[int], None],
) -> int:
    """Index in ``index`` the blocks the local lower tier ``lower`` found when it opened, of
    the namespaces ``registry`` names, telling ``policy`` (the lower tier's) of them and
    ``saw_seq`` the newest ``seq``; how many."""
    if not lower.capabilities.recovers_on_open:
        return 0
    rows = lower.cold_rows()
    if rows is not None:
        return _adopt_rows(lower, registry, index, policy, saw_seq, rows)
    adopted = unknown = 0
    for found in lower.recovered():
        ns = registry.by_digest(found.ref.ns_digest)
        if ns is None:
            unknown += 1
            continue
        block = Block(ns, found.ref, copies={lower.kind: found.location})
        index.add(block)
        ns.nvme_blocks += 1
        policy.inserted(block, 0.0)
        saw_seq(found.ref.seq)
        adopted += 1
    _warn_unknown(unknown)
    return adopted


def _adopt_rows(
    lower: LowerTier,
    registry: NamespaceRegistry,
    index: BlockIndex,
    policy: TierPolicy,
    saw_seq: Callable[[int], None],
    rows: ColdRows,
) -> int:
    """Index the tier's rows as they are (the module's docstring)."""
    adopted = unknown = 0
    unadopted: set[bytes] = set()
    for digest, count in rows.counts().items():
        ns = registry.by_digest(digest)
        if ns is None:
            unknown += count
            unadopted.add(digest)
            continue
        ns.blocks += count
        ns.nvme_blocks += count
        adopted += count
    index.attach_cold(
        rows,
        lower.kind,
        registry.by_digest,
        adopted=adopted,
        unadopted=frozenset(unadopted),
    )
    cache_policy = policy.policy  # nothing is deferred yet: told at once
    per_block = cache_policy.recovers_by_insertion
    for digest, words, klen in rows.key_columns():
        ns = registry.by_digest(digest)
        if ns is None:
            continue
        index.adopt_keys(ns, words, klen)
        if per_block:
            for key in _keys(words, klen):
                cache_policy.inserted((digest, key), 0.0)
    saw_seq(rows.max_seq())
    _warn_unknown(unknown)
    return adopted


def _keys(words: npt.NDArray[np.uint64], klen: npt.NDArray[np.uint8]) -> list[bytes]:
    """The keys of key columns, for a policy with an entry per block (LRU, SLSAP chosen for
    the disk): a Python step each, which CLOCK, the default, does without."""
    flat, lengths = words.tobytes(), klen.tolist()
    return [flat[i * MAX_KEY_BYTES : i * MAX_KEY_BYTES + n] for i, n in enumerate(lengths)]


def _warn_unknown(unknown: int) -> None:
    if unknown:
        log.warning(
            "dropped %d recovered blocks of namespaces the namespace catalog does not name "
            "(it is missing or damaged, or they were forgotten)",
            unknown,
        )
