"""Benchmarks of the foundation: kvtierd against references measured in the same run.

* ``cold``: blocks read from the NVMe tier (DRAM emptied, O_DIRECT, so no page cache) through
  the daemon into client buffers, at 448 KiB, 2, 8 and 32 MiB (``--cold-sizes``), in the order
  they were written and in random order, against ``fio --ioengine=io_uring --direct=1``
  reading the same data file the same way (``read`` / ``randread``) with the same block size
  and queue depth, once with its buffers registered with io_uring (``--fixedbufs``, as the
  daemon's arena is) and once without, the faster of the two each round the reference. The
  daemon's ``nvme.queue_depth`` is fio's ``iodepth`` (``--qd``), and
  the client keeps READs of about 4 MiB in flight for twice that many blocks and 16 MiB
  more (an engine pipelines its loads; the daemon then always has the next read to submit,
  while finished READs are verified, answered and copied out: :func:`cold_window`). Rounds alternate
  A B A B because the virtual disk here is bimodal (``../shared/PLATFORM.md``), and ratios are
  taken pair by pair. The daemon's CPU seconds per GB read are recorded beside them.
* ``dram``: DRAM hits copied out by the client (``read_into``, verified: each copy hashed in
  the same pass) against a plain numpy copy of the same arena bytes into the same destination
  buffers, 448 KiB (an SGLang page) and 8 MiB blocks, in alternating order.
* ``rtt``: LOOKUP round trip (1 and 64 keys), p50/p99, against a bare asyncio Unix-socket echo
  of a frame of the same size, sample by sample in turn: the blocking client against the
  daemon on asyncio (uvloop), the goal's row, and also against the daemon on trio, and the
  async client on asyncio and on trio (``RTT_VARIANTS``). ``--rtt-cpus 0,1`` pins the client
  to one vCPU and the daemon and the echo to the other (unpinned by default).
* ``put``: put + FSYNC throughput against fio sequential O_DIRECT writes with a final fsync.
* ``restart``: time until a restarted daemon answers with 100K blocks indexed, after a clean
  stop (index snapshot) and after ``kill -9`` (header scan).
* ``staging``: what write-back's private copy costs put + FSYNC (issue 14). The daemon as built
  (blocks copied into private staging memory at COMMIT, hashed in the same pass) against the
  same daemon with no private copy (the path before issue 14) and with its staging always full
  (every block takes the fallback: copied and verified at write-back), each patched in its own
  process only, with an FSYNC every 128 MiB (the backlog fits the staging), batch by batch; the
  first two also with one FSYNC at the end; and, on the same blocks, COMMIT's work per block
  in-process (``checksum_off_loop`` of the slot before, ``copy_checksum_off_loop`` into private
  memory now, and a plain memcpy).
* ``verify``: ``read_into`` of DRAM hits (which hashes every block it copies out) against a
  numpy copy of the same arena bytes and a numpy copy followed by xxh3-64, so the verifying
  hash's cost beside the copy shows.

``python -m tools.bench_daemon --json`` prints one JSON object and records the results (table
and plot) in ``docs/benchmarks.md`` (``staging`` and ``verify`` in a section of their own).
Figures are never asserted by tests. The cold-read daemons take extra TOML configuration from
``$KVTIERD_BENCH_CONFIG`` (e.g. ``[dram] policy = "lru"``) to compare settings.

Past 600 lines: ``staging`` and ``verify`` with their section writer (``record_integrity``) are
one purpose of their own, to move into a module beside ``bench_daemon_report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import mmap
import os
import random
import socket
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any, cast

import anyio
import numpy as np

from kvtierd.client import chain_keys, connect, connect_async
from kvtierd.config import LimitsConfig, NvmeConfig, parse_size
from kvtierd.store import copyhash
from kvtierd.store.codec import checksum_off_loop, copy_checksum_off_loop
from kvtierd.store.records import checksum
from kvtierd.testing import DaemonProcess
from tools import benchlib
from tools.references import echo_server, fio_json, fio_read_args

MiB = 1 << 20


def _fill(ns: Any, keys: list[bytes], block_bytes: int) -> None:
    _put_all(ns, keys, np.random.default_rng(7).integers(0, 256, block_bytes, dtype=np.uint8))


def _put_all(ns: Any, keys: list[bytes], block: np.ndarray) -> None:
    step = max(1, min(16, (256 * MiB) // block.nbytes))
    for i in range(0, len(keys), step):
        chunk = keys[i : i + step]
        ns.put(chunk, [block] * len(chunk))


#: Blocks a cold-read client asks for per READ: about 4 MiB of them (one block of 8 MiB and up).
_COLD_READ_BYTES = 4 * MiB
#: READs a cold-read client keeps in flight beyond twice the queue depth's blocks: about this
#: many bytes of them, the READs between their last disk read and the client's next READ.
_COLD_TURNAROUND_BYTES = 16 * MiB


def cold_window(block_bytes: int, qd: int) -> tuple[int, int]:
    """(READs kept in flight, blocks per READ) for a cold read at queue depth ``qd``: READs of
    about 4 MiB, enough of them that twice ``qd`` blocks are asked for at any time, and about
    16 MiB of READs more. The comparison with fio is at the disk's queue depth: the daemon
    runs at most ``qd`` disk requests (its ``nvme.queue_depth``), like fio's ``iodepth``. The
    client asks for more so that the daemon always has the next read to submit while READs
    that finished are verified, answered and copied out (an engine pipelines its loads the
    same way): a READ's reply waits for its slowest block, and at 448 KiB in random order,
    with twice ``qd`` blocks asked, the daemon held only 11-13 of 16 reads in the disk."""
    batch = max(1, min(16, _COLD_READ_BYTES // block_bytes))
    turnaround = -(-_COLD_TURNAROUND_BYTES // (batch * block_bytes))
    return max(2, -(-2 * qd // batch)) + turnaround, batch


async def _cold_read(
    socket_path: Path, block_bytes: int, keys: list[bytes], qd: int, *, zero_copy: bool = False
) -> float:
    """GB/s of reading every key from NVMe into client buffers, in the order of ``keys``, READs
    pipelined as :func:`cold_window` says; ``zero_copy``: leased in the shared arena instead
    (what an engine that moves the bytes on to the GPU from the mapped arena waits for), like
    fio, which never touches its buffer."""
    workers, batch = cold_window(block_bytes, qd)
    async with connect_async(socket_path) as client:
        await client.evict()
        ns = await client.namespace("bench", block_bytes=block_bytes)
        buffers = [[np.ones(block_bytes, np.uint8) for _ in range(batch)] for _ in range(workers)]
        chunks = iter([keys[i : i + batch] for i in range(0, len(keys), batch)])
        started = time.perf_counter()

        async def worker(n: int) -> None:
            for chunk in chunks:  # shared: each worker takes the next READ as its last ends
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


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fio_cold(
    data_file: Path, used: int, block_bytes: int, count: int, qd: int, order: str, *, fixed: bool
) -> float:
    fio = fio_json(
        fio_read_args(
            data_file,
            used,
            block_bytes,
            count,
            qd,
            in_order=order == "in_order",
            fixed_buffers=fixed,
        )
    )
    return float(fio["jobs"][0]["read"]["bw_bytes"]) / 1e9


def bench_cold(
    workdir: Path, block_bytes: int, total_bytes: int, qd: int, rounds: int
) -> list[dict[str, Any]]:
    """Cold reads of ``block_bytes`` blocks in order and in random order, each against fio
    reading the daemon's data file the same way (``read`` / ``randread``, same block size and
    queue depth; the faster of ``--fixedbufs`` and not), in pairs that alternate A B A B; one
    result per order."""
    count = total_bytes // block_bytes
    workers, batch = cold_window(block_bytes, qd)
    dram = max(256 * MiB, 2 * workers * batch * block_bytes + 64 * MiB)
    config = os.environ.get("KVTIERD_BENCH_CONFIG") or f"[nvme]\nqueue_depth = {qd}\n"
    with DaemonProcess(
        workdir / f"cold-{block_bytes >> 10}K",  # size classes do not share disk space
        dram_size=f"{dram >> 20}M",
        nvme_size=f"{(count * (block_bytes + 8192) + 256 * MiB) >> 20}M",
        config_text=config,
    ) as d:
        with connect(d.socket) as client:
            ns = client.namespace("bench", block_bytes=block_bytes)
            keys = chain_keys(range(count), 1, ns.key_salt)
            _fill(ns, keys, block_bytes)
            client.fsync()
            used = client.stats()["tiers"][1]["used_bytes"]
        assert d.process is not None
        shuffled = list(keys)
        random.Random(7).shuffle(shuffled)
        orders = {"in_order": keys, "random": shuffled}
        runs: dict[str, dict[str, list[float]]] = {
            order: {
                "kvtierd": [],
                "lease": [],
                "fio": [],
                "fio_plain": [],
                "fio_fixed": [],
                "cpu": [],
            }
            for order in orders
        }
        for _ in range(rounds):
            for order, ordered in orders.items():
                r = runs[order]
                before = _cpu_s(d.process.pid)
                r["kvtierd"].append(anyio.run(_cold_read, d.socket, block_bytes, ordered, qd))
                r["cpu"].append((_cpu_s(d.process.pid) - before) / (count * block_bytes / 1e9))
                for fixed, name in ((False, "fio_plain"), (True, "fio_fixed")):
                    r[name].append(
                        _fio_cold(
                            d.data_dir / "nvme.data",
                            used,
                            block_bytes,
                            count,
                            qd,
                            order,
                            fixed=fixed,
                        )
                    )
                r["fio"].append(max(r["fio_plain"][-1], r["fio_fixed"][-1]))
                r["lease"].append(
                    anyio.run(
                        functools.partial(_cold_read, zero_copy=True),
                        d.socket,
                        block_bytes,
                        ordered,
                        qd,
                    )
                )
    results = []
    for order, r in runs.items():
        ratios = [a / b for a, b in zip(r["kvtierd"], r["fio"], strict=True)]
        lease_ratios = [a / b for a, b in zip(r["lease"], r["fio"], strict=True)]
        results.append(
            {
                "block_bytes": block_bytes,
                "order": order,
                "queue_depth": qd,
                "reads_in_flight": workers,
                "blocks_per_read": batch,
                "blocks": count,
                "kvtierd_gbps": r["kvtierd"],
                "fio_gbps": r["fio"],  # the faster of the two below, each round
                "fio_plain_gbps": r["fio_plain"],
                "fio_fixedbufs_gbps": r["fio_fixed"],
                "ratios": ratios,
                "median_ratio": benchlib.median(ratios),
                "daemon_cpu_s_per_gb": r["cpu"],
                "zero_copy": {
                    "kvtierd_gbps": r["lease"],
                    "fio_gbps": r["fio"],
                    "ratios": lease_ratios,
                    "median_ratio": benchlib.median(lease_ratios),
                },
            }
        )
    return results


def bench_dram(workdir: Path, block_bytes: int, total_bytes: int, rounds: int) -> dict[str, Any]:
    """``read_into`` of resident blocks (verified: each copy hashed in the same pass) against
    ``np.copyto`` of the same arena bytes into the same buffers, in alternating order."""
    count = total_bytes // block_bytes
    verdict = copyhash.default_hasher().verdict(wait=True)  # the native copy, once proven
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
        views = _arena_views(ns, keys)
        sources = [np.frombuffer(v, np.uint8) for v in views]
        for dst in out:
            dst.fill(1)  # touch the destinations once, for both sides
        batch = max(1, min(64, 128 * MiB // block_bytes))  # a READ pins at most 128 MiB

        def read_into() -> None:
            for i in range(0, count, batch):
                ns.read_into(keys[i : i + batch], out[i : i + batch])

        def copy() -> None:
            for dst, src in zip(out, sources, strict=True):
                np.copyto(dst, src)

        variants = {"kvtierd": read_into, "numpy": copy}
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(rounds):
            for name in _rotated(list(variants), r):
                t0 = time.perf_counter()
                variants[name]()
                seconds[name].append(time.perf_counter() - t0)
        sources.clear()  # their buffers borrow the views
        for view in views:
            view.release()
    moved = count * block_bytes
    kv = [moved / x / 1e9 for x in seconds["kvtierd"]]
    ref = [moved / x / 1e9 for x in seconds["numpy"]]
    ratios = [a / b for a, b in zip(kv, ref, strict=True)]
    return {
        "block_bytes": block_bytes,
        "blocks": count,
        "copy_kernel": verdict.kernel if verdict is not None and verdict.ok else "python",
        "kvtierd_gbps": kv,
        "numpy_gbps": ref,
        "ratios": ratios,
        "median_ratio": benchlib.median(ratios),
    }


#: The LOOKUP round trips measured: (row, daemon runtime, client). The first is the goal's:
#: the blocking client against the daemon as deployed (asyncio on uvloop).
RTT_VARIANTS = (
    ("sync", "asyncio", "sync"),
    ("sync_trio", "trio", "sync"),
    ("async", "asyncio", "asyncio"),
    ("async_trio", "trio", "trio"),
)


def bench_rtt(
    workdir: Path, samples: int, cpus: tuple[int, int] | None = None, rounds: int = 1
) -> dict[str, Any]:
    """LOOKUP round trips of 1 and 64 keys against a bare asyncio echo of a frame of the same
    size over a Unix socket, sample by sample in turn (A B A B), for each of
    :data:`RTT_VARIANTS`; the rows without a suffix are the goal's. ``rounds`` rounds of
    ``samples`` each, the two chain lengths in turn (1 then 64, then 64 then 1): each figure is
    the median of its rounds', the ratio the median of the rounds' ratios (one phase of 2000
    samples gave 0.70 at 64 keys and 1.00 at 1 key, the run before 1.26 and 1.08, the daemon
    unchanged: the echo alone moved from 22 to 50 us between phases).

    With ``cpus`` (client, server) this process (the client) runs on the first CPU and the
    daemon's event loop and the echo server on the second, so that both round trips cross the
    same two vCPUs. Unpinned, where the scheduler happens to put the three processes moves
    either figure by 10-40 % on a loaded 2-vCPU machine (a wake-up on the same vCPU or
    across)."""
    result: dict[str, Any] = {}
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[0]})
    try:
        with echo_server(workdir / "echo.sock") as echo_path:
            for row, runtime, client in RTT_VARIANTS:
                with DaemonProcess(workdir / f"rtt-{row}", nvme_size="0", runtime=runtime) as d:
                    echo = socket.socket(socket.AF_UNIX)
                    echo.connect(str(echo_path))
                    try:
                        if cpus is not None and d.process is not None:
                            os.sched_setaffinity(d.process.pid, {cpus[1]})
                            os.sched_setaffinity(_peer_pid(echo), {cpus[1]})
                        per_round: dict[int, list[dict[str, Any]]] = {1: [], 64: []}
                        for r in range(rounds):
                            lengths = (1, 64) if r % 2 == 0 else (64, 1)
                            if client == "sync":
                                pairs = _rtt_sync(d.socket, echo, samples, lengths)
                            else:
                                pairs = anyio.run(
                                    _rtt_async, d.socket, echo, samples, lengths, backend=client
                                )
                            for n, (lat_kv, lat_echo) in pairs.items():
                                per_round[n].append(_rtt_row(lat_kv, lat_echo, runtime, client))
                    finally:
                        echo.close()
                suffix = "" if row == "sync" else f"_{row}"
                for n, rows in per_round.items():
                    row_result = _rtt_median(rows)
                    row_result["cpus"] = list(cpus) if cpus is not None else None
                    result[f"keys_{n}{suffix}"] = row_result
    finally:
        os.sched_setaffinity(0, before)
    return result


def _peer_pid(sock: socket.socket) -> int:
    """The process at the other end of a connected Unix socket."""
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid)


def _rtt_median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of the rounds' rows: each figure the median of its rounds', the per-round
    ratios kept."""
    merged = dict(rows[0])
    for name in ("kvtierd_p50_us", "kvtierd_p99_us", "echo_p50_us", "echo_p99_us"):
        merged[name] = statistics.median(r[name] for r in rows)
    for name in ("ratio_p50", "ratio_p99"):
        merged[f"{name}_rounds"] = [r[name] for r in rows]
        merged[name] = statistics.median(merged[f"{name}_rounds"])
    return merged


