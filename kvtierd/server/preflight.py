"""Everything that can stop the daemon, checked before it touches the arena or the disk.

Pre-faulting a large arena takes seconds and preallocating the NVMe file minutes; a mistake
found after them (a socket path too long, a port in use, a read-only directory) costs all that
time on every restart, and an arena larger than the memory there is ends in the OOM killer with
no message at all. So :func:`check_host` inspects the host against the configuration first,
without changing anything, and returns one :class:`~kvtierd.server.checks.HostCheck` per
subject (:mod:`kvtierd.server.checks` has the report's vocabulary): what the host gives
the daemon (``ok``), what it falls back from (``fallback``: it runs, without something it would
use) and what stops it (``fail``, with the exit status: 2 for a configuration that must change,
1 for an environment that must). The daemon refuses to start on any failure; ``kvtierd --check``
prints them all.

``blame`` maps a configuration field (``"daemon.socket"``) to the command-line flag that set it
(``"--socket"``), so a message names what the operator typed. ``unit`` (``kvtierd --check
--as-unit``, :mod:`kvtierd.server.unitfile`) judges the start the systemd unit will make: its
directories as made at start, its limits and sandbox instead of this process's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import socket
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvtierd import host
from kvtierd.config import Config, TriState
from kvtierd.errors import ConfigError
from kvtierd.io import IoBackendKind
from kvtierd.io.probe import BindingVerdict, cached_probe, probe_binding
from kvtierd.server.activation import activated
from kvtierd.server.budget import budget_problem, descriptor_budget, nofile_limits
from kvtierd.server.checks import CheckStatus, Fault, HostCheck, size_text
from kvtierd.server.unitfile import ServiceUnit
from kvtierd.store.copyhash import MODULE_ENV, CopyHashVerdict
from kvtierd.store.lifecycle import arena_bytes

__all__ = [
    "check_config_error",
    "check_copy_module",
    "check_host",
    "lock_holder",
    "probe_io_uring",
]

#: ``sizeof(sockaddr_un.sun_path)`` less the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
#: Where the io_uring verdict is cached, in the data directory.
VERDICT_CACHE = "io_uring.verdict"


def _ok(subject: str, detail: str) -> HostCheck:
    return HostCheck(subject, CheckStatus.OK, detail)


def _fallback(subject: str, detail: str) -> HostCheck:
    return HostCheck(subject, CheckStatus.FALLBACK, detail)


def _fail(subject: str, detail: str, fault: Fault = Fault.ENVIRONMENT) -> HostCheck:
    return HostCheck(subject, CheckStatus.FAIL, detail, fault)


def check_config_error(error: ConfigError) -> list[HostCheck]:
    """One failed ``config`` line per problem of an invalid configuration."""
    return [
        _fail("config", f"{p.where}: {p.message}" if p.where else p.message, Fault.CONFIGURATION)
        for p in error.problems
    ]


def probe_io_uring(config: Config, *, use_cache: bool) -> BindingVerdict | None:
    """The liburing binding's verdict for ``config`` (``None`` when io_uring is not asked for),
    probed on the data directory's file system and cached there when ``use_cache``."""
    if config.nvme.io_backend is IoBackendKind.THREADS:
        return None
    data_dir = config.data_path
    directory = data_dir if data_dir.is_dir() else None
    if use_cache and directory is not None and os.access(directory, os.W_OK):
        return cached_probe(directory / VERDICT_CACHE, directory=directory)
    return probe_binding(directory=directory)


