"""The self-test NIXL runs in a child process (see :mod:`kvtierd.nixl.probe`).

Two :class:`~kvtierd.nixl.agent.NixlAgent`\\ s in this process, an owner and a puller, each with
a UCX backend and a memfd buffer registered as DRAM; the puller loads the owner's metadata of
that one registration (as a tenant's client gets its region's) and READs two extents of random
bytes (one page-aligned, one not) into its buffer, as it would from a daemon in another process,
and compares them. :func:`main` prints the
:class:`~kvtierd.nixl.probe.NixlVerdict` as one JSON line; the caller ends the process with
:func:`~kvtierd.nixl.agent.exit_process`. Whatever kills this process (the point of running it
here) is read by the parent from the exit status.
"""

from __future__ import annotations

import mmap
import os
import sys

import msgspec

from kvtierd.childprobe import bind_to_parent
from kvtierd.errors import KvtierError
from kvtierd.io.buffers import buffer_address
from kvtierd.nixl.probe import NixlOutcome, NixlVerdict

__all__ = ["main"]

_BUFFER_BYTES = 64 << 10
#: ``(offset, length)`` pulled, and where each lands in the puller's buffer.
_EXTENTS = [(0, 4096), (20000, 5000)]
_PULL_TIMEOUT_S = 5.0


def _buffer(name: str) -> tuple[mmap.mmap, int]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, _BUFFER_BYTES)
        region = mmap.mmap(fd, _BUFFER_BYTES)
    finally:
        os.close(fd)
    return region, buffer_address(memoryview(region))


def _self_test() -> NixlVerdict:
    try:
        import nixl._api  # noqa: F401
    except Exception as exc:  # an ImportError, or whatever its __init__ raised
        return NixlVerdict(NixlOutcome.IMPORT_ERROR, f"NIXL does not import: {exc}")
    from kvtierd.nixl.agent import NixlAgent

    source, source_base = _buffer("kvtierd-nixl-probe-owner")
    target, target_base = _buffer("kvtierd-nixl-probe-puller")
    source[:] = os.urandom(_BUFFER_BYTES)
    agents: list[NixlAgent] = []
    try:
        owner = NixlAgent(f"kvtierd-probe-owner-{os.getpid()}")
        agents.append(owner)
        puller = NixlAgent(f"kvtierd-probe-puller-{os.getpid()}")
        agents.append(puller)
        region = owner.register(source_base, _BUFFER_BYTES)
        puller.register(target_base, _BUFFER_BYTES)
        peer = puller.add_peer(owner.metadata(region))
        extents = [(source_base + offset, n) for offset, n in _EXTENTS]
        remote = owner.descriptors(extents, within=region)
        local = [(target_base + 8192 * i, n) for i, (_, n) in enumerate(_EXTENTS)]
        puller.pull(peer, remote, local, timeout_s=_PULL_TIMEOUT_S)
        for i, (offset, n) in enumerate(_EXTENTS):
            if target[8192 * i : 8192 * i + n] != source[offset : offset + n]:
                return NixlVerdict(NixlOutcome.SELFTEST_FAILED, "READ brought other bytes")
        for agent in agents:
            agent.close()
    except KvtierError as exc:
        return NixlVerdict(NixlOutcome.SELFTEST_FAILED, str(exc))
    version = getattr(sys.modules.get("nixl_cu12") or sys.modules["nixl"], "__version__", "")
    moved = sum(n for _, n in _EXTENTS)
    return NixlVerdict(
        NixlOutcome.OK, f"NIXL {version or '(unknown version)'}: UCX READ of {moved} bytes"
    )


def main(argv: list[str]) -> int:
    """The child's entry point: ``PARENT_PID TIMEOUT_S``; prints the verdict as one JSON line.
    The caller must end the process with :func:`~kvtierd.nixl.agent.exit_process`."""
    parent, timeout_s = argv
    bind_to_parent(int(parent), float(timeout_s))
    verdict = _self_test()
    sys.stdout.write(msgspec.json.encode(verdict).decode() + "\n")
    return 0
