"""LIST_KEYS's order at scale: memory per key, a page's cost and the longest single step.

``BlockIndex`` keeps each namespace's keys in byte order for LIST_KEYS. Before issue 32's third
round that was a ``sortedcontainers.SortedList`` of the keys' ``bytes``; now it is a
:class:`~kvtierd.store.keyorder.KeyOrder` (33-byte codes in numpy chunks, a small overlay
merged a chunk a step). For each ``--keys`` size, with random 16-byte keys (what
``chain_keys`` makes), this measures, the reference (the ``SortedList``) beside it in the same
run, alternating A B A B:

* memory per key (``tracemalloc``): the order (its own codes), against the list with keys of
  its own (after step 4 of the reshape no ``bytes`` object per key is left to share), and the
  list alone (its keys held elsewhere, as the index's blocks hold them today);
* a page of ``--limit`` keys from a random cursor (CPU seconds of this thread, median of
  ``--pages``), the order carrying an overlay half of its sweep bound, as in service;
* every ``add`` and ``remove`` one at a time, from the order built as a restart builds it
  until a sweep has begun and ended (the longest single one is what holds the event loop);
  and the same with the sweep made one step over the whole order (``chunk`` as large as the
  order: the merge at once, what the incremental sweep avoids).

In-process and CPU-bound; on a shared machine repeat it (``--repeat``).
``python -m tools.bench_keyorder --keys 1000000 10000000 --json`` prints one JSON object and
records the table in ``docs/benchmarks.md``. Figures are never asserted by tests.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
from sortedcontainers import SortedList  # type: ignore[import-untyped]

from kvtierd.keys import KEY_BYTES, MAX_KEY_BYTES
from kvtierd.store.keyorder import CHUNK, MERGE_AT, KeyOrder
from tools import benchlib


def _keys(n: int, seed: int) -> list[bytes]:
    data = np.random.default_rng(seed).bytes(n * KEY_BYTES)
    return [data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]


def _columns(keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` as the cold index's columns hold them (what a restart has)."""
    padded = np.zeros((len(keys), MAX_KEY_BYTES), np.uint8)
    padded[:, :KEY_BYTES] = np.frombuffer(b"".join(keys), np.uint8).reshape(-1, KEY_BYTES)
    return padded.view("<u8"), np.full(len(keys), KEY_BYTES, np.uint8)


