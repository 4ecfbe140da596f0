"""What one request costs in each io_uring binding itself: prepare, submit, reap.

``bench_io.py`` measures whole backends against the disk, where a 2 MiB read costs the kernel
far more CPU than any binding does; this isolates the binding. Each binding (proven first in a
child process, like everywhere else) prepares batches of ``--batch`` one-span ``READV`` requests
(``READV_FIXED`` on a registered buffer where it can) on descriptor -1, submits them, and reaps
them: the kernel fails each at once with ``EBADF``, so what is timed is the Python and C path of
the binding plus the kernel's minimum. The bindings run in turn, ``--rounds`` times, and the
median of the rounds is printed in microseconds per request. Usage::

    python tools/uring_candidates/per_request.py --candidate-path /tmp/lu/pypi:/tmp/lu/v2024 \\
        [--bindings MODULE,...] [--requests 100000] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtierd.io.binding import RawRing, RingOp, UringBinding
from kvtierd.io.buffers import buffer_address
from kvtierd.io.probe import probe_binding

DEFAULT_BINDINGS = (
    "kvtierd.io.liburing_cffi,uring_candidates.pypi_liburing,uring_candidates.liburing_2024"
)
TOOLS = Path(__file__).resolve().parent.parent
_PAGE = 4096


def time_binding(ring: RawRing, address: int, fixed: bool, requests: int, batch: int) -> dict:
    """Microseconds per request spent preparing, submitting and reaping."""
    op, index = (RingOp.READV_FIXED, 0) if fixed else (RingOp.READV, -1)
    prep_s = submit_s = reap_s = 0.0
    tag = 0
    for _ in range(requests // batch):
        keep = []
        t0 = time.perf_counter()
        for i in range(batch):
            tag += 1
            keep.append(ring.prep_rw(op, -1, [(address + i * _PAGE, _PAGE)], 0, index, tag))
        t1 = time.perf_counter()
        ring.submit()
        t2 = time.perf_counter()
        reaped = 0
        while reaped < batch:
            reaped += len(ring.reap())
        t3 = time.perf_counter()
        prep_s, submit_s, reap_s = prep_s + t1 - t0, submit_s + t2 - t1, reap_s + t3 - t2
        del keep  # referenced until reaped, as the backend does
    n = requests // batch * batch
    return {
        "prep_us": prep_s / n * 1e6,
        "submit_us": submit_s / n * 1e6,
        "reap_us": reap_s / n * 1e6,
        "total_us": (prep_s + submit_s + reap_s) / n * 1e6,
    }


def open_binding(module: UringBinding, batch: int) -> tuple[RawRing, int, bool, mmap.mmap]:
    ring = module.open_ring(max(batch, 8))
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    ring.register_eventfd(efd)  # as the backend runs it: every completion bumps the eventfd
    arena = mmap.mmap(-1, batch * _PAGE)
    address = buffer_address(memoryview(arena))
    fixed = ring.supports(RingOp.READV_FIXED)
    if fixed:
        ring.register_buffers([(address, batch * _PAGE)])
    return ring, address, fixed, arena


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bindings", default=DEFAULT_BINDINGS, help="modules, comma-separated")
    parser.add_argument("--candidate-path", default="", help="directories joined by ':'")
    parser.add_argument("--requests", type=int, default=100_000, help="per round and binding")
    parser.add_argument("--batch", type=int, default=16, help="requests per submit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    paths = [p for p in args.candidate_path.split(os.pathsep) if p]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TOOLS), *paths, os.environ.get("PYTHONPATH")])
    )
    rings = {}
    skipped = {}
    for name in [n.strip() for n in args.bindings.split(",") if n.strip()]:
        verdict = probe_binding(name)
        if not verdict.ok:
            skipped[name] = verdict.detail
            continue
        rings[name] = open_binding(importlib.import_module(name), args.batch)
    samples: dict[str, list[dict]] = {name: [] for name in rings}
    for _ in range(args.rounds):
        for name, (ring, address, fixed, _arena) in rings.items():
            samples[name].append(time_binding(ring, address, fixed, args.requests, args.batch))
    result = {
        "requests": args.requests,
        "batch": args.batch,
        "rounds": args.rounds,
        "median_us": {
            name: {
                "fixed": rings[name][2],
                **{k: round(statistics.median(s[k] for s in runs), 3) for k in runs[0]},
            }
            for name, runs in samples.items()
        },
        "not_measured": skipped,
    }
    for ring, *_ in rings.values():
        ring.close()
    if args.json:
        print(json.dumps(result))
        return
    print("| binding | fixed | prepare us | submit us | reap us | total us per request |")
    print("|---|---|---:|---:|---:|---:|")
    for name, m in result["median_us"].items():
        print(
            f"| `{name}` | {'yes' if m['fixed'] else 'no'} | {m['prep_us']:.2f} "
            f"| {m['submit_us']:.2f} | {m['reap_us']:.2f} | {m['total_us']:.2f} |"
        )
    for name, detail in skipped.items():
        print(f"- `{name}`: not measured: {detail}")


if __name__ == "__main__":
    main()
