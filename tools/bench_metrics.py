"""What observability costs: the same requests with metrics on (and scraped) and off.

Two daemons with the same configuration, one with ``daemon.metrics_port`` set, run side by
side; rounds alternate between them (off, on, off, on ...), so drift of this shared machine hits
both. While the metrics daemon is measured, a thread scrapes its ``/metrics`` ten times a
second (a Prometheus scrape is usually every 15 s: this is the worst case). Per round:

* ``lookup``: LOOKUP round trip of 1 key, p50 and p99 (the request the histograms time most);
* ``read``: READ of 16 resident 64 KiB blocks copied into client buffers (``read_into``),
  requests per second;
* ``put``: ALLOC + COMMIT of 4 blocks of 64 KiB, requests per second.

The ratio of each round is metrics-on against metrics-off (latency: on / off; throughput:
off / on), so 1.00 is free and 1.05 costs 5 %. Then the scrape itself: its latency and body size
with 1 namespace and with 64 (the namespace label is bounded, so the body stops growing).

``python -m tools.bench_metrics --json`` prints one JSON object and records the table and the
plot in ``docs/benchmarks.md``. Figures are never asserted by tests.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtierd.client import chain_keys, connect
from kvtierd.testing import DaemonProcess, free_port
from tools import benchlib

BLOCK_BYTES = 64 << 10
READ_BLOCKS = 16
PUT_BLOCKS = 4


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        body: bytes = reply.read()
        return body


@contextlib.contextmanager
def _scraping(port: int | None, hz: float = 10.0) -> Iterator[None]:
    """Scrape ``/metrics`` at ``hz`` in a thread while the block runs (nothing for ``None``)."""
    if port is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(1 / hz):
            _scrape(port)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _rate(fn: Callable[[], object], count: int) -> float:
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    return count / (time.perf_counter() - t0)


def _measure(socket_path: Path, port: int | None, samples: int) -> dict[str, float]:
    with connect(socket_path) as client, _scraping(port):
        ns = client.namespace("bench-metrics", block_bytes=BLOCK_BYTES)
        keys = chain_keys(range(READ_BLOCKS), 1, ns.key_salt)
        block = np.random.default_rng(5).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
        ns.put(keys, [block] * READ_BLOCKS)
        out = [np.empty(BLOCK_BYTES, np.uint8) for _ in range(READ_BLOCKS)]
        latencies = []
        for _ in range(samples):
            t0 = time.perf_counter()
            ns.lookup(keys[:1])
            latencies.append(time.perf_counter() - t0)
        read_rate = _rate(lambda: ns.read_into(keys, out), samples // 4)
        counter = iter(range(1 << 30))

        def put() -> None:
            n = next(counter)
            ns.put(chain_keys(range(n * 8, n * 8 + PUT_BLOCKS), 1, b"p"), [block] * PUT_BLOCKS)

        put_rate = _rate(put, samples // 8)
        ns.forget(keys)
    return {
        "lookup_p50_us": float(np.percentile(latencies, 50)) * 1e6,
        "lookup_p99_us": float(np.percentile(latencies, 99)) * 1e6,
        "read_per_s": read_rate,
        "put_per_s": put_rate,
    }


def _ratios(off: dict[str, float], on: dict[str, float]) -> dict[str, float]:
    return {
        "lookup_p50": on["lookup_p50_us"] / off["lookup_p50_us"],
        "lookup_p99": on["lookup_p99_us"] / off["lookup_p99_us"],
        "read": off["read_per_s"] / on["read_per_s"],
        "put": off["put_per_s"] / on["put_per_s"],
    }


def _scrape_cost(socket_path: Path, port: int, samples: int) -> dict[str, Any]:
    """Scrape latency and body size with 1 namespace, then with 64 open."""
    result: dict[str, Any] = {}
    with connect(socket_path) as client:
        for count in (1, 64):
            for i in range(count):
                ns = client.namespace(f"scrape-{i}", block_bytes=4096)
                ns.lookup(chain_keys(range(1), 1, ns.key_salt))
            times = []
            body = b""
            for _ in range(samples):
                t0 = time.perf_counter()
                body = _scrape(port)
                times.append(time.perf_counter() - t0)
            result[f"namespaces_{count}"] = {
                "p50_ms": float(np.percentile(times, 50)) * 1e3,
                "p99_ms": float(np.percentile(times, 99)) * 1e3,
                "body_bytes": len(body),
                "series": sum(1 for line in body.splitlines() if line and line[:1] != b"#"),
            }
    return result


#: How long both daemons are exercised before the first measured round.
WARM_UP_S = 10.0


def run(rounds: int, samples: int) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-metrics-") as tmp:
        work = Path(tmp)
        common = {"dram_size": "256M", "nvme_size": "0"}
        off_daemon = DaemonProcess(work / "off", **common)  # type: ignore[arg-type]
        on_daemon = DaemonProcess(
            work / "on",
            config_text=f"[daemon]\nmetrics_port = {port}\n",
            **common,  # type: ignore[arg-type]
        )
        with off_daemon, on_daemon:
            # Warm both up for a while, not a number of requests: a freshly started daemon (and
            # this machine) runs slower for its first seconds, which would land in round 1.
            warm_until = time.monotonic() + WARM_UP_S
            while time.monotonic() < warm_until:
                _measure(off_daemon.socket, None, samples // 4)
                _measure(on_daemon.socket, port, samples // 4)
            offs, ons = [], []
            for _ in range(rounds):
                offs.append(_measure(off_daemon.socket, None, samples))
                ons.append(_measure(on_daemon.socket, port, samples))
            scrape = _scrape_cost(on_daemon.socket, port, 50)
    per_round = [_ratios(a, b) for a, b in zip(offs, ons, strict=True)]
    medians = {k: benchlib.median([r[k] for r in per_round]) for k in per_round[0]}
    return {
        "machine": benchlib.machine(),
        "rounds": rounds,
        "samples": samples,
        "scrape_hz": 10.0,
        "off": offs,
        "on": ons,
        "ratios": per_round,
        "median_ratios": medians,
        "scrape": scrape,
    }


def _plot(result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "lookup_p50": "LOOKUP p50",
        "lookup_p99": "LOOKUP p99",
        "read": "READ 16x64K",
        "put": "put 4x64K",
    }
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for x, key in enumerate(labels):
        values = [r[key] for r in result["ratios"]]
        ax.bar(x, result["median_ratios"][key], color="#4c72b0", alpha=0.8)
        ax.scatter([x] * len(values), values, color="black", s=12, zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(labels)), list(labels.values()))
    ax.set_ylabel("metrics on / off (cost; 1 = free)")
    ax.set_title("Cost of metrics, scraped at 10 Hz (bars: median, dots: rounds)")
    return benchlib.save_figure(fig, "metrics.png")


def _markdown(result: dict[str, Any], figure: str) -> str:
    rows = []
    names = {
        "lookup_p50": ("LOOKUP 1 key, p50", "lookup_p50_us", "us"),
        "lookup_p99": ("LOOKUP 1 key, p99", "lookup_p99_us", "us"),
        "read": ("READ of 16 resident 64 KiB blocks, copied out", "read_per_s", "/s"),
        "put": ("put of 4 blocks of 64 KiB (ALLOC + COMMIT)", "put_per_s", "/s"),
    }
    for key, (title, field, unit) in names.items():
        on = ", ".join(f"{r[field]:.0f}" for r in result["on"])
        off = ", ".join(f"{r[field]:.0f}" for r in result["off"])
        ratios = ", ".join(f"{r[key]:.2f}" for r in result["ratios"])
        rows.append(
            f"| {title} | {on} {unit} | {off} {unit} | {ratios} | "
            f"**{result['median_ratios'][key]:.2f}** |"
        )
    scrape = result["scrape"]
    one, many = scrape["namespaces_1"], scrape["namespaces_64"]
    return "\n".join(
        [
            "## Cost of metrics (`tools/bench_metrics.py`)",
            "",
            benchlib.machine_line(result["machine"]),
            "",
            "The same requests against two daemons of the same configuration, one serving "
            "`/metrics` and scraped ten times a second while measured (a usual scrape is every "
            "15 s), rounds alternating. Ratio: metrics-on cost against metrics-off "
            "(1.00 is free). Both daemons are warmed up for 10 s first. Per request the "
            "daemon pays one histogram observation; the rest is the scraping: at 10 Hz each "
            "scrape's few ms of rendering share this machine's 2 cores with the measured "
            "requests (and the scraping thread the client's interpreter), so the throughput "
            "ratios are an upper bound that a 15 s scrape interval divides by 150.",
            "",
            "| request | metrics on | metrics off (reference) | ratio per round | median |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"A scrape takes {one['p50_ms']:.1f} ms p50 ({one['p99_ms']:.1f} ms p99) with one "
            f"namespace, {one['series']} series in {one['body_bytes'] / 1024:.0f} KiB; with 64 "
            f"namespaces open {many['p50_ms']:.1f} ms ({many['p99_ms']:.1f} ms), "
            f"{many['series']} series in {many['body_bytes'] / 1024:.0f} KiB (the namespace "
            "label is bounded, so 64 namespaces cost what the bound allows, not 64 times).",
            "",
            f"![metrics cost]({figure})",
            "",
            "Reproduce: `python -m tools.bench_metrics --json` (about a minute).",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--no-record", action="store_true", help="leave docs/ alone")
    args = parser.parse_args()
    result = run(args.rounds, args.samples)
    if not args.no_record:
        benchlib.record("metrics", _markdown(result, _plot(result)), result)
    benchlib.emit(result, args.json)


if __name__ == "__main__":
    main()
