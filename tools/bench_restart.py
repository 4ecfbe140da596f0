"""A restart with the DRAM kept (issue 35, item 2): what a `systemctl restart` costs an engine's
working set, with the DRAM handed through systemd's file-descriptor store and without.

One real daemon (``--dram`` of DRAM, an NVMe tier) and a working set of ``--blocks-of`` blocks
filling ``--fill`` of the DRAM, FSYNCed. Then, once per mode, the daemon is stopped (SIGTERM)
and started again, and the whole working set is read back once through the client library
(``read_into``, verified as it is copied out), as an engine resuming its conversations would:

* ``kept``: a harness plays systemd (:class:`kvtierd.testing.ServiceManager`: the notify socket
  and the fd store); the start takes the regions back and verifies every block;
* ``not kept``: ``dram.keep_across_restarts = false``, the behaviour before: the DRAM starts
  empty and the first read of each block comes from NVMe (the page cache dropped first, where
  this process may).

References measured in the same run, on the same bytes: a numpy copy of the working set
(memcpy: what a read of resident blocks can at best approach) and xxh3-64 of it in this process
(the work the start's verification does). Figures: stop and start seconds, the verification's
own time (from the daemon's log) against the in-process hash, and the first pass's GB/s in each
mode, against memcpy and against each other.

``python -m tools.bench_restart --json`` prints one JSON object and records the section in
``docs/benchmarks.md`` with a plot. Tests never assert on these figures.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import numpy as np
import xxhash

from kvtierd.client import chain_keys, connect
from kvtierd.testing import DaemonProcess, ServiceManager
from tools import benchlib

NAME = "restart"
_ADOPTED = re.compile(
    r"DRAM kept across the restart: (\d+) blocks \(.*?\) verified and adopted in ([0-9.]+) s"
)


def _config(keep: bool) -> str:
    return f"[dram]\nkeep_across_restarts = {'true' if keep else 'false'}\n"


def _fill(daemon: DaemonProcess, count: int, block: int) -> list[bytes]:
    with connect(daemon.socket) as client:
        ns = client.namespace("working-set", block_bytes=block)
        keys = chain_keys(range(16 * count), 16, ns.key_salt)
        rng = np.random.default_rng(7)
        for start in range(0, count, 16):
            part = keys[start : start + 16]
            ns.put(part, [rng.integers(0, 256, block, np.uint8) for _ in part])
        client.fsync()
    return keys


def _first_pass(daemon: DaemonProcess, keys: list[bytes], block: int) -> dict[str, Any]:
    """Read every block once, 8 at a time; seconds, GB/s and where they came from."""
    with connect(daemon.socket) as client:
        ns = client.namespace("working-set", block_bytes=block)
        tiers = ns.lookup_each(keys, promote=False)
        buffers = [bytearray(block) for _ in range(8)]
        started = time.perf_counter()
        for start in range(0, len(keys), 8):
            part = keys[start : start + 8]
            ns.read_into(part, buffers[: len(part)])
        seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "gb_per_s": len(keys) * block / seconds / 1e9,
        "from_dram": tiers.count("dram"),
        "from_nvme": tiers.count("nvme"),
    }


def _restart(daemon: DaemonProcess) -> tuple[float, float]:
    started = time.perf_counter()
    daemon.stop()
    stopped = time.perf_counter()
    daemon.start(timeout_s=300)
    return stopped - started, time.perf_counter() - stopped


def _references(nbytes: int) -> dict[str, float]:
    source = np.random.default_rng(1).integers(0, 256, nbytes, np.uint8)
    target = np.empty_like(source)
    copies, hashes = [], []
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(target, source)
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        xxhash.xxh3_64_intdigest(source.data)
        hashes.append(time.perf_counter() - started)
    return {
        "memcpy_gb_per_s": nbytes / min(copies) / 1e9,
        "xxh3_gb_per_s": nbytes / min(hashes) / 1e9,
    }


def run(dram: int, fill: float, block: int) -> dict[str, Any]:
    count = int(dram * fill) // block
    result: dict[str, Any] = {
        "machine": benchlib.machine(),
        "dram_bytes": dram,
        "block_bytes": block,
        "blocks": count,
        "working_set_bytes": count * block,
    }
    result["references"] = _references(count * block)
    for mode, keep in (("kept", True), ("not_kept", False)):
        with benchlib.bench_workdir(f"restart-{mode}") as work, ServiceManager(work) as manager:
            daemon = DaemonProcess(
                work / "d",
                dram_size=str(dram),
                nvme_size=str(4 * dram),
                config_text=_config(keep),
                manager=manager,
            )
            with daemon:
                benchlib.log(f"{mode}: writing {count} blocks of {benchlib.size_name(block)}")
                keys = _fill(daemon, count, block)
                stop_s, start_s = _restart(daemon)
                if not keep:
                    benchlib.drop_page_cache()
                first = _first_pass(daemon, keys, block)
                adopted = _ADOPTED.search(daemon.log())
            result[mode] = {
                "stop_s": stop_s,
                "start_s": start_s,
                "first_pass": first,
                "verified_blocks": int(adopted[1]) if adopted else 0,
                "verify_s": float(adopted[2]) if adopted else 0.0,
            }
            benchlib.log(f"{mode}: {result[mode]}")
    kept, cold = result["kept"], result["not_kept"]
    refs = result["references"]
    result["ratios"] = {
        "first_pass_kept_vs_not_kept": kept["first_pass"]["gb_per_s"]
        / cold["first_pass"]["gb_per_s"],
        "first_pass_kept_vs_memcpy": kept["first_pass"]["gb_per_s"] / refs["memcpy_gb_per_s"],
        "verify_vs_xxh3": (
            (count * block / kept["verify_s"] / 1e9) / refs["xxh3_gb_per_s"]
            if kept["verify_s"]
            else None
        ),
    }
    return result


def _markdown(result: dict[str, Any], figure: str) -> str:
    kept, cold, refs, ratios = (
        result["kept"],
        result["not_kept"],
        result["references"],
        result["ratios"],
    )
    verify = ratios["verify_vs_xxh3"]
    lines = [
        "## Restart with the DRAM kept (`tools/bench_restart.py`)",
        "",
        benchlib.machine_line(result["machine"]),
        "",
        f"A working set of {result['blocks']} blocks of "
        f"{benchlib.size_name(result['block_bytes'])} "
        f"({result['working_set_bytes'] / 2**30:.2f} GiB) in a {result['dram_bytes'] >> 20} MiB "
        "DRAM tier, FSYNCed; the daemon stopped (SIGTERM) and started again, then every block read "
        "once through the client (`read_into`, verified as it is copied out). `kept`: a harness "
        "plays systemd's fd store and the start verifies and adopts the DRAM; `not kept`: "
        "`dram.keep_across_restarts = false`, the page cache dropped, the first pass reads NVMe. "
        "References in the same run, on the same number of bytes: numpy copy "
        f"{refs['memcpy_gb_per_s']:.2f} GB/s, xxh3-64 {refs['xxh3_gb_per_s']:.2f} GB/s.",
        "",
        "| | stop s | start s | blocks verified (s) | first pass: from DRAM / NVMe "
        "| first pass GB/s | of memcpy |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, row in (("kept", kept), ("not kept", cold)):
        first = row["first_pass"]
        lines.append(
            f"| {label} | {row['stop_s']:.2f} | {row['start_s']:.2f} | "
            f"{row['verified_blocks']} ({row['verify_s']:.2f}) | "
            f"{first['from_dram']} / {first['from_nvme']} | {first['gb_per_s']:.2f} | "
            f"{first['gb_per_s'] / refs['memcpy_gb_per_s']:.2f} |"
        )
    lines += [
        "",
        f"The first pass after a restart: **{ratios['first_pass_kept_vs_not_kept']:.1f}x** as fast "
        f"with the DRAM kept as without. The start's verification "
        + (
            f"ran at {verify:.2f} of an in-process xxh3 of the same bytes."
            if verify is not None
            else "was too short to time from the log."
        ),
        "",
        f"![first pass after a restart]({figure})",
    ]
    return "\n".join(lines)


def _plot(result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = ["DRAM kept", "not kept (NVMe)", "memcpy (reference)"]
    values = [
        result["kept"]["first_pass"]["gb_per_s"],
        result["not_kept"]["first_pass"]["gb_per_s"],
        result["references"]["memcpy_gb_per_s"],
    ]
    ax.barh(labels, values, color=["tab:green", "tab:orange", "tab:gray"])
    ax.set_xlabel("GB/s, first read of the working set after a restart")
    ax.invert_yaxis()
    return benchlib.save_figure(fig, "restart.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dram", default="2G", help="the DRAM tier's size (default 2G)")
    parser.add_argument(
        "--fill", type=float, default=0.75, help="share of DRAM the working set fills"
    )
    parser.add_argument("--blocks-of", default="2M", help="block size (default 2M)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--no-record", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args()
    result = run(benchlib.parse_size(args.dram), args.fill, benchlib.parse_size(args.blocks_of))
    if not args.no_record:
        figure = _plot(result)
        benchlib.record(NAME, _markdown(result, figure), result)
    benchlib.emit(result, args.json)


if __name__ == "__main__":
    main()
