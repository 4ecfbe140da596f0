"""Start-up: the store indexes what the local lower tier recovered when it opened.

A tier that keeps its records as rows (:meth:`~kvtierd.store.tier.LowerTier.cold_rows`, the
NVMe tier) is adopted in bulk, with no ``Block`` made: each namespace's counts come from one
``bincount`` over the rows, and the keys, a piece of the columns at a time, go to the NVMe
policy (an entry per block until CLOCK over the rows replaces it) and to the listing order; a
``Block`` is made only when one is asked for (:class:`~kvtierd.store.index.BlockIndex`). At 1M
blocks a ``Block`` each cost the start 13.5 s (docs/architecture.md, "The index at scale").
Any other tier lists its blocks (:meth:`~kvtierd.store.tier.LowerTier.recovered`) and gets a
``Block`` each.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtierd.store.coldrefs import ColdRows
from kvtierd.store.index import Block

if TYPE_CHECKING:
    from kvtierd.store.residency import Residency

__all__ = ["adopt_recovered"]

log = logging.getLogger("kvtierd.store")


def adopt_recovered(r: Residency) -> int:
    """Index the blocks ``r``'s local lower tier found when it opened; how many."""
    if r.lower is None or not r.lower.capabilities.recovers_on_open:
        return 0
    rows = r.lower.cold_rows()
    if rows is not None:
        return _adopt_rows(r, rows)
    adopted = unknown = 0
    for found in r.lower.recovered():
        ns = r.registry.by_digest(found.ref.ns_digest)
        if ns is None:
            unknown += 1
            continue
        block = Block(ns, found.ref, copies={r.lower.kind: found.location})
        r.index.add(block)
        ns.nvme_blocks += 1
        r.lower_policy.inserted(block, 0.0)
        r.saw_seq(found.ref.seq)
        adopted += 1
    _warn_unknown(unknown)
    return adopted


def _adopt_rows(r: Residency, rows: ColdRows) -> int:
    """Index the tier's rows as they are (the module's docstring)."""
    assert r.lower is not None
    adopted = unknown = 0
    unadopted: set[bytes] = set()
    for digest, count in rows.counts().items():
        ns = r.registry.by_digest(digest)
        if ns is None:
            unknown += count
            unadopted.add(digest)
            continue
        ns.blocks += count
        ns.nvme_blocks += count
        adopted += count
    r.index.attach_cold(
        rows,
        r.lower.kind,
        r.registry.by_digest,
        adopted=adopted,
        unadopted=frozenset(unadopted),
    )
    policy = r.lower_policy.policy  # nothing is deferred yet: told at once
    for digest, keys in rows.keys_by_namespace():
        if digest in unadopted:
            continue
        r.index.adopt_keys(digest, keys)
        for key in keys:
            policy.inserted((digest, key), 0.0)
    r.saw_seq(rows.max_seq())
    _warn_unknown(unknown)
    return adopted


def _warn_unknown(unknown: int) -> None:
    if unknown:
        log.warning(
            "dropped %d recovered blocks of namespaces the namespace catalog does not name "
            "(it is missing or damaged, or they were forgotten)",
            unknown,
        )
