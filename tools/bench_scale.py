"""Scale: what the daemon costs per indexed block, how long a restart takes at millions of
blocks, and small-block op rates and CPU against fio (issue 32, item 4).

* ``index``: for each size (blocks of 4 KiB, one namespace), the NVMe data file is synthesised
  directly: a daemon creates the data file (sparse, ``nvme.preallocate = false``) and the
  namespace catalog (through its own catalog writer, by opening the namespace), is stopped, and
  the segment headers and record headers are then written into the file with the package's own
  format (:mod:`kvtierd.store.records`, :class:`~kvtierd.store.segments.SegmentMap` plans the
  segments as the tier does). Payloads are left as holes: a hole reads as zeroes, and every
  record carries the checksum of a zero block, so a read of one verifies. Nothing goes through
  the socket, so 10M blocks take minutes, not hours. Then the real daemon is started twice:
  after a crash (no snapshot: every header is scanned) and after the clean stop that follows it
  (index snapshot). Each start is timed from ``exec`` to the first INIT answered as a serving
  daemon (``kvtierd.testing.wait_until_serving``), with the tier's part (its recovery) and the
  store's (adopting the recovered blocks) from the stamps of the daemon's log lines, and the
  daemon's memory (``VmRSS``; and its peak, ``VmHWM``) is read from ``/proc``. Memory per
  block is the RSS above the same daemon started on the same file before the records were
  written, divided by the blocks. A sample of keys is looked up and read back to show the
  index is the real one.
* ``ops``: 4 KiB and 64 KiB blocks put (+ FSYNC) and read back from NVMe (DRAM emptied first)
  through the daemon (``--ops-sizes``), its disk queue depth ``--qd`` (READs of ``--qd`` blocks,
  four in flight: :func:`_read_ops`), against ``fio --ioengine=io_uring --direct=1`` random writes
  (with a final fsync) and random reads of the same size and queue depth in the same directory
  (reads: the faster of ``--fixedbufs`` and not, each round); rounds alternate kvtierd and fio
  (the virtual disk is bimodal: ``../shared/PLATFORM.md``) and ratios are taken pair by pair.
  CPU-seconds per GB: the daemon's ``utime + stime`` from ``/proc/<pid>/stat`` plus this (client)
  process's, over the bytes moved; fio's from its own report (``usr_cpu + sys_cpu`` of its run
  time).
* ``overflow``: 4 KiB puts into a daemon whose DRAM (``--overflow-mib``, each size its own
  daemon) is full of blocks not yet written back, one more DRAM's worth, against the same
  daemon's rate while DRAM filled. Each needs a victim that write-back has cleaned; the rate
  past DRAM should not fall as the DRAM (the blocks resident) grows.

Goals (issue 32): at most 128 bytes of daemon memory per indexed block, a restart at 10M blocks
under 20 s, 64 KiB reads at 0.8 of fio's IOPS. A size whose projected daemon memory (from the
smallest size's per-block figure) exceeds ``--max-daemon-gib`` is skipped, not run: the machine
is shared.

``python -m tools.bench_scale --json`` prints one JSON object and records the results (table and
plot) in ``docs/benchmarks.md``. Figures are never asserted by tests.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from kvtierd.client import connect, connect_async
from kvtierd.config import parse_size
from kvtierd.store.records import PAGE_BYTES, RecordHeader, Superblock, checksum
from kvtierd.store.recovery import DATA_FILE_NAME, SNAPSHOT_NAME
from kvtierd.store.segments import SegmentMap, slot_bytes_for
from kvtierd.testing import DaemonProcess
from tools import benchlib
from tools.references import fio_json, fio_read_args
from tools.scale_checkpoint import synthesise_checkpoint

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_SEGMENT_BYTES = 64 * MiB  # nvme.segment_bytes' default: plan segments as the tier does
#: Checkpoints on (the default, spelled out): the crash-after-a-checkpoint start needs the
#: daemon to trust one; with them off a start deletes any it finds and scans.
_SYNTH_CONFIG = '[nvme]\npreallocate = false\ncheckpoint_every_bytes = "8G"\n'
_TICKS = os.sysconf("SC_CLK_TCK")


# -- /proc -------------------------------------------------------------------------------------


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _memory(pid: int) -> dict[str, int]:
    """The daemon's resident memory in bytes: all of it, its anonymous part (the index lives
    there; the arena is shared memory) and the peak."""
    return {
        "rss_bytes": _status_kib(pid, "VmRSS") * KiB,
        "anon_bytes": _status_kib(pid, "RssAnon") * KiB,
        "peak_bytes": _status_kib(pid, "VmHWM") * KiB,
    }


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15)


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _pid(d: DaemonProcess) -> int:
    assert d.process is not None
    return d.process.pid


# -- index: synthesised data file, restart time and memory ---------------------------------------


def _key(prefix: int, i: int) -> bytes:
    return struct.pack(">QQ", prefix, i)


def synthesise(data_file: Path, digest: bytes, blocks: int, block_bytes: int, prefix: int) -> int:
    """Write ``blocks`` records of ``digest`` (keys ``_key(prefix, i)``, zero payloads left as
    holes) into the daemon-initialised, sparse ``data_file``: segment headers first, as the
    tier carves them, each record header at its slot. Returns the bytes written."""
    zero = checksum(bytes(block_bytes))
    slot_bytes = slot_bytes_for(block_bytes)
    fd = os.open(data_file, os.O_RDWR)
    written = 0
    try:
        superblock = Superblock.unpack(os.pread(fd, PAGE_BYTES, 0))
        segmap = SegmentMap(superblock.file_id, superblock.file_bytes, _SEGMENT_BYTES)
        seq = 0
        while seq < blocks:
            header = segmap.plan_segment(slot_bytes)
            if header is None:
                raise RuntimeError(f"{data_file} holds only {seq} of {blocks} blocks")
            segmap.add_segment(header)
            written += os.pwrite(fd, header.pack(), header.start)
            for index in range(min(header.slot_count, blocks - seq)):
                seq += 1
                record = RecordHeader(
                    digest, _key(prefix, seq - 1), block_bytes, block_bytes, zero, seq
                )
                written += os.pwrite(fd, record.pack(), header.slot_offset(index))
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


_RECOVERED = re.compile(r"blocks recovered by (\w+) in ([0-9.]+) s")


def _tier_recovery_s(d: DaemonProcess) -> float | None:
    """The NVMe tier's own recovery time (snapshot or scan, before the store adopts the
    blocks) at the daemon's last start, from its log."""
    found = _RECOVERED.findall(d.log())
    return float(found[-1][1]) if found else None


