"""Which promotions of a READ go to the disk together: runs (batches) of a READ's blocks.

A READ of blocks written one after another finds their records side by side in the data file.
Reading each record alone costs one request (and its Python, its completion, its wake-up) per
block, which at 448 KiB blocks is more of the event loop than the disk's time; one vectored read
of the whole run moves the same bytes with one request. Blocks read in random order cost a
task, a wait and a hash call each unless they too go together: the store batches any local
copies of a READ, and the tier reads those that follow one another in one request and the
others beside it, all in flight at once (:meth:`~kvtierd.store.tier.LowerTier.load_run`).
:func:`plan_runs` decides, purely, which neighbours of the READ's order go together: consecutive
items ``follows`` accepts, up to a bound on bytes and on items per run (what one batch holds
before any of it is verified, and the header pages it needs). It never reorders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["plan_runs"]

T = TypeVar("T")


def plan_runs(
    items: Sequence[T],
    follows: Callable[[T, T], bool],
    nbytes: Callable[[T], int],
    *,
    max_bytes: int,
    max_items: int,
) -> list[list[T]]:
    """``items`` cut, in order, into runs: an item joins the run before it when
    ``follows(last, item)`` and the run stays within ``max_bytes`` (``nbytes`` of each item)
    and ``max_items``; an item larger than ``max_bytes`` is a run of its own. Raises
    :class:`ValueError` for a bound below 1."""
    if max_bytes < 1 or max_items < 1:
        raise ValueError("a run holds at least one item of at least one byte")
    runs: list[list[T]] = []
    run_bytes = 0
    for item in items:
        size = nbytes(item)
        if (
            runs
            and len(runs[-1]) < max_items
            and run_bytes + size <= max_bytes
            and follows(runs[-1][-1], item)
        ):
            runs[-1].append(item)
            run_bytes += size
        else:
            runs.append([item])
            run_bytes = size
    return runs
