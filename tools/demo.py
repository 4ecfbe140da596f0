"""The README's main job: run kvtierd on its embedded defaults and show a put/lookup/get round
trip that survives a daemon restart.

It starts the daemon (socket and data under the checkout's ``.kvtierd/``), stores the KV blocks
of a SmolLM2-sized 4K-token prompt, restarts the daemon (recovery from the NVMe tier), looks the
prompt up again, reads every block back from disk and checks it byte for byte, then stops the
daemon. Block contents are synthetic here; ``docs/benchmarks.md`` has the real-model figures.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtierd.client import Layout, chain_keys, connect
from kvtierd.testing import DaemonProcess

LAYOUT = Layout("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64, "float32", 16)
BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 4


def block_for(key: bytes) -> np.ndarray:
    """Deterministic block content derived from its key, so every read can be checked."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 2**31, BLOCK_BYTES // 4, dtype=np.uint32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    console = Console()
    daemon = DaemonProcess(None, dram_size=None, nvme_size=None)
    console.print(f"[bold]Starting kvtierd[/] on its defaults (socket {daemon.socket})")
    with daemon:
        with connect(daemon.socket) as client:
            ns = client.namespace("demo", block_bytes=BLOCK_BYTES, layout=LAYOUT)
            keys = chain_keys(range(args.tokens), LAYOUT.block_tokens, ns.key_salt)
            ns.forget(keys)
            started = time.perf_counter()
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("storing KV blocks", total=len(keys))
                for i in range(0, len(keys), 16):
                    chunk = keys[i : i + 16]
                    ns.put(chunk, [block_for(k) for k in chunk])
                    progress.advance(task, len(chunk))
            client.fsync()
            put_s = time.perf_counter() - started
        console.print(f"stored {len(keys)} blocks ({len(keys) * BLOCK_BYTES >> 20} MiB) "
                      f"and made them durable in {put_s:.2f} s")
        console.print("[bold]Restarting the daemon[/] (the DRAM tier starts empty)")
        daemon.stop()
        daemon.start()
        with connect(daemon.socket) as client:
            ns = client.namespace("demo", block_bytes=BLOCK_BYTES, layout=LAYOUT)
            t0 = time.perf_counter()
            hits = ns.lookup(keys)
            t1 = time.perf_counter()
            with ns.get(keys[:hits]) as views:
                t2 = time.perf_counter()
                intact = all(np.array_equal(np.frombuffer(v, np.uint32), block_for(k))
                             for v, k in zip(views, keys, strict=False))
            tiers = {t["name"]: t for t in client.stats()["tiers"]}
        table = Table(title="After restart")
        table.add_column("step")
        table.add_column("result", justify="right")
        table.add_row("LOOKUP", f"{hits}/{len(keys)} blocks hit in {(t1 - t0) * 1e3:.2f} ms")
        gbps = hits * BLOCK_BYTES / (t2 - t1) / 1e9
        table.add_row("READ from NVMe", f"{t2 - t1:.3f} s ({gbps:.2f} GB/s)")
        table.add_row("blocks byte-exact", "yes" if intact else "NO")
        table.add_row("NVMe tier hits", str(tiers["nvme"]["hits"]))
        console.print(table)
    console.print("kvtierd stopped.")
    return 0 if intact and hits == len(keys) else 1


if __name__ == "__main__":
    sys.exit(main())
