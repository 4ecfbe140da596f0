"""The two processes of the NIXL tests, run as ``python -m tests.nixl.peer ROLE DIR ...``.

A process that loaded NIXL segfaults at interpreter exit, so NIXL never enters the pytest
process: each role runs in a child and ends through :func:`kvtierd.nixl.agent.exit_process`.

``owner DIR``: maps an 8 MiB memfd (as an arena region is), fills it with random bytes,
registers it and writes into ``DIR``: ``owner.md`` (the metadata of that registration alone, as
a tenant's client gets it), ``extents.bin`` (descriptors of :data:`EXTENTS`), ``first.bin``
(descriptors of the first extent alone), ``expected.bin`` (those extents' bytes) and
``refused.txt`` (what :meth:`~kvtierd.nixl.agent.NixlAgent.descriptors` raised for an extent
reaching past the region's end); then it prints ``ready``. It obeys lines on stdin:
``deregister`` (prints ``deregistered``) and ``exit`` (or the end of stdin).

``puller DIR CASE``: registers a buffer of its own, loads the owner's metadata and pulls
:data:`EXTENTS` into it, then prints one JSON line ``{"error": ..., "sha256": ...,
"expected": ...}`` (``error`` is ``module.Class: message`` or ""). ``CASE``: ``sync``
(:meth:`~kvtierd.nixl.agent.NixlAgent.pull`), ``asyncio`` or ``trio``
(:meth:`~kvtierd.nixl.agent.NixlAgent.pull_async` on that event loop), ``short`` (the
descriptors truncated), ``unknown-peer`` (descriptors of an agent never loaded), or ``again``
(a pull, ``pulled`` printed, a line awaited on stdin, then the pull that is reported).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import traceback
from pathlib import Path

import anyio
import msgspec

from kvtierd.io.buffers import buffer_address
from kvtierd.nixl import descriptors
from kvtierd.nixl.agent import Extent, NixlAgent, exit_process

REGION_BYTES = 8 << 20
#: (offset, length) in the owner's region: page-aligned, odd-sized, and the region's last page.
EXTENTS = [(0, 64 << 10), (1 << 20, 12345), (5 << 20, 1 << 20), (REGION_BYTES - 4096, 4096)]
PULL_TIMEOUT_S = 30.0


def _region(name: str) -> tuple[mmap.mmap, int]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, REGION_BYTES)
        region = mmap.mmap(fd, REGION_BYTES)
    finally:
        os.close(fd)
    return region, buffer_address(memoryview(region))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"


def _owner(directory: Path) -> None:
    region, base = _region("kvtierd-test-owner")
    region[:] = os.urandom(REGION_BYTES)
    with NixlAgent(f"owner-{os.getpid()}") as agent:
        registration = agent.register(base, REGION_BYTES)
        extents = [(base + offset, length) for offset, length in EXTENTS]
        (directory / "owner.md").write_bytes(agent.metadata(registration))
        (directory / "extents.bin").write_bytes(agent.descriptors(extents, within=registration))
        first = agent.descriptors(extents[:1], within=registration)
        (directory / "first.bin").write_bytes(first)
        expected = b"".join(region[offset : offset + length] for offset, length in EXTENTS)
        (directory / "expected.bin").write_bytes(expected)
        try:
            agent.descriptors([(base + REGION_BYTES - 3072, 4096)], within=registration)
            refused = ""
        except Exception as exc:
            refused = _error(exc)
        (directory / "refused.txt").write_text(refused)
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "deregister":
                agent.deregister(registration)
                print("deregistered", flush=True)
            elif line.strip() == "exit":
                break


def _pull(agent: NixlAgent, peer: str, remote: bytes, local: list[Extent], case: str) -> None:
    if case in ("asyncio", "trio"):

        async def pull() -> None:
            await agent.pull_async(peer, remote, local, timeout_s=PULL_TIMEOUT_S)

        anyio.run(pull, backend=case)
    else:
        agent.pull(peer, remote, local, timeout_s=PULL_TIMEOUT_S)


def _puller(directory: Path, case: str) -> None:
    region, base = _region("kvtierd-test-puller")
    with NixlAgent(f"puller-{os.getpid()}") as agent:
        agent.register(base, REGION_BYTES)
        peer = agent.add_peer((directory / "owner.md").read_bytes())
        remote = (directory / "extents.bin").read_bytes()
        local, offset = [], 0
        for _, length in EXTENTS:
            local.append((base + offset, length))
            offset += length
        if case == "short":
            remote = remote[: len(remote) // 2]
        elif case == "unknown-peer":
            peer = "nobody"
            stated = msgspec.msgpack.decode(remote, type=descriptors.Descriptors)
            remote = descriptors.encode(peer, stated.extents, stated.extents)
        elif case == "again":
            _pull(agent, peer, remote, local, "sync")
            print("pulled", flush=True)
            sys.stdin.readline()
            region[:offset] = bytes(offset)
        error = ""
        try:
            _pull(agent, peer, remote, local, case)
        except Exception as exc:
            error = _error(exc)
        digest = hashlib.sha256(region[:offset]).hexdigest()
        expected = hashlib.sha256((directory / "expected.bin").read_bytes()).hexdigest()
        print(json.dumps({"error": error, "sha256": digest, "expected": expected}), flush=True)


def main(argv: list[str]) -> int:
    """Run a role; a failure is printed to stderr and exits 1 (never through the interpreter's
    shutdown, which would crash)."""
    role, directory, *rest = argv
    try:
        if role == "owner":
            _owner(Path(directory))
        else:
            _puller(Path(directory), rest[0])
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
