"""Cold O_DIRECT random reads through the kvtierd io backends, against fio on the same file.

Method: one preallocated file (written by fio, so every extent is real data, not an unwritten
extent the file system would answer with zeros), read at random block-aligned offsets with
``O_DIRECT`` at the given block size and queue depth by these engines in turn:

* one per io_uring binding named in ``--bindings`` (labelled by its module): the
  :mod:`kvtierd.io` io_uring backend driving that binding, ``queue_depth`` tasks each reading
  into its own slot of a memfd arena, registered as fixed buffers wherever the binding can
  prepare the fixed opcodes. Each binding is first proven in a child process
  (:func:`kvtierd.io.probe.probe_binding`), as the daemon does: one that dies there (SIGILL on a
  CPU it was not built for) or fails is reported as not measured, and the run goes on;
* ``threads``: the thread-pool backend on the same arena;
* ``fio``: ``fio --ioengine=io_uring --direct=1 --rw=randread`` (uniform random offsets with
  replacement, like the backends).

The virtual disk here is bimodal (for tens of seconds it runs at about 1.3 or about 3.5 GB/s), so
the engines alternate for ``--rounds`` rounds of ``--seconds`` each, and the ratios to fio are
taken round by round; the medians summarise. The order rotates every round (A B C, B C A,
C A B, ...), so that no engine always runs after the others drained a burst budget of the disk.
CPU time per GB is the process CPU time (user + system, all threads) of the backend run, and
fio's own usr+sys for fio (the job's threads only: the whole fio process, from ``getrusage`` of
children, is recorded beside it: 1.1x the job's figure at 4 KiB here, 1.7x at 2 MiB).
The file is deleted afterwards. Usage::

    python -m tools.bench_io [--json] [--size 2M] [--qd 16] [--file-size 2G] [--rounds 6]
        [--bindings MODULE,...] [--candidate-path DIR[:DIR...]]

The io_uring binding candidates of ``docs/io.md`` were adapters in ``tools/uring_candidates/``
(archived out of the tree: ``git checkout 32a3316 -- tools/uring_candidates``) over packages
installed outside the project, found through ``--candidate-path``::

    pip install --no-deps --target /tmp/lu/pypi liburing==2026.3.30
    CFLAGS="-march=x86-64 -mtune=generic" pip wheel --no-deps --no-binary liburing \\
        -w /tmp/lu/w2024 liburing==2024.5.3
    pip install --no-deps --target /tmp/lu/v2024 dynamic-import \\
        /tmp/lu/w2024/liburing-2024.5.3-*.whl
    B=kvtierd.io.liburing_cffi,uring_candidates.pypi_liburing
    B=$B,uring_candidates.liburing_2024,uring_candidates.cffi_plain
    python -m tools.bench_io --candidate-path /tmp/lu/pypi:/tmp/lu/v2024 --bindings $B
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from kvtierd.io import BindingVerdict, IoBackend, open_io_backend
from kvtierd.io.binding import DEFAULT_BINDING
from kvtierd.io.probe import probe_binding
from tools import benchlib
from tools.benchlib import parse_size

_MADV_POPULATE_WRITE = 23  # Linux 5.14+; the mmap module names it only from Python 3.13


@dataclass(frozen=True)
class Sample:
    engine: str
    gbps: float
    bytes_read: int
    seconds: float
    cpu_s_per_gb: float
    #: CPU of the whole process: the same for a backend; for fio, every thread of the fio
    #: process and its start-up (``getrusage`` of children), where ``cpu_s_per_gb`` is the job's.
    process_cpu_s_per_gb: float


@dataclass(frozen=True)
class Engine:
    """One measured engine: ``label`` is the binding's module, ``threads`` or ``fio``."""

    label: str
    kind: str
    detail: str
    fixed_buffers: bool = False
    fixed_ops: int = 0


def short(label: str) -> str:
    """The last part of a module name, for table columns."""
    return label.rsplit(".", 1)[-1]


