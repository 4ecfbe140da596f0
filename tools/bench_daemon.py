"""Benchmarks of the foundation: kvtierd against references measured in the same run.

* ``cold``: blocks read from the NVMe tier (DRAM emptied, O_DIRECT, so no page cache) through
  the daemon into client buffers, against ``fio --ioengine=io_uring --direct=1`` random reads
  of the same data file with the same block size and queue depth; rounds alternate A B A B
  because the virtual disk here is bimodal (``../shared/PLATFORM.md``), and ratios are taken
  pair by pair.
* ``dram``: DRAM hits copied out by the client against a plain numpy copy of the same bytes
  from a shared mapping into the same destination buffers.
* ``rtt``: LOOKUP round trip (1 and 64 keys), p50/p99, against a bare asyncio Unix-socket echo
  of a frame of the same size.
* ``put``: put + FSYNC throughput against fio sequential O_DIRECT writes with a final fsync.
* ``restart``: time until a restarted daemon answers with 100K blocks indexed, after a clean
  stop (index snapshot) and after ``kill -9`` (header scan).

``python tools/bench_daemon.py --json`` prints one JSON object and records the results (table
and plot) in ``docs/benchmarks.md``. Figures are never asserted by tests. The cold-read daemons
take extra TOML configuration from ``$KVTIERD_BENCH_CONFIG`` (e.g. ``[dram] policy = "lru"``)
to compare settings.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from references import echo_server, fio_json

from kvtierd.client import chain_keys, connect, connect_async
from kvtierd.testing import DaemonProcess

MiB = 1 << 20


def _fill(ns: Any, keys: list[bytes], block_bytes: int) -> None:
    block = np.random.default_rng(7).integers(0, 256, block_bytes, dtype=np.uint8)
    step = max(1, min(16, (256 * MiB) // block_bytes))
    for i in range(0, len(keys), step):
        chunk = keys[i : i + step]
        ns.put(chunk, [block] * len(chunk))


async def _cold_read(
    socket_path: Path, block_bytes: int, keys: list[bytes], qd: int, *, zero_copy: bool = False
) -> float:
    """GB/s of reading every key from NVMe into client buffers, ``qd`` blocks in flight;
    ``zero_copy``: leased in the shared arena instead (what an engine that moves the bytes on
    to the GPU from the mapped arena waits for), like fio, which never touches its buffer."""
    workers = min(qd, 4)
    batch = max(1, qd // workers)
    async with connect_async(socket_path) as client:
        await client.evict()
        ns = await client.namespace("bench", block_bytes=block_bytes)
        buffers = [[np.empty(block_bytes, np.uint8) for _ in range(batch)] for _ in range(workers)]
        chunks = [keys[i : i + batch] for i in range(0, len(keys), batch)]
        started = time.perf_counter()

        async def worker(n: int) -> None:
            for chunk in chunks[n::workers]:
                if zero_copy:
                    async with ns.lease(chunk):
                        pass
                else:
                    await ns.read_into(chunk, buffers[n][: len(chunk)])

        async with anyio.create_task_group() as tg:
            for n in range(workers):
                tg.start_soon(worker, n)
        elapsed = time.perf_counter() - started
    return len(keys) * block_bytes / elapsed / 1e9


def bench_cold(
    workdir: Path, block_bytes: int, total_bytes: int, qd: int, rounds: int
) -> dict[str, Any]:
    count = total_bytes // block_bytes
    dram = max(256 * MiB, 2 * qd * block_bytes + 64 * MiB)
    with DaemonProcess(
        workdir / f"cold-{block_bytes >> 20}M",  # size classes do not share disk space
        dram_size=f"{dram >> 20}M",
        nvme_size=f"{(count * (block_bytes + 8192) + 256 * MiB) >> 20}M",
        config_text=os.environ.get("KVTIERD_BENCH_CONFIG"),
    ) as d:
        with connect(d.socket) as client:
            ns = client.namespace("bench", block_bytes=block_bytes)
            keys = chain_keys(range(count), 1, ns.key_salt)
            _fill(ns, keys, block_bytes)
            client.fsync()
            used = client.stats()["tiers"][1]["used_bytes"]
        data_file = d.data_dir / "nvme.data"
        daemon_gbps, lease_gbps, fio_gbps = [], [], []
        for _ in range(rounds):
            daemon_gbps.append(anyio.run(_cold_read, d.socket, block_bytes, keys, qd))
            lease_gbps.append(
                anyio.run(
                    functools.partial(_cold_read, zero_copy=True),
                    d.socket,
                    block_bytes,
                    keys,
                    qd,
                )
            )
            fio = fio_json(
                [
                    "--rw=randread",
                    f"--bs={block_bytes}",
                    f"--iodepth={qd}",
                    f"--filename={data_file}",
                    f"--size={used}",
                    "--readonly",
                    f"--io_size={count * block_bytes}",
                ]
            )
            fio_gbps.append(fio["jobs"][0]["read"]["bw_bytes"] / 1e9)
    ratios = [a / b for a, b in zip(daemon_gbps, fio_gbps, strict=True)]
    lease_ratios = [a / b for a, b in zip(lease_gbps, fio_gbps, strict=True)]
    return {
        "block_bytes": block_bytes,
        "queue_depth": qd,
        "blocks": count,
        "kvtierd_gbps": daemon_gbps,
        "fio_gbps": fio_gbps,
        "ratios": ratios,
        "median_ratio": benchlib.median(ratios),
        "zero_copy": {
            "kvtierd_gbps": lease_gbps,
            "fio_gbps": fio_gbps,
            "ratios": lease_ratios,
            "median_ratio": benchlib.median(lease_ratios),
        },
    }


def bench_dram(workdir: Path, block_bytes: int, total_bytes: int, rounds: int) -> dict[str, Any]:
    count = total_bytes // block_bytes
    with (
        DaemonProcess(
            workdir / "dram", dram_size=f"{(total_bytes + 128 * MiB) >> 20}M", nvme_size="0"
        ) as d,
        connect(d.socket) as client,
    ):
        ns = client.namespace("bench", block_bytes=block_bytes)
        keys = chain_keys(range(count), 1, ns.key_salt)
        _fill(ns, keys, block_bytes)
        out = [np.empty(block_bytes, np.uint8) for _ in range(count)]
        source = np.frombuffer(client.arena.view(0, total_bytes), np.uint8).reshape(count, -1)
        for dst in out:
            dst.fill(1)  # touch the destinations once, for both sides
        kv, ref = [], []
        batch = 64
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(0, count, batch):
                ns.read_into(keys[i : i + batch], out[i : i + batch])
            kv.append(total_bytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for i in range(count):
                np.copyto(out[i], source[i])
            ref.append(total_bytes / (time.perf_counter() - t0) / 1e9)
    ratios = [a / b for a, b in zip(kv, ref, strict=True)]
    return {
        "block_bytes": block_bytes,
        "blocks": count,
        "kvtierd_gbps": kv,
        "numpy_gbps": ref,
        "ratios": ratios,
        "median_ratio": benchlib.median(ratios),
    }


def bench_rtt(workdir: Path, samples: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with DaemonProcess(workdir / "rtt", nvme_size="0") as d, connect(d.socket) as client:
        ns = client.namespace("bench", block_bytes=4096)
        keys = chain_keys(range(64), 1, ns.key_salt)
        ns.put(keys, [bytes(4096)] * 64)
        with echo_server(workdir / "echo.sock") as echo_path:
            echo = socket.socket(socket.AF_UNIX)
            echo.connect(str(echo_path))
            for n in (1, 64):
                frame = 32 + 4 + 17 * n
                lat_kv, lat_echo = [], []
                for _ in range(samples):
                    t0 = time.perf_counter()
                    ns.lookup(keys[:n])
                    lat_kv.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    echo.sendall(b"x" * frame)
                    got = 0
                    while got < frame:
                        got += len(echo.recv(65536))
                    lat_echo.append(time.perf_counter() - t0)
                result[f"keys_{n}"] = {
                    "kvtierd_p50_us": benchlib.percentile(lat_kv, 50) * 1e6,
                    "kvtierd_p99_us": benchlib.percentile(lat_kv, 99) * 1e6,
                    "echo_p50_us": benchlib.percentile(lat_echo, 50) * 1e6,
                    "echo_p99_us": benchlib.percentile(lat_echo, 99) * 1e6,
                }
                r = result[f"keys_{n}"]
                r["ratio_p50"] = r["kvtierd_p50_us"] / r["echo_p50_us"]
                r["ratio_p99"] = r["kvtierd_p99_us"] / r["echo_p99_us"]
            echo.close()
    return result


def bench_put(
    workdir: Path, block_bytes: int, total_bytes: int, qd: int, rounds: int
) -> dict[str, Any]:
    count = total_bytes // block_bytes
    kv, ref = [], []
    for r in range(rounds):
        with DaemonProcess(
            workdir / f"put{r}",
            dram_size=f"{(total_bytes + 128 * MiB) >> 20}M",
            nvme_size=f"{(2 * total_bytes + 256 * MiB) >> 20}M",
        ) as d:
            with connect(d.socket) as client:
                ns = client.namespace("bench", block_bytes=block_bytes)
                keys = chain_keys(range(count), 1, ns.key_salt)
                t0 = time.perf_counter()
                _fill(ns, keys, block_bytes)
                client.fsync()
                kv.append(total_bytes / (time.perf_counter() - t0) / 1e9)
            target = workdir / f"fio-write-{r}"
            fio = fio_json(
                [
                    "--rw=write",
                    f"--bs={block_bytes}",
                    f"--iodepth={qd}",
                    f"--filename={target}",
                    f"--size={total_bytes}",
                    "--end_fsync=1",
                ]
            )
            job = fio["jobs"][0]
            ref.append(job["write"]["io_bytes"] / (job["job_runtime"] / 1e3) / 1e9)
            target.unlink()
    ratios = [a / b for a, b in zip(kv, ref, strict=True)]
    return {
        "block_bytes": block_bytes,
        "blocks": count,
        "kvtierd_gbps": kv,
        "fio_gbps": ref,
        "ratios": ratios,
        "median_ratio": benchlib.median(ratios),
        "note": "the host caches writes, so neither figure is a durability rate",
    }


def bench_restart(workdir: Path, blocks: int) -> dict[str, Any]:
    d = DaemonProcess(
        workdir / "restart", dram_size="512M", nvme_size=f"{blocks * 8192 // MiB + 512}M"
    )
    with d, connect(d.socket) as client:
        ns = client.namespace("bench", block_bytes=4096)
        keys = chain_keys(range(blocks), 1, ns.key_salt)
        zero = bytes(4096)
        for i in range(0, blocks, 4096):
            ns.put(keys[i : i + 4096], [zero] * len(keys[i : i + 4096]))
        client.fsync()
    timings = {}
    for mode in ("snapshot", "scan"):
        t0 = time.perf_counter()
        d.start(timeout_s=300)
        timings[f"{mode}_s"] = time.perf_counter() - t0
        with connect(d.socket) as client:
            ns = client.namespace("bench", block_bytes=4096)
            found = ns.lookup(keys)
        timings[f"{mode}_found"] = found
        if mode == "snapshot":
            d.kill()  # no snapshot for the next start: recovery scans every header
        else:
            d.stop()
    return {"blocks": blocks, **timings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default="cold,dram,rtt,put,restart")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cold-bytes", type=int, default=1536 * MiB)
    parser.add_argument("--qd", type=int, default=16)
    parser.add_argument("--restart-blocks", type=int, default=100_000)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    only = set(args.only.split(","))
    result: dict[str, Any] = {"machine": benchlib.machine()}
    with tempfile.TemporaryDirectory(
        prefix="kvtierd-bench-", dir=os.environ.get("BENCH_DIR", "/var/tmp")
    ) as tmp:
        work = Path(tmp)
        if "cold" in only:
            result["cold"] = [
                bench_cold(work, bs, args.cold_bytes, args.qd, args.rounds)
                for bs in (2 * MiB, 32 * MiB)
            ]
        if "dram" in only:
            result["dram"] = bench_dram(work, 2 * MiB, 512 * MiB, args.rounds)
        if "rtt" in only:
            result["rtt"] = bench_rtt(work, 2000)
        if "put" in only:
            result["put"] = bench_put(work, 2 * MiB, 1024 * MiB, args.qd, max(2, args.rounds // 2))
        if "restart" in only:
            result["restart"] = bench_restart(work, args.restart_blocks)
    benchlib.emit(result, args.json)
    if not args.no_record:
        from bench_daemon_report import record_daemon

        record_daemon(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