def _traced(build: Callable[[], Any]) -> tuple[Any, int]:
    """What ``build`` returns and the bytes it left allocated."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        built = build()
        return built, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def _cpu(call: Callable[[], object]) -> float:
    start = time.thread_time()
    call()
    return time.thread_time() - start


def _pages(structure: Any, cursors: list[bytes], limit: int) -> float:
    """Median CPU seconds of a page from each cursor (for a ``SortedList``, as
    ``BlockIndex.page`` read it)."""
    if isinstance(structure, KeyOrder):
        return statistics.median(_cpu(lambda c=c: structure.page(c, limit)) for c in cursors)

    def page(after: bytes) -> list[bytes]:
        return list(itertools.islice(structure.irange(after, inclusive=(False, False)), limit + 1))

    return statistics.median(_cpu(lambda c=c: page(c)) for c in cursors)


def _steps(order: Any, fresh: list[bytes], stored: list[bytes]) -> dict[str, Any]:
    """Adds of ``fresh`` and removes of ``stored`` alternately, each timed, until a sweep has
    begun and ended (for a ``SortedList``: as many as the order needed)."""
    times: list[float] = []
    longest = longest_wall = 0.0
    swept = False
    is_order = isinstance(order, KeyOrder)
    gc.disable()
    try:
        for i, (new, old) in enumerate(zip(fresh, stored, strict=False)):
            for op, key in ((order.add, new), (order.remove, old)):
                start, cpu = time.perf_counter(), time.thread_time()
                op(key)
                took = time.thread_time() - cpu
                longest_wall = max(longest_wall, time.perf_counter() - start)
                times.append(took)
                longest = max(longest, took)
            if is_order:
                swept = swept or order.sweeping
                if swept and not order.sweeping:
                    break
            elif i >= MERGE_AT:
                break
    finally:
        gc.enable()
    return {
        "ops": len(times),
        "longest_s": longest,
        "longest_wall_s": longest_wall,
        "p9999_s": benchlib.percentile(times, 99.99),
        "median_s": statistics.median(times),
        "total_s": sum(times),
    }


def _run(n: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    keys = _keys(n, seed)
    rng = random.Random(seed)
    cursors = [rng.choice(keys) for _ in range(args.pages)]
    fresh = _keys(MERGE_AT * 2 + n // 10, seed + 1)
    words, klen = _columns(keys)
    result: dict[str, Any] = {"keys": n}
    for name in ("sortedlist", "keyorder") * args.repeat:
        if name == "sortedlist":
            structure, nbytes = _traced(lambda: SortedList(keys))
            # With keys of its own: what the list costs once nothing else holds the keys.
            owned, with_keys = _traced(lambda: SortedList(_keys(n, seed + 2)))
            result.setdefault("sortedlist_with_keys", []).append(with_keys / n)
            del owned
        else:
            start = time.thread_time()
            structure, nbytes = _traced(lambda: KeyOrder.from_columns(words, klen))
            result.setdefault("build_s", []).append(time.thread_time() - start)
            for key in fresh[-MERGE_AT // 2 :]:  # an overlay, as in service
                structure.add(key)
        row = result.setdefault(name, {"bytes_per_key": [], "page_s": []})
        row["bytes_per_key"].append(nbytes / n)
        row["page_s"].append(_pages(structure, cursors, args.limit))
        del structure
    sample = rng.sample(keys, min(n, len(fresh)))
    for name in ("sortedlist", "keyorder", "at_once") * args.repeat:
        if name == "sortedlist":
            structure = SortedList(keys)
        else:
            chunk = n + len(fresh) if name == "at_once" else CHUNK
            structure = KeyOrder.from_columns(words, klen, chunk=chunk)
        steps = _steps(structure, fresh, sample)
        result.setdefault(name, {}).setdefault("steps", []).append(steps)
        del structure
    for name in ("sortedlist", "keyorder"):
        row = result[name]
        row["bytes_per_key"] = statistics.median(row["bytes_per_key"])
        row["page_s"] = statistics.median(row["page_s"])
    for name in ("sortedlist", "keyorder", "at_once"):
        row = result[name]
        row["longest_s"] = statistics.median(s["longest_s"] for s in row["steps"])
        row["median_op_s"] = statistics.median(s["median_s"] for s in row["steps"])
    result["sortedlist_with_keys"] = statistics.median(result["sortedlist_with_keys"])
    result["memory_ratio"] = result["keyorder"]["bytes_per_key"] / result["sortedlist_with_keys"]
    result["page_ratio"] = result["keyorder"]["page_s"] / result["sortedlist"]["page_s"]
    result["longest_vs_at_once"] = result["keyorder"]["longest_s"] / result["at_once"]["longest_s"]
    return result


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "## LIST_KEYS order: memory, a page, the longest step (issue 32, index step 6)",
        "",
        "`KeyOrder` (33-byte codes in numpy chunks, an overlay merged a chunk a step) against",
        "the `SortedList` it replaced, same run, random 16-byte keys. Memory: `tracemalloc`; the",
        "list with its keys' `bytes` (the ratio's reference: step 4 leaves no other holder of",
        "them) and without. Page: CPU of one page from a random cursor, half an overlay in the",
        "order. Steps: every add and remove timed",
        "from a restart's order until a sweep has run; *at once*: the same with the whole",
        "overlay merged in one step (one chunk as large as the order).",
        "",
        f"| keys | B/key list with keys (alone) | B/key order | ratio "
        f"| page of {result['limit']} list (us) "
        "| page order (us) | ratio | longest step list (ms) | longest step order (ms) "
        "| merge at once (ms) | order / at once | build from columns (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        s, k, a = row["sortedlist"], row["keyorder"], row["at_once"]
        lines.append(
            f"| {row['keys']:,} | {row['sortedlist_with_keys']:.1f} ({s['bytes_per_key']:.1f}) "
            f"| {k['bytes_per_key']:.1f} | "
            f"{row['memory_ratio']:.2f} | {s['page_s'] * 1e6:.0f} | {k['page_s'] * 1e6:.0f} | "
            f"{row['page_ratio']:.2f} | {s['longest_s'] * 1e3:.2f} | {k['longest_s'] * 1e3:.2f} "
            f"| {a['longest_s'] * 1e3:.1f} | {row['longest_vs_at_once']:.3f} "
            f"| {statistics.median(row['build_s']):.2f} |"
        )
    lines += ["", benchlib.machine_line(result["machine"])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--limit", type=int, default=1024, help="keys a page (LIST_KEYS' default)")
    parser.add_argument("--pages", type=int, default=200, help="pages timed per structure")
    parser.add_argument("--repeat", type=int, default=2, help="A B rounds per size")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    rows = [_run(n, args, seed=n) for n in args.keys]
    result = {"machine": benchlib.machine(), "limit": args.limit, "rows": rows}
    benchlib.emit(result, args.json)
    if not args.no_record:
        benchlib.record("keyorder", _markdown(result), result)


if __name__ == "__main__":
    main()
