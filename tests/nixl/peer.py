"""The two processes of the NIXL tests, run as ``python -m tests.nixl.peer ROLE DIR ...``.

A process that loaded NIXL segfaults at interpreter exit, so NIXL never enters the pytest
process: each role runs in a child and ends through :func:`kvtierd.nixl.agent.exit_process`.

``owner DIR``: maps an 8 MiB memfd (as an arena region is), fills it with random bytes,
registers it and writes ``DIR/owner.md`` (its metadata), ``DIR/extents.bin`` (descriptors of
:data:`EXTENTS`), ``DIR/outside.bin`` and ``DIR/expected.bin`` (those extents' bytes), then prints ``ready``. It then
obeys lines on stdin: ``deregister`` (prints ``deregistered``) and ``exit``.

``puller DIR CASE``: registers a buffer of its own, loads the owner's metadata and pulls
(``CASE``: ``extents``, ``outside`` (past the region's end), ``short`` (truncated), or ``again`` for a pull after a line on stdin),
then prints one JSON line: ``{"error": ..., "elapsed_s": ..., "sha256": ...}``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import time
from pathlib import Path

from kvtierd.io.buffers import buffer_address
from kvtierd.nixl.agent import NixlAgent, exit_process

REGION_BYTES = 8 << 20
#: (offset, length) in the owner's region: page-aligned, odd-sized, and the region's last byte.
EXTENTS = [(0, 64 << 10), (1 << 20, 12345), (5 << 20, 1 << 20), (REGION_BYTES - 4096, 4096)]
PULL_TIMEOUT_S = 5.0


def _region(name: str) -> tuple[mmap.mmap, int]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, REGION_BYTES)
    region = mmap.mmap(fd, REGION_BYTES)
    os.close(fd)
    return region, buffer_address(memoryview(region))


def _owner(directory: Path) -> None:
    region, base = _region("kvtierd-test-owner")
    region[:] = os.urandom(REGION_BYTES)
    agent = NixlAgent("owner")
    registration = agent.register(base, REGION_BYTES)
    extents = [(base + offset, length) for offset, length in EXTENTS]
    (directory / "owner.md").write_bytes(agent.metadata())
    (directory / "extents.bin").write_bytes(agent.descriptors(extents))
    # The same lengths, the last one reaching 1 KiB past the region's end.
    outside = [*extents[:-1], (base + REGION_BYTES - 3072, 4096)]
    (directory / "outside.bin").write_bytes(agent.descriptors(outside))
    expected = b"".join(region[offset : offset + length] for offset, length in EXTENTS)
    (directory / "expected.bin").write_bytes(expected)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "deregister":
            agent.deregister(registration)
            print("deregistered", flush=True)
        elif line.strip() == "exit":
            break
    agent.close()


def _puller(directory: Path, case: str) -> None:
    region, base = _region("kvtierd-test-puller")
    agent = NixlAgent("puller")
    agent.register(base, REGION_BYTES)
    peer = agent.add_peer((directory / "owner.md").read_bytes())
    remote = (directory / "extents.bin").read_bytes()
    local, offset = [], 0
    for _, length in EXTENTS:
        local.append((base + offset, length))
        offset += length
    if case == "outside":
        remote = (directory / "outside.bin").read_bytes()
    elif case == "short":
        remote = remote[: len(remote) // 2]
    if case == "again":
        agent.pull(peer, remote, local, timeout_s=PULL_TIMEOUT_S)
        print("pulled", flush=True)
        sys.stdin.readline()
    started = time.monotonic()
    error = ""
    try:
        agent.pull(peer, remote, local, timeout_s=PULL_TIMEOUT_S)
    except Exception as exc:
        error = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - started
    digest = hashlib.sha256(region[:offset]).hexdigest()
    expected = hashlib.sha256((directory / "expected.bin").read_bytes()).hexdigest()
    print(json.dumps({"error": error, "elapsed_s": elapsed, "sha256": digest,
                      "expected": expected}), flush=True)  # fmt: skip
    agent.close()


def main(argv: list[str]) -> int:
    role, directory, *rest = argv
    if role == "owner":
        _owner(Path(directory))
    else:
        _puller(Path(directory), rest[0])
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
