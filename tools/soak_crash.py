"""Crash soak: SIGKILL the daemon at random moments during heavy writes, restart, verify.

Each iteration starts ``kvtierd`` on the same data directory (asyncio and trio alternately), runs
a writer (PUT batches, FORGET, EVICT, FSYNC at random points) and a reader (LOOKUP then READ of
keys it has seen committed) against it, kills the daemon with SIGKILL after a random delay, and
then, on the restarted daemon, checks two things:

* every key whose FSYNC returned (and that was not forgotten afterwards) is present and
  byte-exact;
* every block the daemon serves, for every key ever written, is byte-exact: a torn or wrong block
  is never served (a miss is fine for a block that was not FSYNC'd).

A block's bytes are a function of its key, so any served block can be checked. The same loop
runs in CI (``tests/integration/test_crash.py``, 50 iterations); this tool runs it longer::

    python tools/soak_crash.py --iterations 500 [--seed 1] [--dir DIR]

and prints a JSON summary; the exit status is 1 when a violation was found.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvtierd.client import BlockNotFoundError, KvtierError, Namespace, connect
from kvtierd.testing import DaemonProcess

__all__ = ["CrashLoop", "Summary", "block_content", "main"]

BLOCK_BYTES = 16 * 1024 + 123  # deliberately not a page multiple
UNIVERSE = 600  # distinct keys: about 12 MiB of slots, well inside the NVMe tier
NAMESPACE = "crash"


@functools.cache
def block_content(key: bytes) -> bytes:
    """The one true content of ``key``."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(BLOCK_BYTES)


