"""What the systemd unit gives the daemon, read from the unit as installed, so that
``kvtierd --check --as-unit`` judges the start the unit will make, not the shell it runs in.

Before the first start the daemon's directories do not exist: ``RuntimeDirectory=`` and
``StateDirectory=`` make them (or hand them over) to ``User=`` as the unit starts. Its limits
are the unit's (``LimitMEMLOCK=``, ``LimitNOFILE=``, ``MemoryMax=``), not those of the
operator's shell, and its sandbox (``ProtectSystem=``, ``ProtectHome=``, ``ReadWritePaths=``)
decides where it may write. Judged from a shell, ``/run`` is not writable by the service user
and the arena cannot be locked, though neither is true of the start; a data directory outside
the sandbox's writable paths looks fine, though the start fails on it.

:func:`read_unit` reads the few settings that decide those checks, with systemd's rules for
the files: the unit, then its drop-ins in file-name order (one in ``/etc`` hides one of the same
name further down the search path), a later assignment replacing an earlier one and an empty
one clearing a list. Specifiers (``%i``), ``Environment=`` and every setting that does not bear
on the checks are not read. :func:`assume_user` becomes ``User=``, as systemd does.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtierd.server.checks import size_text

__all__ = ["UNIT_NAME", "UNIT_PATH", "ServiceUnit", "assume_user", "parse_unit", "read_unit"]

UNIT_NAME = "kvtierd.service"
#: Where systemd looks for system units, the most important first.
UNIT_PATH = tuple(
    Path(p)
    for p in (
        "/etc/systemd/system",
        "/run/systemd/system",
        "/usr/local/lib/systemd/system",
        "/usr/lib/systemd/system",
        "/lib/systemd/system",
    )
)
#: systemd's fixed search path for an ``ExecStart=`` program named without a directory.
EXEC_SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin")
#: What a unit that sets no limit gets (systemd's ``DefaultLimitMEMLOCK=`` and
#: ``DefaultLimitNOFILE=`` in system.conf, as shipped since systemd 240).
DEFAULT_MEMLOCK_BYTES = 8 << 20
DEFAULT_NOFILE = (1024, 524288)
#: ``infinity`` as a number, as :func:`kvtierd.server.budget.nofile_limits` gives it.
UNLIMITED = 1 << 62

_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}
#: What each ``ProtectSystem=`` makes read-only; ``strict`` leaves the API file systems.
_PROTECTED = {
    "no": (),
    "yes": ("/usr", "/boot", "/efi"),
    "full": ("/usr", "/boot", "/efi", "/etc"),
    "strict": ("/",),
}
_API_FILE_SYSTEMS = ("/dev", "/proc", "/sys")
_HOMES = ("/home", "/root", "/run/user")
_PRIVATE_TMP = ("/tmp", "/var/tmp")
_SIZE_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
                  "P": 1 << 50, "E": 1 << 60}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ServiceUnit:
    """The settings of the unit that the start-up checks depend on."""

    files: tuple[Path, ...]
    #: ``User=`` (``root`` when unset) and ``Group=`` (the user's own when ``None``).
    user: str
    group: str | None
    #: The program ``ExecStart=`` runs, as written (a bare name is looked up in
    #: :data:`EXEC_SEARCH_PATH`).
    program: str
    runtime_directories: tuple[Path, ...]
    state_directories: tuple[Path, ...]
    #: The soft ``RLIMIT_MEMLOCK`` in bytes, ``None`` for ``infinity``.
    memlock_bytes: int | None
    #: ``RLIMIT_NOFILE`` (soft, hard), :data:`UNLIMITED` for ``infinity``.
    nofile: tuple[int, int]
    #: ``MemoryMax=`` in bytes, ``None`` when unset or ``infinity``.
    memory_max_bytes: int | None
    protect_system: str
    protect_home: str
    private_tmp: bool
    read_write_paths: tuple[Path, ...]
    ambient_capabilities: frozenset[str]
    #: The words ``ExecStart=`` gives the program (``--config /etc/kvtierd/kvtierd.toml``).
    arguments: tuple[str, ...] = ()

    def provides(self, path: Path) -> str | None:
        """The setting that gives ``path`` (a directory, or a file in one) to the unit's user
        at start (``"RuntimeDirectory=kvtierd"``), or ``None``."""
        for key, base, directories in (
            ("RuntimeDirectory", "/run", self.runtime_directories),
            ("StateDirectory", "/var/lib", self.state_directories),
        ):
            for directory in directories:
                if _under(path, (directory,)):
                    return f"{key}={directory.relative_to(base)}"
        return None

    def sandbox_denies(self, path: Path) -> str | None:
        """Why the unit's sandbox keeps the daemon from creating files in ``path``, or
        ``None``."""
        if self.provides(path) or _under(path, self.read_write_paths):
            return None
        if self.protect_home != "no" and _under(path, _HOMES):
            return f"ProtectHome={self.protect_home} hides /home, /root and /run/user"
        if self.private_tmp and _under(path, _PRIVATE_TMP):
            return None  # private to the unit, and emptied when it stops
        strict = self.protect_system == "strict"
        if strict and _under(path, _API_FILE_SYSTEMS):
            return None
        if _under(path, _PROTECTED.get(self.protect_system, ())):
            return (
                f"ProtectSystem={self.protect_system} makes it read-only (add "
                "ReadWritePaths= in a drop-in)"
            )
        return None

    def program_problem(self) -> str | None:
        """Why systemd could not run ``ExecStart=``'s program here, or ``None``."""
        if "/" in self.program:
            candidates = [Path(self.program)]
        else:
            candidates = [Path(d) / self.program for d in EXEC_SEARCH_PATH]
        if any(p.is_file() and os.access(p, os.X_OK) for p in candidates):
            return None
        if "/" not in self.program:
            searched = ":".join(EXEC_SEARCH_PATH)
            return f"ExecStart= program {self.program} is not an executable file in {searched}"
        return f"ExecStart= program {self.program} is not an executable file"

    def describe(self) -> str:
        """What the unit gives, in one line (the ``unit`` line of ``kvtierd --check``)."""
        made = [
            f"{d} ({key}=)"
            for key, directories in (
                ("RuntimeDirectory", self.runtime_directories),
                ("StateDirectory", self.state_directories),
            )
            for d in directories
        ]
        memlock = "infinity" if self.memlock_bytes is None else size_text(self.memlock_bytes)
        soft, hard = (str(n) if n < UNLIMITED else "infinity" for n in self.nofile)
        parts = [
            f"as {self.user}" + (f":{self.group}" if self.group else ""),
            f"ExecStart={shlex.join([self.program, *self.arguments])}",
            *([" and ".join(made) + " made at start"] if made else []),
            f"LimitMEMLOCK={memlock}",
            f"LimitNOFILE={soft if soft == hard else f'{soft}:{hard}'}",
        ]
        if self.memory_max_bytes is not None:
            parts.append(f"MemoryMax={size_text(self.memory_max_bytes)}")
        return f"{', '.join(str(f) for f in self.files)}: {'; '.join(parts)}"


