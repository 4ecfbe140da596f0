"""Loop time: another client's LOOKUP latency while one client pipelines the largest requests.

Issue 31: one legal HINT (40 chains of 8192 keys) held the daemon's event loop for 250 ms, and
other clients' LOOKUP p99 went from 2.7 ms to 275 ms. This measures the same thing for every
opcode. One daemon; a *watcher* process LOOKUPs one stored key on its own connection, one LOOKUP
due every millisecond, each timed from when it fell due (so a stall counts for every LOOKUP that
fell due during it, as it would for an engine whose requests keep arriving). Rounds alternate:

* ``reference``: the watcher alone;
* ``heavy``: meanwhile a second process pipelines, on one connection, the largest legal request
  of every opcode, again and again: LOOKUP of 8192 resident and of 8192 NVMe keys, READ of 8192
  (copied out, then RELEASE) from DRAM and from NVMe, READ_RESIDENT of 8192, ALLOC + COMMIT of
  8192 new blocks, FORGET of 8192, a HINT whose queue holds 8192 keys (two chains), a sparse
  HINT of an 8192-block chain with 768 KiB of queries, LIST_KEYS of 8192, EVICT (a walk of the
  whole index), FSYNC, STATFS, LIST_NS, POOL_STATUS and DOCTOR.

The figure is the watcher's LOOKUP p99 in heavy rounds, against the goal (20 ms on this
machine), and as a ratio to the p99 of the reference rounds of the same run. Separate
processes, so that the load generator's interpreter never delays the watcher's. Everything
shares this machine's cores, so the figures are noisy; run it more than once.

``python -m tools.bench_loop --json`` prints one JSON object and records the table in
``docs/benchmarks.md``. Figures are never asserted by tests.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from kvtierd.client import KvtierError, chain_keys, connect, connect_async, ops
from kvtierd.protocol.messages import EvictRequest, ReadResidentReply, ReadResidentRequest
from kvtierd.testing import DaemonProcess
from kvtierd.testing.loop_load import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    HEAD_DIM,
    LAYERS,
    LAYOUT,
    QUERY_HEADS,
    SPARSE_BYTES,
    N,
)
from tools import benchlib

GOAL_P99_MS = 20.0
#: The watcher's LOOKUP rate: one due every millisecond.
PERIOD_S = 0.001
SETS = ("nvme", "dram", "even", "odd")


def _blocks(count: int, nbytes: int) -> list[np.ndarray]:
    return [np.full(nbytes, i % 251, np.uint8) for i in range(count)]


def _prepare(socket: Path) -> dict[str, list[bytes]]:
    with connect(socket) as client:
        ns = client.namespace("big", block_bytes=BLOCK_BYTES)
        sparse = client.namespace("sparse", block_bytes=SPARSE_BYTES, layout=LAYOUT, sparse=True)
        keys = chain_keys(range(BLOCK_TOKENS * len(SETS) * N), BLOCK_TOKENS, ns.key_salt)
        sets = {name: keys[i * N : (i + 1) * N] for i, name in enumerate(SETS)}
        sets["sparse"] = chain_keys(range(BLOCK_TOKENS * N), BLOCK_TOKENS, sparse.key_salt)
        ns.put(sets["nvme"], _blocks(N, BLOCK_BYTES))
        sparse.put(sets["sparse"], _blocks(N, SPARSE_BYTES))
        client.fsync()
        client.evict()
        ns.put(sets["dram"], _blocks(N, BLOCK_BYTES))
        ns.put(sets["odd"], _blocks(N, BLOCK_BYTES))
        watch = client.namespace("watch", block_bytes=BLOCK_BYTES)
        sets["watch"] = chain_keys(range(BLOCK_TOKENS), BLOCK_TOKENS, watch.key_salt)
        watch.put(sets["watch"], _blocks(1, BLOCK_BYTES))
        return sets


def _watch(socket: str, key: list[bytes], stop: Any, out: Any) -> None:
    """The watcher process: a LOOKUP due every :data:`PERIOD_S`, each timed from when it was due
    (not from when the previous answer let it go: a closed loop would count a 300 ms stall as
    one slow LOOKUP among thousands, where an engine's requests keep arriving during it);
    (due time, latency) of each until ``stop``."""
    samples: list[tuple[float, float]] = []
    _renice(-10)  # measure the daemon, not this process waiting for a core
    with connect(socket) as client:
        ns = client.namespace("watch", block_bytes=BLOCK_BYTES)
        due = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            if now < due:
                time.sleep(due - now)
            hits = ns.lookup(key)
            done = time.perf_counter()
            while due <= done:  # every LOOKUP that fell due meanwhile waited until now
                samples.append((due, done - due))
                due += PERIOD_S
            if hits != 1:
                raise RuntimeError(f"the watched key answered {hits} hits")
    out.put(samples)


async def _heavy_rounds(
    socket: Path, sets: dict[str, list[bytes]], seconds: float, skip: frozenset[str]
) -> tuple[int, float, float, dict[str, int]]:
    """Pipeline every opcode's largest request, round after round, for ``seconds``; (rounds,
    when the first began, when the last ended: ``perf_counter``, the same clock in every
    process here; the errors answered, by request and class: a quota refusal is a legitimate
    answer when the round's leases and writes together pin more than a connection's share)."""
    errors: dict[str, int] = {}
    queries = np.ones((LAYERS, QUERY_HEADS, HEAD_DIM), np.float32)
    new_blocks = _blocks(N, BLOCK_BYTES)
    rounds = 0
    async with connect_async(socket) as client:
        ns = await client.namespace("big", block_bytes=BLOCK_BYTES)
        sparse = await client.namespace(
            "sparse", block_bytes=SPARSE_BYTES, layout=LAYOUT, sparse=True
        )
        scratch = await client.namespace("scratch", block_bytes=BLOCK_BYTES)
        nsid = ns.handle.ns

        async def read(keys: list[bytes]) -> None:
            await ns.read_into(keys, [bytearray(BLOCK_BYTES) for _ in keys])

        async def read_resident() -> None:
            reply = await client.run(ops.request(ReadResidentRequest(sets["dram"]), nsid))
            assert isinstance(reply, ReadResidentReply)
            if reply.extents:
                await client.run(ops.release([reply.lease]))

        began = time.perf_counter()
        until = began + seconds
        while time.perf_counter() < until:
            put, forget = ("even", "odd") if rounds % 2 == 0 else ("odd", "even")
            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "lookup_dram": lambda: ns.lookup(sets["dram"]),
                "lookup_nvme": lambda: ns.lookup(sets["nvme"]),
                "read_resident": read_resident,
                "read_dram": lambda: read(sets["dram"]),
                "read_nvme": lambda: read(sets["nvme"]),
                "put": lambda put=put: ns.put(sets[put], new_blocks),  # type: ignore[misc]
                "forget": lambda forget=forget: ns.forget(sets[forget]),  # type: ignore[misc]
                "hint_queue": lambda: ns.hint([sets["nvme"][: N // 2], sets["nvme"][N // 2 :]]),
                "hint_sparse": lambda: sparse.hint_attention(
                    sets["sparse"], queries, query_layers=list(range(LAYERS)), budget_blocks=64
                ),
                "list_keys": lambda: client.list_keys(nsid, limit=N),
                "evict": lambda: client.run(ops.request(EvictRequest(), scratch.handle.ns)),
                "fsync": client.fsync,
                "statfs": client.stats,
                "list_ns": client.namespaces,
                "pool_status": client.pool_status,
                "doctor": client.doctor,
            }
            async with anyio.create_task_group() as tg:
                for name, call in calls.items():
                    if name not in skip:
                        tg.start_soon(_answered, name, call, errors)
            rounds += 1
        return rounds, began, time.perf_counter(), errors


async def _answered(name: str, call: Callable[[], Awaitable[Any]], errors: dict[str, int]) -> None:
    try:
        await call()
    except KvtierError as exc:
        label = f"{name}: {type(exc).__name__}"
        errors[label] = errors.get(label, 0) + 1


def _renice(increment: int) -> None:
    with contextlib.suppress(OSError):  # raising priority needs root (CAP_SYS_NICE)
        os.nice(increment)


def _heavy(
    socket: str, sets: dict[str, list[bytes]], seconds: float, skip: frozenset[str], out: Any
) -> None:
    _renice(10)  # its own CPU work (copies, checksums) must not starve the watcher
    try:
        out.put(anyio.run(_heavy_rounds, Path(socket), sets, seconds, skip))
    except BaseException as exc:  # the parent must hear of it, not wait for ever
        out.put(repr(exc))
        raise


def _summary(latencies_s: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in latencies_s]
    return {
        "lookups": len(ms),
        "p50_ms": benchlib.percentile(ms, 50),
        "p99_ms": benchlib.percentile(ms, 99),
        "p999_ms": benchlib.percentile(ms, 99.9),
        "max_ms": max(ms),
        "over_goal": sum(x >= GOAL_P99_MS for x in ms),
    }


def run(
    rounds: int, seconds: float, runtime: str, io_backend: str, skip: frozenset[str] = frozenset()
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    config = f'[nvme]\nio_backend = "{io_backend}"\n'
    with tempfile.TemporaryDirectory() as tmp:
        daemon = DaemonProcess(
            Path(tmp) / "kvtierd",
            dram_size="384M",
            nvme_size="1G",
            runtime=runtime,
            config_text=config,
        )
        with daemon:
            sets = _prepare(daemon.socket)
            stop, samples = ctx.Event(), ctx.Queue()
            watcher = ctx.Process(
                target=_watch, args=(str(daemon.socket), sets["watch"], stop, samples)
            )
            watcher.start()
            time.sleep(1.0)  # connected and warm
            windows: list[tuple[str, float, float, int]] = []
            refused: dict[str, int] = {}
            for _ in range(rounds):
                start = time.perf_counter()
                time.sleep(seconds)
                windows.append(("reference", start, time.perf_counter(), 0))
                done = ctx.Queue()
                heavy = ctx.Process(
                    target=_heavy, args=(str(daemon.socket), sets, seconds, skip, done)
                )
                heavy.start()
                answer = done.get(timeout=600)
                heavy.join()
                if isinstance(answer, str):
                    raise RuntimeError(f"the heavy client failed: {answer}")
                heavy_rounds, start, end, errors = answer
                windows.append(("heavy", start, end, heavy_rounds))
                for label, count in errors.items():
                    refused[label] = refused.get(label, 0) + count
            stop.set()
            watched: list[tuple[float, float]] = samples.get(timeout=60)
            watcher.join()
    results: list[dict[str, Any]] = []
    for kind, start, end, heavy_rounds in windows:
        inside = [lat for t, lat in watched if start <= t < end]
        results.append({"kind": kind, "heavy_rounds": heavy_rounds, **_summary(inside)})
    reference = [r["p99_ms"] for r in results if r["kind"] == "reference"]
    loaded = [r["p99_ms"] for r in results if r["kind"] == "heavy"]
    p99 = benchlib.median(loaded)
    worst = max(r["max_ms"] for r in results if r["kind"] == "heavy")
    return {
        "machine": benchlib.machine(),
        "runtime": runtime,
        "io_backend": io_backend,
        "skipped": sorted(skip),
        "seconds_per_round": seconds,
        "rounds": results,
        "reference_p99_ms": benchlib.median(reference),
        "heavy_p99_ms": p99,
        "ratio": p99 / benchlib.median(reference),
        "goal_p99_ms": GOAL_P99_MS,
        "goal_met": p99 < GOAL_P99_MS,
        "max_ms": worst,
        "errors_answered": refused,
    }


def _markdown(result: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    rows = [
        f"| {r['kind']} | {r['heavy_rounds'] or ''} | {r['lookups']} | {r['p50_ms']:.2f} | "
        f"{r['p99_ms']:.2f} | {r['p999_ms']:.1f} | {r['max_ms']:.1f} | {r['over_goal']} |"
        for r in result["rounds"]
    ]
    history = [
        f"| {run['machine']['date']} | {run.get('label', '')} | {run['runtime']} | "
        f"{run.get('io_backend', 'auto')} | "
        f"{run['reference_p99_ms']:.2f} | {run['heavy_p99_ms']:.2f} | {run['ratio']:.1f} | "
        f"{run.get('max_ms', float('nan')):.0f} | {'met' if run['goal_met'] else 'missed'} |"
        for run in runs
    ]
    return "\n".join(
        [
            "## Loop time under the largest requests (`tools/bench_loop.py`)",
            "",
            benchlib.machine_line(result["machine"]),
            "",
            "A watcher process LOOKUPs one key on its own connection, one LOOKUP due every "
            "millisecond, each timed from when it fell due (a stall counts for every LOOKUP "
            "due during it); in *heavy* rounds a second process pipelines the largest legal "
            "request of every opcode (8192 keys each, a HINT queue of 8192 keys, a sparse HINT "
            "of an 8192-block chain with 768 KiB of queries, LIST_KEYS 8192, EVICT, FSYNC, the "
            "admin requests), round after round; *reference* rounds are the watcher alone, "
            "in the same run. "
            f"Goal (issue 31): the watcher's LOOKUP p99 under {GOAL_P99_MS:.0f} ms while "
            "loaded (before: one 40 x 8192-key HINT alone took it from 2.7 ms to 275 ms).",
            "",
            f"| round | heavy rounds done | LOOKUPs | p50 ms | p99 ms | p99.9 ms | max ms | "
            f"LOOKUPs of {GOAL_P99_MS:.0f} ms or more |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Median p99: **{result['heavy_p99_ms']:.2f} ms** loaded against "
            f"{result['reference_p99_ms']:.2f} ms alone (ratio {result['ratio']:.1f}); goal "
            f"{'met' if result['goal_met'] else 'missed'}.",
            "",
            "What was found on the way (issue 31, item 5). The HINT queue bound and the "
            "slices removed the per-request holds that the issue measured (one HINT, 250 ms) "
            "and that the same pipeline showed before (an 8192-block COMMIT's policy "
            "bookkeeping applied at once, 50-80 ms; 8192 promotion tasks started at once, "
            "230 ms; an 8192-block READ's or ALLOC's walk, 80-140 ms): the loaded p99 fell by "
            "about half (the `before` rows against `after (slicing)`). What was left were "
            "stops of 100-300 ms a few times per heavy round, with any subset of the requests "
            "(`--skip`, `--io-backend threads`): CPython's full garbage collections, which "
            "walk every tracked object the daemon holds and which no slice can cut (with the "
            "collector disabled, an experiment only, the `gc disabled` row met the goal). The "
            "daemon now freezes its long-lived objects once it serves and every 10 s "
            "(`kvtierd/server/collector.py`), so a full collection walks only what was made "
            "since, and an 8192-key LOOKUP (a 5 ms step) takes its turn on the lane: the "
            "`gc frozen` rows. A closed-loop watcher (each LOOKUP sent when the previous "
            "answered) hides such stops: it measured a loaded p99 of 3-5 ms for the slicing "
            "code alone.",
            "",
            "Requests of the heavy client answered with an error (each a refusal the "
            "protocol defines, counted, not retried): "
            + (
                ", ".join(f"{k} x{v}" for k, v in sorted(result["errors_answered"].items()))
                or "none"
            )
            + ".",
            "",
            "Runs recorded (each a separate invocation; the machine is shared, so figures "
            "move with whatever else runs: these ran late, at a load average of 1.0-1.5 "
            "on its 2 vCPUs, after the other engineers' test runs had ended; `before` is "
            "commit ce268ce, which has the HINT bound but none of the slicing, run by the "
            "same tool from a worktree):",
            "",
            "| date | daemon | runtime | NVMe I/O | reference p99 ms | loaded p99 ms | ratio | "
            "loaded max ms | goal |",
            "|---|---|---|---|---|---|---|---|---|",
            *history,
            "",
            "Reproduce: `python -m tools.bench_loop --json` (about a minute).",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0, help="per round")
    parser.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument(
        "--io-backend", choices=["auto", "io_uring", "threads"], default="auto", help="nvme's"
    )
    parser.add_argument(
        "--skip", default="", help="requests to leave out, comma-separated (to find a cause)"
    )
    parser.add_argument(
        "--label", default="", help="what the daemon ran, for the record (default: the commit)"
    )
    parser.add_argument("--no-record", action="store_true", help="leave docs/ alone")
    args = parser.parse_args()
    skip = frozenset(filter(None, args.skip.split(",")))
    result = run(args.rounds, args.seconds, args.runtime, args.io_backend, skip)
    result["label"] = args.label or result["machine"]["commit"]
    if not args.no_record and not skip:
        runs = _history(result)
        benchlib.record("loop", _markdown(result, runs), {**result, "history": runs})
    benchlib.emit(result, args.json)


def _history(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The earlier runs' summaries (from the recorded JSON) and this one's."""
    import json

    path = benchlib.ASSETS / "loop.json"
    earlier: list[dict[str, Any]] = []
    if path.exists():
        earlier = json.loads(path.read_text()).get("history", [])
    keep = (
        "label",
        "machine",
        "runtime",
        "io_backend",
        "reference_p99_ms",
        "heavy_p99_ms",
        "ratio",
        "goal_met",
        "max_ms",
    )
    return [*earlier, {k: result[k] for k in keep}][-8:]


if __name__ == "__main__":
    main()
