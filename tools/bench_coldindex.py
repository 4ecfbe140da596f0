"""The cold index's longest single step: what one put can hold the event loop for.

``ColdIndex.add`` runs on the daemon's event loop, once per record written back to NVMe. Two
of its calls are not like the others: the one that finds the bucket table too full, and the
one that finds the row columns full. Before issue 32's second round, the first rebuilt the
whole table at once (about 0.13 s a million keys); now it starts a table twice the size and
moves a few buckets per insert. This builds an index of ``--keys`` records (as a restart does,
from columns), then adds records one at a time, each timed in CPU seconds of its thread
(``time.thread_time``: the other engineers' processes preempting it are not counted; the
wall-clock longest is reported beside it), until a
bucket growth has begun and ended and the columns have grown. It does so twice, alternating:

* ``at_once``: the same index with incremental growth switched off (the table rebuilt on one
  insert: the behaviour before);
* ``incremental``: as the daemon runs it.

The figures: the longest single ``add`` of each, what it was doing (bucket growth, column
growth, a move step or an ordinary insert), the median ``add``, and the ratio of the two
longest. In-process and CPU-bound; on a shared machine repeat it (``--repeat``).

Beside them, the other step on the loop that grows with the index: the NVMe tier's CLOCK
(:mod:`kvtierd.store.clock`) choosing a batch of 16 victims, once with every row referenced
(its hand passes every row twice: the longest it can take) and then the median of 100 later
batches, each evicted as the tier would; and the same for write-back's sweep of one slot
class (``victims_in_class``), which filters the rows by their segment's class first.

``python -m tools.bench_coldindex --keys 1000000 4000000 --json`` prints one JSON object and
records the table in ``docs/benchmarks.md``. Figures are never asserted by tests.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, cast

import numpy as np

from kvtierd.store.clock import ClockPolicy
from kvtierd.store.coldindex import COLUMNS, ColdIndex
from kvtierd.store.records import RecordHeader
from tools import benchlib

DIGEST = b"\x01" * 16
SLOTS = 1 << 16  # slots a segment


def _prefilled(keys: int, incremental: bool) -> ColdIndex:
    """An index of ``keys`` records, keys ``0..keys-1`` as 8 bytes, as a restart builds it."""
    n = np.arange(keys, dtype=np.uint64)
    columns: dict[str, Any] = {}
    for name, dtype, width in COLUMNS:
        columns[name] = np.zeros((keys, width) if width > 1 else keys, dtype)
    columns["key"][:, 0] = n
    columns["klen"][:] = 8
    columns["stored"][:] = columns["raw"][:] = 4096
    columns["seq"][:] = n + 1
    columns["segment"][:] = n // SLOTS
    columns["index"][:] = n % SLOTS
    index = ColdIndex.from_columns(columns, [DIGEST], seed=5)
    if not incremental:
        index._incremental_from = 1 << 62
    return index


def _run(keys: int, incremental: bool) -> dict[str, Any]:
    index = _prefilled(keys, incremental)
    rows_before = len(index._cols["klen"])
    buckets_before = len(index._hash)
    times: list[float] = []  # CPU seconds of this thread: preemption by other work excluded
    longest = (0.0, "")
    longest_wall = 0.0
    grew_columns = grew_buckets = False
    n = keys
    gc.disable()
    try:
        while not (grew_columns and grew_buckets and not index.moving):
            h = RecordHeader(DIGEST, n.to_bytes(8, "little"), 4096, 4096, 0, n + 1, 0)
            moving, rows, buckets = index.moving, len(index._cols["klen"]), len(index._hash)
            start, cpu = time.perf_counter(), time.thread_time()
            index.add(DIGEST, h, n // SLOTS, n % SLOTS)
            took = time.thread_time() - cpu
            longest_wall = max(longest_wall, time.perf_counter() - start)
            times.append(took)
            kind = "move step" if moving else "insert"
            if len(index._hash) != buckets:
                kind, grew_buckets = "bucket growth", True
            if len(index._cols["klen"]) != rows:
                kind, grew_columns = "column growth", True
            if took > longest[0]:
                longest = (took, kind)
            n += 1
    finally:
        gc.enable()
    return {
        "keys": keys,
        "adds": len(times),
        "buckets": [buckets_before, len(index._hash)],
        "rows": [rows_before, len(index._cols["klen"])],
        "longest_s": longest[0],
        "longest_kind": longest[1],
        "longest_wall_s": longest_wall,
        "p9999_s": benchlib.percentile(times, 99.99),
        "median_s": statistics.median(times),
    }


def _clock(keys: int, prefix: str = "clock", slot_class: int | None = None) -> dict[str, float]:
    """CPU seconds of CLOCK's batches of 16 victims over ``keys`` rows, all referenced; with
    ``slot_class``, write-back's sweep of one class (``victims_in_class``) over segments of two
    classes in turn (half the rows of the one asked for)."""
    index = _prefilled(keys, True)
    index.column("ref")[:keys] = 1
    segments = (keys + SLOTS - 1) // SLOTS
    classes = np.where(np.arange(segments) % 2 == 0, 8192, 16384).astype(np.int64)
    policy = ClockPolicy(lambda: index, classes=lambda: classes)
    times: list[float] = []
    for _ in range(101):
        cpu = time.thread_time()
        if slot_class is None:
            chosen = policy.victims(16, lambda block: True)
        else:
            chosen = policy.victims_in_class(16, slot_class, lambda block: True)
        times.append(time.thread_time() - cpu)
        for block in chosen:
            index.remove(index.find(*cast(tuple[bytes, bytes], block)))
    return {
        f"{prefix}_all_referenced_s": times[0],
        f"{prefix}_median_s": statistics.median(times[1:]),
    }


def _column_copy(keys: int) -> float:
    """CPU seconds of growing ``keys`` rows of columns by copying them into arrays 1.25x
    longer, as the index did before its columns were grown by ``mremap``."""
    old = [np.ones((keys, width) if width > 1 else keys, dtype) for _, dtype, width in COLUMNS]
    start = time.thread_time()
    for column in old:
        grown = np.zeros((int(keys * 1.25), *column.shape[1:]), column.dtype)
        grown[:keys] = column
    return time.thread_time() - start


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "## Cold index: the longest single insert (issue 32, bucket growth off the loop)",
        "",
        "`ColdIndex.add` (on the event loop, once per record written back) timed one call at a",
        "time from an index of the given size until its buckets and columns have grown.",
        "Reference: the same index rebuilding its buckets at once (the behaviour before), same",
        "run; and the copy of the columns into arrays 1.25x longer (the columns' growth before).",
        "CLOCK: the NVMe tier's policy choosing 16 victims, every row referenced (two passes of",
        "its hand), and the median later batch; one class: write-back's sweep of the rows of one",
        "slot class (half of them, segments of two classes in turn), its ratio to the first.",
        "",
        "| keys | at once: longest (ms, what) | incremental: longest (ms, what) | ratio "
        "| column copy before (ms) | median add (us) | CLOCK all referenced (ms) "
        "| CLOCK batch (us) | one class: all referenced (ms, ratio) | one class: batch (us) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        a, b = row["at_once"], row["incremental"]
        lines.append(
            f"| {row['keys']:,} | {a['longest_s'] * 1e3:.1f} ({a['longest_kind']}) | "
            f"{b['longest_s'] * 1e3:.1f} ({b['longest_kind']}) | {row['ratio']:.3f} | "
            f"{row['column_copy_s'] * 1e3:.1f} | "
            f"{b['median_s'] * 1e6:.1f} | {row['clock_all_referenced_s'] * 1e3:.1f} | "
            f"{row['clock_median_s'] * 1e6:.0f} | "
            f"{row['clock_class_all_referenced_s'] * 1e3:.1f} "
            f"({row['clock_class_all_referenced_s'] / row['clock_all_referenced_s']:.2f}) | "
            f"{row['clock_class_median_s'] * 1e6:.0f} |"
        )
    lines += ["", benchlib.machine_line(result["machine"])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--repeat", type=int, default=1, help="A B pairs per size")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    rows = []
    for keys in args.keys:
        runs: dict[str, list[dict[str, Any]]] = {"at_once": [], "incremental": []}
        for _ in range(args.repeat):
            for name in runs:
                runs[name].append(_run(keys, name == "incremental"))
        # Per variant the run whose longest step is the median of its repeats.
        best = {
            name: sorted(found, key=lambda r: r["longest_s"])[len(found) // 2]
            for name, found in runs.items()
        }
        rows.append(
            {
                "keys": keys,
                **best,
                "ratio": best["incremental"]["longest_s"] / best["at_once"]["longest_s"],
                "column_copy_s": statistics.median(_column_copy(keys) for _ in range(3)),
                **_clock(keys),
                **_clock(keys, "clock_class", 8192),
                "runs": runs,
            }
        )
    result = {"machine": benchlib.machine(), "rows": rows}
    benchlib.emit(result, args.json)
    if not args.no_record:
        benchlib.record("coldindex", _markdown(result), result)


if __name__ == "__main__":
    main()