_STAMPED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*(blocks recovered by|store ready)"
)


def _adoption_s(d: DaemonProcess) -> float | None:
    """How long the store took to adopt the recovered blocks at the daemon's last start: from
    the tier's "recovered" log line to "store ready" (millisecond stamps)."""
    stamps: dict[str, float] = {}
    for line in d.log().splitlines():
        found = _STAMPED.match(line)
        if found:
            when = time.mktime(time.strptime(found[1], "%Y-%m-%d %H:%M:%S")) + int(found[2]) / 1e3
            stamps[found[3]] = when
    if len(stamps) < 2:
        return None
    return stamps["store ready"] - stamps["blocks recovered by"]


def _timed_start(d: DaemonProcess) -> float:
    started = time.perf_counter()
    d.start(timeout_s=1800)
    return time.perf_counter() - started


def _check(d: DaemonProcess, prefix: int, blocks: int, block_bytes: int) -> dict[str, int]:
    """Look up a sample of the synthesised keys and read a few back (verified zero blocks)."""
    rng = random.Random(blocks)
    sample = sorted(rng.sample(range(blocks), min(1000, blocks)))
    keys = [_key(prefix, i) for i in sample]
    with connect(d.socket) as client:
        ns = client.namespace("scale", block_bytes=block_bytes)
        found = sum(ns.lookup([key], promote=False) for key in keys)
        buffers = [np.ones(block_bytes, np.uint8) for _ in range(8)]
        read = ns.read_into(keys[:8], buffers)
        zeroes = sum(not buffer.any() for buffer in buffers)
    return {"sampled": len(keys), "found": found, "read": read, "read_zeroes": zeroes}