def _rtt_sync(
    path: Path, echo: socket.socket, samples: int, lengths: tuple[int, ...] = (1, 64)
) -> dict[int, tuple[list, list]]:
    pairs: dict[int, tuple[list, list]] = {}
    with connect(path) as client:
        ns = client.namespace("bench", block_bytes=4096)
        keys = chain_keys(range(64), 1, ns.key_salt)
        ns.put(keys, [bytes(4096)] * 64)
        for n in lengths:
            lat_kv: list[float] = []
            lat_echo: list[float] = []
            chain = keys[:n]
            for _ in range(samples):
                t0 = time.perf_counter()
                ns.lookup(chain)
                lat_kv.append(time.perf_counter() - t0)
                lat_echo.append(_echo_once(echo, _rtt_frame_bytes(n)))
            pairs[n] = (lat_kv, lat_echo)
    return pairs


async def _rtt_async(
    path: Path, echo: socket.socket, samples: int, lengths: tuple[int, ...] = (1, 64)
) -> dict[int, tuple[list, list]]:
    """:func:`_rtt_sync` with the async client; the echo stays a blocking round trip (nothing
    else runs on the loop meanwhile)."""
    pairs: dict[int, tuple[list, list]] = {}
    async with connect_async(path) as client:
        ns = await client.namespace("bench", block_bytes=4096)
        keys = chain_keys(range(64), 1, ns.key_salt)
        await ns.put(keys, [bytes(4096)] * 64)
        for n in lengths:
            lat_kv: list[float] = []
            lat_echo: list[float] = []
            chain = keys[:n]
            for _ in range(samples):
                t0 = time.perf_counter()
                await ns.lookup(chain)
                lat_kv.append(time.perf_counter() - t0)
                lat_echo.append(_echo_once(echo, _rtt_frame_bytes(n)))
            pairs[n] = (lat_kv, lat_echo)
    return pairs


