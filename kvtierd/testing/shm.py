"""Shared memory that stopped processes left in ``/dev/shm``: found and removed.

Python's ``multiprocessing`` names its shared-memory segments ``psm_*`` and, under the spawn
and forkserver start methods, its semaphores ``sem.mp-*``; the resource tracker unlinks them
when their owners exit, unless the owners and the tracker were killed (vLLM's message queues,
its engine core and workers, after ``killpg``). vLLM's CPU offloading maps
``vllm_offload_*``. Nothing else unlinks them: each stays until the machine reboots, a few
hundred MB apiece for vLLM's queues.

:func:`orphans` lists the entries that appeared since a snapshot (:func:`snapshot`), match
those names, belong to this process's uid and are neither open nor mapped by any process whose
``/proc`` entries it can read: what no one can still be using (another uid's entries are never
touched, since their holders may be out of sight). :func:`remove_orphans` unlinks them.
``python -m kvtierd.testing.shm SNAPSHOT`` lists what appeared since the snapshot file (one
name per line, as ``ls /dev/shm`` writes it) and exits 1 if anything did: the check
``tools/test.sh`` makes after the suite.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
from collections.abc import Collection
from pathlib import Path

__all__ = ["SHM", "orphans", "remove_orphans", "snapshot"]

SHM = Path("/dev/shm")
#: What multiprocessing names its segments and semaphores, and vLLM its offloading regions.
PATTERNS = ("psm_*", "sem.mp-*", "vllm_offload_*")


def snapshot(root: Path = SHM) -> frozenset[str]:
    """The names in ``root`` now (empty where it does not exist)."""
    try:
        return frozenset(os.listdir(root))
    except FileNotFoundError:
        return frozenset()


def _held(root: Path) -> set[str]:
    """The names in ``root`` that a live process has open or mapped."""
    prefix = f"{root}/"
    held: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        # OSError: it exited meanwhile, or is not ours to read
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)  # the path may hold spaces
                if len(fields) == 6 and fields[5].startswith(prefix):
                    held.add(fields[5][len(prefix) :].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        held.add(target[len(prefix) :])
    return held


def _ours(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False


def orphans(before: Collection[str], root: Path = SHM) -> list[Path]:
    """Entries of ``root`` named as :data:`PATTERNS` names them, this uid's, absent from
    ``before`` and held by no process this one can see."""
    new = [
        name
        for name in snapshot(root) - set(before)
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in PATTERNS) and _ours(root / name)
    ]
    if not new:
        return []
    held = _held(root)
    return sorted(root / name for name in new if name not in held)


def remove_orphans(before: Collection[str], root: Path = SHM) -> list[Path]:
    """Unlink :func:`orphans`; returns what was removed."""
    removed = []
    for path in orphans(before, root):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to unlink
            path.unlink()
            removed.append(path)
    return removed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvtierd.testing.shm SNAPSHOT_FILE", file=sys.stderr)
        return 2
    before = Path(argv[0]).read_text().split()
    left = orphans(before)
    for path in left:
        print(f"left behind: {path}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