def prepare_file(path: Path, file_size: int, block: int) -> None:
    subprocess.run(
        ["fio", "--name=prep", f"--filename={path}", "--rw=write", f"--bs={block}",
         f"--size={file_size}", "--direct=1", "--ioengine=io_uring", "--iodepth=16",
         "--end_fsync=1", "--output-format=terse"],
        check=True, capture_output=True,
    )  # fmt: skip


def run_fio(path: Path, file_size: int, block: int, qd: int, seconds: float) -> Sample:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
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
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    process_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    gb = nbytes / 1e9
    return Sample("fio", gb / elapsed, nbytes, elapsed, cpu_s / gb, process_s / gb)


async def run_backend(
    label: str,
    backend: IoBackend,
    fd: int,
    slots: list[memoryview],
    file_blocks: int,
    seconds: float,
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
    gb = total / 1e9
    return Sample(label, gb / elapsed, total, elapsed, cpu_s / gb, cpu_s / gb)


def make_arena(nbytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("bench-arena", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    arena = mmap.mmap(fd, nbytes)
    # First touch is slow, and registration pins every page: fault the arena in before timing.
    arena.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
    return fd, arena


async def open_backends(
    stack: contextlib.AsyncExitStack, verdicts: list[BindingVerdict], view: memoryview, qd: int
) -> dict[str, IoBackend]:
    """An io_uring backend per proven binding (the arena registered where the binding can use
    fixed buffers), then the threads backend, all closed by ``stack``."""
    backends: dict[str, IoBackend] = {}
    for verdict in verdicts:
        backend = await stack.enter_async_context(
            open_io_backend("io_uring", queue_depth=qd, binding=verdict.binding, verdict=verdict)
        )
        if backend.supports_fixed_buffers:
            backend.register_buffer(view)
        backends[verdict.binding] = backend
    backends["threads"] = await stack.enter_async_context(
        open_io_backend("threads", queue_depth=qd)
    )
    return backends


async def run_rounds(
    args: argparse.Namespace,
    path: Path,
    backends: dict[str, IoBackend],
    fd: int,
    slots: list[memoryview],
) -> list[list[Sample]]:
    """Every engine once a round, the order rotating by one each round."""
    file_blocks = args.file_size // args.size
    labels = [*backends, "fio"]
    rounds = []
    for i in range(args.rounds):
        samples = []
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            if label == "fio":
                sample = run_fio(path, args.file_size, args.size, args.qd, args.seconds)
            else:
                sample = await run_backend(
                    label, backends[label], fd, slots, file_blocks, args.seconds
                )
            samples.append(sample)
        rounds.append(samples)
    return rounds


async def bench(
    args: argparse.Namespace, path: Path, verdicts: list[BindingVerdict]
) -> tuple[list[Engine], list[list[Sample]]]:
    """Run the rounds; returns the engines (in ``--bindings`` order, then threads and fio)
    and each round's samples in the order they ran."""
    block, qd = args.size, args.qd
    arena_fd, arena = make_arena(block * qd)
    view = memoryview(arena)
    slots = [view[i * block : (i + 1) * block] for i in range(qd)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        async with contextlib.AsyncExitStack() as stack:
            backends = await open_backends(stack, verdicts, view, qd)
            for label, backend in backends.items():  # warm-up: threads spawned, code paths hot
                await run_backend(label, backend, fd, slots, args.file_size // block, 0.5)
            rounds = await run_rounds(args, path, backends, fd, slots)
            engines = [
                Engine(
                    v.binding,
                    "io_uring",
                    # describe() as the probe's child printed it, alone in its process (beside
                    # another candidate, a binding may name the other's shared object)
                    v.detail.rsplit("; ", 1)[0],
                    backends[v.binding].supports_fixed_buffers,
                    backends[v.binding].statistics().fixed_ops,
                )
                for v in verdicts
            ]
    finally:
        os.close(fd)
        del slots
        view.release()
        arena.close()  # no binding may keep an export of the arena
        os.close(arena_fd)
    threads = Engine("threads", "threads", "os.preadv in anyio worker threads")
    fio = Engine("fio", "fio", "fio --ioengine=io_uring --direct=1")
    return [*engines, threads, fio], rounds


def cpu_has_avx512() -> bool:
    """Whether this CPU has AVX-512 Foundation (``avx512f`` in ``/proc/cpuinfo``)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return "avx512f" in line.split()
    return False


def summarise(
    args: argparse.Namespace,
    engines: list[Engine],
    skipped: list[BindingVerdict],
    rounds: list[list[Sample]],
) -> dict[str, Any]:
    labels = [e.label for e in engines]
    measured = labels[:-1]  # every engine but fio has a ratio to fio
    per_round: list[dict[str, Any]] = []
    for i, samples in enumerate(rounds, 1):
        by = {s.engine: s for s in samples}
        fio = by["fio"].gbps
        per_round.append(
            {
                "round": i,
                "order": [s.engine for s in samples],
                "gbps": {e: round(by[e].gbps, 3) for e in labels},
                "ratio_to_fio": {e: round(by[e].gbps / fio, 3) for e in measured},
                "cpu_s_per_gb": {e: round(by[e].cpu_s_per_gb, 4) for e in labels},
            }
        )

    def med(key: str, engine: str) -> float:
        return round(benchlib.median([r[key][engine] for r in per_round]), 4)

    def spread(engine: str) -> list[float]:
        ratios = [r["ratio_to_fio"][engine] for r in per_round]
        return [min(ratios), max(ratios)]

    return {
        "benchmark": "io_backends",
        "params": {
            "block_bytes": args.size,
            "queue_depth": args.qd,
            "file_bytes": args.file_size,
            "rounds": args.rounds,
            "seconds_per_run": args.seconds,
            "bindings": args.bindings,
            "candidate_paths": args.candidate_path,
        },
        "engines": [asdict(e) for e in engines],
        "not_measured": [
            {"binding": v.binding, "detail": v.detail, "signal": v.signal} for v in skipped
        ],
        "rounds": per_round,
        "median_gbps": {e: med("gbps", e) for e in labels},
        "median_ratio_to_fio": {e: med("ratio_to_fio", e) for e in measured},
        "ratio_to_fio_range": {e: spread(e) for e in measured},
        "median_cpu_s_per_gb": {e: med("cpu_s_per_gb", e) for e in labels},
        "median_fio_process_cpu_s_per_gb": round(
            benchlib.median(
                [s.process_cpu_s_per_gb for r in rounds for s in r if s.engine == "fio"]
            ),
            4,
        ),
        "raw": [[asdict(s) for s in samples] for samples in rounds],
        "machine": benchlib.machine(),
        "cpu_avx512": cpu_has_avx512(),
    }


def markdown(result: dict[str, Any]) -> str:
    p, engines = result["params"], result["engines"]
    g, q, c = result["median_gbps"], result["median_ratio_to_fio"], result["median_cpu_s_per_gb"]
    lines = [
        "## Disk I/O backends: cold O_DIRECT random reads vs fio",
        "",
        f"`tools/bench_io.py`: {p['block_bytes'] >> 10} KiB random reads at queue depth "
        f"{p['queue_depth']} from a {p['file_bytes'] >> 20} MiB file, engines alternated "
        f"for {p['rounds']} rounds of {p['seconds_per_run']} s, order rotating "
        "(the disk is bimodal, so compare within a round). An io_uring engine is the kvtierd "
        "io_uring backend driving the binding its module names.",
        "",
        "| engine | fixed buffers | median GB/s | median ratio to fio | ratio range "
        "| CPU s per GB |",
        "|---|---|---:|---:|---|---:|",
    ]
    for e in engines:
        label = e["label"]
        if e["kind"] == "io_uring":
            fixed = f"yes ({e['fixed_ops']:,} requests)" if e["fixed_ops"] else "no"
            name = f"io_uring: `{label}`"
        else:
            fixed, name = ("no (fio's default)" if label == "fio" else "no"), label
        if label == "fio":
            ratio, span = "1", ""
        else:
            lo, hi = result["ratio_to_fio_range"][label]
            ratio, span = f"{q[label]:.2f}", f"{lo:.2f}-{hi:.2f}"
        lines.append(f"| {name} | {fixed} | {g[label]:.2f} | {ratio} | {span} | {c[label]:.3f} |")
    lines += ["", "Per round, GB/s (ratio to fio):", ""]
    labels = [e["label"] for e in engines]
    lines += [
        "| round | order | " + " | ".join(short(label) for label in labels) + " |",
        "|---:|---|" + "---:|" * len(labels),
    ]
    for r in result["rounds"]:
        cells = [
            f"{r['gbps'][label]:.2f}"
            + (f" ({r['ratio_to_fio'][label]:.2f})" if label in r["ratio_to_fio"] else "")
            for label in labels
        ]
        order = ", ".join(short(label) for label in r["order"])
        lines.append(f"| {r['round']} | {order} | " + " | ".join(cells) + " |")
    lines += ["", "Bindings:", ""]
    lines += [f"- `{e['label']}`: {e['detail']}" for e in engines if e["kind"] == "io_uring"]
    lines += [f"- `{s['binding']}`: not measured: {s['detail']}" for s in result["not_measured"]]
    lines += [
        "",
        "CPU seconds per GB read: the process's user + system time (all threads) during the run; "
        "for fio the job's own usr + sys as fio reports it (the whole fio process, all its "
        f"threads and start-up included: {result['median_fio_process_cpu_s_per_gb']:.3f}).",
        "",
        f"This CPU has AVX-512: {'yes' if result['cpu_avx512'] else 'no'} (a binding built for "
        "it, such as the PyPI liburing 2026 wheels, runs only where it does).",
        "",
        benchlib.machine_line(result["machine"]),
    ]
    return "\n".join(lines)


def add_candidate_paths(paths: list[str]) -> None:
    """Put ``paths`` where this process and its probe children import from."""
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))


def probe_all(bindings: list[str], directory: Path) -> list[BindingVerdict]:
    verdicts = []
    for binding in bindings:
        verdict = probe_binding(binding, directory=directory)
        print(
            f"probe {binding}: {'ok' if verdict.ok else 'FAILED'}: {verdict.detail}",
            file=sys.stderr,
        )
        verdicts.append(verdict)
    return verdicts


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
    parser.add_argument(
        "--bindings",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=[DEFAULT_BINDING],
        help=f"io_uring binding modules, comma-separated (default {DEFAULT_BINDING})",
    )
    parser.add_argument(
        "--candidate-path",
        type=lambda text: [p for p in text.split(os.pathsep) if p],
        action="extend",
        default=[],
        help="directories holding the candidate packages (repeatable, or joined by ':')",
    )
    args = parser.parse_args()
    if shutil.which("fio") is None:
        parser.error("fio is not installed")
    if args.size % 4096 or args.file_size < args.size:
        parser.error("--size must be a multiple of 4096 and at most --file-size")
    if len(set(args.bindings)) != len(args.bindings) or {"threads", "fio"} & set(args.bindings):
        parser.error("--bindings must name distinct modules")
    add_candidate_paths(args.candidate_path)
    with tempfile.TemporaryDirectory(prefix="bench_io_", dir=args.dir) as tmp:
        verdicts = probe_all(args.bindings, Path(tmp))
        path = Path(tmp) / "data"
        prepare_file(path, args.file_size, args.size)
        ok = [v for v in verdicts if v.ok]
        engines, rounds = anyio.run(bench, args, path, ok)
    result = summarise(args, engines, [v for v in verdicts if not v.ok], rounds)
    if not args.no_record:
        benchlib.record("io_backends", markdown(result), result)
    benchlib.emit(result, args.json)
    if not args.json:
        print(markdown(result))


if __name__ == "__main__":
    main()