def bench_index(
    workdir: Path, blocks: int, block_bytes: int, checkpoint_share: float = 0.0
) -> dict[str, Any]:
    directory = workdir / f"index-{blocks}"
    slot_bytes = slot_bytes_for(block_bytes)
    nvme_mib = (blocks * slot_bytes + 2 * _SEGMENT_BYTES) // MiB + 1
    d = DaemonProcess(
        directory, dram_size="64M", nvme_size=f"{nvme_mib}M", config_text=_SYNTH_CONFIG
    )
    prefix = random.Random(blocks).getrandbits(64)
    try:
        with d, connect(d.socket) as client:  # creates the data file and the catalog
            digest = client.namespace("scale", block_bytes=block_bytes).handle.digest
        empty_s = _timed_start(d)  # the same daemon on the same file, no records yet
        with connect(d.socket) as client:
            client.namespace("scale", block_bytes=block_bytes)
        empty = _memory(_pid(d))
        d.stop()
        for snapshot in d.data_dir.glob("index*.snapshot"):
            snapshot.unlink()  # stale once the file is written to; the first start scans
        started = time.perf_counter()
        written = synthesise(d.data_dir / DATA_FILE_NAME, digest, blocks, block_bytes, prefix)
        synth_s = time.perf_counter() - started
        result: dict[str, Any] = {
            "blocks": blocks,
            "block_bytes": block_bytes,
            "synthesise_s": synth_s,
            "synthesised_bytes": written,
            "empty_start_s": empty_s,
            "empty": empty,
        }
        modes = ("scan", "snapshot", "checkpoint") if checkpoint_share else ("scan", "snapshot")
        for mode in modes:
            if mode == "checkpoint":  # a crash after a checkpoint and a share of writes since
                result["checkpoint_segments"] = synthesise_checkpoint(
                    d.data_dir / SNAPSHOT_NAME, d.data_dir / DATA_FILE_NAME, checkpoint_share
                )
            seconds = _timed_start(d)
            memory = _memory(_pid(d))
            check = _check(d, prefix, blocks, block_bytes)
            memory_after = _memory(_pid(d))
            started = time.perf_counter()
            d.stop(timeout_s=1800)  # writes the snapshot the next start loads
            result[mode] = {
                "start_s": seconds,
                "tier_recovery_s": _tier_recovery_s(d),
                "adoption_s": _adoption_s(d),
                **memory,
                "bytes_per_block": (memory["rss_bytes"] - empty["rss_bytes"]) / blocks,
                "anon_bytes_per_block": (memory["anon_bytes"] - empty["anon_bytes"]) / blocks,
                "after_check": memory_after,
                "check": check,
                "stop_s": time.perf_counter() - started,
            }
        if checkpoint_share:
            result["take"] = _take_checkpoint(d, prefix, blocks, block_bytes)
        return result
    finally:
        if d.running:
            d.kill()
        shutil.rmtree(directory, ignore_errors=True)


_TAKEN = re.compile(
    r"index checkpoint \d+ written: (\d+) blocks; its copy held the event loop at most "
    r"([\d.]+) ms"
)


def _take_checkpoint(
    d: DaemonProcess, prefix: int, blocks: int, block_bytes: int
) -> dict[str, Any]:
    """A checkpoint of the whole index taken by the serving daemon: restarted (from its
    snapshot) with a checkpoint every 1 MiB written, 256 new blocks put and synced. The longest
    the event loop was held by one slice of the checkpoint's copy, from the daemon's log, and
    how long after the first put the checkpoint was written."""
    config = d.directory / "kvtierd.toml"
    config.write_text(_SYNTH_CONFIG.replace('"8G"', '"1M"'))
    try:
        d.start(timeout_s=1800)
        before = len(_TAKEN.findall(d.log()))
        started = time.perf_counter()
        with connect(d.socket) as client:
            ns = client.namespace("scale", block_bytes=block_bytes)
            keys = [_key(prefix, blocks + i) for i in range(256)]
            block = np.full(block_bytes, 7, np.uint8)
            for first in range(0, len(keys), 64):
                ns.put(keys[first : first + 64], [block] * 64)
            client.fsync()
        deadline = time.monotonic() + 900
        while len(taken := _TAKEN.findall(d.log())) == before:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon took no checkpoint within 15 minutes")
            time.sleep(0.2)
        written_s = time.perf_counter() - started
        d.stop(timeout_s=1800)
    finally:
        config.write_text(_SYNTH_CONFIG)
    rows, slice_ms = taken[before]
    return {"rows": int(rows), "longest_slice_ms": float(slice_ms), "written_within_s": written_s}


