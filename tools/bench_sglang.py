"""kvtierd as SGLang HiCache's L3 storage beside SGLang's own file backend (``HiCacheFile``).

    python -m tools.bench_sglang [--json] [--pages 192] [--batch 64] [--rounds 6] [--record]

One run, the same bf16 pages for both (random data of a page of 16 tokens of a 28-layer model
with 2 KV heads of 128 per TP rank: 448 KiB), both in one temporary directory on the same disk:

* **kvtierd** through the calls SGLang makes with ``interface_v1`` (``batch_set_v1`` /
  ``batch_get_v1``: host pool <-> arena, one copy), and through the tensor calls
  (``batch_set`` / ``batch_get`` into page tensors) that SGLang makes without it;
* **HiCacheFile** through its tensor calls (its only path), into page tensors: the copy SGLang
  then makes into its host pool (``set_from_flat_data_page``) is *not* counted for it.

Per round: ``batch_set`` of every page (batches of ``--batch``), then every page read back cold,
then warm. Cold means nothing in memory: for kvtierd, FSYNC and ``evict()`` (the DRAM copies
dropped; its NVMe tier reads with O_DIRECT, so no page cache is involved), for the file backend
``os.sync()`` and ``posix_fadvise(DONTNEED)`` on every page file (the kernel drops their cached
pages). Warm is the same read again at once (kvtierd: in DRAM; file: in the page cache), into
other host-pool pages than the cold read's: SGLang loads from its L3 storage into free host
slots, which it last wrote long ago, never into the slots it has just filled with the same pages;
slots written a moment before sit dirty in the CPU cache (84 MiB of them, in a 300 MiB L3 here),
which favours cached stores (the file side's torch copy) over the non-temporal ones of kvtierd's
copy kernel. Both sides read into the same slots.
Figures: GB/s over all batches of all rounds and the p99 of one batch's time; ratios: the median
over rounds of the two sides' ratio within one round (the disk is bimodal: see PLATFORM.md, so
only sides measured side by side compare). Records section
``sglang`` of ``docs/benchmarks.md`` (table and ``docs/benchmarks/sglang.png``) with ``--record``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvtierd.client import connect
from kvtierd.store import copyhash
from kvtierd.testing import DaemonProcess
from tools import benchlib
from tools.references import fio_json

LAYERS, HEADS, HEAD_DIM, PAGE = 28, 2, 128, 16
DTYPE = torch.bfloat16
PAGE_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * PAGE * DTYPE.itemsize


class HostPool:
    """SGLang's ``MHATokenToKVPoolHost`` page methods (page_first), as the tests use them."""

    layout, page_size, dtype = "page_first", PAGE, DTYPE

    def __init__(self, pages: int) -> None:
        self.kv_buffer = torch.zeros((2, pages * PAGE, LAYERS, HEADS, HEAD_DIM), dtype=DTYPE)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE_BYTES // DTYPE.itemsize, dtype=DTYPE)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape = (2, PAGE, LAYERS, HEADS, HEAD_DIM)
        self.kv_buffer[:, index : index + PAGE] = data_page.reshape(shape)


def storage_config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/llama-like",
        extra_config=extra,
    )


def timed(batches: list[Callable[[], Any]]) -> list[float]:
    times = []
    for run in batches:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def figures(times: list[float], pages: int) -> dict[str, float]:
    return {
        "gb_per_s": round(pages * PAGE_BYTES / sum(times) / 1e9, 3),
        "p99_ms": round(benchlib.percentile([t * 1e3 for t in times], 99), 2),
    }