def key_of(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"crashkey"


@dataclass
class Summary:
    iterations: int = 0
    puts: int = 0
    forgets: int = 0
    fsyncs: int = 0
    durable_checked: int = 0
    served_checked: int = 0
    reads_during_run: int = 0
    misses_not_durable: int = 0
    violations: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


_Client = Callable[[DaemonProcess, random.Random, threading.Event], None]


class CrashLoop:
    """The loop's state across iterations: which keys were ever written, which are durable."""

    def __init__(self, directory: Path, *, seed: int, dram_size: str, nvme_size: str) -> None:
        self.directory = directory
        self.rng = random.Random(seed)
        self.dram_size = dram_size
        self.nvme_size = nvme_size
        self.written: set[bytes] = set()  # every key ever sent in a PUT
        self.durable: set[bytes] = set()  # FSYNC returned after its PUT, not forgotten since
        self.summary = Summary()
        self._lock = threading.Lock()

    # -- one iteration ---------------------------------------------------------------------

    def iteration(self, number: int) -> None:
        runtime = "trio" if number % 2 else "asyncio"
        daemon = DaemonProcess(
            self.directory,
            dram_size=self.dram_size,
            nvme_size=self.nvme_size,
            runtime=runtime,
        )
        daemon.start(timeout_s=60)
        try:
            self.verify(daemon, number)
            self.write_and_kill(daemon)
        finally:
            daemon.kill()
        self.summary.iterations += 1

    def verify(self, daemon: DaemonProcess, number: int) -> None:
        """After a restart: durable keys present and exact; whatever is served is exact."""
        with connect(daemon.socket, timeout_s=30) as client:
            ns = client.namespace(NAMESPACE, block_bytes=BLOCK_BYTES)
            present = self._present(ns, number, sorted(self.written))
            for start in range(0, len(present), 32):
                chunk = present[start : start + 32]
                try:  # the common case: every block of the chunk is intact
                    with ns.get(chunk) as views:
                        for key, view in zip(chunk, views, strict=True):
                            self._check_served(number, key, view)
                except BlockNotFoundError:
                    for key in chunk:
                        self._verify_one(ns, number, key)
            if client.stats()["leases"] != 0:
                self._violation(f"iteration {number}: leases left after verification")

    def _present(self, ns: Namespace, number: int, keys: list[bytes]) -> list[bytes]:
        """The keys LOOKUP reports present (one LOOKUP per missing key, not per key)."""
        present: list[bytes] = []
        i = 0
        while i < len(keys):
            chunk = keys[i : i + 512]
            hits = ns.lookup(chunk)
            present += chunk[:hits]
            i += hits
            if hits < len(chunk):
                if keys[i] in self.durable:
                    self._violation(f"iteration {number}: FSYNC'd key {keys[i].hex()} is missing")
                i += 1
        return present

    def _verify_one(self, ns: Namespace, number: int, key: bytes) -> None:
        present = ns.lookup([key]) == 1
        if key in self.durable and not present:
            self._violation(f"iteration {number}: FSYNC'd key {key.hex()} is missing")
            return
        if not present:
            return
        try:
            with ns.get([key]) as views:
                self._check_served(number, key, views[0])
        except BlockNotFoundError:
            if key in self.durable:
                self._violation(f"iteration {number}: FSYNC'd key {key.hex()} unreadable")
            else:
                self.summary.misses_not_durable += 1

    def _check_served(self, number: int, key: bytes, view: memoryview) -> None:
        if view != block_content(key):
            self._violation(f"iteration {number}: key {key.hex()} served wrong bytes")
        self.summary.served_checked += 1
        if key in self.durable:
            self.summary.durable_checked += 1

    def write_and_kill(self, daemon: DaemonProcess) -> None:
        stop = threading.Event()
        seed = self.rng.getrandbits(32)
        threads = [
            threading.Thread(target=self._guard, args=(self._writer, daemon, seed, stop)),
            threading.Thread(target=self._guard, args=(self._reader, daemon, seed + 1, stop)),
        ]
        for thread in threads:
            thread.start()
        time.sleep(self.rng.uniform(0.05, 0.6))
        stop.set()
        daemon.kill()
        for thread in threads:
            thread.join(60)
            if thread.is_alive():
                self._violation("a client thread hung after the daemon was killed")

    def _guard(
        self, func: _Client, daemon: DaemonProcess, seed: int, stop: threading.Event
    ) -> None:
        try:
            func(daemon, random.Random(seed), stop)
        except (KvtierError, OSError) as exc:
            if not stop.is_set():  # set just before the kill: this failure is not the kill's
                self._violation(f"{func.__name__} failed while the daemon was up: {exc!r}")
        except Exception as exc:  # any other failure is a finding
            self._violation(f"{func.__name__} raised {exc!r}")

    def _writer(self, daemon: DaemonProcess, rng: random.Random, stop: threading.Event) -> None:
        with connect(daemon.socket, timeout_s=30) as client:
            ns = client.namespace(NAMESPACE, block_bytes=BLOCK_BYTES)
            since_fsync: set[bytes] = set()
            while not stop.is_set():
                roll = rng.random()
                if roll < 0.65:
                    keys = [key_of(rng.randrange(UNIVERSE)) for _ in range(rng.randint(1, 12))]
                    keys = list(dict.fromkeys(keys))
                    with self._lock:
                        self.written.update(keys)
                    ns.put(keys, [block_content(k) for k in keys])
                    since_fsync.update(keys)
                    self.summary.puts += len(keys)
                elif roll < 0.8:
                    client.fsync()
                    with self._lock:
                        self.durable |= since_fsync
                    since_fsync.clear()
                    self.summary.fsyncs += 1
                elif roll < 0.95:
                    keys = [key_of(rng.randrange(UNIVERSE)) for _ in range(rng.randint(1, 16))]
                    with self._lock:  # not required any more, from the moment it is asked
                        self.durable -= set(keys)
                    since_fsync -= set(keys)
                    ns.forget(list(dict.fromkeys(keys)))
                    self.summary.forgets += len(keys)
                else:
                    client.evict()

    def _reader(self, daemon: DaemonProcess, rng: random.Random, stop: threading.Event) -> None:
        with connect(daemon.socket, timeout_s=30) as client:
            ns = client.namespace(NAMESPACE, block_bytes=BLOCK_BYTES)
            while not stop.is_set():
                with self._lock:
                    candidates = sorted(self.written)
                if not candidates:
                    time.sleep(0.01)
                    continue
                keys = rng.sample(candidates, min(len(candidates), rng.randint(1, 6)))
                hits = ns.lookup(keys)
                if not hits:
                    continue
                try:
                    with ns.get(keys[:hits]) as views:
                        for key, view in zip(keys, views, strict=False):
                            if bytes(view) != block_content(key):
                                self._violation(f"key {key.hex()} served wrong bytes mid-run")
                except BlockNotFoundError:
                    continue  # forgotten or evicted between LOOKUP and READ
                self.summary.reads_during_run += 1

    def _violation(self, text: str) -> None:
        with self._lock:
            self.summary.violations.append(text)


def run(
    iterations: int,
    *,
    directory: Path,
    seed: int = 0,
    dram_size: str = "32M",
    nvme_size: str = "128M",
    log: bool = False,
) -> Summary:
    """Run the loop; returns its summary (violations included, never raised)."""
    started = time.monotonic()
    loop = CrashLoop(directory, seed=seed, dram_size=dram_size, nvme_size=nvme_size)
    for number in range(iterations):
        loop.iteration(number)
        if log:
            s = loop.summary
            print(
                f"iteration {number + 1}/{iterations}: written {len(loop.written)} "
                f"durable {len(loop.durable)} violations {len(s.violations)}",
                file=sys.stderr,
            )
    # the last kill is verified too
    daemon = DaemonProcess(directory, dram_size=dram_size, nvme_size=nvme_size)
    daemon.start(timeout_s=60)
    try:
        loop.verify(daemon, iterations)
    finally:
        daemon.kill()
    loop.summary.elapsed_s = round(time.monotonic() - started, 2)
    return loop.summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--dir", type=Path, help="data directory (default: a temporary one)")
    parser.add_argument("--dram-size", default="32M")
    parser.add_argument("--nvme-size", default="128M")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="kvtierd-soak-"))
    try:
        summary = run(
            args.iterations,
            directory=directory,
            seed=args.seed,
            dram_size=args.dram_size,
            nvme_size=args.nvme_size,
            log=True,
        )
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps({"seed": args.seed, **asdict(summary)}, indent=2))
    return 1 if summary.violations else 0


if __name__ == "__main__":
    sys.exit(main())
