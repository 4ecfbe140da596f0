"""What this host gives the daemon, read from ``/proc`` and ``/sys``: memory, huge pages, the
memory-lock limit, capabilities.

Pure readers: every function reads a few kernel files and returns a value; a file that is
missing or unreadable (another kernel, a container) yields the answer that promises least
(``None`` for "unknown", 0 free huge pages, "" for an unknown mode), never an exception. The
arena and the start-up checks (:mod:`kvtierd.server.preflight`) decide what to do with them.
"""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

__all__ = [
    "CAP_IPC_LOCK",
    "cgroup_memory_headroom",
    "free_disk_bytes",
    "free_hugepage_bytes",
    "has_capability",
    "hugepage_bytes",
    "io_uring_disabled",
    "memlock_limit",
    "memory_available",
    "nearest_existing",
    "process_shmem_bytes",
    "shmem_thp_mode",
    "unix_listening",
]

#: The capability that lifts ``RLIMIT_MEMLOCK`` (``include/uapi/linux/capability.h``).
CAP_IPC_LOCK = 14
#: cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number.
_V1_UNLIMITED = 1 << 62

_PROC = Path("/proc")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (counts such as ``HugePages_Free`` as they are)."""
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in (_PROC / "meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                scale = 1024 if fields[1:] == ["kB"] else 1
                values[name] = int(fields[0]) * scale
    return values


def memory_available() -> int | None:
    """``MemAvailable``: what can be allocated without swapping, in bytes."""
    return _meminfo().get("MemAvailable")


def hugepage_bytes() -> int:
    """The size of the default hugetlb page (2 MiB on x86-64)."""
    return _meminfo().get("Hugepagesize", 2 << 20)


def free_hugepage_bytes() -> int:
    """Bytes of reserved hugetlb pages nobody holds (``vm.nr_hugepages`` minus those in use)."""
    info = _meminfo()
    return info.get("HugePages_Free", 0) * info.get("Hugepagesize", 0)


def shmem_thp_mode() -> str:
    """The kernel's transparent huge page mode for shared memory ("" when unknown)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return ""
    chosen = [word for word in text.split() if word.startswith("[")]
    return chosen[0].strip("[]") if chosen else ""


def io_uring_disabled() -> str:
    """``kernel.io_uring_disabled`` (0 allowed, 1 for a group only, 2 off; "" when unknown)."""
    try:
        return (_PROC / "sys" / "kernel" / "io_uring_disabled").read_text().strip()
    except OSError:
        return ""


def process_shmem_bytes(pid: int) -> int:
    """The shared memory process ``pid`` has resident (``RssShmem``): a daemon's arena."""
    with contextlib.suppress(OSError, ValueError):
        for line in (_PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


#: ``__SO_ACCEPTCON`` in /proc/net/unix's flags: the socket listens.
_SO_ACCEPTCON = 0x10000


def unix_listening(path: Path) -> bool:
    """Whether a socket listens on the Unix socket path ``path``, read from /proc/net/unix:
    without connecting to it (a connection to a socket systemd holds would start its service)."""
    try:
        lines = (_PROC / "net" / "unix").read_text().splitlines()[1:]
    except OSError:
        return False
    wanted = str(path)
    for line in lines:
        fields = line.split(maxsplit=7)
        if len(fields) == 8 and fields[7] == wanted and int(fields[3], 16) & _SO_ACCEPTCON:
            return True
    return False


def nearest_existing(path: Path) -> Path:
    """``path``, or its closest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_disk_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still allocate on the file system holding ``path``
    (or, when it does not exist yet, its closest existing ancestor)."""
    st = os.statvfs(nearest_existing(path))
    return st.f_bavail * st.f_frsize


def memlock_limit() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes, ``None`` when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def has_capability(capability: int) -> bool:
    """Whether this process holds ``capability`` in its effective set."""
    with contextlib.suppress(OSError, ValueError):
        for line in (_PROC / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> capability & 1)
    return False


def cgroup_memory_headroom() -> int | None:
    """How many more bytes this process's memory cgroup (and its ancestors) allow, ``None``
    when no limit applies or none can be read: the limit less the usage, plus the inactive page
    cache the kernel would reclaim first. cgroup v2 (``memory.max``) and v1
    (``memory.limit_in_bytes``) are both understood."""
    headrooms: list[int] = []
    for directory, limit_name, usage_name, inactive_name in _memory_cgroups():
        with contextlib.suppress(OSError, ValueError):
            limit_text = (directory / limit_name).read_text().strip()
            if limit_text == "max":
                continue
            limit = int(limit_text)
            if limit >= _V1_UNLIMITED:
                continue
            usage = int((directory / usage_name).read_text().strip())
            headrooms.append(max(0, limit - usage + _stat(directory, inactive_name)))
    return min(headrooms) if headrooms else None


def _stat(directory: Path, name: str) -> int:
    """One counter of a cgroup's ``memory.stat`` (0 when absent): here the inactive page cache,
    which the kernel reclaims before it refuses the cgroup memory (kubelet's working set)."""
    with contextlib.suppress(OSError, ValueError):
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return 0


def _memory_cgroups() -> list[tuple[Path, str, str, str]]:
    """The memory cgroup directories that bound this process, innermost first."""
    try:
        lines = (_PROC / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[Path, str, str, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (_CGROUP_ROOT / "cgroup.controllers").exists():
            names = ("memory.max", "memory.current", "inactive_file")
            found += [(d, *names) for d in _chain(_CGROUP_ROOT, path)]
        elif "memory" in controllers.split(","):
            mount = _CGROUP_ROOT / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            found += [(d, *names) for d in _chain(mount, path)]
    return found


def _chain(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each ancestor up to ``mount`` that exists (inside a container the
    cgroup path may be hidden and the container's own cgroup mounted at the root)."""
    parts = [p for p in path.split("/") if p]
    chain = [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in chain if d.is_dir()]
