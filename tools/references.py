"""Reference measurements the benchmarks compare kvtierd against: fio and a bare socket echo."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["echo_server", "fio_json", "fio_read_s", "make_fio_file"]

#: The daemon's promotion concurrency: what fio's reference read of a restore's bytes uses.
FIO_QUEUE_DEPTH = 32

_ECHO = r"""
import asyncio, sys
async def handle(reader, writer):
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_unix_server(handle, sys.argv[1])
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def fio_json(args: Sequence[str]) -> dict[str, Any]:
    """Run one fio job (io_uring, O_DIRECT) and return its JSON report."""
    if shutil.which("fio") is None:
        raise RuntimeError("fio is not installed (tools/setup.sh installs it)")
    command = [
        "fio",
        "--name=ref",
        "--ioengine=io_uring",
        "--direct=1",
        "--output-format=json",
        "--group_reporting",
        *args,
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    report: dict[str, Any] = json.loads(out.stdout[out.stdout.index("{") :])
    return report


def make_fio_file(path: Path, nbytes: int) -> None:
    """Write ``nbytes`` to ``path`` with fio, for :func:`fio_read_s` to read."""
    fio_json([f"--filename={path}", f"--size={nbytes}", "--bs=1M", "--rw=write", "--iodepth=8"])


def fio_read_s(path: Path, nbytes: int, block_bytes: int) -> float:
    """Seconds fio needs to read ``nbytes`` of ``path`` in order, in ``block_bytes`` requests
    (rounded up to 4 KiB; O_DIRECT, io_uring, queue depth :data:`FIO_QUEUE_DEPTH`): what
    reading a restore's blocks costs the disk alone."""
    bs = -(-block_bytes // 4096) * 4096
    size = -(-nbytes // bs) * bs
    report = fio_json(
        [
            f"--filename={path}",
            f"--size={size}",
            f"--bs={bs}",
            "--rw=read",
            f"--iodepth={FIO_QUEUE_DEPTH}",
        ]
    )
    runtime_ms: float = report["jobs"][0]["read"]["runtime"]
    return runtime_ms / 1000


def fio_read_args(
    data_file: Path,
    used: int,
    block_bytes: int,
    count: int,
    qd: int,
    *,
    in_order: bool = False,
    fixed_buffers: bool = False,
) -> list[str]:
    """fio's arguments for ``count`` reads of ``block_bytes`` from the first ``used`` bytes of a
    daemon's data file (read-only: fio never writes the file it measures). ``fixed_buffers``:
    fio's buffers registered with io_uring (``--fixedbufs``), as the daemon's arena is; on the
    virtual machines measured that reads faster into memory the registration faulted in
    (docs/architecture.md, *Fixed buffers before the pre-fault*), so a fair reference runs both
    and takes the faster."""
    return [
        "--rw=read" if in_order else "--rw=randread",
        f"--bs={block_bytes}",
        f"--iodepth={qd}",
        f"--filename={data_file}",
        f"--size={used}",
        "--readonly",
        f"--io_size={count * block_bytes}",
        *(["--fixedbufs"] if fixed_buffers else []),
    ]


@contextlib.contextmanager
def echo_server(path: Path) -> Iterator[Path]:
    """A bare asyncio Unix-socket echo server in its own process (the RTT reference)."""
    process = subprocess.Popen([sys.executable, "-c", _ECHO, str(path)], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        process.stdout.readline()
        while not path.exists():
            time.sleep(0.01)
        yield path
    finally:
        process.terminate()
        process.wait()