def check_host(
    config: Config,
    verdict: BindingVerdict | None,
    blame: Mapping[str, str] | None = None,
    *,
    restart: bool = False,
    unit: ServiceUnit | None = None,
) -> list[HostCheck]:
    """Every start-up check of ``config`` on this host (see the module docstring).

    ``restart``: the checks are for restarting the daemon that runs on this data directory now
    (``kvtierd --check`` before ``systemctl restart``), so what that daemon holds (its data
    directory lock, its socket, presumably its metrics port, its arena's memory) counts as
    released. Without it, another daemon holding any of them is a failure.

    ``unit``: the checks are for a start by that systemd unit, run as its user: the directories
    it makes at start count as writable, its ``LimitMEMLOCK=``, ``LimitNOFILE=``,
    ``MemoryMax=`` and capabilities replace this process's, and its sandbox decides where the
    daemon may write.
    """

    def name(field: str) -> str:
        return (blame or {}).get(field, field)

    running = lock_holder(config.data_path) if restart else None
    need = arena_bytes(config)
    hugetlb = config.dram.hugepages is not TriState.NEVER and host.free_hugepage_bytes() >= need
    data_dir = _guard(
        "data_dir", _data_dir, config.data_path, name("daemon.data_dir"), running, unit
    )
    if data_dir.status is CheckStatus.FAIL and config.nvme.size and not config.nvme.path:
        nvme = HostCheck("nvme", CheckStatus.SKIPPED, "the NVMe file lies in data_dir (above)")
    else:
        nvme = _guard("nvme", _nvme, config, name, unit)
    return [
        _io_uring(config, verdict, name),
        _hugepages(config, need, name),
        _shmem_thp(hugetlb),
        _mlock(config, need, name, unit),
        _memory(need, hugetlb, config, name, running, unit),
        data_dir,
        nvme,
        _guard("socket", _socket, config, name, running, unit, restart),
        _guard("metrics", _metrics, config, name, running),
        _descriptors(config, unit),
        _guard("pool", _pool, config),
    ]


def check_copy_module(verdict: CopyHashVerdict | None) -> HostCheck:
    """Which kernel copies blocks and hashes them in one pass (:mod:`kvtierd.store.copyhash`):
    the native module's ("avx2", "sse2"), or Python's, and then why. Python still verifies
    every copy, 256 KiB at a time, but a DRAM hit then costs more than a plain copy: a
    fallback, never a failure."""
    subject = "copyhash"
    if verdict is None:
        return _fallback(subject, "python until the probe answers: it gave no verdict in time")
    if verdict.ok:
        return _ok(subject, f"{verdict.kernel}: one pass copies and hashes ({verdict.detail})")
    if not verdict.module:
        why = f"{MODULE_ENV} is empty (the native module is turned off)"
    elif "ModuleNotFoundError" in verdict.detail:
        why = f"{verdict.module} is not built (reinstall kvtierd): {verdict.detail}"
    else:
        why = f"{verdict.module} failed its probe: {verdict.detail}"
    return _fallback(subject, f"python, 256 KiB at a time, slower than a copy: {why}")


def _guard(subject: str, check: Callable[..., HostCheck], *args: Any) -> HostCheck:
    """``check(*args)``, or a failure saying why the file system would not answer it (a
    directory that may not be searched, a path that vanished meanwhile)."""
    try:
        return check(*args)
    except OSError as exc:
        return _fail(subject, f"cannot check: {exc}")


def lock_holder(data_dir: Path) -> str | None:
    """The pid (as the lock file says it) of the daemon holding ``data_dir``, or ``None``."""
    try:
        fd = os.open(data_dir / "kvtierd.lock", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)
    return None


# -- the checks -----------------------------------------------------------------------------

Namer = Callable[[str], str]


def _io_uring(config: Config, verdict: BindingVerdict | None, name: Namer) -> HostCheck:
    kind = config.nvme.io_backend
    if kind is IoBackendKind.THREADS or verdict is None:
        return _ok("io_uring", f"not used ({name('nvme.io_backend')} = threads)")
    setting = host.io_uring_disabled()
    kernel = f"kernel.io_uring_disabled = {setting}; " if setting else ""
    if verdict.ok:
        return _ok("io_uring", f"{kernel}{verdict.detail}")
    if kind is IoBackendKind.AUTO:
        return _fallback("io_uring", f"threads instead: {verdict.detail}")
    detail = f"{name('nvme.io_backend')} = io_uring, but {verdict.detail}"
    return _fail("io_uring", detail, Fault.CONFIGURATION)


