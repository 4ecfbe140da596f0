"""Which prefixes of a chain SGLang may restore, pool by pool (pure: no I/O, no SGLang import).

A hybrid model keeps more than KV pages: Mamba states, sliding-window (SWA) pages, a DSA
indexer's pages. SGLang 0.5.23 stores each in a pool of its own and asks ``batch_exists_v2``
for the longest prefix every pool can serve, each pool by its *hit policy*
(``PoolHitPolicy``):

* ``all_pages``: every page of the prefix (an indexer's pages go with every KV page);
* ``trailing_pages``: only the last ``window`` pages before the prefix's end (a Mamba state or
  a sliding window is needed only where the computation resumes). Such a pool holds windows
  that end where spans were stored, so prefix 5 may be restorable while 4 and 3 are not: the
  answer is the *set* of restorable prefix lengths, which SGLang intersects across ranks;
* ``block_groups`` (DeepSeek V4's compressed pools) is named by SGLang but served by none of
  its own backends; it is refused here, as they refuse it.

A prefix is usable only when the KV pages and every pool allow it (all or nothing): the answer
is the largest length in the intersection. SGLang's own file backend (``HiCacheFile``) is the
reference these functions follow, window by window.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "ALL_PAGES",
    "TRAILING_PAGES",
    "PoolHits",
    "hit_policy",
    "pool_hits",
    "usable_prefix",
]

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"


@dataclass(frozen=True, slots=True)
class PoolHits:
    """One pool's verdict: ``boundary``, the longest prefix it can serve (0: none), and every
    prefix length it can serve."""

    boundary: int
    restorable: frozenset[int]


def hit_policy(policy: object) -> str:
    """SGLang's ``PoolHitPolicy`` (a ``str`` enum) or its value, checked.

    Raises:
        ValueError: a policy other than ``all_pages`` or ``trailing_pages``.
    """
    value = str(getattr(policy, "value", policy))
    if value not in (ALL_PAGES, TRAILING_PAGES):
        raise ValueError(
            f"kvtierd's SGLang backend serves the hit policies {ALL_PAGES!r} and "
            f"{TRAILING_PAGES!r}, not {value!r}"
        )
    return value


def pool_hits(policy: str, present: Sequence[bool], window: int = 1) -> PoolHits:
    """The prefixes of ``len(present)`` KV pages a pool can serve, ``present[i]`` saying
    whether it holds page ``i``; ``window`` is a ``trailing_pages`` pool's pages per prefix.

    Raises:
        ValueError: a policy other than ``all_pages`` or ``trailing_pages``.
    """
    if hit_policy(policy) == ALL_PAGES:
        boundary = next((i for i, here in enumerate(present) if not here), len(present))
        return PoolHits(boundary, frozenset(range(1, boundary + 1)))
    window = max(1, window)
    # missing[p]: pages absent among the first p; the window before p is whole when the count
    # does not grow over it.
    missing = [0, *itertools.accumulate(not here for here in present)]
    restorable = frozenset(
        p for p in range(1, len(present) + 1) if missing[p] == missing[max(0, p - window)]
    )
    return PoolHits(max(restorable, default=0), restorable)


def usable_prefix(kv_pages: int, pools: Iterable[PoolHits]) -> tuple[int, list[int]]:
    """The longest prefix every pool and the ``kv_pages`` stored KV pages allow, and every
    such length, ascending."""
    usable = set(range(1, kv_pages + 1))
    for hits in pools:
        usable &= hits.restorable
    ordered = sorted(usable)
    return (ordered[-1] if ordered else 0), ordered
