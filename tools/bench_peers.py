"""Peer benchmark: the same workload through kvtierd and through LMCache 0.5.6, with memcpy and
fio as the limits, in one run.

Workload, per chunk shape: N chunks are written once; then every round has each system answer a
lookup over all N keys and copy every chunk into a caller's buffer (``numpy.copyto`` from
whatever buffer the system hands back; kvtierd's ``BlockLease.copy_into``, which verifies the
block's checksum in the pass that copies it), in two request sizes: one chunk per request
(latency is per chunk) and ``--batch`` chunks per request (an engine's request for a whole prefix).

* *cold*: one system at a time, in an order that rotates every round (the disk is bimodal, see
  ``../shared/PLATFORM.md``, so compare within a round): kvtierd's DRAM is evicted and its reads
  come from NVMe through O_DIRECT; LMCache's disk paths have their files' page-cache pages
  dropped (``fsync`` + ``POSIX_FADV_DONTNEED``); fio reads the same number of bytes from
  kvtierd's data file at the disk's best (2 MiB random reads at ``--fio-qd``, the faster of
  ``--fixedbufs`` and not).
* *warm*: after one untimed read of every chunk through every system, every system's requests
  interleaved request by request (order rotating), so that all of them share the machine's
  moments; on 2 shared vCPUs memory bandwidth swings 2-3x within seconds.

Destinations: every copy lands in a buffer this process has not written for at least
:data:`RING_BYTES` of copies (a ring of destination buffers that every system's requests walk in
turn), and each buffer is scribbled over right after its check, never right before its copy. An
engine loads a chunk into pages of its KV cache or host pool that it last wrote long ago; a
destination zeroed just before the timed copy sits dirty in the CPU cache (this machine's L3 holds
300 MiB), which favours cached stores (``memcpy``, LMCache's torch copy) over stores that bypass
the cache (kvtierd's copy kernel, see ``kvtierd/store/copyhash.py``) by 10-30 %, a case no engine
is in. Every system gets the same destinations, so the comparison stays like for like.

After every request or pass, outside the timed window, every byte is compared with what was
written. Systems: kvtierd through its client (LOOKUP and READ_RESIDENT, then copies and
leased READs; and with one leased READ per request); LMCache's CPU backend,
disk backend (buffered and O_DIRECT), MP-mode ``fs_native`` L2 adapter and TCP server
(``tools/bench_peers_lmcache.py``); LMCache's StorageManager with kvtierd as its storage plug-in
(:mod:`kvtierd.engines.lmcache`); ``memcpy`` (numpy copy from process memory, the warm limit).

``python -m tools.bench_peers --json`` prints one JSON object and records the results (tables and
a plot) in the ``peers`` section of ``docs/benchmarks.md``; ``--no-record`` only prints. The
daemon's data and LMCache's files go to ``$BENCH_DIR`` (default ``/var/tmp``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvtierd.client import BlockLease, Layout, chain_keys, connect
from kvtierd.store import copyhash
from kvtierd.testing import DaemonProcess
from tools import benchlib
from tools.bench_peers_lmcache import GB, ChunkShape, FsNativeDriver, ManagerDriver, TcpServer
from tools.bench_peers_report import (
    ADAPTER,
    KVTIERD,
    KVTIERD_READ,
    LMC_CPU,
    LMC_TCP,
    SYSTEMS_WITH_TARGETS,
)
from tools.references import fio_json

MiB = 1 << 20
#: How many bytes of copies at least pass before a destination buffer is written again: more than
#: the share of the L3 cache a copy keeps here, so each copy finds its destination out of cache.
RING_BYTES = 512 * MiB
SHAPES = {
    "llama8b": ChunkShape("llama8b", 32, 8, 128, 256, "float16"),  # 32 MiB per chunk
    "smollm2": ChunkShape("smollm2", 30, 3, 64, 512, "float32"),  # 22.5 MiB per block
}
LMC_DISK = ("LMCache disk", "LMCache disk O_DIRECT", "LMCache fs_native")
MEMCPY, FIO = "memcpy", "fio"


class Driver(Protocol):
    name: str
    cold: bool

    def write(self, chunks: list[np.ndarray]) -> None: ...
    def drop(self) -> None: ...
    def lookup(self) -> int: ...
    def read(self, i: int, dst: np.ndarray) -> None: ...
    def read_many(self, first: int, dsts: list[np.ndarray]) -> None: ...
    def close(self) -> None: ...


class KvtierdDriver:
    """kvtierd's own client: LOOKUP of the whole chain (which starts promotion), then each chunk
    copied out of the shared arena. With ``hold`` (what docs/client.md tells engines to do) the
    LOOKUP is followed by READ_RESIDENT, which leases the chunks already in DRAM, so loading
    one of them is a copy with no round trip, and the lease ends after the last of them; the
    chunks not held (cold reads) are READ one request at a time. Without ``hold`` every request
    is a leased READ."""

    cold = True

    def __init__(
        self, name: str, shape: ChunkShape, count: int, socket: Path, *, hold: bool
    ) -> None:
        self.name = name
        self.hold = hold
        self.held: BlockLease | None = None
        self.client = connect(socket)
        layout = Layout(
            f"bench/{shape.name}",
            shape.layers,
            shape.kv_heads,
            shape.head_dim,
            shape.dtype,
            shape.tokens,
        )
        self.ns = self.client.namespace(
            f"bench/{shape.name}", block_bytes=shape.nbytes, layout=layout
        )
        self.keys = chain_keys(range(count), 1, self.ns.key_salt)

    def write(self, chunks: list[np.ndarray]) -> None:
        for start in range(0, len(chunks), 4):
            self.ns.put(self.keys[start : start + 4], chunks[start : start + 4])
        self.client.fsync()

    def drop(self) -> None:
        self._let_go()
        self.client.evict()

    def lookup(self) -> int:
        self._let_go()
        hits = self.ns.lookup(self.keys)
        if self.hold:
            self.held = self.ns.acquire(self.keys[:hits], resident_only=True, verify_on_copy=True)
        return hits

    def read(self, i: int, dst: np.ndarray) -> None:
        self.read_many(i, [dst])

    def read_many(self, first: int, dsts: list[np.ndarray]) -> None:
        held = len(self.held.views) if self.held is not None else 0
        end = first + len(dsts)
        if end <= held:
            assert self.held is not None
            for i, dst in enumerate(dsts, first):
                self.held.copy_into(i, dst)  # verified in the pass that copies
            if end == held:
                self._let_go()
            return
        with self.ns.lease(self.keys[first:end], verify_on_copy=True) as lease:
            for i, dst in enumerate(dsts):
                lease.copy_into(i, dst)

    def _let_go(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None

    def close(self) -> None:
        self._let_go()
        self.client.close()


class MemcpyDriver:
    """The warm limit: the chunks copied from process memory."""

    name, cold = MEMCPY, False

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []

    def write(self, chunks: list[np.ndarray]) -> None:
        self.chunks = [c.copy() for c in chunks]

    def drop(self) -> None:
        pass

    def lookup(self) -> int:
        return len(self.chunks)

    def read(self, i: int, dst: np.ndarray) -> None:
        np.copyto(dst, self.chunks[i])

    def read_many(self, first: int, dsts: list[np.ndarray]) -> None:
        for i, dst in enumerate(dsts, first):
            np.copyto(dst, self.chunks[i])

    def close(self) -> None:
        self.chunks = []


def _summary(lat: list[float], total_bytes: int, wall: float) -> dict[str, float]:
    return {
        "gbps": total_bytes / wall / 1e9,
        "p50_ms": benchlib.percentile(lat, 50) * 1e3,
        "p99_ms": benchlib.percentile(lat, 99) * 1e3,
    }


def timed_pass(
    drv: Driver, chunks: list[np.ndarray], dsts: list[np.ndarray], batch: int
) -> tuple[dict[str, float], list[float]]:
    """Lookup, then every chunk copied into ``dsts``: one chunk per request (``batch`` 1, the
    latencies are per chunk) or ``batch`` chunks per request (latencies per request)."""
    started = time.perf_counter()
    hits = drv.lookup()
    lat = []
    for first in range(0, len(dsts), batch):
        t0 = time.perf_counter()
        if batch == 1:
            drv.read(first, dsts[first])
        else:
            drv.read_many(first, dsts[first : first + batch])
        lat.append(time.perf_counter() - t0)
    wall = time.perf_counter() - started
    if hits != len(chunks):
        raise RuntimeError(f"{drv.name}: lookup found {hits} of {len(chunks)} chunks")
    for i, (dst, chunk) in enumerate(zip(dsts, chunks, strict=True)):
        _check_and_scribble(drv, i, dst, chunk)
    return _summary(lat, sum(c.nbytes for c in chunks), wall), lat


def _check_and_scribble(drv: Driver, i: int, dst: np.ndarray, chunk: np.ndarray) -> None:
    """Compare a destination with what was written, then zero it, so that a read that copied
    nothing fails the next check, and so that no timed copy writes into a buffer zeroed just
    before it (see the module's note on destinations)."""
    if not np.array_equal(dst, chunk):
        raise RuntimeError(f"{drv.name}: chunk {i} read back differs from what was written")
    dst.fill(0)


def ring_size(chunk_bytes: int, count: int, batch: int) -> int:
    """Destination buffers enough for :data:`RING_BYTES` of copies between two writes of one
    buffer, one request of ``batch`` chunks besides, and at least one per chunk."""
    return max(count, batch + -(-RING_BYTES // chunk_bytes))


def interleaved_pass(
    drivers: list[Driver], chunks: list[np.ndarray], ring: list[np.ndarray], per_request: int
) -> dict[str, tuple[dict[str, float], list[float]]]:
    """Warm reads of every system interleaved request by request (the order rotating each
    request), so that they share the machine's moments: on 2 shared vCPUs memory bandwidth
    swings 2-3x within seconds. Each system's figure is its lookup plus its own requests.
    Every request copies into the next buffers of ``ring``, whoever made the request before."""
    spent = {d.name: 0.0 for d in drivers}
    lat: dict[str, list[float]] = {d.name: [] for d in drivers}
    for drv in drivers:  # untimed: warm means read once since the last cold pass of anyone
        drv.lookup()  # (kvtierd's EVICT empties every namespace of the daemon)
        for i in range(len(chunks)):
            drv.read(i, ring[i % len(ring)])
    for drv in drivers:
        t0 = time.perf_counter()
        hits = drv.lookup()
        spent[drv.name] += time.perf_counter() - t0
        if hits != len(chunks):
            raise RuntimeError(f"{drv.name}: lookup found {hits} of {len(chunks)} chunks")
    for dst in ring:
        dst.fill(0)
    cursor = 0
    for k, first in enumerate(range(0, len(chunks), per_request)):
        group = chunks[first : first + per_request]
        for drv in drivers[k % len(drivers) :] + drivers[: k % len(drivers)]:
            dsts = [ring[(cursor + j) % len(ring)] for j in range(len(group))]
            cursor += len(group)
            t0 = time.perf_counter()
            if per_request == 1:
                drv.read(first, dsts[0])
            else:
                drv.read_many(first, dsts)
            elapsed = time.perf_counter() - t0
            spent[drv.name] += elapsed
            lat[drv.name].append(elapsed)
            for i, (dst, chunk) in enumerate(zip(dsts, group, strict=True), first):
                _check_and_scribble(drv, i, dst, chunk)
    total = sum(c.nbytes for c in chunks)
    return {name: (_summary(lat[name], total, spent[name]), lat[name]) for name in spent}


def fio_pass(data_file: Path, used: int, nbytes: int, qd: int) -> dict[str, float]:
    """``nbytes`` of kvtierd's data file read by fio at the disk's best (2 MiB random reads at
    queue depth ``qd``, io_uring, O_DIRECT; the faster of its buffers registered with io_uring,
    ``--fixedbufs``, as kvtierd's arena is, and not); its latencies are per 2 MiB read."""
    jobs = [
        fio_json(
            [
                "--rw=randread",
                "--bs=2M",
                f"--iodepth={qd}",
                f"--filename={data_file}",
                f"--size={used}",
                "--readonly",
                f"--io_size={nbytes}",
                *fixed,
            ]
        )["jobs"][0]["read"]
        for fixed in ([], ["--fixedbufs"])
    ]
    job = max(jobs, key=lambda job: float(job["bw_bytes"]))
    pct = job["clat_ns"]["percentile"]
    return {
        "gbps": job["bw_bytes"] / 1e9,
        "p50_ms": pct["50.000000"] / 1e6,
        "p99_ms": pct["99.000000"] / 1e6,
    }


def _systems(
    work: Path,
    shape: ChunkShape,
    count: int,
    batch: int,
    daemon: DaemonProcess,
    evict: Any,
    tcp_url: str,
) -> list[Any]:
    staging = ((batch + 4) * shape.nbytes + 64 * MiB) / GB  # LMCache's CPU pool as staging
    disk = count * shape.nbytes * 1.3 / GB
    drivers: list[Any] = [
        KvtierdDriver(KVTIERD, shape, count, daemon.socket, hold=True),
        KvtierdDriver(KVTIERD_READ, shape, count, daemon.socket, hold=False),
        ManagerDriver(
            ADAPTER,
            shape,
            count,
            "kvtierd",
            evict=evict,
            local_cpu=False,
            max_local_cpu_size=staging,
            storage_plugins=["kvtierd"],
            extra_config={
                "storage_plugin.kvtierd.module_path": "kvtierd.engines.lmcache",
                "storage_plugin.kvtierd.class_name": "KvtierdBackend",
                "kvtierd.socket": str(daemon.socket),
            },
        ),
        ManagerDriver(
            LMC_CPU,
            shape,
            count,
            "LocalCPUBackend",
            local_cpu=True,
            max_local_cpu_size=(count * shape.nbytes * 1.1 + 256 * MiB) / GB,
        ),
    ]
    for name, odirect in ((LMC_DISK[0], False), (LMC_DISK[1], True)):
        path = work / name.replace(" ", "-")
        drivers.append(
            ManagerDriver(
                name,
                shape,
                count,
                "LocalDiskBackend",
                cold_dir=path,
                local_cpu=False,
                max_local_cpu_size=staging,
                local_disk=f"file://{path}/",
                max_local_disk_size=disk,
                extra_config={"use_odirect": odirect},
            )
        )
    drivers.append(FsNativeDriver(LMC_DISK[2], shape, count, work / "fs-native", batch=batch))
    drivers.append(
        ManagerDriver(
            LMC_TCP,
            shape,
            count,
            "RemoteBackend",
            local_cpu=False,
            max_local_cpu_size=staging,
            remote_url=tcp_url,
            remote_serde="naive",
        )
    )
    drivers.append(MemcpyDriver())
    return drivers


def _only(drivers: list[Any], wanted: frozenset[str]) -> list[Any]:
    """The drivers named in ``wanted`` (all when it is empty); the others closed."""
    if not wanted:
        return drivers
    for drv in drivers:
        if drv.name not in wanted:
            drv.close()
    return [drv for drv in drivers if drv.name in wanted]


def bench_shape(
    work: Path,
    shape: ChunkShape,
    count: int,
    rounds: int,
    batch: int,
    fio_qd: int,
    wanted: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    chunks = [
        rng.integers(0, 1 << 63, shape.nbytes // 8, dtype=np.uint64).view(np.uint8)
        for _ in range(count)
    ]
    dsts = [np.ones(shape.nbytes, np.uint8) for _ in range(ring_size(shape.nbytes, count, batch))]
    total = count * shape.nbytes
    dram = 2 * total + 256 * MiB
    nvme = 2 * count * (shape.nbytes + MiB) + 512 * MiB
    result: dict[str, Any] = {
        "shape": shape.describe(),
        "chunks": count,
        "batch": batch,
        "write_gbps": {},
        "rounds": [],
    }
    with DaemonProcess(
        work / "kvtierd", dram_size=f"{dram >> 20}M", nvme_size=f"{nvme >> 20}M"
    ) as daemon:
        admin = connect(daemon.socket)
        server = TcpServer(work / "lmcache-server.log")
        drivers: list[Any] = []
        try:
            drivers = _systems(work, shape, count, batch, daemon, admin.evict, server.url)
            drivers = _only(drivers, wanted)
            names = {drv.name for drv in drivers}
            for drv in drivers:
                if drv.name == KVTIERD_READ and KVTIERD in names:  # the same namespace: stored
                    continue
                t0 = time.perf_counter()
                drv.write(chunks)
                result["write_gbps"][drv.name] = total / (time.perf_counter() - t0) / 1e9
            admin.fsync()
            used = admin.stats()["tiers"][1]["used_bytes"]
            samples: dict[str, dict[str, list[float]]] = {}
            order = [*drivers, FIO] if not wanted or FIO in wanted else list(drivers)
            for r in range(rounds):
                rotated = order[r % len(order) :] + order[: r % len(order)]
                record: dict[str, Any] = {
                    "order": [d if isinstance(d, str) else d.name for d in rotated]
                }
                for drv in rotated:  # cold: one system at a time, each emptying its caches
                    if drv == FIO:
                        fio = fio_pass(
                            daemon.data_dir / "nvme.data", used, count * shape.nbytes, fio_qd
                        )
                        record[FIO] = {"cold": fio, "cold_batch": fio}
                    elif drv.cold:
                        for mode, per_request in (("cold", 1), ("cold_batch", batch)):
                            drv.drop()
                            figures, lat = timed_pass(drv, chunks, dsts[:count], per_request)
                            record.setdefault(drv.name, {})[mode] = figures
                            samples.setdefault(drv.name, {}).setdefault(mode, []).extend(lat)
                warm = [d for d in rotated if d != FIO]
                for mode, per_request in (("warm", 1), ("warm_batch", batch)):
                    passes = interleaved_pass(warm, chunks, dsts, per_request)
                    for name, (figures, lat) in passes.items():
                        record.setdefault(name, {})[mode] = figures
                        samples.setdefault(name, {}).setdefault(mode, []).extend(lat)
                result["rounds"].append(record)
                print(f"{shape.name} round {r + 1}/{rounds} done", file=sys.stderr)
            result["latency_ms"] = {
                name: {
                    mode: {
                        "p50": benchlib.percentile(lat, 50) * 1e3,
                        "p99": benchlib.percentile(lat, 99) * 1e3,
                    }
                    for mode, lat in modes.items()
                }
                for name, modes in samples.items()
            }
        finally:
            for drv in drivers:
                drv.close()
            server.close()
            admin.close()
    result.update(summarise(result["rounds"]))
    return result


MODES = ("cold", "warm", "cold_batch", "warm_batch")


def _median(rounds: list[dict[str, Any]], name: str, mode: str) -> float | None:
    values = [r[name][mode]["gbps"] for r in rounds if mode in r.get(name, {})]
    return benchlib.median(values) if values else None


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per system and mode, and the per-round ratios behind the targets."""
    names = sorted({n for r in rounds for n in r if n != "order"})
    medians = {n: {m: v for m in MODES if (v := _median(rounds, n, m)) is not None} for n in names}

    def ratios(name: str, mode: str, ref: str) -> list[float]:
        out = []
        for r in rounds:
            refs_here = LMC_DISK if ref == "best LMCache disk" else (ref,)
            here = [r[n][mode]["gbps"] for n in refs_here if mode in r.get(n, {})]
            if mode in r.get(name, {}) and here:  # a run of some --systems may lack either
                out.append(r[name][mode]["gbps"] / max(here))
        return out

    refs = {
        "cold": (FIO, "best LMCache disk"),
        "warm": (LMC_CPU, MEMCPY, LMC_TCP),
    }
    out: dict[str, Any] = {"median_gbps": medians, "ratios": {}}
    for system in SYSTEMS_WITH_TARGETS:
        table: dict[str, Any] = {}
        for mode in MODES:
            for ref in refs[mode.split("_")[0]]:
                if ref == system or (system == LMC_CPU and ref != MEMCPY):
                    continue
                values = ratios(system, mode, ref)
                if values:
                    table[f"{mode} vs {ref}"] = {
                        "per_round": values,
                        "median": benchlib.median(values),
                    }
        out["ratios"][system] = table
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--shapes", default="llama8b,smollm2")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="chunks per request, batched modes")
    parser.add_argument("--fio-qd", type=int, default=16)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument(
        "--systems",
        default="",
        help="comma-separated systems to run (names as in the tables, fio and memcpy too; "
        "default all): a trial, never recorded",
    )
    args = parser.parse_args()
    wanted = frozenset(name.strip() for name in args.systems.split(",") if name.strip())
    verdict = copyhash.default_hasher().verdict(wait=True)  # kvtierd's copies: once proven
    result: dict[str, Any] = {
        "machine": benchlib.machine(),
        "lmcache": _lmcache_version(),
        "fio_qd": args.fio_qd,
        "copy_kernel": verdict.kernel if verdict is not None and verdict.ok else "python",
    }
    result["shapes"] = []
    result["load_average"] = {"start": os.getloadavg()}
    for name in args.shapes.split(","):
        with benchlib.bench_workdir("peers") as tmp:
            result["shapes"].append(
                bench_shape(
                    tmp,
                    SHAPES[name],
                    args.chunks,
                    args.rounds,
                    args.batch,
                    args.fio_qd,
                    wanted,
                )
            )
    result["load_average"]["end"] = os.getloadavg()
    benchlib.emit(result, args.json)
    if not args.no_record and not wanted:
        from tools.bench_peers_report import record_peers

        record_peers(result)
    return 0


def _lmcache_version() -> str:
    from importlib.metadata import version

    return version("lmcache")


if __name__ == "__main__":
    sys.exit(main())