def _rtt_frame_bytes(keys: int) -> int:
    """A LOOKUP request's frame: the header, the body's array and a 16-byte key each."""
    return 32 + 4 + 17 * keys


def _echo_once(echo: socket.socket, frame_bytes: int) -> float:
    frame = b"x" * frame_bytes
    t0 = time.perf_counter()
    echo.sendall(frame)
    got = 0
    while got < frame_bytes:
        got += len(echo.recv(65536))
    return time.perf_counter() - t0


def _rtt_row(
    lat_kv: list[float], lat_echo: list[float], runtime: str, client: str
) -> dict[str, Any]:
    r: dict[str, Any] = {
        "daemon_runtime": runtime,
        "client": client,
        "kvtierd_p50_us": benchlib.percentile(lat_kv, 50) * 1e6,
        "kvtierd_p99_us": benchlib.percentile(lat_kv, 99) * 1e6,
        "echo_p50_us": benchlib.percentile(lat_echo, 50) * 1e6,
        "echo_p99_us": benchlib.percentile(lat_echo, 99) * 1e6,
    }
    r["ratio_p50"] = r["kvtierd_p50_us"] / r["echo_p50_us"]
    r["ratio_p99"] = r["kvtierd_p99_us"] / r["echo_p99_us"]
    return r


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


#: Patches a daemon process applies before it runs (``command_prefix``, below): each replaces a
#: method of the running code, in that one process.
_NO_PRIVATE_COPY = """
import contextlib
from kvtierd.store.staging import StagedCopies

@contextlib.asynccontextmanager
async def copy_of(self, source, checksum):
    yield source

StagedCopies.copy_of = copy_of  # write-back writes the slot as it is...
StagedCopies.take = lambda self, nbytes: None  # ...and COMMIT hashes it in place: no copy
"""
_NO_COMMIT_COPY = """
from kvtierd.store.staging import StagedCopies

StagedCopies.take = lambda self, nbytes: None  # the staging is always full: the fallback
"""
_COUNT_STAGING = """
import sys
from kvtierd.store.store import BlockStore

fsync = BlockStore.fsync

async def counted(self):
    durable = await fsync(self)
    counts = (self.staged.staged_at_commit, self.staged.copied_at_writeback)
    print("bench-staging", *counts, file=sys.stderr, flush=True)
    return durable

BlockStore.fsync = counted
"""
_RUN_KVTIERD = """
import runpy, sys
sys.argv = ["kvtierd", *sys.argv[4:]]  # after: python -m kvtierd
runpy.run_module("kvtierd", run_name="__main__", alter_sys=True)
"""

