"""The daemon mode of ``tools/replay.py``: the trace against a real kvtierd, SLSAP on and off."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtierd.replay import TraceRequest, capacity_in_blocks, distinct_blocks
from kvtierd.replay.daemon import DaemonReplay
from tools import benchlib


def daemon_mode(
    requests: Sequence[TraceRequest],
    trace: Path,
    capacity: float,
    *,
    block_bytes: int,
    speed: float,
    prefill_tokens_s: float,
    rounds: int,
) -> dict[str, Any]:
    """``rounds`` replays with SLSAP prefetch off and on, each against a fresh daemon, the order
    alternating from round to round (this disk's speed drifts by tens of percent within
    minutes); every figure is the median over rounds, and each round is kept."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    blocks = capacity_in_blocks(capacity, requests)
    per_mode: dict[str, list[dict[str, Any]]] = {"off": [], "slsap": []}
    for index in range(rounds):
        for prefetch in (False, True) if index % 2 == 0 else (True, False):
            result = _one_replay(
                requests, blocks, block_bytes, speed, prefill_tokens_s, prefetch=prefetch
            )
            per_mode["slsap" if prefetch else "off"].append(result)
    runs = {mode: _medians(results) for mode, results in per_mode.items()}
    wins = sum(
        on["read_wait_total_s"] < off["read_wait_total_s"]
        for off, on in zip(per_mode["off"], per_mode["slsap"], strict=True)
    )
    return {
        "mode": "daemon",
        "trace": str(trace),
        "requests": len(requests),
        "distinct_blocks": distinct_blocks(requests),
        "capacity_blocks": blocks,
        "block_bytes": block_bytes,
        "speed": speed,
        "prefill_tokens_s": prefill_tokens_s,
        "dram_fraction_at_read": {k: v["dram_fraction_at_read"] for k, v in runs.items()},
        "read_wait_total_s": {k: v["read_wait_total_s"] for k, v in runs.items()},
        "rounds": rounds,
        "rounds_slsap_waited_less": wins,
        "runs": runs,
        "per_round": per_mode,
        "machine": benchlib.machine(),
    }


def _one_replay(
    requests: Sequence[TraceRequest],
    blocks: int,
    block_bytes: int,
    speed: float,
    prefill_tokens_s: float,
    *,
    prefetch: bool,
) -> dict[str, Any]:
    with benchlib.bench_workdir("replay") as tmp:
        replay = DaemonReplay(
            tmp,
            capacity_blocks=blocks,
            block_bytes=block_bytes,
            speed=speed,
            prefill_tokens_s=prefill_tokens_s,
            prefetch=prefetch,
        )
        result = replay.replay(requests).as_dict()
    daemon = result.pop("daemon")
    result["prefetch_promoted"] = daemon.get("prefetch_promoted", 0)
    result["prefetch_used"] = daemon.get("prefetch_used", 0)
    result["prefetch_wasted_bytes"] = daemon.get("prefetch_wasted_bytes", 0)
    return result


def _medians(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric field's median over the rounds; other fields from the first round."""
    return {
        key: benchlib.median([r[key] for r in results])
        if isinstance(value, int | float) and not isinstance(value, bool)
        else value
        for key, value in results[0].items()
    }


def record_daemon_mode(result: dict[str, Any]) -> None:
    off, on = result["runs"]["off"], result["runs"]["slsap"]
    accuracy = on["prefetch_used"] / on["prefetch_promoted"] if on["prefetch_promoted"] else 0.0
    lines = [
        "## SLSAP in the daemon: trace replay against a real kvtierd",
        "",
        benchlib.machine_line(result["machine"]),
        "",
        f"The first {result['requests']} requests of `{Path(result['trace']).name}` "
        f"({result['distinct_blocks']:,} distinct blocks of {result['block_bytes'] >> 10} KiB; "
        f"DRAM holds {result['capacity_blocks']:,}, the NVMe tier all), replayed at "
        f"{result['speed']}x speed; one engine serving a FIFO queue at "
        f"{result['prefill_tokens_s']:,.0f} prefill tokens/s; LOOKUP at arrival, READ when the "
        "engine starts the request. *Off*: LRU, the arrival LOOKUP promotes nothing. *SLSAP*: the "
        "reuse policy, the arrival LOOKUP promotes its hits, idle-disk reuse promotions. "
        f"Medians of {result['rounds']} rounds, off and on alternating in order, each against a "
        f"fresh daemon; SLSAP's READ waited less in {result['rounds_slsap_waited_less']} of "
        f"{result['rounds']} rounds.",
        "",
        "| | blocks READ | already in DRAM at READ | READ wait total | p50 / p99 "
        "| prefetch accuracy | wasted prefetch |",
        "|---|---|---|---|---|---|---|",
        f"| off | {off['blocks_read']:,} | {off['dram_fraction_at_read']:.1%} | "
        f"{off['read_wait_total_s']:.2f} s | "
        f"{off['read_wait_p50_ms']:.1f} / {off['read_wait_p99_ms']:.1f} ms | - | - |",
        f"| SLSAP | {on['blocks_read']:,} | **{on['dram_fraction_at_read']:.1%}** | "
        f"**{on['read_wait_total_s']:.2f} s** | "
        f"{on['read_wait_p50_ms']:.1f} / {on['read_wait_p99_ms']:.1f} ms | "
        f"{accuracy:.1%} | {on['prefetch_wasted_bytes'] / 2**20:.1f} MiB |",
        "",
        "| round | off: in DRAM at READ, wait | SLSAP: in DRAM at READ, wait |",
        "|---|---|---|",
        *(
            f"| {i + 1} | {a['dram_fraction_at_read']:.1%}, {a['read_wait_total_s']:.2f} s "
            f"| {b['dram_fraction_at_read']:.1%}, {b['read_wait_total_s']:.2f} s |"
            for i, (a, b) in enumerate(
                zip(result["per_round"]["off"], result["per_round"]["slsap"], strict=True)
            )
        ),
        "",
        "Reproduce: `python -m tools.replay --mode daemon --requests 1000 "
        f"--rounds {result['rounds']} --record`.",
    ]
    benchlib.record("slsap_daemon_replay", "\n".join(lines), result)
