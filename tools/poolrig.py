"""The shared pool's bench rig: a ``redis-server`` on loopback, the daemon's pool
configuration, a restart on a wiped data directory (the restore the pool benchmarks time), and
the leased read every restore measurement makes (``bench_pool``, the TTFT benchmark's pool
case ``tools.ttft.pool``, ``bench_nixl``)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio

from kvtierd.client import connect_async
from kvtierd.testing import DaemonProcess, free_port

__all__ = ["GROUP", "daemon_read", "pool_config", "redis_server", "restart_wiped"]

GROUP = "bench"


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[int]:
    """A ``redis-server`` on loopback without persistence, in ``directory``; yields its port."""
    import redis

    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    command += ["--protected-mode", "no", "--save", "", "--appendonly", "no"]
    command += ["--dir", str(directory), "--logfile", str(directory / "redis.log")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(port=port, socket_connect_timeout=1) as probe:
                    probe.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def pool_config(port: int, key_prefix: str, *, key_secret_file: Path | None = None) -> str:
    """The daemon's configuration: the pool on ``port`` (write-through) under ``key_prefix``;
    ``key_secret_file``: the key secret outside the data directory, so that a restart on a wiped
    one (:func:`restart_wiped`) derives the same keys from the same tokens, as a rank that lost
    its disk but shares the secret file with its group does. Without it the restarted daemon
    makes a new secret: the pool's blocks come back, but only a client that kept their keys (a
    READ by key) finds them, not one that derives keys from tokens (an engine)."""
    daemon = "" if key_secret_file is None else f'[daemon]\nkey_secret_file = "{key_secret_file}"\n'
    return daemon + (
        "[pool]\n"
        f'url = "redis://127.0.0.1:{port}"\n'
        "allow_plaintext = true\n"
        'write_policy = "write-through"\n'
        f'group_id = "{GROUP}"\n'
        f'key_prefix = "{key_prefix}"\n'
    )


def restart_wiped(daemon: DaemonProcess) -> float:
    """Stop ``daemon`` if it runs, wipe its data directory, start it; seconds until it answers
    (attached and restored: the daemon waits for the pool before it is ready)."""
    if daemon.running:
        daemon.stop()
    shutil.rmtree(daemon.data_dir, ignore_errors=True)
    started = time.perf_counter()
    daemon.start(timeout_s=60)
    return time.perf_counter() - started


async def daemon_read(
    socket_path: Path, block_bytes: int, keys: list[bytes], concurrency: int, batch: int
) -> tuple[float, list[float]]:
    """(GB/s, per-block latencies in s) of leasing every key, ``concurrency`` blocks in flight."""
    chunks = [keys[i : i + batch] for i in range(0, len(keys), batch)]
    latencies: list[float] = []
    async with connect_async(socket_path) as client:
        ns = await client.namespace("bench", block_bytes=block_bytes)
        next_chunk = iter(chunks)

        async def worker() -> None:
            for chunk in next_chunk:
                t0 = time.perf_counter()
                async with ns.lease(chunk):
                    latencies.extend([time.perf_counter() - t0] * len(chunk))

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(max(1, concurrency // batch)):
                tg.start_soon(worker)
        elapsed = time.perf_counter() - started
    return len(keys) * block_bytes / elapsed / 1e9, latencies
