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
runs in CI (``tests/integration/test_crash.py``, 50 iterations); ``tools/soak_crash.py`` runs it
longer and records it.

With ``--hostile`` the daemon has two tenants, and the honest writer and reader use tenant
``honest`` while a hostile client (its own thread, two connections) attacks its own tenant's
region, ``hostile``, the ways issue 14's review did: it commits blocks that are whole forged
records (a record header for the honest namespace, naming an honest key, with a payload that
matches the header's checksum), scribbles forged records over its whole region (committed slots
included) and over the slots it has just committed (through a writable mapping of its own),
punches holes in the region, tries to shrink or grow it (sealed: must fail with EPERM), and holds
ALLOCs it never commits; a second hostile thread reads the hostile tenant's blocks meanwhile.
Half the cycles give the daemon little staging memory, so that most blocks of a long COMMIT are
not copied at COMMIT but at write-back, out of a slot the hostile client is still
scribbling on (the copy is verified, and dropped when it changed). If
a forged record ever reached the data file it would be recovered as an honest block, so the checks
above catch it; on top of them every hostile block served (during the run and after each restart)
must be the bytes committed for it (a miss is fine), and no ALLOC left uncommitted may ever become
visible. A success of a refused attack (ftruncate, finding honest bytes in the hostile mapping) is a
defence failure. Where NIXL works, a hostile run also turns on the daemon's TCP listener and NIXL
reads and adds :mod:`kvtierd.testing.remote_attacks`'s attackers of both (junk and cut-off
handshakes, idle floods, writes over TCP, a NIXL reader widening its grant); ``run(...,
remote=False)`` leaves them out. The module is past 600 lines for that second client: it shares the
loop, its state and its checks. The workload itself is :mod:`kvtierd.testing.soak`.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import mmap
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvtierd.client import BlockNotFoundError, Client, KvtierError, Namespace, connect
from kvtierd.errors import CorruptBlockError, NoSpaceError, QuotaError
from kvtierd.store.records import PAGE_BYTES
from kvtierd.testing import DaemonProcess
from kvtierd.testing.remote_attacks import REMOTE_UID, RemoteAttacker, nixl_attack, prepare
from kvtierd.testing.soak import (
    BLOCK_BYTES,
    FORGED_SEQ,
    HONEST,
    HONEST_DIGEST,
    HOSTILE,
    HOSTILE_BLOCK_BYTES,
    HOSTILE_DIGEST,
    HOSTILE_NAMESPACE,
    HOSTILE_UNIVERSE,
    NAMESPACE,
    UNIVERSE,
    block_content,
    forged_record,
    hostile_content,
    hostile_key_of,
    key_of,
)

__all__ = ["CrashLoop", "HostileClient", "Summary", "run"]

TENANTS = """
[[tenants]]
name = "honest"
uids = [{uid}]
dram_share = 0.75

[[tenants]]
name = "hostile"
uids = [{uid}, {remote_uid}]
dram_share = 0.25
"""
#: Little staging memory: 128K of copies, 64K of them write-back's own. Most blocks of a long
#: COMMIT find no room to be copied at COMMIT, so write-back copies them from their slots, which
#: their tenant can still write to, and verifies the copies.
SMALL_STAGING = """
[limits]
max_block_bytes = "64K"

[nvme]
queue_depth = 192
staging_bytes = "128K"
"""
#: A checkpoint every 2 MiB written (about 120 blocks): kills land before, during and after
#: checkpoints, and a restart adopts one and scans only the segments written since.
CHECKPOINTS = 'checkpoint_every_bytes = "2M"\n'


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
    hostile: bool = False
    #: Acknowledged (FSYNC'd, not forgotten) blocks expected at the restarts, and found exact.
    durable_expected: int = 0
    durable_recovered: int = 0
    #: Blocks served (honest or hostile, during the run or after a restart) with wrong bytes.
    wrong_bytes_served: int = 0
    #: Honest reads the client library refused (checksum mismatch): nobody writes there.
    corrupt_reads: int = 0
    #: Hostile blocks served and compared; hostile reads the client library refused (their
    #: slot changed after COMMIT: a miss).
    hostile_served_checked: int = 0
    hostile_misses: int = 0
    #: Hostile blocks the daemons reported dropped at write-back (seen before each kill).
    writebacks_dropped: int = 0
    hostile_actions: dict[str, int] = field(default_factory=dict)
    hostile_outcomes: dict[str, int] = field(default_factory=dict)
    defence_failures: int = 0
    #: The remote attackers' transports (``tcp+tls, nixl``), or why they did not run.
    remote: str = ""