def _hugepages(config: Config, need: int, name: Namer) -> HostCheck:
    mode = config.dram.hugepages
    if mode is TriState.NEVER:
        return _ok("hugepages", f"off ({name('dram.hugepages')} = never)")
    page = host.hugepage_bytes()
    free, wanted = host.free_hugepage_bytes() // page, -(-need // page)
    if free >= wanted:
        return _ok("hugepages", f"{free} free {size_text(page)} hugetlb pages hold the arena")
    shortfall = f"{free} of the {wanted} {size_text(page)} hugetlb pages the arena needs are free"
    if mode is TriState.ALWAYS:
        detail = f"{name('dram.hugepages')} = always, but {shortfall} (raise vm.nr_hugepages)"
        return _fail("hugepages", detail)
    return _fallback("hugepages", f"ordinary pages: {shortfall} (vm.nr_hugepages)")


def _shmem_thp(hugetlb: bool) -> HostCheck:
    if hugetlb:
        return _ok("thp", "not needed: the arena is on hugetlb pages")
    mode = host.shmem_thp_mode()
    if mode in ("never", "deny"):
        return _fallback(
            "thp",
            f"4 KiB pages: transparent_hugepage/shmem_enabled is {mode!r}, so the arena gets no "
            "2 MiB pages and copies run about 10 % slower (set it to 'advise')",
        )
    return _ok("thp", f"transparent_hugepage/shmem_enabled is {mode or 'unknown'!r}")


def _mlock(config: Config, need: int, name: Namer, unit: ServiceUnit | None) -> HostCheck:
    mode = config.dram.mlock
    if mode is TriState.NEVER:
        return _ok("mlock", f"off ({name('dram.mlock')} = never)")
    if unit is None:
        capable, limit, source = host.has_capability(host.CAP_IPC_LOCK), host.memlock_limit(), ""
    else:
        capable = "CAP_IPC_LOCK" in unit.ambient_capabilities
        limit, source = unit.memlock_bytes, " (LimitMEMLOCK= of the unit)"
    if capable:
        return _ok("mlock", "CAP_IPC_LOCK: the arena can be locked and registered with io_uring")
    if limit is None or limit >= need:
        shown = "unlimited" if limit is None else size_text(limit)
        return _ok("mlock", f"RLIMIT_MEMLOCK {shown}{source} holds the {size_text(need)} arena")
    detail = (
        f"RLIMIT_MEMLOCK is {size_text(limit)}, the arena {size_text(need)}: it cannot be locked "
        "(it may be swapped) nor registered as io_uring fixed buffers (LimitMEMLOCK=infinity)"
    )
    if mode is TriState.ALWAYS:
        return _fail("mlock", f"{name('dram.mlock')} = always, but {detail}")
    return _fallback("mlock", detail)


def _memory(
    need: int,
    hugetlb: bool,
    config: Config,
    name: Namer,
    running: str | None,
    unit: ServiceUnit | None,
) -> HostCheck:
    if hugetlb:
        return _ok("memory", f"the {size_text(need)} arena comes from reserved hugetlb pages")
    # The running daemon's arena is given back when it stops.
    freed = host.process_shmem_bytes(int(running)) if running and running.isdigit() else 0
    # The unit's own cgroup starts empty: its MemoryMax= is the headroom, not this shell's.
    cgroup = (
        (host.cgroup_memory_headroom(), "the memory cgroup's limit")
        if unit is None
        else (unit.memory_max_bytes, "MemoryMax= of the unit")
    )
    limits = [
        (value + freed, source)
        for value, source in ((host.memory_available(), "MemAvailable"), cgroup)
        if value is not None
    ]
    if not limits:
        return _ok("memory", f"{size_text(need)} arena; the memory available is unknown")
    available, source = min(limits)
    if need > available:
        return _fail(
            "memory",
            f"{name('dram.size')} = {size_text(config.dram.size)} needs a {size_text(need)} "
            f"arena, but only {size_text(available)} is available ({source}): lower "
            f"{name('dram.size')} or free memory",
        )
    also = f", with the running daemon's {size_text(freed)}" if freed else ""
    detail = f"{size_text(need)} arena, {size_text(available)} available ({source}{also})"
    return _ok("memory", detail)