# -- ops: small blocks through the daemon against fio --------------------------------------------


def _put_ops(d: DaemonProcess, keys: list[bytes], block_bytes: int) -> tuple[float, float, float]:
    """Put ``keys`` (batches of 64) and FSYNC: (ops/s durable, CPU seconds of daemon and
    client, ops/s acknowledged before the FSYNC)."""
    block = np.random.default_rng(7).integers(0, 256, block_bytes, dtype=np.uint8)
    with connect(d.socket) as client:
        ns = client.namespace("ops", block_bytes=block_bytes)
        cpu0 = _cpu_s(_pid(d)) + _own_cpu_s()
        started = time.perf_counter()
        for i in range(0, len(keys), 64):
            chunk = keys[i : i + 64]
            ns.put(chunk, [block] * len(chunk))
        acknowledged = time.perf_counter() - started
        client.fsync()
        elapsed = time.perf_counter() - started
        cpu = _cpu_s(_pid(d)) + _own_cpu_s() - cpu0
    return len(keys) / elapsed, cpu, len(keys) / acknowledged


#: READs a small-block read client keeps in flight (:func:`_read_ops`).
_READS_IN_FLIGHT = 4


async def _read_ops(
    d: DaemonProcess, keys: list[bytes], block_bytes: int, qd: int
) -> tuple[float, float, float]:
    """Read every key from NVMe (DRAM emptied first) into client buffers in random order,
    READs of ``qd`` blocks, :data:`_READS_IN_FLIGHT` of them at once: (ops/s, CPU seconds of
    daemon and client, CPU seconds of the daemon alone). The daemon runs at most ``qd`` disk
    reads (its ``nvme.queue_depth``, fio's ``iodepth``); the client asks for more, as an
    engine asks for a request's blocks at once, so that the disk's queue is refilled while
    finished READs are verified, answered and copied out (with ``qd`` blocks asked in all the
    disk's queue emptied at every READ's end: 0.23 of fio's IOPS at 64 KiB)."""
    workers = _READS_IN_FLIGHT
    batch = qd
    order = keys[:]
    random.Random(len(keys)).shuffle(order)
    async with connect_async(d.socket) as client:
        await client.evict()
        ns = await client.namespace("ops", block_bytes=block_bytes)
        buffers = [[np.empty(block_bytes, np.uint8) for _ in range(batch)] for _ in range(workers)]
        chunks = [order[i : i + batch] for i in range(0, len(order), batch)]
        daemon0 = _cpu_s(_pid(d))
        cpu0 = daemon0 + _own_cpu_s()
        started = time.perf_counter()

        async def worker(n: int) -> None:
            for chunk in chunks[n::workers]:
                await ns.read_into(chunk, buffers[n][: len(chunk)])

        async with anyio.create_task_group() as tg:
            for n in range(workers):
                tg.start_soon(worker, n)
        elapsed = time.perf_counter() - started
        daemon = _cpu_s(_pid(d))
        cpu = daemon + _own_cpu_s() - cpu0
    return len(keys) / elapsed, cpu, daemon - daemon0


def _fio(args: list[str]) -> tuple[float, float]:
    """(IOPS, CPU seconds) of one fio job."""
    job = fio_json(args)["jobs"][0]
    side = job["read"] if job["read"]["io_bytes"] else job["write"]
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000
    return side["iops"], cpu