def drop_file_cache(directory: Path) -> None:
    os.sync()
    for path in directory.glob("*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(pages: int, batch: int, rounds: int, root: Path) -> dict[str, Any]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from kvtierd.engines.sglang import KvtierdHiCacheStorage

    g = torch.Generator().manual_seed(0)
    pool = HostPool(3 * pages)  # the pages, then the cold reads' slots, then the warm reads'
    pool.kv_buffer[:, : pages * PAGE].copy_(
        torch.randn((2, pages * PAGE, LAYERS, HEADS, HEAD_DIM), generator=g).to(DTYPE)
    )
    spans = [range(i, min(i + batch, pages)) for i in range(0, pages, batch)]
    results: dict[str, dict[str, list[float]]] = {}
    per_round: dict[str, dict[str, list[float]]] = {}  # each round's seconds, for pair ratios
    dram = f"{max(256, 3 * pages * PAGE_BYTES >> 20)}M"  # both key sets of a round
    nvme = f"{max(512, 4 * pages * PAGE_BYTES >> 20)}M"
    fio_file = root / "fio.dat"  # the disk's own speed for one round's bytes, each round
    fio_json([f"--filename={fio_file}", f"--size={pages * PAGE_BYTES}", "--bs=1M", "--rw=write"])
    with DaemonProcess(root / "kvtierd", dram_size=dram, nvme_size=nvme) as daemon:
        kv = KvtierdHiCacheStorage(storage_config({"socket": str(daemon.socket)}), {})
        kv.register_mem_pool_host(pool)
        file_dir = root / "hicache-file"
        hf = HiCacheFile(storage_config({"file_storage_path": str(file_dir)}))
        admin = connect(daemon.socket, client_name="bench-sglang")
        for _ in range(rounds):
            keys = [uuid.uuid4().hex for _ in range(pages)]
            flat = [pool.get_data_page(i * PAGE).clone() for i in range(pages)]
            targets = [torch.empty_like(flat[0]) for _ in range(batch)]
            src = [torch.arange(s[0] * PAGE, (s[-1] + 1) * PAGE) for s in spans]
            slots = {  # each phase's own host slots, never the ones read into just before
                phase: [t + k * pages * PAGE for t in src]
                for k, phase in ((1, "cold"), (2, "warm"))
            }
            sides = _sides(kv, hf, pool, keys, flat, targets, src)
            stores = {"kvtierd_v1": kv, "kvtierd_tensor": kv, "hicache_file": hf}
            for name, (put, get) in sides.items():
                store = stores.get(name, hf)
                out = results.setdefault(name, {"set": [], "cold": [], "warm": []})
                seconds = per_round.setdefault(name, {"set": [], "cold": [], "warm": []})
                if name != "hicache_file_to_pool":
                    set_s = timed([partial(put, s, j) for j, s in enumerate(spans)])
                    out["set"] += set_s
                    seconds["set"].append(sum(set_s))
                names = [k + ("t" if name == "kvtierd_tensor" else "") for k in keys]
                for phase in ("cold", "warm"):
                    if phase == "cold" and store is hf:
                        drop_file_cache(file_dir)
                    elif phase == "cold":
                        admin.fsync()
                        admin.evict()
                    # as SGLang's prefetch: one hit query over the prefix, then batch reads
                    start = time.perf_counter()
                    if store.batch_exists(names) != pages:
                        raise RuntimeError(f"{name}: stored pages not found")
                    query_s = time.perf_counter() - start
                    batch_s = timed([partial(get, s, slots[phase][j]) for j, s in enumerate(spans)])
                    batch_s[0] += query_s
                    out[phase] += batch_s
                    seconds[phase].append(sum(batch_s))
                if name in ("kvtierd_v1", "hicache_file_to_pool"):  # the pages it read back
                    _check_slots(pool, pages, name)
            disk_s = _fio_read_s(fio_file, pages * PAGE_BYTES)
            results.setdefault("disk_fio", {"cold": []})["cold"].append(disk_s)
            per_round.setdefault("disk_fio", {"cold": []})["cold"].append(disk_s)
            kv.clear()
            hf.clear()
        admin.close()
        kv.close()
    total = pages * rounds
    table = {
        name: {phase: figures(times, total) for phase, times in phases.items() if times}
        for name, phases in results.items()
    }

    def ratio(name: str, ref: str, phase: str) -> float:
        """The median over rounds of the pair's ratio within a round: the disk changes speed
        for tens of seconds at a time, so only sides measured next to each other compare."""
        pairs = zip(per_round[ref][phase], per_round[name][phase], strict=True)
        return round(statistics.median(ref_s / name_s for ref_s, name_s in pairs), 2)

    ratios = {
        "kvtierd_v1_vs_file_to_pool": {
            p: ratio("kvtierd_v1", "hicache_file_to_pool", p) for p in ("cold", "warm")
        },
        "kvtierd_v1_vs_file": {
            p: ratio("kvtierd_v1", "hicache_file", p) for p in ("set", "cold", "warm")
        },
        "kvtierd_tensor_vs_file": {
            p: ratio("kvtierd_tensor", "hicache_file", p) for p in ("set", "cold", "warm")
        },
        "cold_vs_disk": {
            name: ratio(name, "disk_fio", "cold")
            for name in ("kvtierd_v1", "kvtierd_tensor", "hicache_file", "hicache_file_to_pool")
        },
    }
    return {"sides": table, "ratios": ratios}


def _check_slots(pool: HostPool, pages: int, name: str) -> None:
    """The pages read back into the cold and the warm slots equal the pages stored; then zero
    the slots, so that the next side's reads must fill them again: the warm slots first, so
    that the next side's cold reads pass over the cache before its warm reads."""
    stored = pool.kv_buffer[:, : pages * PAGE].view(torch.int16)
    for k in (2, 1):
        back = pool.kv_buffer[:, k * pages * PAGE : (k + 1) * pages * PAGE].view(torch.int16)
        if not torch.equal(back, stored):
            raise RuntimeError(f"{name}: pages read back differ")
        back.zero_()


#: A side's (store batch ``j`` of pages ``s``, read pages ``s`` into the host slots ``host``).
Side = tuple[Callable[[range, int], Any], Callable[[range, torch.Tensor], Any]]


def _sides(
    kv: Any,
    hf: Any,
    pool: HostPool,
    keys: list[str],
    flat: list[torch.Tensor],
    targets: list[torch.Tensor],
    src: list[torch.Tensor],
) -> dict[str, Side]:
    """Each side's (store batch ``j`` of pages ``s``, read it back) for one round's pages."""
    tensor_keys = [k + "t" for k in keys]  # the tensor calls' own copies of the pages
    return {
        "kvtierd_v1": (
            lambda s, j: kv.batch_set_v1([keys[i] for i in s], src[j]),
            lambda s, host: _check_all(kv.batch_get_v1([keys[i] for i in s], host)),
        ),
        "kvtierd_tensor": (
            lambda s, j: kv.batch_set([tensor_keys[i] for i in s], [flat[i] for i in s]),
            lambda s, _: _check_all(kv.batch_get([tensor_keys[i] for i in s], targets[: len(s)])),
        ),
        "hicache_file": (
            lambda s, j: hf.batch_set([keys[i] for i in s], [flat[i] for i in s]),
            lambda s, _: _check_all(hf.batch_get([keys[i] for i in s], targets[: len(s)])),
        ),
        "hicache_file_to_pool": (
            lambda s, j: None,  # reads the pages hicache_file stored
            lambda s, host: _file_to_pool(hf, pool, [keys[i] for i in s], host, targets),
        ),
    }


def _fio_read_s(path: Path, nbytes: int) -> float:
    """Seconds fio needs to read ``nbytes`` of ``path`` as the pages are read: 448 KiB random
    reads, O_DIRECT, io_uring, queue depth 32 (what the disk gives this access pattern); the
    faster of its buffers registered with io_uring (``--fixedbufs``) and not."""
    speeds = [
        float(
            fio_json(
                [
                    f"--filename={path}",
                    f"--size={nbytes}",
                    f"--bs={PAGE_BYTES}",
                    "--rw=randread",
                    "--iodepth=32",
                    *fixed,
                ]
            )["jobs"][0]["read"]["bw_bytes"]
        )
        for fixed in ([], ["--fixedbufs"])
    ]
    return nbytes / max(speeds)


def _file_to_pool(
    hf: Any, pool: HostPool, keys: list[str], host: torch.Tensor, targets: list[torch.Tensor]
) -> None:
    """SGLang's ``_generic_page_get``: the file backend reads into flat pages, then each page
    is copied into the host pool."""
    got = hf.batch_get(keys, targets[: len(keys)])
    _check_all(got)
    for i, page in enumerate(got):
        pool.set_from_flat_data_page(int(host[i * PAGE]), page)


def _check_all(result: list[Any]) -> None:
    if not all(r is not None and r is not False for r in result):
        raise RuntimeError("a page stored in this run was not read back")


LABELS = {
    "kvtierd_v1": "kvtierd, `_v1` (into the host pool)",
    "kvtierd_tensor": "kvtierd, tensor calls (into page tensors)",
    "hicache_file": "HiCacheFile (into page tensors)",
    "hicache_file_to_pool": "HiCacheFile + copy into the host pool (SGLang's path for it)",
    "disk_fio": "the disk: fio, the same bytes (448 KiB O_DIRECT random reads, qd 32)",
}
PHASES = ("set", "cold", "warm")


def record(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = result["sides"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.16
    for k, name in enumerate(LABELS):
        xs = [p + (k - 2) * width for p in range(len(PHASES))]
        ys = [sides[name].get(ph, {}).get("gb_per_s", 0.0) for ph in PHASES]
        ax.bar(xs, ys, width, label=LABELS[name].replace("`", ""))
    ax.set_xticks(range(len(PHASES)), ["batch_set", "batch_get cold", "batch_get warm"])
    ax.set_ylabel("GB/s")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    benchlib.save_figure(fig, "sglang.png")
    benchlib.record("sglang", "\n".join(_section(result)), result)


def _section(result: dict[str, Any]) -> list[str]:
    sides, r = result["sides"], result["ratios"]
    lines = [
        "## SGLang HiCache backend",
        "",
        f"`python -m tools.bench_sglang --record`: {result['pages']} bf16 pages of "
        f"{PAGE_BYTES:,} bytes (16 tokens, 28 layers, 2 KV heads of 128), batches of "
        f"{result['batch']}, {result['rounds']} rounds with fresh keys, SGLang "
        f"{result['sglang']}, both backends in one temporary directory. kvtierd's backend "
        "(`kvtierd.engines.sglang`) through the `_v1` calls (arena -> SGLang's host pool, what "
        'SGLang uses with `"interface_v1": 1`) and through the tensor calls; SGLang\'s '
        "`HiCacheFile` through its tensor calls (its only path), with and without the copy "
        "into the host pool that SGLang's `_generic_page_get` then makes for it. A read phase "
        "is what SGLang's prefetch does: one `batch_exists` over all pages, then `batch_get` "
        "per batch (the query's time counted in the first batch). Cold: kvtierd FSYNC + "
        "`evict()` (DRAM copies dropped; NVMe reads are O_DIRECT, no page cache), the file "
        "backend `os.sync()` + `posix_fadvise(DONTNEED)` on every page file. Warm: the same "
        "read again at once, into other host slots than the cold read's (SGLang loads into "
        "free slots it last wrote long ago; slots just written sit dirty in the CPU cache and "
        "favour cached stores over the copy kernel's non-temporal ones; before 2026-12-06 "
        "14:10 warm read into the cold read's slots). GB/s over all batches of all rounds; "
        "p99 of one batch. Pages read into the host pool are compared byte for byte with the "
        "pages stored. The disk line is fio reading a file of one round's bytes once per "
        "round, in the same random 448 KiB O_DIRECT requests (its p99 is of whole rounds): "
        "the cold reads' ceiling.",
        "",
        "| backend | set GB/s | set p99 ms | cold GB/s | cold p99 ms | warm GB/s | warm p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in LABELS.items():
        cells = []
        for ph in PHASES:
            f = sides[name].get(ph)
            cells += [f"{f['gb_per_s']:.2f}", f"{f['p99_ms']:.1f}"] if f else ["", ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    v1p, v1f, tf = (
        r["kvtierd_v1_vs_file_to_pool"],
        r["kvtierd_v1_vs_file"],
        r["kvtierd_tensor_vs_file"],
    )
    lines += [
        "",
        "Ratios (the median over rounds of each round's ratio of GB/s, since the disk changes "
        "speed between rounds; target: cold and warm `batch_get` >= 1.5x HiCacheFile): "
        "kvtierd `_v1` vs HiCacheFile as SGLang runs it (into the host pool) "
        f"cold {v1p['cold']}x, warm {v1p['warm']}x; kvtierd `_v1` vs HiCacheFile's read "
        f"alone cold {v1f['cold']}x, warm "
        f"{v1f['warm']}x, set {v1f['set']}x; kvtierd tensor calls vs HiCacheFile's cold "
        f"{tf['cold']}x, warm {tf['warm']}x, set {tf['set']}x. Cold reads against the disk "
        "(fio) in the same round: "
        + ", ".join(f"{LABELS[n].split(' (')[0]} {x}x" for n, x in r["cold_vs_disk"].items())
        + ".",
        "",
        "![GB/s per phase](benchmarks/sglang.png)",
        "",
        benchlib.machine_line(result["machine"]),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=192)
    parser.add_argument("--batch", type=int, default=64, help="pages per batch call")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", type=Path, default=None, help="where both backends store")
    parser.add_argument("--record", action="store_true", help="write docs/benchmarks.md section")
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args(argv)
    import sglang

    # kvtierd's copies once proven native: under load the probe's child took seconds, and the
    # first rounds' copies ran in Python meanwhile (247 of 576 pages in one profile)
    verdict = copyhash.default_hasher().verdict(wait=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = measure(args.pages, args.batch, args.rounds, Path(tmp))
    result.update(
        pages=args.pages,
        batch=args.batch,
        rounds=args.rounds,
        page_bytes=PAGE_BYTES,
        sglang=sglang.__version__,
        machine=benchlib.machine(),
        copy_kernel=verdict.kernel if verdict is not None and verdict.ok else "python",
    )
    if args.record:
        record(result)
    benchlib.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