def read_unit(path: Path | None = None) -> ServiceUnit:
    """The unit as installed: ``path`` with its drop-ins (``<path>.d/*.conf``), or, when
    ``path`` is ``None``, ``kvtierd.service`` where systemd finds it (:data:`UNIT_PATH`) with
    the drop-ins of every directory there. Raises :class:`OSError` (``FileNotFoundError`` when
    there is no unit) and :class:`ValueError` for a value it cannot read."""
    files = unit_files(path)
    return parse_unit([f.read_text() for f in files], files=files)


def unit_files(path: Path | None = None) -> list[Path]:
    """The unit file and its drop-ins, in the order systemd applies them."""
    if path is not None:
        fragment, dropin_dirs = path, [Path(f"{path}.d")]
    else:
        found = [d / UNIT_NAME for d in UNIT_PATH if (d / UNIT_NAME).is_file()]
        if not found:
            where = ", ".join(str(d) for d in UNIT_PATH)
            raise FileNotFoundError(errno.ENOENT, f"no {UNIT_NAME} in {where}")
        fragment, dropin_dirs = found[0], [d / f"{UNIT_NAME}.d" for d in UNIT_PATH]
    if not fragment.is_file():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(fragment))
    dropins: dict[str, Path] = {}
    for directory in dropin_dirs:  # the most important first: it hides the same name below
        for conf in sorted(directory.glob("*.conf")):
            dropins.setdefault(conf.name, conf)
    return [fragment, *(dropins[name] for name in sorted(dropins))]