def _directory_problem(path: Path, unit: ServiceUnit | None = None) -> str | None:
    """Why the daemon could not create files in ``path`` (creating it if needed), or ``None``.
    Under ``unit``, a directory the unit makes at start needs no rights now, and one its
    sandbox keeps read-only is a problem whatever the rights."""
    existing = host.nearest_existing(path)
    if not existing.is_dir():
        return f"{existing} is not a directory"
    with contextlib.suppress(OSError):
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"{existing} is on a read-only file system"
    if unit is not None:
        if (denied := unit.sandbox_denies(path)) is not None:
            return f"{path} is not writable in the unit: {denied}"
        if unit.provides(path) is not None:
            return None
    if not os.access(existing, os.W_OK | os.X_OK):
        user = pwd.getpwuid(os.geteuid()).pw_name
        return f"{existing} is not writable by {user}"
    return None


def _writable(path: Path, unit: ServiceUnit | None) -> str:
    """How the daemon gets to write in ``path``, which :func:`_directory_problem` passed."""
    given = unit.provides(path) if unit is not None else None
    return f"given to {unit.user} at start ({given})" if unit and given else "writable"


def _data_dir(
    data_dir: Path, field: str, running: str | None, unit: ServiceUnit | None
) -> HostCheck:
    if (problem := _directory_problem(data_dir, unit)) is not None:
        return _fail("data_dir", f"{field} {data_dir}: {problem}")
    free = size_text(host.free_disk_bytes(data_dir))
    free = f"{data_dir} is {_writable(data_dir, unit)}, {free} free"
    if running is not None:
        held = f"the running kvtierd (pid {running}) holds it until it stops"
        return _ok("data_dir", f"{free}; {held}")
    if (holder := lock_holder(data_dir)) is not None:
        return _fail("data_dir", f"{field} {data_dir} is in use by another kvtierd (pid {holder})")
    return _ok("data_dir", free)


def _nvme(config: Config, name: Namer, unit: ServiceUnit | None) -> HostCheck:
    size = config.nvme.size
    if not size:
        return _ok("nvme", f"no disk tier ({name('nvme.size')} = 0)")
    path = Path(config.nvme.path) if config.nvme.path else config.data_path / "nvme.data"
    if unit is not None and (denied := unit.sandbox_denies(path)) is not None:
        return _fail("nvme", f"{name('nvme.path')} {path} is not writable in the unit: {denied}")
    allocated = 0
    if path.exists():
        st = path.stat()
        if stat.S_ISBLK(st.st_mode):
            if not os.access(path, os.R_OK | os.W_OK):
                return _fail("nvme", f"{name('nvme.path')} {path}: no read and write access")
            return _ok("nvme", f"block device {path}")
        if not stat.S_ISREG(st.st_mode):
            return _fail("nvme", f"{name('nvme.path')} {path} is neither a file nor a device")
        allocated = st.st_blocks * 512
    elif (problem := _directory_problem(path.parent, unit)) is not None:
        return _fail("nvme", f"{name('nvme.path')} {path}: {problem}")
    needed = max(0, size - allocated) if config.nvme.preallocate else 0
    free = host.free_disk_bytes(path.parent)
    if needed > free:
        return _fail(
            "nvme",
            f"{name('nvme.size')} = {size_text(size)} does not fit in {path}: "
            f"{size_text(needed)} to preallocate, {size_text(free)} free (lower "
            f"{name('nvme.size')} or free disk space)",
        )
    return _ok("nvme", f"{path}: {size_text(size)}, {size_text(needed)} to allocate, "
               f"{size_text(free)} free")  # fmt: skip