_Client = Callable[[DaemonProcess, random.Random, threading.Event], None]


class CrashLoop:
    """The loop's state across iterations: which keys were ever written, which are durable."""

    def __init__(
        self,
        directory: Path,
        *,
        seed: int,
        dram_size: str,
        nvme_size: str,
        hostile: bool = False,
        remote: bool = True,
    ) -> None:
        self.directory = directory
        self.rng = random.Random(seed)
        self.dram_size = dram_size
        self.nvme_size = nvme_size
        self.hostile = hostile
        self.tenant = HONEST if hostile else "default"
        self.written: set[bytes] = set()  # every key ever sent in a PUT
        self.durable: set[bytes] = set()  # FSYNC returned after its PUT, not forgotten since
        self.held_keys: set[bytes] = set()  # hostile keys ALLOCed and never committed
        self.summary = Summary(hostile=hostile)
        self.actions: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.dropped_seen = 0  # corrupt_writebacks of the daemon now running
        self._lock = threading.Lock()
        self.remote = None
        if hostile and remote:
            self.remote, self.summary.remote = prepare(directory)
        if self.remote is not None:
            self.summary.remote = f"tcp+tls on 127.0.0.1:{self.remote.port}, nixl widen"

    # -- one iteration ---------------------------------------------------------------------

    def daemon(self, runtime: str = "asyncio", *, small_staging: bool = False) -> DaemonProcess:
        config = ""
        if self.hostile:
            config = TENANTS.format(uid=os.getuid(), remote_uid=REMOTE_UID)
        # (TOML: one [nvme] table, so the checkpoints' line goes into the staging's)
        config += (SMALL_STAGING if self.hostile and small_staging else "[nvme]\n") + CHECKPOINTS
        if self.remote is not None:
            config += self.remote.config_text()
        return DaemonProcess(
            self.directory,
            dram_size=self.dram_size,
            nvme_size=self.nvme_size,
            runtime=runtime,
            config_text=config,
        )

    def iteration(self, number: int) -> None:
        # both runtimes, each with the default staging memory and with little
        daemon = self.daemon("trio" if number % 2 else "asyncio", small_staging=number % 4 >= 2)
        daemon.start(timeout_s=60)
        try:
            self.verify(daemon, number)
            if self.remote is not None:
                nixl_attack(self, self.remote, daemon, number)
            self.write_and_kill(daemon)
        finally:
            daemon.kill()
        self.summary.iterations += 1

    def verify(self, daemon: DaemonProcess, number: int) -> None:
        """After a restart: durable keys present and exact; whatever is served is exact."""
        with connect(daemon.socket, timeout_s=30) as client:
            ns = client.namespace(NAMESPACE, block_bytes=BLOCK_BYTES, tenant=self.tenant)
            # The hostile tenant forges records of every honest key, written or not.
            keys = [key_of(i) for i in range(UNIVERSE)] if self.hostile else self.written
            self.summary.durable_expected += len(self.durable)
            present = self._present(ns, number, sorted(keys))
            for start in range(0, len(present), 32):
                chunk = present[start : start + 32]
                try:  # the common case: every block of the chunk is intact
                    with ns.get(chunk) as views:
                        for key, view in zip(chunk, views, strict=True):
                            self._check_served(number, key, view)
                except BlockNotFoundError:
                    for key in chunk:
                        self._verify_one(ns, number, key)
            if self.hostile:
                self._verify_hostile(client, number)
            if client.stats()["leases"] != 0:
                self.violation(f"iteration {number}: leases left after verification")

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
                    self.violation(f"iteration {number}: FSYNC'd key {keys[i].hex()} is missing")
                i += 1
        return present

    def _verify_one(self, ns: Namespace, number: int, key: bytes) -> None:
        present = ns.lookup([key]) == 1
        if key in self.durable and not present:
            self.violation(f"iteration {number}: FSYNC'd key {key.hex()} is missing")
            return
        if not present:
            return
        try:
            with ns.get([key]) as views:
                self._check_served(number, key, views[0])
        except CorruptBlockError:
            self._corrupt(f"iteration {number}: honest key {key.hex()} failed its checksum")
        except BlockNotFoundError:
            if key in self.durable:
                self.violation(f"iteration {number}: FSYNC'd key {key.hex()} unreadable")
            else:
                self.summary.misses_not_durable += 1

    def _check_served(self, number: int, key: bytes, view: memoryview) -> None:
        exact = view == block_content(key)
        if not exact:
            self._wrong(f"iteration {number}: key {key.hex()} served wrong bytes")
        self.summary.served_checked += 1
        if key in self.durable:
            self.summary.durable_checked += 1
            self.summary.durable_recovered += exact

    def _verify_hostile(self, client: Client, number: int) -> None:
        """Every hostile block served is the one committed; no uncommitted ALLOC is visible."""
        ns = client.namespace(HOSTILE_NAMESPACE, block_bytes=HOSTILE_BLOCK_BYTES, tenant=HOSTILE)
        for i in range(HOSTILE_UNIVERSE):
            self.read_hostile(ns, hostile_key_of(i), f"iteration {number}")
        for key in sorted(self.held_keys):
            if ns.lookup([key]):
                self.violation(f"iteration {number}: never committed {key.hex()} is present")

    def read_hostile(self, ns: Namespace, key: bytes, when: str) -> str:
        """Read one hostile block through the library; returns ``exact``, ``corrupt`` or
        ``miss`` (wrong bytes are a violation)."""
        buffer = bytearray(HOSTILE_BLOCK_BYTES)
        try:
            ns.read_into([key], [buffer])
        except CorruptBlockError:
            with self._lock:
                self.summary.hostile_misses += 1
            return "corrupt"
        except BlockNotFoundError:
            return "miss"
        with self._lock:
            self.summary.hostile_served_checked += 1
        if buffer != hostile_content(key):
            self._wrong(f"{when}: hostile key {key.hex()} served bytes it did not commit")
        return "exact"

    def write_and_kill(self, daemon: DaemonProcess) -> None:
        stop = threading.Event()
        seed = self.rng.getrandbits(32)
        clients: list[_Client] = [self._writer, self._reader]
        if self.hostile:
            clients += [self._hostile, self._hostile_reader]
        if self.remote is not None:
            clients.append(self._remote_attacker)
        threads = [
            threading.Thread(target=self._guard, args=(func, daemon, seed + i, stop))
            for i, func in enumerate(clients)
        ]
        self.dropped_seen = 0
        for thread in threads:
            thread.start()
        time.sleep(self.rng.uniform(0.05, 0.6))
        if not daemon.running:  # before the kill: the clients' failures are a crash's
            assert daemon.process is not None
            tail = daemon.log().strip().splitlines()[-1:]
            self.violation(f"the daemon exited with {daemon.process.returncode}: {tail}")
        stop.set()
        daemon.kill()
        for thread in threads:
            thread.join(60)
            if thread.is_alive():
                self.violation("a client thread hung after the daemon was killed")
        self.summary.writebacks_dropped += self.dropped_seen

    def _guard(
        self, func: _Client, daemon: DaemonProcess, seed: int, stop: threading.Event
    ) -> None:
        try:
            func(daemon, random.Random(seed), stop)
        except (KvtierError, OSError) as exc:
            if not stop.is_set():  # set just before the kill: this failure is not the kill's
                self.violation(f"{func.__name__} failed while the daemon was up: {exc!r}")
        except Exception as exc:  # any other failure is a finding
            self.violation(f"{func.__name__} raised {exc!r}")

    def _writer(self, daemon: DaemonProcess, rng: random.Random, stop: threading.Event) -> None:
        with connect(daemon.socket, timeout_s=30) as client:
            ns = client.namespace(NAMESPACE, block_bytes=BLOCK_BYTES, tenant=self.tenant)
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
            ns = client.namespace(NAMESPACE, block_bytes=BLOCK_BYTES, tenant=self.tenant)
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
                                self._wrong(f"key {key.hex()} served wrong bytes mid-run")
                except CorruptBlockError:
                    self._corrupt(f"honest keys {keys[0].hex()}... failed a checksum mid-run")
                    continue
                except BlockNotFoundError:
                    continue  # forgotten or evicted between LOOKUP and READ
                self.summary.reads_during_run += 1

    def _hostile(self, daemon: DaemonProcess, rng: random.Random, stop: threading.Event) -> None:
        with (
            connect(daemon.socket, timeout_s=30) as client,
            connect(daemon.socket, timeout_s=30) as hog,
        ):
            attacker = HostileClient(self, client, hog, rng)
            try:
                while not stop.is_set() and not attacker.broken:
                    attacker.step()
            finally:
                attacker.close()

    def _hostile_reader(
        self, daemon: DaemonProcess, rng: random.Random, stop: threading.Event
    ) -> None:
        """Reads the hostile tenant's blocks while its other client scribbles on them."""
        with connect(daemon.socket, timeout_s=30) as client:
            ns = client.namespace(
                HOSTILE_NAMESPACE, block_bytes=HOSTILE_BLOCK_BYTES, tenant=HOSTILE
            )
            while not stop.is_set():
                key = hostile_key_of(rng.randrange(HOSTILE_UNIVERSE))
                self.outcome(f"reader_{self.read_hostile(ns, key, 'mid-run')}")

    def _remote_attacker(
        self, daemon: DaemonProcess, rng: random.Random, stop: threading.Event
    ) -> None:
        """Attacks the TCP listener until the kill
        (:class:`~kvtierd.testing.remote_attacks.RemoteAttacker`)."""
        assert self.remote is not None
        attacker = RemoteAttacker(self, self.remote, rng)
        while not stop.is_set():
            attacker.step()

    # -- book-keeping (any thread) ---------------------------------------------------------

    def action(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.actions[kind] += n

    def outcome(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.outcomes[kind] += n

    def never_committed(self, keys: list[bytes]) -> None:
        with self._lock:
            self.held_keys.update(keys)

    def defence_failed(self, text: str) -> None:
        with self._lock:
            self.summary.defence_failures += 1
        self.violation(f"defence failed: {text}")

    def _wrong(self, text: str) -> None:
        with self._lock:
            self.summary.wrong_bytes_served += 1
        self.violation(text)

    def _corrupt(self, text: str) -> None:
        with self._lock:
            self.summary.corrupt_reads += 1
        self.violation(text)

    def violation(self, text: str) -> None:
        with self._lock:
            self.summary.violations.append(text)

    def finish(self) -> Summary:
        self.summary.hostile_actions = dict(sorted(self.actions.items()))
        self.summary.hostile_outcomes = dict(sorted(self.outcomes.items()))
        return self.summary


class HostileClient:
    """A client of tenant ``hostile`` doing, against its own region, what issue 14's attacks
    did; ``step`` runs one attack chosen at random. ``hog`` is a second connection, which holds
    the ALLOCs that are never committed (a connection may pin only part of its region)."""

    ATTACKS: ClassVar[dict[str, float]] = {
        "commit": 0.25,  # then, mostly, write_after_commit over the slots just committed
        "scribble_region": 0.2,
        "punch_hole": 0.1,
        "ftruncate": 0.1,
        "hold_alloc": 0.12,
        "read_own": 0.1,
        "search_honest": 0.05,
        "fsync": 0.08,
    }

    def __init__(self, loop: CrashLoop, client: Client, hog: Client, rng: random.Random) -> None:
        self.loop = loop
        self.client = client
        self.rng = rng
        self.ns = client.namespace(
            HOSTILE_NAMESPACE, block_bytes=HOSTILE_BLOCK_BYTES, tenant=HOSTILE
        )
        self.hog = hog.namespace(HOSTILE_NAMESPACE, block_bytes=HOSTILE_BLOCK_BYTES, tenant=HOSTILE)
        self.fd, self.size = self.ns.arena.fd, self.ns.arena.size_bytes
        self.mapping = mmap.mmap(self.fd, self.size)  # a writable mapping of its own
        self.region: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(
            self.mapping, np.uint8
        )
        self.base = _address(self.ns.arena_buffer())
        self.held: list[contextlib.AbstractContextManager[Any]] = []
        self.allocs_held = 0  # the keys of held ALLOCs follow the committed ones, from 0 again
        self.broken = False  # a defence failed in a way that makes going on unsafe
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

    def step(self) -> None:
        kind = self.rng.choices(list(self.ATTACKS), weights=list(self.ATTACKS.values()))[0]
        getattr(self, kind)()
        self.loop.action(kind)
        dropped = self.client.stats()["corrupt_writebacks"]
        self.loop.dropped_seen = max(self.loop.dropped_seen, dropped)

    def commit(self) -> None:
        """Commit forged records as blocks (in new slots: FORGET first), then, mostly, overwrite
        the committed slots at once with other forged records, racing write-back."""
        count = self.rng.randint(1, 40)  # a long COMMIT outruns the staging memory
        keys = list(dict.fromkeys(self._key() for _ in range(count)))
        self.ns.forget(keys)
        offsets = []
        try:
            with self.ns.write(keys) as write:
                for key, view in zip(write.keys, write.views, strict=True):
                    if view is not None:
                        view[:] = hostile_content(key)
                        offsets.append(_address(view) - self.base)
        except (QuotaError, NoSpaceError):
            self.loop.outcome("commit_refused")
            return
        if offsets and self.rng.random() < 0.7 and self.region is not None:
            forged = forged_record(HONEST_DIGEST, self._honest_key(), BLOCK_BYTES, FORGED_SEQ)
            image = np.frombuffer(forged, np.uint8)
            for offset in offsets:
                self.region[offset : offset + len(image)] = image
            self.loop.action("write_after_commit", len(offsets))

    def scribble_region(self) -> None:
        """Forged records (for an honest key, or one of its own) over the whole region, at a
        random page phase, committed slots and pending ALLOCs included."""
        assert self.region is not None
        if self.rng.random() < 0.5:
            image = forged_record(HONEST_DIGEST, self._honest_key(), BLOCK_BYTES, FORGED_SEQ)
        else:
            image = forged_record(HOSTILE_DIGEST, self._key(), HOSTILE_BLOCK_BYTES, FORGED_SEQ)
        unit = np.frombuffer(image, np.uint8)
        tiled = np.tile(unit, -(-self.size // len(unit)) + 1)
        start = self.rng.randrange(len(unit) // PAGE_BYTES) * PAGE_BYTES
        self.region[:] = tiled[start : start + self.size]

    def punch_hole(self) -> None:
        """FALLOC_FL_PUNCH_HOLE | KEEP_SIZE, the whole region or a random run of pages."""
        pages = self.size // PAGE_BYTES
        first = 0 if self.rng.random() < 0.5 else self.rng.randrange(pages)
        length = (pages - first) * PAGE_BYTES
        if self.libc.fallocate(self.fd, 3, first * PAGE_BYTES, length) != 0:
            self.loop.outcome(f"punch_hole_{errno.errorcode.get(ctypes.get_errno(), '?')}")

    def ftruncate(self) -> None:
        """Shrink or grow the region: sealed, so it must fail with EPERM."""
        target = self.rng.choice([0, self.size // 2, self.size - PAGE_BYTES, self.size * 2])
        try:
            os.ftruncate(self.fd, target)
        except OSError as exc:
            self.loop.outcome(f"ftruncate_{errno.errorcode.get(exc.errno or 0, exc.errno)}")
            if exc.errno != errno.EPERM:
                self.loop.defence_failed(f"ftruncate to {target} failed with {exc!r}, not EPERM")
            return
        self.loop.defence_failed(f"ftruncate of the sealed region to {target} bytes succeeded")
        self.broken = True  # the mappings now end early: touching them would SIGBUS

    def hold_alloc(self) -> None:
        """ALLOC slots it never commits (new keys each time), until the quota refuses."""
        first = HOSTILE_UNIVERSE + self.allocs_held
        keys = [hostile_key_of(first + i) for i in range(self.rng.randint(8, 64))]
        self.loop.never_committed(keys)
        write = self.hog.write(keys)
        try:
            write.__enter__()
        except QuotaError:
            self.loop.outcome("hold_alloc_refused")
            return
        self.held.append(write)
        self.allocs_held += len(keys)
        self.loop.outcome("alloc_held", len(keys))

    def read_own(self) -> None:
        key = self._key()
        self.loop.outcome(f"own_read_{self.loop.read_hostile(self.ns, key, 'mid-run')}")

    def search_honest(self) -> None:
        """Look for an honest block's bytes in everything this client can map."""
        key = key_of(self.rng.randrange(UNIVERSE))
        if self.mapping.find(block_content(key)[:64]) >= 0:
            self.loop.defence_failed(f"honest block {key.hex()} is visible to the hostile tenant")

    def fsync(self) -> None:
        self.client.fsync()

    def close(self) -> None:
        """Abandon the held ALLOCs (the daemon is dead or dying by now) and unmap."""
        for write in self.held:
            with contextlib.suppress(Exception):
                write.__exit__(ConnectionAbortedError, ConnectionAbortedError(), None)
        self.region = None
        self.mapping.close()

    def _key(self) -> bytes:
        return hostile_key_of(self.rng.randrange(HOSTILE_UNIVERSE))

    def _honest_key(self) -> bytes:
        return key_of(self.rng.randrange(UNIVERSE))


def _address(view: memoryview) -> int:
    """Where ``view``'s first byte is in this process's memory."""
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def run(
    iterations: int,
    *,
    directory: Path,
    seed: int = 0,
    dram_size: str = "32M",
    nvme_size: str = "128M",
    progress: Callable[[str], None] | None = None,
    hostile: bool = False,
    remote: bool = True,
) -> Summary:
    """Run the loop; returns its summary (violations included, never raised). ``progress`` is
    told a line after each iteration; ``remote`` adds the TCP and NIXL attackers to a
    ``hostile`` run (:mod:`kvtierd.testing.remote_attacks`)."""
    started = time.monotonic()
    loop = CrashLoop(
        directory,
        seed=seed,
        dram_size=dram_size,
        nvme_size=nvme_size,
        hostile=hostile,
        remote=remote,
    )
    for number in range(iterations):
        loop.iteration(number)
        if progress is not None:
            progress(
                f"iteration {number + 1}/{iterations}: written {len(loop.written)} "
                f"durable {len(loop.durable)} violations {len(loop.summary.violations)}"
            )
    # the last kill is verified too
    daemon = loop.daemon()
    daemon.start(timeout_s=60)
    try:
        loop.verify(daemon, iterations)
    finally:
        daemon.kill()
    loop.summary.elapsed_s = round(time.monotonic() - started, 2)
    return loop.finish()