#: ``command_prefix`` for a daemon with no private copy anywhere (what issue 14 replaced): COMMIT
#: hashes the tenant's slot in place and write-back stores the slot as it is. The reference the
#: ``staging`` scenario measures the daemon as built against; nothing else in it differs.
_DIRECT_WRITEBACK = [sys.executable, "-c", _NO_PRIVATE_COPY + _RUN_KVTIERD]

#: ``command_prefix`` for the daemon as built that, after each FSYNC, logs ``StagedCopies``'
#: two counters (blocks copied at COMMIT; blocks write-back had to copy and verify itself),
#: which STATFS does not report. Nothing else in it differs.
_COUNTED_STAGING = [sys.executable, "-c", _COUNT_STAGING + _RUN_KVTIERD]

#: ``command_prefix`` for the daemon as built with its staging always full for COMMIT: every
#: block takes the fallback (hashed in place at COMMIT, copied and verified at write-back: the
#: first design of issue 14). Counted like ``_COUNTED_STAGING``.
_FALLBACK_ONLY = [sys.executable, "-c", _COUNT_STAGING + _NO_COMMIT_COPY + _RUN_KVTIERD]


def _staging_counts(d: DaemonProcess) -> tuple[int, int]:
    """Blocks staged at COMMIT and blocks copied at write-back so far, as of the last FSYNC
    (``_COUNTED_STAGING``'s log lines)."""
    for line in reversed(d.log().splitlines()):
        if line.startswith("bench-staging "):
            at_commit, at_writeback = line.split()[1:]
            return int(at_commit), int(at_writeback)
    return 0, 0


def _put_fsync_s(
    client: Any, ns: Any, keys: list[bytes], block: np.ndarray, fsync_every: int
) -> float:
    """Seconds to put every key (16 blocks per PUT) with an FSYNC after each ``fsync_every``
    blocks and after the last."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), fsync_every):
        _put_all(ns, keys[i : i + fsync_every], block)
        client.fsync()
    return time.perf_counter() - t0


def _hash_s(sources: list[memoryview], ring: list[memoryview]) -> float:
    """Seconds of COMMIT's work per block without commit-time staging, and in the fallback:
    ``checksum_off_loop`` of each slot in place (worker-thread hop included, as COMMIT calls
    it). ``ring`` is unused; the signature is the other steps'."""

    async def run() -> float:
        t0 = time.perf_counter()
        for source in sources:
            await checksum_off_loop(source)
        return time.perf_counter() - t0

    return anyio.run(run)


def _copy_hash_s(sources: list[memoryview], ring: list[memoryview]) -> float:
    """Seconds of COMMIT's work per block with commit-time staging: ``copy_checksum_off_loop``
    of each slot into private memory (the ring), as ``StagedCopies.stage`` calls it."""

    async def run() -> float:
        t0 = time.perf_counter()
        for i, source in enumerate(sources):
            await copy_checksum_off_loop(ring[i % len(ring)], source)
        return time.perf_counter() - t0

    return anyio.run(run)


def _memcpy_s(sources: list[memoryview], ring: list[memoryview]) -> float:
    t0 = time.perf_counter()
    for i, source in enumerate(sources):
        ring[i % len(ring)][:] = source
    return time.perf_counter() - t0