def _socket(
    config: Config, name: Namer, running: str | None, unit: ServiceUnit | None, restart: bool
) -> HostCheck:
    path = config.socket_path
    length = len(os.fsencode(path))
    if length > MAX_SOCKET_PATH_BYTES:
        return _fail(
            "socket",
            f"{name('daemon.socket')} {path} is {length} bytes long; a Unix socket path holds "
            f"at most {MAX_SOCKET_PATH_BYTES}",
            Fault.CONFIGURATION,
        )
    if activated():  # systemd bound it and passes it: it answers, and nobody else serves it
        return _ok("socket", f"{path}, passed by systemd (socket activation)")
    if (problem := _directory_problem(path.parent, unit)) is not None:
        return _fail("socket", f"{name('daemon.socket')} {path}: {problem}")
    if path.exists() and not path.is_socket():
        return _fail("socket", f"{name('daemon.socket')} {path} exists and is not a socket")
    # Read from /proc, never by connecting: a connection to a socket systemd holds would start
    # the service, and a check must change nothing.
    listening = path.is_socket() and host.unix_listening(path)
    if listening and not restart:  # a start now, not passed the socket: it cannot bind there
        return _fail(
            "socket",
            f"{name('daemon.socket')} {path}: another process listens on it (a kvtierd, or "
            "systemd's kvtierd.socket: start the daemon through the unit then)",
        )
    group = config.daemon.socket_group
    if group and (refused := _group_problem(group, name("daemon.socket_group"))) is not None:
        return refused
    where = f"{path} ({length} of {MAX_SOCKET_PATH_BYTES} bytes), directory "
    where += _writable(path.parent, unit)
    if listening and running is not None:
        where += f"; the running kvtierd (pid {running}) listens until it stops"
    elif listening:  # no kvtierd holds the data directory: systemd's kvtierd.socket, or a squatter
        where += (
            "; held by another process while no kvtierd runs: kvtierd.socket passes it to the "
            "daemon at its start (socket activation); a start without it finds the path taken"
        )
    return _ok("socket", where)


def _group_problem(group: str, field: str) -> HostCheck | None:
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return _fail("socket", f"{field} {group!r} does not exist", Fault.CONFIGURATION)
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        user = pwd.getpwuid(os.geteuid()).pw_name
        return _fail("socket", f"{field} {group!r}: {user} is not a member, so cannot give it the "
                     "socket")  # fmt: skip
    return None


def _metrics(config: Config, name: Namer, running: str | None) -> HostCheck:
    port, address = config.daemon.metrics_port, config.daemon.metrics_address
    if not port:
        return _ok("metrics", f"off ({name('daemon.metrics_port')} = 0)")
    try:
        addresses = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, where = addresses[0]
        with socket.socket(family, kind, proto) as trial:
            trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
            trial.bind(where)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE and running is not None:
            detail = f"{address}:{port} in use, presumably by the running kvtierd (pid {running})"
            return _ok("metrics", detail)
        if exc.errno == errno.EADDRINUSE:
            why = "is in use"
        elif exc.errno == errno.EACCES:
            why = "needs privileges (a port below 1024)"
        else:
            why = f"cannot be bound: {exc.strerror or exc}"
        return _fail("metrics", f"{name('daemon.metrics_port')} {port} on {address} {why}")
    return _ok("metrics", f"http://{address}:{port}/metrics (port free)")


def _descriptors(config: Config, unit: ServiceUnit | None) -> HostCheck:
    """The connection caps and the daemon's own descriptors against ``RLIMIT_NOFILE`` (the
    unit's ``LimitNOFILE=`` under ``unit``)."""
    budget = descriptor_budget(config)
    soft, hard = nofile_limits() if unit is None else unit.nofile
    problem = budget_problem(budget, hard)
    if problem is not None:
        return _fail("nofile", problem, Fault.CONFIGURATION)
    if budget.total > soft:
        detail = f"raises RLIMIT_NOFILE from {soft} to {budget.total} (hard limit {hard})"
    else:
        detail = f"within RLIMIT_NOFILE {soft}"
    source = "" if unit is None else " (LimitNOFILE= of the unit)"
    return _ok("nofile", f"{budget.describe()}, {detail}{source}")


def _pool(config: Config) -> HostCheck:
    pool = config.pool
    if not pool.url:
        return _ok("pool", "none (pool.url is empty)")
    for field in ("ca_file", "cert_file", "key_file", "password_file"):
        if path := getattr(pool, field):
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                return _fail("pool", f"pool.{field} {path}: {exc.strerror}", Fault.CONFIGURATION)
    return _ok("pool", f"{pool.url} (not contacted here: `kvtierctl pool check` does)")
