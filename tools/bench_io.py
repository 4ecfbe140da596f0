"""Cold O_DIRECT random reads through the kvtierd io backends, against fio on the same file.

Method: one preallocated file (written by fio, so every extent is real data, not an unwritten
extent the file system would answer with zeros), read at random block-aligned offsets with
``O_DIRECT`` at the given block size and queue depth by three engines in turn:

* ``io_uring``: :mod:`kvtierd.io` io_uring backend, ``queue_depth`` tasks each reading into its
  own slot of a registered memfd arena (fixed buffers);
* ``threads``: the thread-pool backend on the same arena;
* ``fio``: ``fio --ioengine=io_uring --direct=1 --rw=randread`` (uniform random offsets with
  replacement, like the backends).

The virtual disk here is bimodal (for tens of seconds it runs at about 1.3 or about 3.5 GB/s), so
the engines alternate for ``--rounds`` rounds of ``--seconds`` each, and the ratios to fio are
taken round by round; the medians summarise. The order rotates every round (A B C, B C A,
C A B, ...), so that no engine always runs after the others drained a burst budget of the disk.
CPU time per GB is the process CPU time (user + system, all threads) of the backend run, and
fio's own usr+sys for fio.
The file is deleted afterwards. Usage::

    python tools/bench_io.py [--json] [--size 2M] [--qd 16] [--file-size 2G] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from kvtierd.io import IoBackend, open_io_backend

ENGINES = ("io_uring", "threads", "fio")
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; the mmap module names it only from Python 3.13
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Sample:
    engine: str
    gbps: float
    bytes_read: int
    seconds: float
    cpu_s_per_gb: float


def parse_size(text: str) -> int:
    """``4K``, ``2M``, ``2G`` or a plain byte count."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def prepare_file(path: Path, file_size: int, block: int) -> None:
    subprocess.run(
        ["fio", "--name=prep", f"--filename={path}", "--rw=write", f"--bs={block}",
         f"--size={file_size}", "--direct=1", "--ioengine=io_uring", "--iodepth=16",
         "--end_fsync=1", "--output-format=terse"],
        check=True, capture_output=True,
    )  # fmt: skip