def parse_unit(texts: Sequence[str], *, files: Iterable[Path] = ()) -> ServiceUnit:
    """The :class:`ServiceUnit` of a unit file's text followed by its drop-ins'. Raises
    :class:`ValueError` for a value it cannot read."""
    settings: dict[str, list[str]] = {}
    for text in texts:
        for key, value in _assignments(text):
            if value:
                settings.setdefault(key, []).append(value)
            else:
                settings[key] = []  # an empty assignment clears what came before

    def last(key: str, default: str = "") -> str:
        return settings.get(key, [default])[-1] if settings.get(key) else default

    def words(key: str) -> list[str]:
        return [w for value in settings.get(key, []) for w in value.split()]

    command = last("ExecStart")
    prefixes = command[: len(command) - len(command.lstrip("@-:+!|"))]
    try:
        exec_start = shlex.split(command[len(prefixes) :])
    except ValueError as exc:
        raise ValueError(f"ExecStart=: {exc}") from None
    if "@" in prefixes and len(exec_start) > 1:  # the next word is argv[0], not an argument
        del exec_start[1]
    memlock = last("LimitMEMLOCK")
    try:
        memlock_bytes = _limit(memlock)[0] if memlock else DEFAULT_MEMLOCK_BYTES
        nofile = _nofile(last("LimitNOFILE"))
        memory_max_bytes = _memory_max(last("MemoryMax"))
    except ValueError as exc:
        raise ValueError(f"{exc} (LimitMEMLOCK=, LimitNOFILE= or MemoryMax=)") from None
    return ServiceUnit(
        files=tuple(files),
        user=last("User", "root"),
        group=last("Group") or None,
        program=exec_start[0] if exec_start else "",
        runtime_directories=tuple(Path("/run") / _name(w) for w in words("RuntimeDirectory")),
        state_directories=tuple(Path("/var/lib") / _name(w) for w in words("StateDirectory")),
        memlock_bytes=memlock_bytes,
        nofile=nofile,
        memory_max_bytes=memory_max_bytes,
        protect_system=_tristate(last("ProtectSystem", "no")),
        protect_home=_tristate(last("ProtectHome", "no")),
        private_tmp=last("PrivateTmp", "no").lower() in _TRUE,
        read_write_paths=tuple(Path(w.lstrip("-+")) for w in words("ReadWritePaths")),
        ambient_capabilities=frozenset(w for w in words("AmbientCapabilities") if w[0] != "~"),
        arguments=tuple(exec_start[1:]),
    )


def assume_user(unit: ServiceUnit) -> str:
    """Become ``unit``'s ``User=`` and ``Group=``, with the user's supplementary groups, as
    systemd does before it starts the daemon, and work from ``/`` as a system unit does; the
    user's name. Nothing changes when this process is that user already. Raises
    :class:`KeyError` when the user or group does not exist and :class:`PermissionError` when
    this process, neither root nor that user, cannot become it."""
    try:
        entry = pwd.getpwuid(int(unit.user)) if unit.user.isdigit() else pwd.getpwnam(unit.user)
    except KeyError:
        raise KeyError(f"User={unit.user} does not exist (systemd-sysusers makes it)") from None
    try:
        gid = entry.pw_gid if unit.group is None else _gid(unit.group)
    except KeyError:
        raise KeyError(f"Group={unit.group} does not exist") from None
    if os.geteuid() == entry.pw_uid and os.getegid() == gid:
        return entry.pw_name
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid()).pw_name
        raise PermissionError(
            errno.EPERM, f"run it as root or as {entry.pw_name}, not as {me}: the checks judge "
            "the rights of the user the unit runs as"
        )  # fmt: skip
    os.initgroups(entry.pw_name, gid)
    os.setgid(gid)
    os.setuid(entry.pw_uid)
    os.environ.update(HOME=entry.pw_dir, USER=entry.pw_name, LOGNAME=entry.pw_name)
    os.chdir("/")
    return entry.pw_name


def _gid(group: str) -> int:
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def _assignments(text: str) -> Iterable[tuple[str, str]]:
    """``(key, value)`` of each assignment in the ``[Service]`` section of a unit file."""
    section = ""
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.strip()
        while line.endswith("\\"):  # a continuation joins the next line, with a space
            line = line[:-1] + " " + next(lines, "").strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service" and "=" in line:
            key, _, value = line.partition("=")
            yield key.strip(), value.strip()


def _name(word: str) -> str:
    """A ``RuntimeDirectory=`` entry's directory (``name:symlink`` names a symlink too)."""
    return word.split(":")[0]


def _tristate(value: str) -> str:
    lowered = value.lower()
    return "yes" if lowered in _TRUE else "no" if lowered in _FALSE else lowered


def _bytes(value: str) -> int | None:
    """systemd's size (base 1024, ``infinity`` as ``None``); raises :class:`ValueError`."""
    if value == "infinity":
        return None
    number, suffix = value.rstrip("KMGTPEB"), value[len(value.rstrip("KMGTPEB")) :]
    try:
        return int(float(number) * _SIZE_SUFFIXES[suffix])
    except (KeyError, ValueError):
        raise ValueError(f"not a size: {value!r}") from None


def _limit(value: str) -> tuple[int | None, int | None]:
    """A ``Limit*=`` value as (soft, hard): one value sets both, ``soft:hard`` each."""
    soft, _, hard = value.partition(":")
    return _bytes(soft), _bytes(hard or soft)


def _nofile(value: str) -> tuple[int, int]:
    if not value:
        return DEFAULT_NOFILE
    soft, hard = _limit(value)
    return (UNLIMITED if soft is None else soft, UNLIMITED if hard is None else hard)


def _memory_max(value: str) -> int | None:
    if not value:
        return None
    if value.endswith("%"):
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(physical * float(value[:-1]) / 100)
    return _bytes(value)


def _under(path: Path, bases: Iterable[Path | str]) -> bool:
    """Whether ``path`` is one of ``bases`` or inside one (symbolic links resolved)."""
    resolved = path.resolve()
    return any(resolved.is_relative_to(Path(base).resolve()) for base in bases)