def bench_ops(workdir: Path, block_bytes: int, count: int, qd: int, rounds: int) -> dict[str, Any]:
    slot = slot_bytes_for(block_bytes)
    directory = workdir / f"ops-{block_bytes >> 10}K"
    d = DaemonProcess(  # the disk's queue depth is fio's
        directory,
        dram_size="64M",
        nvme_size=f"{(rounds * count * slot + 256 * MiB) // MiB}M",
        config_text=f"[nvme]\nqueue_depth = {qd}\n",
    )
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "put_ops",
            "put_cpu_s",
            "put_ack_ops",
            "fio_write_iops",
            "fio_write_cpu_s",
            "read_ops",
            "read_cpu_s",
            "read_daemon_cpu_s",
            "fio_read_iops",
            "fio_read_cpu_s",
        )
    }
    gb = count * block_bytes / 1e9
    try:
        with d:
            data_file = d.data_dir / DATA_FILE_NAME
            for r in range(rounds):
                keys = [_key(r, i) for i in range(count)]
                ops, cpu, ack = _put_ops(d, keys, block_bytes)
                rows["put_ops"].append(ops)
                rows["put_cpu_s"].append(cpu)
                rows["put_ack_ops"].append(ack)
                target = directory / "fio-write"
                iops, cpu = _fio(
                    [
                        "--rw=randwrite",
                        f"--bs={block_bytes}",
                        f"--iodepth={qd}",
                        f"--filename={target}",
                        f"--size={count * block_bytes}",
                        "--end_fsync=1",
                    ]
                )
                target.unlink()
                rows["fio_write_iops"].append(iops)
                rows["fio_write_cpu_s"].append(cpu)
                ops, cpu, daemon_cpu = anyio.run(_read_ops, d, keys, block_bytes, qd)
                rows["read_ops"].append(ops)
                rows["read_cpu_s"].append(cpu)
                rows["read_daemon_cpu_s"].append(daemon_cpu)
                with connect(d.socket) as client:
                    used = client.stats()["tiers"][1]["used_bytes"]
                # the faster of fio with its buffers registered (as the daemon's arena is) and not
                iops, cpu = max(
                    _fio(
                        fio_read_args(data_file, used, block_bytes, count, qd, fixed_buffers=fixed)
                    )
                    for fixed in (False, True)
                )
                rows["fio_read_iops"].append(iops)
                rows["fio_read_cpu_s"].append(cpu)
                print(
                    f"ops {block_bytes >> 10} KiB round {r}: put {rows['put_ops'][-1]:.0f}/s "
                    f"(fio {rows['fio_write_iops'][-1]:.0f}), read {rows['read_ops'][-1]:.0f}/s "
                    f"(fio {iops:.0f})",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    put_ratio = [a / b for a, b in zip(rows["put_ops"], rows["fio_write_iops"], strict=True)]
    read_ratio = [a / b for a, b in zip(rows["read_ops"], rows["fio_read_iops"], strict=True)]
    return {
        "block_bytes": block_bytes,
        "blocks": count,
        "queue_depth": qd,
        **rows,
        "put_ratios": put_ratio,
        "read_ratios": read_ratio,
        "median_put_ratio": benchlib.median(put_ratio),
        "median_read_ratio": benchlib.median(read_ratio),
        # CPU-seconds per GB moved, kvtierd (daemon + client) and fio, medians over the rounds
        "put_cpu_s_per_gb": benchlib.median(rows["put_cpu_s"]) / gb,
        "fio_write_cpu_s_per_gb": benchlib.median(rows["fio_write_cpu_s"]) / gb,
        "read_cpu_s_per_gb": benchlib.median(rows["read_cpu_s"]) / gb,
        "read_daemon_cpu_s_per_gb": benchlib.median(rows["read_daemon_cpu_s"]) / gb,
        "fio_read_cpu_s_per_gb": benchlib.median(rows["fio_read_cpu_s"]) / gb,
    }


def bench_overflow(workdir: Path, dram_mib: int, past: int) -> dict[str, Any]:
    """Puts of 4 KiB blocks once DRAM is full: each needs a victim evicted (written back
    first when dirty). ``past`` puts are timed after DRAM was filled; their rate against
    the rate while DRAM filled, for a DRAM of ``dram_mib``. Run at two DRAM sizes, it shows
    whether the cost of a put past DRAM grows with the blocks resident."""
    block_bytes = 4 * KiB
    fill = dram_mib * MiB // block_bytes
    directory = workdir / f"overflow-{dram_mib}M"
    block = np.random.default_rng(7).integers(0, 256, block_bytes, dtype=np.uint8)
    rates = []
    try:
        with (
            DaemonProcess(
                directory, dram_size=f"{dram_mib}M", nvme_size=f"{4 * dram_mib + 256}M"
            ) as d,
            connect(d.socket) as client,
        ):
            ns = client.namespace("overflow", block_bytes=block_bytes)
            for first, count in ((0, fill), (fill, past)):
                keys = [_key(7, i) for i in range(first, first + count)]
                started = time.perf_counter()
                for i in range(0, count, 64):
                    ns.put(keys[i : i + 64], [block] * len(keys[i : i + 64]))
                rates.append(count / (time.perf_counter() - started))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "dram_mib": dram_mib,
        "resident_blocks": fill,
        "put_ops_filling": rates[0],
        "put_ops_past_dram": rates[1],
        "ratio": rates[1] / rates[0],
    }


