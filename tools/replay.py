"""Replay a Mooncake-format request trace through cache policies (simulation mode).

    python -m tools.replay --trace FILE --capacity 0.10 --policy lru,arc,s3fifo,belady,slsap --json

prints one JSON object; ``hit_ratio`` maps each policy to its block hit ratio. ``--capacity``
below 1 is a fraction of the trace's distinct blocks, otherwise a number of blocks. ``belady``
sees the future (offline optimum) and is labelled so in ``offline``.

    python -m tools.replay --sweep [--record]

runs every policy at 1, 5, 10 and 25 % on the trace, measures the pure SLSAP engine (block
references per second with every call into the policy timed, and memory per tracked block),
draws ``docs/benchmarks/slsap_replay.png`` and, with ``--record``, writes the ``slsap_replay``
section of ``docs/benchmarks.md``.

    python -m tools.replay --workloads [--record]

runs every policy at the same capacities on three seeded workload-model traces (conversation,
agent, RAG; ``kvtierd.replay.workloads``), the check that SLSAP's defaults are not fitted to the
one real trace, and records the ``slsap_workloads`` section.

    python -m tools.replay --mode daemon --requests 1000 [--capacity 0.10] [--speed 4]
        [--rounds 3] [--record]

replays against a real kvtierd (64 KiB blocks) with a queue-and-prefill-rate engine model, SLSAP
off then on, and reports the share of blocks already in DRAM when READ came and READ's wait on
the disk (``kvtierd.replay.daemon``).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from kvtierd.policy import AccessContext, CachePolicy
from kvtierd.replay import (
    ArrivalFeed,
    CacheSimulator,
    PolicyName,
    TraceRequest,
    capacity_in_blocks,
    distinct_blocks,
    read_mooncake,
    simulate,
)
from kvtierd.slsap import SlsapPolicy
from tools import benchlib
from tools.replay_plot import draw_hit_ratios

DEFAULT_TRACE = benchlib.ROOT.parent / "shared/data/traces/mooncake_fast25_synthetic_trace.jsonl"
SWEEP_CAPACITIES = (0.01, 0.05, 0.10, 0.25)
ALL_POLICIES = tuple(PolicyName)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacity", type=float, default=0.10)
    parser.add_argument("--policy", default=",".join(p.value for p in ALL_POLICIES))
    parser.add_argument("--block-bytes", type=int, default=65536)
    parser.add_argument("--json", action="store_true", help="one JSON object on one line")
    parser.add_argument("--sweep", action="store_true", help="the benchmark: all policies, 4 sizes")
    parser.add_argument(
        "--workloads", action="store_true", help="all policies, 4 sizes, workload-model traces"
    )
    parser.add_argument("--record", action="store_true", help="record the results in docs/")
    parser.add_argument("--mode", choices=("simulation", "daemon"), default="simulation")
    parser.add_argument("--requests", type=int, default=0, help="replay only the first N")
    parser.add_argument("--speed", type=float, default=4.0, help="daemon mode: time compression")
    parser.add_argument(
        "--rounds", type=int, default=3, help="daemon mode: off/on pairs (medians reported)"
    )
    parser.add_argument(
        "--prefill-tokens-s",
        type=float,
        default=100_000.0,
        help="daemon mode: the engine model's prefill rate",
    )
    args = parser.parse_args(argv)
    if args.workloads:
        from tools.replay_workloads import record_workloads_mode, workloads_mode

        result = workloads_mode(SWEEP_CAPACITIES, args.block_bytes)
        if args.record:
            record_workloads_mode(result)
        benchlib.emit(result, args.json)
        return 0
    requests = read_mooncake(args.trace)
    if args.requests:
        requests = requests[: args.requests]
    if args.mode == "daemon":
        from tools.replay_daemon import daemon_mode, record_daemon_mode

        result = daemon_mode(
            requests,
            args.trace,
            args.capacity,
            block_bytes=args.block_bytes,
            speed=args.speed,
            prefill_tokens_s=args.prefill_tokens_s,
            rounds=args.rounds,
        )
        if args.record:
            record_daemon_mode(result)
    elif args.sweep:
        result = sweep(requests, args.trace, args.block_bytes)
        if args.record:
            record(result)
    else:
        policies = [PolicyName(name.strip()) for name in args.policy.split(",") if name.strip()]
        result = one_capacity(requests, args.trace, args.capacity, policies, args.block_bytes)
    benchlib.emit(result, args.json)
    return 0


def one_capacity(
    requests: Sequence[TraceRequest],
    trace: Path,
    capacity: float,
    policies: Sequence[PolicyName],
    block_bytes: int,
) -> dict[str, Any]:
    """Every policy at one capacity: the ``--json`` interface."""
    blocks = capacity_in_blocks(capacity, requests)
    runs = {p.value: simulate(requests, p, blocks, block_bytes=block_bytes) for p in policies}
    return {
        "trace": str(trace),
        "requests": len(requests),
        "distinct_blocks": distinct_blocks(requests),
        "references": sum(len(r.hash_ids) for r in requests),
        "capacity_blocks": blocks,
        "block_bytes": block_bytes,
        "hit_ratio": {name: run.hit_ratio for name, run in runs.items()},
        "prefix_hit_ratio": {name: run.prefix_hit_ratio for name, run in runs.items()},
        "lower_tier_bytes": {name: run.lower_tier_bytes for name, run in runs.items()},
        "offline": [name for name, run in runs.items() if run.offline],
        "elapsed_s": {name: round(run.elapsed_s, 3) for name, run in runs.items()},
    }


class _TimedPolicy(CachePolicy):
    """Forwards every call to ``inner`` and adds up the time spent inside it."""

    def __init__(self, inner: SlsapPolicy) -> None:
        self.inner = inner
        self.spent_s = 0.0

    def _timed(self, call: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.spent_s += time.perf_counter() - started

    def observe_request(self, blocks: Sequence[Hashable], now: float, request_id: int) -> None:
        self._timed(self.inner.observe_request, blocks, now, request_id)

    def admit(self, block: Hashable, now: float, context: AccessContext | None = None) -> bool:
        return bool(self._timed(self.inner.admit, block, now, context))

    def inserted(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self._timed(self.inner.inserted, block, now, context)

    def accessed(self, block: Hashable, now: float, context: AccessContext | None = None) -> None:
        self._timed(self.inner.accessed, block, now, context)

    def removed(self, block: Hashable) -> None:
        self._timed(self.inner.removed, block)

    def victims(self, count: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        chosen: list[Hashable] = self._timed(self.inner.victims, count, evictable)
        return chosen

    def __len__(self) -> int:
        return len(self.inner)


def engine_cost(
    requests: Sequence[TraceRequest], capacity_blocks: int, repeats: int = 3
) -> dict[str, Any]:
    """Block references per second of time spent inside the SLSAP policy (all calls a store
    makes, timing overhead included; the median of ``repeats`` replays, since one run on a
    shared machine can be a few percent off either way), and its memory per tracked block."""
    runs: list[float] = []
    for _ in range(repeats):
        timed = _TimedPolicy(SlsapPolicy())
        run = CacheSimulator(timed, capacity_blocks, name="slsap").replay(ArrivalFeed(requests))
        runs.append(run.references / timed.spent_s)
    stats = timed.inner.statistics()
    tracked = stats.resident + stats.ghosts
    model = SlsapPolicy()
    started = time.perf_counter()
    for index, request in enumerate(requests):
        model.observe_request(request.hash_ids, request.arrival_s, index)
    observe_s = time.perf_counter() - started
    return {
        "capacity_blocks": capacity_blocks,
        "references": run.references,
        "events_per_s": round(benchlib.median(runs)),
        "events_per_s_runs": [round(r) for r in runs],
        "observe_events_per_s": round(run.references / observe_s),
        "load_average": os.getloadavg()[0],
        "tracked_blocks": tracked,
        "memory_bytes": stats.memory_bytes,
        "bytes_per_tracked_block": round(stats.memory_bytes / max(tracked, 1), 1),
    }


def sweep(requests: Sequence[TraceRequest], trace: Path, block_bytes: int) -> dict[str, Any]:
    """Every policy at every sweep capacity, plus the engine's cost at 10 % and at 1 % (the
    smallest tier refits most often for its size: at least every ``min_refit_events``)."""
    rows = [
        one_capacity(requests, trace, c, ALL_POLICIES, block_bytes) | {"capacity": c}
        for c in SWEEP_CAPACITIES
    ]
    cost = engine_cost(requests, capacity_in_blocks(0.10, requests))
    small = engine_cost(requests, capacity_in_blocks(0.01, requests))
    return {
        "trace": str(trace),
        "distinct_blocks": rows[0]["distinct_blocks"],
        "references": rows[0]["references"],
        "capacities": rows,
        "engine": cost,
        "engine_1_percent": small,
        "machine": benchlib.machine(),
    }


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw_hit_ratios(ax, result["capacities"])
    ax.set_ylabel("block hit ratio")
    ax.set_title("Mooncake FAST'25 synthetic trace: hit ratio vs capacity")
    ax.legend()
    benchlib.save_figure(fig, "slsap_replay.png")


def record(result: dict[str, Any]) -> None:
    plot(result)
    names = [p.value for p in ALL_POLICIES]
    lines = [
        "## SLSAP reuse policy: trace replay (simulation)",
        "",
        f"`python -m tools.replay --sweep --record` on `{Path(result['trace']).name}` "
        f"({result['references']} block references, {result['distinct_blocks']} distinct blocks)."
        " Block hit ratio of one DRAM tier, demand caching, no prefetch; `belady` is the offline"
        " optimum and sees the future. Accounting: `docs/slsap-reuse.md`.",
        "",
        "| capacity | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for row in result["capacities"]:
        cells = " | ".join(f"{row['hit_ratio'][n]:.4f}" for n in names)
        lines.append(f"| {100 * row['capacity']:g} % ({row['capacity_blocks']} blocks) | {cells} |")
    cost, small = result["engine"], result["engine_1_percent"]
    lines += [
        "",
        f"Pure SLSAP engine at 10 %: {cost['events_per_s']:,} block references/s on one core"
        f" (median of {', '.join(f'{r:,}' for r in cost['events_per_s_runs'])})"
        " with every call a store makes timed (observe, admit, victims, inserted, removed,"
        f" accessed); the reuse model alone (`observe_request`): {cost['observe_events_per_s']:,}"
        f" references/s. Memory: {cost['bytes_per_tracked_block']} bytes per tracked block"
        f" ({cost['tracked_blocks']} tracked: residents and ghosts). At 1 %, where refits are"
        f" most frequent for the tier's size: {small['events_per_s']:,} references/s (median of"
        f" {', '.join(f'{r:,}' for r in small['events_per_s_runs'])}). One-minute load average"
        f" during the run: {cost['load_average']:.1f} on {result['machine']['cores']} cores"
        " (a shared machine: throughput figures are lower bounds).",
        "",
        "![hit ratio vs capacity](benchmarks/slsap_replay.png)",
        "",
        benchlib.machine_line(result["machine"]),
    ]
    benchlib.record("slsap_replay", "\n".join(lines), result)


if __name__ == "__main__":
    raise SystemExit(main())