def _arena_views(ns: Any, keys: list[bytes]) -> list[memoryview]:
    """Views of the blocks' arena bytes (they stay put: nothing evicts them in these runs)."""
    extents = []
    step = max(1, min(64, 128 * MiB // ns.block_bytes))  # a connection may lease only part
    for i in range(0, len(keys), step):  # of its region
        with ns.lease(keys[i : i + step]) as lease:
            extents += lease.extents
    return [ns.arena.view(e.offset, e.length) for e in extents]


#: Room for copies made at COMMIT in a daemon on the defaults: the staging memory less the
#: reserve kept for write-back's own copies.
STAGING_ROOM_BYTES = NvmeConfig().staging_bytes - LimitsConfig().max_block_bytes

#: COMMIT's work per block, measured in-process on the blocks just written.
_COMMIT_STEPS = {"hash": _hash_s, "copy_hash": _copy_hash_s, "memcpy": _memcpy_s}


def _rotated(names: list[str], n: int) -> list[str]:
    return names[n % len(names) :] + names[: n % len(names)]


def bench_staging(
    workdir: Path, block_bytes: int, total_bytes: int, rounds: int, fsync_every_bytes: int
) -> dict[str, Any]:
    """Put + FSYNC of ``total_bytes`` into the daemon as built (``_COUNTED_STAGING``), one
    without any private copy (``_DIRECT_WRITEBACK``) and one where every block takes the
    fallback (``_FALLBACK_ONLY``). Each round: with an FSYNC every ``fsync_every_bytes`` (a
    backlog that fits the staging room), batch by batch across the three in a rotating order,
    so that all three see the same load; and, as whole runs in a rotating order, the first two
    with one FSYNC at the end. Then, on the as-built daemon's blocks, COMMIT's work per block
    in-process, in a rotating order: the hash in place, the fused copy + hash into private
    memory (a ring of ``fsync_every_bytes``, what one batch's staged copies span), a memcpy."""
    count = total_bytes // block_bytes
    every = max(1, fsync_every_bytes // block_bytes)
    if every >= count:
        raise ValueError("fsync_every_bytes must be below total_bytes (else no batches)")
    sizes = {
        "dram_size": f"{(total_bytes + 128 * MiB) >> 20}M",
        "nvme_size": f"{(total_bytes + 512 * MiB) >> 20}M",
    }
    block = np.random.default_rng(7).integers(0, 256, block_bytes, dtype=np.uint8)
    s: dict[str, list[float]] = {}
    tag = f"{block_bytes >> 10}K"
    prefixes = {
        "staged": _COUNTED_STAGING,
        "direct": _DIRECT_WRITEBACK,
        "fallback": _FALLBACK_ONLY,
    }
    with contextlib.ExitStack() as stack:
        daemons = {
            name: stack.enter_context(
                DaemonProcess(workdir / f"{name}-{tag}", command_prefix=prefix, **sizes)
            )
            for name, prefix in prefixes.items()
        }
        sides = {}
        for name, d in daemons.items():
            client = stack.enter_context(connect(d.socket))
            ns = client.namespace("bench", block_bytes=block_bytes)
            sides[name] = (client, ns, chain_keys(range(count), 1, ns.key_salt))
        ring_map = stack.enter_context(mmap.mmap(-1, every * block_bytes))
        ring_map.write(bytes(len(ring_map)))  # fault the pages in before timing
        ring_view = memoryview(ring_map)
        stack.callback(ring_view.release)
        ring = [ring_view[i * block_bytes : (i + 1) * block_bytes] for i in range(every)]

        def counts() -> dict[str, tuple[int, int]]:
            return {name: _staging_counts(d) for name, d in daemons.items()}

        def at_end(r: int) -> None:
            for name in _rotated(["staged", "direct"], r):
                before = counts()
                seconds = _put_fsync_s(*sides[name], block, count)
                _record(s, f"{name}_at_end", seconds, before[name], counts()[name])
                sides[name][1].forget(sides[name][2])

        for r in range(rounds):
            if r % 2:
                at_end(r)
            before = counts()
            batched = _batched_s(sides, block, every, r)
            after = counts()
            for name, seconds in batched.items():
                _record(s, name, seconds, before[name], after[name])
            _commit_steps(s, sides["staged"][1], sides["staged"][2], ring, r)
            for _, ns, keys in sides.values():
                ns.forget(keys)
            if r % 2 == 0:
                at_end(r)
        for view in ring:
            view.release()
    return _staging_result(block_bytes, count, every, s)


def _record(
    s: dict[str, list[float]],
    label: str,
    seconds: float,
    before: tuple[int, int],
    after: tuple[int, int],
) -> None:
    """A run's time, and how many of its blocks were staged at COMMIT and by the fallback."""
    s.setdefault(label, []).append(seconds)
    s.setdefault(f"{label}_at_commit", []).append(after[0] - before[0])
    s.setdefault(f"{label}_fallback", []).append(after[1] - before[1])


def _batched_s(
    sides: dict[str, tuple[Any, Any, list[bytes]]], block: np.ndarray, every: int, r: int
) -> dict[str, float]:
    """Seconds of put + FSYNC of every key on each side, one batch of ``every`` blocks at a
    time, the sides in a rotating order batch by batch."""
    seconds = dict.fromkeys(sides, 0.0)
    count = len(next(iter(sides.values()))[2])
    for b, start in enumerate(range(0, count, every)):
        for name in _rotated(list(sides), r + b):
            client, ns, keys = sides[name]
            seconds[name] += _put_fsync_s(client, ns, keys[start : start + every], block, every)
    return seconds


def _commit_steps(
    sample: dict[str, list[float]], ns: Any, keys: list[bytes], ring: list[memoryview], r: int
) -> None:
    sources = _arena_views(ns, keys)
    for name in _rotated(list(_COMMIT_STEPS), r):
        sample.setdefault(name, []).append(_COMMIT_STEPS[name](sources, ring))
    for view in sources:
        view.release()


def _staging_result(
    block_bytes: int, count: int, every: int, s: dict[str, list[float]]
) -> dict[str, Any]:
    total = count * block_bytes

    def gbps(seconds: list[float]) -> list[float]:
        return [total / x / 1e9 for x in seconds]

    def per_block_us(seconds: list[float]) -> float:
        return benchlib.median(seconds) / count * 1e6

    def run(label: str, reference: str) -> dict[str, Any]:
        ratios = [y / x for x, y in zip(s[label], s[reference], strict=True)]  # of throughput
        return {
            "put_fsync_gbps": gbps(s[label]),
            "direct_put_fsync_gbps": gbps(s[reference]),
            "throughput_ratio": ratios,
            "median_throughput_ratio": benchlib.median(ratios),
            "staged_at_commit": s[f"{label}_at_commit"],
            "fallback_blocks": s[f"{label}_fallback"],
        }

    added = [c - h for c, h in zip(s["copy_hash"], s["hash"], strict=True)]
    added_share = [a / t for a, t in zip(added, s["staged"], strict=True)]
    return {
        "block_bytes": block_bytes,
        "blocks": count,
        "fsync_every_blocks": every,
        "fsync_every_bytes": every * block_bytes,
        "staging_room_bytes": STAGING_ROOM_BYTES,
        **run("staged", "direct"),
        "put_fsync_us_per_block": per_block_us(s["staged"]),
        "direct_put_fsync_us_per_block": per_block_us(s["direct"]),
        "fallback": run("fallback", "direct"),
        "fsync_at_end": run("staged_at_end", "direct_at_end"),
        "hash_s": s["hash"],
        "hash_gbps": gbps(s["hash"]),
        "copy_hash_s": s["copy_hash"],
        "copy_hash_gbps": gbps(s["copy_hash"]),
        "memcpy_s": s["memcpy"],
        "memcpy_gbps": gbps(s["memcpy"]),
        "hash_us_per_block": per_block_us(s["hash"]),
        "copy_hash_us_per_block": per_block_us(s["copy_hash"]),
        "memcpy_us_per_block": per_block_us(s["memcpy"]),
        "added_us_per_block": [a / count * 1e6 for a in added],
        "median_added_us_per_block": per_block_us(added),
        "added_share": added_share,
        "median_added_share": benchlib.median(added_share),
    }


def bench_verify(workdir: Path, block_bytes: int, total_bytes: int, rounds: int) -> dict[str, Any]:
    """``read_into`` of DRAM hits against a numpy copy of the same arena bytes into the same
    buffers, that copy followed by xxh3-64 of each buffer (verifying in two passes), the
    one-pass copy and xxh3-64 in this process (what read_into runs, without the daemon), and
    xxh3-64 of the arena bytes alone; variants in a rotating order each round."""
    count = total_bytes // block_bytes
    verdict = copyhash.default_hasher().verdict(wait=True)  # the native copy, once proven
    with (
        DaemonProcess(
            workdir / f"verify-{block_bytes >> 10}K",
            dram_size=f"{(total_bytes + 128 * MiB) >> 20}M",
            nvme_size="0",
        ) as d,
        connect(d.socket) as client,
    ):
        ns = client.namespace("bench", block_bytes=block_bytes)
        keys = chain_keys(range(count), 1, ns.key_salt)
        _fill(ns, keys, block_bytes)
        views = _arena_views(ns, keys)
        sources = [np.frombuffer(v, np.uint8) for v in views]
        out = [np.empty(block_bytes, np.uint8) for _ in range(count)]
        for dst in out:
            dst.fill(1)  # touch the destinations once, for every variant
        batch = max(1, min(64, 128 * MiB // block_bytes))  # a READ pins at most 128 MiB

        def read_into() -> None:
            for i in range(0, count, batch):
                ns.read_into(keys[i : i + batch], out[i : i + batch])

        def copy() -> None:
            for dst, src in zip(out, sources, strict=True):
                np.copyto(dst, src)

        targets = [dst.data for dst in out]

        def copy_xxh3() -> None:
            for dst, target, src in zip(out, targets, sources, strict=True):
                np.copyto(dst, src)
                checksum(target)

        def one_pass() -> None:
            for target, view in zip(targets, views, strict=True):
                copyhash.copy_checksum(target, view)

        def xxh3() -> None:
            for view in views:
                checksum(view)

        variants = {
            "read_into": read_into,
            "copy": copy,
            "copy_xxh3": copy_xxh3,
            "one_pass": one_pass,
            "xxh3": xxh3,
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                variants[name]()
                seconds[name].append(time.perf_counter() - t0)
        sources.clear()  # their buffers borrow the views
        targets.clear()
        for view in views:
            view.release()

    def overhead(name: str) -> list[float]:
        return [(a - b) / b for a, b in zip(seconds[name], seconds["copy"], strict=True)]

    verify, hashing = overhead("read_into"), overhead("copy_xxh3")
    one_pass = overhead("one_pass")
    return {
        "block_bytes": block_bytes,
        "copy_kernel": verdict.kernel if verdict is not None and verdict.ok else "python",
        "blocks": count,
        "keys_per_read": batch,
        **{f"{name}_gbps": [total_bytes / x / 1e9 for x in s] for name, s in seconds.items()},
        "verify_overhead": verify,
        "median_verify_overhead": benchlib.median(verify),
        "hash_overhead": hashing,
        "median_hash_overhead": benchlib.median(hashing),
        "one_pass_overhead": one_pass,
        "median_one_pass_overhead": benchlib.median(one_pass),
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


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


def _row(values: list[float], fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(x) for x in values)


def _per_round(values: list[int]) -> str:
    return f"{values[0]} every round" if len(set(values)) == 1 else ", ".join(map(str, values))


def _cost(ratio: float) -> str:
    """What a throughput ratio (as built / without protection) costs, in words."""
    return f"{1 - ratio:.0%}" if ratio < 1 else "nothing measurable"


def _run_row(label: str, run: dict[str, Any]) -> str:
    return (
        f"| {label} | {_row(run['put_fsync_gbps'])} | {_row(run['direct_put_fsync_gbps'])} "
        f"| {_row(run['throughput_ratio'])} | **{run['median_throughput_ratio']:.2f}** "
        f"| {_per_round(run['staged_at_commit'])} | {_per_round(run['fallback_blocks'])} |"
    )


def _staging_lines(runs: list[dict[str, Any]]) -> list[str]:
    first = runs[0]
    room, every = _size(first["staging_room_bytes"]), _size(first["fsync_every_bytes"])
    total = _size(first["blocks"] * first["block_bytes"])
    header = (
        "| put+FSYNC GB/s | without protection | ratio to it, per round | **median** "
        "| blocks staged at COMMIT | fallback blocks |"
    )
    lines = [
        " ".join(STAGING_DESIGN.split()).format(room=room),
        "",
        " ".join(STAGING_METHOD.split()).format(total=total, every=every, room=room),
        "",
        f"FSYNC every {every}, the three daemons batch by batch (the main figure: as built):",
        "",
        f"| block, daemon {header}",
        "|---|---|---|---|---:|---|---|",
    ]
    for r in runs:
        lines.append(_run_row(f"{_size(r['block_bytes'])}, as built", r))
        lines.append(_run_row(f"{_size(r['block_bytes'])}, all by the fallback", r["fallback"]))
    lines += [
        "",
        "COMMIT's work per block, in-process on the as-built daemon's blocks just written (the "
        f"arena, mapped by the client; {total}, so read from memory, not cache): "
        "`checksum_off_loop` of the slot (COMMIT without staging, and in the fallback), "
        f"`copy_checksum_off_loop` of the slot into private memory (a ring of {every}, what one "
        "batch's staged copies span: COMMIT now, and the fallback's write-back), both through "
        "the worker-thread hop as the daemon calls them, and a plain memcpy of the same bytes "
        "(no hop). Added: copy + hash less hash, per round; its share: over the as-built put + "
        "FSYNC time of the same round.",
        "",
        "| block | hash in place, us | copy + hash, us | memcpy, us | **added, us** "
        "| put+FSYNC per block, us (as built; without) | added share, per round | **median** |",
        "|---|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {_size(r['block_bytes'])} | {r['hash_us_per_block']:.0f} "
            f"| {r['copy_hash_us_per_block']:.0f} | {r['memcpy_us_per_block']:.0f} "
            f"| **{r['median_added_us_per_block']:.0f}** "
            f"| {r['put_fsync_us_per_block']:.0f}; {r['direct_put_fsync_us_per_block']:.0f} "
            f"| {_row(r['added_share'])} | **{r['median_added_share']:.2f}** |"
        )
    lines += [
        "",
        f"One FSYNC at the end of {total}, as built against the unprotected daemon, whole runs:",
        "",
        f"| block {header}",
        "|---|---|---|---|---:|---|---|",
        *(_run_row(_size(r["block_bytes"]), r["fsync_at_end"]) for r in runs),
    ]
    return [*lines, "", *_staging_verdict(runs)]


def _staging_verdict(runs: list[dict[str, Any]]) -> list[str]:
    """What the figures above say, in words that follow them."""
    every = _size(runs[0]["fsync_every_bytes"])
    spread = [x for r in runs for x in r["throughput_ratio"]]
    fallbacks = sum(sum(r["fallback_blocks"]) for r in runs)
    costs = " and ".join(
        f"{_cost(r['median_throughput_ratio'])} at {_size(r['block_bytes'])}" for r in runs
    )
    unexplained = "; ".join(
        f"{_size(r['block_bytes'])}: {_cost(r['median_throughput_ratio'])} end to end, "
        f"{r['median_added_share']:.0%} in-process"
        for r in runs
        if not _explained(r)
    )
    lines = [
        f"**With an FSYNC every {every}, write-back's protection costs put + FSYNC throughput "
        f"{costs} here** (as built against the unprotected daemon, medians of rounds; single "
        f"rounds range {min(spread):.2f}-{max(spread):.2f}). "
        + (
            "Every block was staged at COMMIT; write-back wrote each copy as it was. "
            if fallbacks == 0
            else f"{fallbacks} blocks over all rounds still took the fallback. "
        )
        + "What COMMIT does more per block, in-process: "
        + "; ".join(_added(r) for r in runs)
        + ". On these few shared cores such work should add to put + FSYNC about one for one; "
        + (
            "the end-to-end costs agree with these shares within 8 points."
            if not unexplained
            else "the end-to-end costs and these shares differ by more than 8 points at "
            f"{unexplained}: COMMIT's added work is not all that separates the two daemons."
        ),
        "",
        _fallback_sentence(runs),
        "",
        _at_end_sentence(runs),
    ]
    over = [r for r in runs if r["median_throughput_ratio"] < 0.90]
    if over:
        named = " and ".join(
            f"{_size(r['block_bytes'])} ({_cost(r['median_throughput_ratio'])})" for r in over
        )
        budget = f"**More than issue 14's 10 % budget at {named}.** "
        if all(_explained(r) for r in over):
            budget += (
                "What remains there is the copy: one pass that writes each block into private "
                "memory, with the hash riding on it ("
                + "; ".join(
                    f"copy + hash {r['copy_hash_us_per_block']:.0f} us, memcpy "
                    f"{r['memcpy_us_per_block']:.0f} us at {_size(r['block_bytes'])}"
                    for r in over
                )
                + "), made while the client waits for COMMIT. The fallback does more work per "
                "block (a second hash, at write-back), but after COMMIT has answered, where it "
                "can overlap the client's next PUT; against it the design as built gains "
                + " and ".join(f"{_gain(r):.0f} points at {_size(r['block_bytes'])}" for r in over)
                + "."
            )
        else:
            budget += (
                "COMMIT's added work does not account for it ("
                + "; ".join(
                    f"{r['median_added_share']:.0%} of put + FSYNC time at "
                    f"{_size(r['block_bytes'])}"
                    for r in over
                )
                + "); this run does not show what the rest is."
            )
        lines += ["", budget]
    return lines


def _explained(run: dict[str, Any]) -> bool:
    """Whether COMMIT's added work, measured in-process, accounts for the end-to-end cost."""
    cost = max(0.0, 1 - run["median_throughput_ratio"])
    return bool(abs(cost - run["median_added_share"]) <= 0.08)


def _added(run: dict[str, Any]) -> str:
    added = run["median_added_us_per_block"]
    return (
        f"at {_size(run['block_bytes'])} the copy + hash takes "
        f"{run['copy_hash_us_per_block']:.0f} us where the hash in place took "
        f"{run['hash_us_per_block']:.0f} us (a memcpy: {run['memcpy_us_per_block']:.0f} us), "
        + (
            f"{added:.0f} us more per block, {run['median_added_share']:.0%} of put + FSYNC time"
            if added > 0
            else "no measurable difference"
        )
    )


def _fallback_sentence(runs: list[dict[str, Any]]) -> str:
    def share(run: dict[str, Any]) -> float:
        """Write-back's copy + hash over the fallback daemon's put + FSYNC time per block."""
        put_us = run["block_bytes"] / benchlib.median(run["fallback"]["put_fsync_gbps"]) / 1e3
        return float(run["copy_hash_us_per_block"] / put_us)

    return (
        "With the staging always full, every block took the fallback ("
        + "; ".join(
            f"{_size(r['block_bytes'])}: it cost {_cost(r['fallback']['median_throughput_ratio'])}"
            " of put + FSYNC throughput, median ratio "
            f"{r['fallback']['median_throughput_ratio']:.2f}"
            for r in runs
        )
        + "): each block is hashed in its slot at COMMIT, as without protection, then copied "
        "and hashed again at write-back, about "
        + ", ".join(
            f"{r['copy_hash_us_per_block']:.0f} us ({share(r):.0%} of its put + FSYNC time)"
            for r in runs
        )
        + " per block in-process. "
        + FIRST_DESIGN
    )


def _at_end_sentence(runs: list[dict[str, Any]]) -> str:
    def fallen(run: dict[str, Any], of: int) -> str:
        counts = run["fallback_blocks"]
        taken = (
            f"{counts[0]} of {of} blocks in every round"
            if len(set(counts)) == 1
            else f"{_per_round(counts)} of {of} blocks (median {benchlib.median(counts):.0f})"
        )
        return (
            f"{taken} took the fallback, put + FSYNC at {run['median_throughput_ratio']:.2f} "
            "of the unprotected daemon"
        )

    kept_up = all(
        benchlib.median(r["fsync_at_end"]["fallback_blocks"]) < 0.1 * r["blocks"] for r in runs
    )
    never = all(not any(r["fsync_at_end"]["fallback_blocks"]) for r in runs)
    return (
        "With one FSYNC at the end, "
        + (
            "write-back kept up with the client (this host caches writes): the backlog stayed "
            "within the room in every round"
            if never
            else "write-back mostly kept up with the client (this host caches writes): the "
            "backlog stayed within the room in most rounds"
            if kept_up
            else "the backlog outgrew the room"
        )
        + " ("
        + "; ".join(
            f"{_size(r['block_bytes'])}: {fallen(r['fsync_at_end'], r['blocks'])}" for r in runs
        )
        + ")"
        + (
            "; those whole runs see the load change between them, so their ratios scatter more "
            "than the batched ones."
            if all(_scatter(r["fsync_at_end"]) > _scatter(r) for r in runs)
            else "."
        )
    )


def _gain(run: dict[str, Any]) -> float:
    """Points of throughput ratio the design as built gains over the fallback for every block."""
    return float(
        100 * (run["median_throughput_ratio"] - run["fallback"]["median_throughput_ratio"])
    )


def _scatter(run: dict[str, Any]) -> float:
    return float(max(run["throughput_ratio"]) - min(run["throughput_ratio"]))


#: The design the ``staging`` scenario measures (docs/benchmarks.md).
STAGING_DESIGN = """
**Write-back's private copy (issue 14).** What reaches the disk is a daemon-private copy of each
committed block, never the tenant's slot, which its clients can still write to. At COMMIT, while
the staging memory has room (`nvme.staging_bytes`, 256 MiB by default, less
`limits.max_block_bytes` kept for write-back's own copies: {room}), the daemon copies each block
there and hashes the copy in the same pass (`kvtierd.store.codec.copy_checksum_off_loop`: 128 KiB
pieces into streaming xxh3-64, so the hash reads bytes still in cache), in place of COMMIT's hash
of the slot; write-back then writes that copy with no further work. A block committed while the
room is taken (the fallback) is hashed in its slot at COMMIT, then copied and hashed again at
write-back, and written only if the hashes agree.
"""

#: How the ``staging`` scenario measures it.
STAGING_METHOD = """
Three daemons run side by side, each patched in its own process only: the one as built
(`_COUNTED_STAGING` only logs `StagedCopies`' two counters after each FSYNC, which STATFS does
not report); the same code with no private copy anywhere, the path before issue 14
(`_DIRECT_WRITEBACK` patches `StagedCopies.take` and `copy_of`); and the one as built with its
staging always full for COMMIT, so that every block takes the fallback (`_FALLBACK_ONLY` patches
`StagedCopies.take`; counted too). Each round all three take put of {total} (16 blocks per PUT)
with an FSYNC every {every}, as an engine that makes each batch durable before it sends the next:
the backlog awaiting write-back is then at most one batch (the client waits for each FSYNC) and
fits the {room} of room. They take it batch by batch, in an order that rotates every batch, so
that the three see the same load. Then the first two take the same {total} with one FSYNC at the
end, as whole runs in a rotating order, where the backlog may outgrow the room. Each run's blocks
are forgotten after it.
"""


#: The first design, as this scenario measured it before the change (commit 54ff075).
FIRST_DESIGN = (
    "The first design took that path for every block: put + FSYNC of 1 GiB with one FSYNC at "
    "the end ran at 0.69 (256 KiB) and 0.56 (2 MiB) of the unprotected daemon (commit 54ff075)."
)


def _verify_lines(runs: list[dict[str, Any]]) -> list[str]:
    reads = ", ".join(f"{r['keys_per_read']} keys" for r in runs)
    lines = [
        "**Readers' verification.** A DRAM-only daemon holds 512 MiB in blocks of each size; "
        f"each round, in a rotating order: `read_into` of every block ({reads} per READ, at "
        "most 128 MiB; it copies each block out of the arena and hashes the copy in the same "
        "pass), `np.copyto` of the same arena bytes into the same destination buffers, that "
        "copy followed by xxh3-64 of each destination (verifying in two passes, as before "
        "issue 32), the one-pass copy and xxh3-64 in the benchmark's own process "
        f"(`copyhash.copy_checksum`, kernel `{runs[0].get('copy_kernel', '?')}`), and xxh3-64 "
        "of the arena bytes alone. Overheads are over the copy, per round: read_into's "
        "includes the READ / RELEASE round trips besides the hash.",
        "",
        "| block | read_into GB/s | numpy copy GB/s | copy + xxh3 GB/s | one pass GB/s "
        "| xxh3 alone GB/s | read_into over the copy, per round | **median** "
        "| copy + xxh3 over the copy | one pass over the copy |",
        "|---|---|---|---|---|---:|---|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {_size(r['block_bytes'])} | {_row(r['read_into_gbps'])} | {_row(r['copy_gbps'])} "
            f"| {_row(r['copy_xxh3_gbps'])} | {_row(r['one_pass_gbps'])} "
            f"| {benchlib.median(r['xxh3_gbps']):.1f} "
            f"| {_row([100 * x for x in r['verify_overhead']], '{:+.0f} %')} "
            f"| **{100 * r['median_verify_overhead']:+.0f} %** "
            f"| {100 * r['median_hash_overhead']:+.0f} % "
            f"| {100 * r['median_one_pass_overhead']:+.0f} % |"
        )
    hashing = [r["median_hash_overhead"] for r in runs]
    one_pass = [r["median_one_pass_overhead"] for r in runs]
    speeds = [benchlib.median(r["xxh3_gbps"]) for r in runs]
    lines += [
        "",
        f"Hashing a copy after making it adds {100 * min(hashing):.0f}-{100 * max(hashing):.0f} %"
        f" to the copy (xxh3-64 alone: {min(speeds):.1f}-{max(speeds):.1f} GB/s here); hashing "
        "the registers each stripe is stored from, with non-temporal stores that never read the "
        f"destination first, {100 * min(one_pass):+.0f} to {100 * max(one_pass):+.0f} % "
        "(docs/architecture.md, integrity).",
    ]
    return lines


def record_integrity(result: dict[str, Any]) -> None:
    """The ``daemon_integrity`` section of docs/benchmarks.md (``staging``, ``verify``)."""
    lines = ["## Integrity costs: write-back's private copy, readers' verification", ""]
    load = result["load_average"]
    cores = result["machine"]["cores"]
    shared = max(load["start"], load["end"]) > cores  # its own daemons and client load ~1
    lines += [
        f"`python -m tools.bench_daemon --only staging,verify --rounds {result['rounds']}`. "
        f"One-minute load average {load['start']:.1f} at the start and {load['end']:.1f} at the "
        f"end, on {cores} cores"
        + (
            ": other jobs (test suites) shared the machine, so absolute GB/s are far below a "
            "quiet machine's. "
            if shared
            else " (the benchmark's own processes: no other job ran). "
        )
        + "The variants alternate round by round, ratios are taken within a round and figures "
        "are medians of rounds.",
        "",
    ]
    if "staging" in result:
        lines += [*_staging_lines(result["staging"]), ""]
    if "verify" in result:
        lines += [*_verify_lines(result["verify"]), ""]
    lines += [benchlib.machine_line(result["machine"]), ""]
    lines.append(
        "Reproduce: `python -m tools.bench_daemon --only staging,verify --json` (about 3 minutes)."
    )
    benchlib.record("daemon_integrity", "\n".join(lines), result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default="cold,dram,rtt,put,restart,staging,verify")
    parser.add_argument("--rounds", type=benchlib.positive_int, default=4)
    parser.add_argument("--cold-bytes", type=int, default=1536 * MiB)
    parser.add_argument("--cold-sizes", default="448K,2M,8M,32M")
    parser.add_argument("--qd", type=int, default=16)
    parser.add_argument("--restart-blocks", type=int, default=100_000)
    parser.add_argument("--dram-bytes", type=int, default=512 * MiB)
    parser.add_argument("--staging-bytes", type=int, default=1024 * MiB)
    parser.add_argument("--staging-fsync-bytes", type=int, default=128 * MiB)
    parser.add_argument("--rtt-samples", type=int, default=2000)
    parser.add_argument(
        "--rtt-cpus",
        default="",
        help="CLIENT,SERVER: run the rtt client on CPU CLIENT and the daemon and the echo on "
        "CPU SERVER (default: unpinned)",
    )
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    only = set(args.only.split(","))
    result: dict[str, Any] = {"machine": benchlib.machine()}
    load_start = os.getloadavg()[0]
    with benchlib.bench_workdir("bench") as work:
        if "cold" in only:
            result["cold"] = [
                entry
                for size in args.cold_sizes.split(",")
                for entry in bench_cold(
                    work, int(parse_size(size)), args.cold_bytes, args.qd, args.rounds
                )
            ]
        if "dram" in only:
            result["dram"] = [
                bench_dram(work, bs, args.dram_bytes, args.rounds) for bs in (448 << 10, 8 * MiB)
            ]
        if "rtt" in only:
            cpus = tuple(int(c) for c in args.rtt_cpus.split(",")) if args.rtt_cpus else None
            if cpus is not None and len(cpus) != 2:
                parser.error("--rtt-cpus takes CLIENT,SERVER")
            result["rtt"] = bench_rtt(
                work, args.rtt_samples, cast(tuple[int, int] | None, cpus), args.rounds
            )
        if "put" in only:
            result["put"] = bench_put(work, 2 * MiB, 1024 * MiB, args.qd, max(2, args.rounds // 2))
        if "restart" in only:
            result["restart"] = bench_restart(work, args.restart_blocks)
        if "staging" in only:
            result["staging"] = [
                bench_staging(work, bs, args.staging_bytes, args.rounds, args.staging_fsync_bytes)
                for bs in (256 << 10, 2 * MiB)
            ]
        if "verify" in only:
            result["verify"] = [
                bench_verify(work, bs, args.dram_bytes, args.rounds) for bs in (448 << 10, 8 * MiB)
            ]
    result["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    result["rounds"] = args.rounds
    benchlib.emit(result, args.json)
    if not args.no_record:
        from tools.bench_daemon_report import record_daemon

        if only & {"cold", "dram", "rtt", "put", "restart"}:
            record_daemon(result)
        if only & {"staging", "verify"}:
            record_integrity(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