# -- report ------------------------------------------------------------------------------------

_GOAL_BYTES_PER_BLOCK = 128
_GOAL_RESTART_S = 20.0
_GOAL_RESTART_BLOCKS = 10_000_000
_GOAL_READ_RATIO = 0.8


def _projection(runs: list[dict[str, Any]], blocks: int) -> dict[str, float]:
    """Linear fit of start time and memory against blocks, evaluated at ``blocks``."""
    sizes = np.array([run["blocks"] for run in runs], dtype=float)
    out: dict[str, float] = {"blocks": blocks}
    for mode in ("scan", "snapshot"):
        for what, pick in (
            ("start_s", lambda run, m=mode: run[m]["start_s"]),
            ("rss_bytes", lambda run, m=mode: run[m]["rss_bytes"] - run["empty"]["rss_bytes"]),
        ):
            values = np.array([pick(run) for run in runs], dtype=float)
            if len(runs) >= 2:
                slope, intercept = np.polyfit(sizes, values, 1)
            else:
                slope, intercept = values[0] / sizes[0], 0.0
            out[f"{mode}_{what}"] = float(slope * blocks + intercept)
    return out


def _plot(runs: list[dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = [run["blocks"] / 1e6 for run in runs]
    for mode, marker in (("scan", "o"), ("snapshot", "s")):
        left.plot(
            sizes,
            [run[mode]["bytes_per_block"] for run in runs],
            marker=marker,
            label=f"after {mode}",
        )
        right.plot(
            sizes, [run[mode]["start_s"] for run in runs], marker=marker, label=f"restart by {mode}"
        )
    left.axhline(_GOAL_BYTES_PER_BLOCK, color="grey", linestyle="--", label="goal 128 B")
    left.set_xlabel("indexed blocks (millions)")
    left.set_ylabel("daemon RSS per block (bytes)")
    left.set_ylim(bottom=0)
    left.legend()
    right.set_xlabel("indexed blocks (millions)")
    right.set_ylabel("start to ready (s)")
    right.set_ylim(bottom=0)
    right.legend()
    return benchlib.save_figure(fig, "scale.png")


def _start(run: dict[str, Any]) -> str:
    tier, adoption = run.get("tier_recovery_s"), run.get("adoption_s")
    parts = [f"{tier:.1f}" if tier is not None else "-", f"{adoption:.1f}" if adoption else "-"]
    return f"{run['start_s']:.1f} ({' / '.join(parts)})"


def _markdown(result: dict[str, Any], plot: str | None) -> str:
    lines = [
        "## Scale: memory per block, restart time, small-block ops (`tools/bench_scale.py`)",
        "",
        benchlib.machine_line(result["machine"]),
        "",
    ]
    runs = result.get("index", [])
    if runs:
        lines += [
            "Synthesised data files of 4 KiB blocks (records and catalog in the real format, "
            "payloads as holes); the real daemon started after a crash (header scan) and after "
            "a clean stop (index snapshot). Memory: daemon RSS above the same daemon on the "
            f"empty file, per block (goal <= {_GOAL_BYTES_PER_BLOCK} B). Restart: exec to first "
            f"INIT served (goal < {_GOAL_RESTART_S:.0f} s at 10M).",
            "",
            "| blocks | start s: scan (tier's / store's part) "
            "| start s: snapshot (tier's / store's) | B/block (scan) | B/block (snapshot) "
            "| peak RSS GiB | keys found |",
            "|---|---|---|---|---|---|---|",
        ]
        for run in runs:
            lines.append(
                f"| {run['blocks']:,} | {_start(run['scan'])} | {_start(run['snapshot'])} | "
                f"{run['scan']['bytes_per_block']:.0f} | "
                f"{run['snapshot']['bytes_per_block']:.0f} | "
                f"{max(run['scan']['peak_bytes'], run['snapshot']['peak_bytes']) / GiB:.2f} | "
                f"{run['scan']['check']['found']}/{run['scan']['check']['sampled']} |"
            )
        crashes = [run for run in runs if "checkpoint" in run]
        if crashes:
            lines += [
                "",
                "Crash restart from a checkpoint (issue 32): a checkpoint, then writes into a "
                "share of the segments (their records rewritten), then a crash; the start adopts "
                "the checkpoint and scans the segments written since, against the full scan "
                "(the first column above) of the same file in the same run.",
                "",
                "| blocks | segments written since / all | start s: checkpoint (tier's / "
                "store's) | of the full scan's start | keys found |",
                "|---|---|---|---|---|",
            ]
            for run in crashes:
                c = run["checkpoint"]
                lines.append(
                    f"| {run['blocks']:,} | {' / '.join(map(str, run['checkpoint_segments']))} | "
                    f"{_start(c)} | {c['start_s'] / run['scan']['start_s']:.3f} | "
                    f"{c['check']['found']}/{c['check']['sampled']} |"
                )
        taken = [run for run in runs if "take" in run]
        if taken:
            lines += [
                "",
                "A checkpoint taken by the serving daemon (on by default, "
                "`nvme.checkpoint_every_bytes`): its copy of the index is made 64K rows per "
                "step of the event loop, written in a worker thread. "
                + "; ".join(
                    f"{t['take']['rows']:,} rows: the loop held at most "
                    f"{t['take']['longest_slice_ms']:.1f} ms by one slice, written within "
                    f"{t['take']['written_within_s']:.1f} s of the writes that called for it"
                    for t in taken
                )
                + ".",
            ]
        p = result.get("projection")
        measured = [r for r in result["index"] if p and r["blocks"] >= p["blocks"]]
        if measured:
            r = measured[0]
            goal = (
                "met"
                if max(r["snapshot"]["start_s"], r["checkpoint"]["start_s"]) < 20
                else "not met"
            )
            lines += [
                "",
                f"Measured at {r['blocks']:,} blocks (the goal's size): restart "
                f"{r['scan']['start_s']:.1f} s by a full scan, {r['snapshot']['start_s']:.1f} s "
                f"from the clean stop's snapshot, {r['checkpoint']['start_s']:.1f} s after a crash "
                f"that followed a checkpoint (goal < 20 s: {goal} from a snapshot or a "
                "checkpoint; a full scan reads every record's header page, 4 KiB each, as many "
                "as there are blocks, and no scan can meet it on this disk); daemon memory "
                f"{r['scan']['bytes_per_block']:.0f} B a block "
                f"({(r['scan']['rss_bytes'] - r['empty']['rss_bytes']) / GiB:.2f} GiB above an "
                "empty daemon).",
            ]
        elif p:
            lines += [
                "",
                f"Projected linearly to {p['blocks']:,} blocks: restart "
                f"{p['scan_start_s']:.0f} s by scan, {p['snapshot_start_s']:.0f} s by snapshot; "
                f"daemon memory {p['scan_rss_bytes'] / GiB:.1f} GiB above an empty daemon.",
            ]
        if result.get("skipped"):
            lines.append(f"Not run (projected memory too large): {result['skipped']}.")
        if plot:
            lines += ["", f"![scale]({plot})"]
    ops = result.get("ops", [])
    if ops:
        lines += [
            "",
            f"Small blocks through the daemon against fio (io_uring, O_DIRECT, random, same "
            f"size and queue depth {ops[0]['queue_depth']}, the daemon's nvme.queue_depth), "
            "rounds alternating; reads from NVMe with DRAM emptied, READs of queue-depth "
            f"blocks, {_READS_IN_FLIGHT} in flight (goal: 64 KiB reads >= {_GOAL_READ_RATIO} of "
            "fio's IOPS). CPU-s/GB: daemon + client against fio; daemon: the daemon alone.",
            "",
            "| block | put+FSYNC ops/s (acked) | fio write IOPS | put ratio | read ops/s "
            "| fio read IOPS | read ratio | CPU-s/GB read (fio) | daemon CPU-s/GB read "
            "| CPU-s/GB put (fio) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for run in ops:
            lines.append(
                f"| {run['block_bytes'] >> 10} KiB | {benchlib.median(run['put_ops']):,.0f} "
                f"({benchlib.median(run['put_ack_ops']):,.0f}) | "
                f"{benchlib.median(run['fio_write_iops']):,.0f} | "
                f"{run['median_put_ratio']:.2f} | {benchlib.median(run['read_ops']):,.0f} | "
                f"{benchlib.median(run['fio_read_iops']):,.0f} | "
                f"{run['median_read_ratio']:.2f} | {run['read_cpu_s_per_gb']:.1f} "
                f"({run['fio_read_cpu_s_per_gb']:.2f}) | "
                f"{run['read_daemon_cpu_s_per_gb']:.1f} | "
                f"{run['put_cpu_s_per_gb']:.1f} "
                f"({run['fio_write_cpu_s_per_gb']:.2f}) |"
            )
    overflow = result.get("overflow", [])
    if overflow:
        lines += [
            "",
            "4 KiB puts (acknowledged, no FSYNC) for one more DRAM's worth once DRAM is full, "
            "each evicting a victim, against the same daemon's rate while DRAM filled:",
            "",
            "| DRAM | resident blocks | put ops/s filling | put ops/s past DRAM | ratio |",
            "|---|---|---|---|---|",
        ]
        for run in overflow:
            lines.append(
                f"| {run['dram_mib']} MiB | {run['resident_blocks']:,} | "
                f"{run['put_ops_filling']:,.0f} | {run['put_ops_past_dram']:,.0f} | "
                f"{run['ratio']:.3f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default="index,ops,overflow")
    parser.add_argument(
        "--sizes", default="250000,500000,1000000", help="blocks per index run, comma-separated"
    )
    parser.add_argument("--max-daemon-gib", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--qd", type=int, default=16)
    # rounds fit in the 64 MiB of DRAM: puts past a full DRAM wait for write-back
    # (``overflow``), so a round larger than DRAM measures the disk's writes, not the puts
    parser.add_argument("--ops-blocks", type=int, default=4096, help="blocks per ops round")
    parser.add_argument("--ops-sizes", default="4K,64K", help="ops block sizes, comma-separated")
    parser.add_argument(
        "--overflow-mib",
        default="16,32",
        help="DRAM sizes (MiB) of the overflow runs, comma-separated: a put past a full DRAM "
        "should cost the same at each",
    )
    parser.add_argument(
        "--checkpoint-share",
        type=float,
        default=0.02,
        help="index runs also start after a crash that followed a checkpoint and writes into "
        "this share of the segments (0: not run)",
    )
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    only = set(args.only.split(","))
    result: dict[str, Any] = {"machine": benchlib.machine()}
    load_start = os.getloadavg()[0]
    with benchlib.bench_workdir("scale") as work:
        if "index" in only:
            runs: list[dict[str, Any]] = []
            skipped = []
            for blocks in sorted(int(s) for s in args.sizes.split(",")):
                if runs:
                    per_block = max(
                        (run[m]["peak_bytes"] - run["empty"]["rss_bytes"]) / run["blocks"]
                        for run in runs
                        for m in ("scan", "snapshot")
                    )
                    if per_block * blocks > args.max_daemon_gib * GiB:
                        skipped.append(blocks)
                        continue
                runs.append(bench_index(work, blocks, 4 * KiB, args.checkpoint_share))
                print(f"index {blocks}: {runs[-1]['scan']['start_s']:.1f} s", file=sys.stderr)
            result["index"] = runs
            result["skipped"] = skipped
            result["projection"] = _projection(runs, _GOAL_RESTART_BLOCKS)
        if "ops" in only:
            result["ops"] = [
                bench_ops(work, int(parse_size(bs)), args.ops_blocks, args.qd, args.rounds)
                for bs in args.ops_sizes.split(",")
            ]
        if "overflow" in only:
            result["overflow"] = [
                bench_overflow(work, mib, mib * MiB // (4 * KiB))
                for mib in sorted(int(m) for m in args.overflow_mib.split(","))
            ]
    result["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    result["rounds"] = args.rounds
    benchlib.emit(result, args.json)
    if not args.no_record:
        plot = _plot(result["index"]) if len(result.get("index", [])) > 1 else None
        benchlib.record("scale", _markdown(result, plot), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