def run_fio(path: Path, file_size: int, block: int, qd: int, seconds: float) -> Sample:
    out = subprocess.run(
        ["fio", "--name=randread", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
         "--rw=randread", f"--bs={block}", f"--iodepth={qd}", f"--size={file_size}",
         "--norandommap", "--randrepeat=0", "--time_based", f"--runtime={seconds}s",
         "--output-format=json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    job = json.loads(out.stdout)["jobs"][0]
    nbytes = int(job["read"]["io_bytes"])
    elapsed = job["read"]["runtime"] / 1000
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * elapsed
    return Sample("fio", nbytes / elapsed / 1e9, nbytes, elapsed, cpu_s / (nbytes / 1e9))


async def run_backend(
    backend: IoBackend, fd: int, slots: list[memoryview], file_blocks: int, seconds: float
) -> Sample:
    block = slots[0].nbytes
    total = 0
    deadline = time.perf_counter() + seconds

    async def worker(slot: memoryview, seed: int) -> None:
        nonlocal total
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            # Not "total += await ...": that reads total before the await and loses updates.
            moved = await backend.readv(fd, rng.randrange(file_blocks) * block, [slot])
            total += moved

    cpu0, t0 = time.process_time(), time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, slot in enumerate(slots):
            tg.start_soon(worker, slot, random.getrandbits(32) + i)
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    return Sample(backend.kind.value, total / elapsed / 1e9, total, elapsed, cpu_s / (total / 1e9))


def make_arena(nbytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("bench-arena", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    arena = mmap.mmap(fd, nbytes)
    # First touch is slow, and registration pins every page: fault the arena in before timing.
    arena.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
    return fd, arena


async def bench(args: argparse.Namespace, path: Path) -> list[list[Sample]]:
    block, qd, file_size = args.size, args.qd, args.file_size
    file_blocks = file_size // block
    arena_fd, arena = make_arena(block * qd)
    view = memoryview(arena)
    slots = [view[i * block : (i + 1) * block] for i in range(qd)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    rounds: list[list[Sample]] = []
    try:
        async with (
            open_io_backend("io_uring", queue_depth=qd) as uring,
            open_io_backend("threads", queue_depth=qd) as threads,
        ):
            uring.register_buffer(view)
            for backend in (uring, threads):  # warm-up: threads spawned, code paths hot
                await run_backend(backend, fd, slots, file_blocks, 0.5)
            for i in range(args.rounds):
                samples = []
                for engine in ENGINES[i % 3 :] + ENGINES[: i % 3]:
                    if engine == "fio":
                        samples.append(run_fio(path, file_size, block, qd, args.seconds))
                    else:
                        backend = uring if engine == "io_uring" else threads
                        samples.append(
                            await run_backend(backend, fd, slots, file_blocks, args.seconds)
                        )
                rounds.append(samples)
    finally:
        os.close(fd)
        del slots
        view.release()
        arena.close()
        os.close(arena_fd)
    return rounds


def summarise(args: argparse.Namespace, rounds: list[list[Sample]]) -> dict[str, Any]:
    per_round: list[dict[str, Any]] = []
    for i, samples in enumerate(rounds, 1):
        by = {s.engine: s for s in samples}
        fio = by["fio"].gbps
        per_round.append(
            {
                "round": i,
                "order": [s.engine for s in samples],
                "gbps": {e: round(by[e].gbps, 3) for e in ENGINES},
                "ratio_to_fio": {e: round(by[e].gbps / fio, 3) for e in ENGINES[:2]},
                "cpu_s_per_gb": {e: round(by[e].cpu_s_per_gb, 4) for e in ENGINES},
            }
        )

    def med(key: str, engine: str) -> float:
        return round(benchlib.median([r[key][engine] for r in per_round]), 4)

    return {
        "benchmark": "io_backends",
        "params": {
            "block_bytes": args.size,
            "queue_depth": args.qd,
            "file_bytes": args.file_size,
            "rounds": args.rounds,
            "seconds_per_run": args.seconds,
        },
        "rounds": per_round,
        "median_gbps": {e: med("gbps", e) for e in ENGINES},
        "median_ratio_to_fio": {e: med("ratio_to_fio", e) for e in ENGINES[:2]},
        "median_cpu_s_per_gb": {e: med("cpu_s_per_gb", e) for e in ENGINES},
        "raw": [[asdict(s) for s in samples] for samples in rounds],
        "machine": benchlib.machine(),
    }


def markdown(result: dict[str, Any]) -> str:
    p = result["params"]
    lines = [
        "## Disk I/O backends: cold O_DIRECT random reads vs fio",
        "",
        f"`tools/bench_io.py`: {p['block_bytes'] >> 10} KiB random reads at queue depth "
        f"{p['queue_depth']} from a {p['file_bytes'] >> 20} MiB file, engines alternated "
        f"for {p['rounds']} rounds of {p['seconds_per_run']} s, order rotating "
        "(the disk is bimodal, so compare within a round).",
        "",
        "| round | order | io_uring GB/s | threads GB/s | fio GB/s | io_uring/fio | threads/fio |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rounds"]:
        g, q = r["gbps"], r["ratio_to_fio"]
        lines.append(
            f"| {r['round']} | {', '.join(r['order'])} | {g['io_uring']:.2f} "
            f"| {g['threads']:.2f} | {g['fio']:.2f} | {q['io_uring']:.2f} | {q['threads']:.2f} |"
        )
    g, q, c = result["median_gbps"], result["median_ratio_to_fio"], result["median_cpu_s_per_gb"]
    lines += [
        f"| **median** | | {g['io_uring']:.2f} | {g['threads']:.2f} | {g['fio']:.2f} "
        f"| {q['io_uring']:.2f} | {q['threads']:.2f} |",
        "",
        f"CPU seconds per GB read (median): io_uring {c['io_uring']:.3f}, "
        f"threads {c['threads']:.3f}, fio {c['fio']:.3f}.",
        "",
        benchlib.machine_line(result["machine"]),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--size", type=parse_size, default=parse_size("2M"))
    parser.add_argument("--qd", type=int, default=16)
    parser.add_argument("--file-size", type=parse_size, default=parse_size("2G"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each run")
    parser.add_argument("--dir", type=Path, default=None, help="where the file goes")
    parser.add_argument("--no-record", action="store_true", help="leave docs/ untouched")
    args = parser.parse_args()
    if shutil.which("fio") is None:
        parser.error("fio is not installed")
    if args.size % 4096 or args.file_size < args.size:
        parser.error("--size must be a multiple of 4096 and at most --file-size")
    with tempfile.TemporaryDirectory(prefix="bench_io_", dir=args.dir) as tmp:
        path = Path(tmp) / "data"
        prepare_file(path, args.file_size, args.size)
        rounds = anyio.run(bench, args, path)
    result = summarise(args, rounds)
    if not args.no_record:
        benchlib.record("io_backends", markdown(result), result)
    benchlib.emit(result, args.json)
    if not args.json:
        print(markdown(result))


if __name__ == "__main__":
    main()
