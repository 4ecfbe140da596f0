"""Daemon configuration: a TOML file over embedded defaults, every field validated.

The defaults are the struct defaults below; a file overrides any subset of them and command-line
flags override the file. Unknown keys, wrong types, values out of range and broken rules between
fields are all refused together: one :class:`ConfigError` lists each problem on its own line,
naming the field (``dram.size``), or the flag that set it (``--dram-size``), and what is wrong
(:mod:`kvtierd.config_reader` does the reading). Modes are enums, so a bad value is answered with
the allowed ones.

Where the daemon keeps its socket and data when nothing says otherwise:

* under systemd, ``$RUNTIME_DIRECTORY`` and ``$STATE_DIRECTORY`` (set by the unit);
* in a source checkout (the package sits next to ``pyproject.toml``), ``<checkout>/.kvtierd/``,
  so a developer's daemon never needs root;
* otherwise ``/run/kvtierd`` and ``/var/lib/kvtierd``.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import socket
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec

from kvtierd.config_reader import read_config
from kvtierd.errors import ConfigError, ConfigProblem
from kvtierd.io.base import IoBackendKind

__all__ = [
    "ByteSize",
    "Config",
    "DaemonConfig",
    "DramConfig",
    "LogLevel",
    "NvmeConfig",
    "PolicyKind",
    "PoolConfig",
    "PoolWritePolicy",
    "Runtime",
    "TenantConfig",
    "TriState",
    "default_data_dir",
    "default_socket_path",
    "load_config",
    "parse_size",
]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.I)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}


class ByteSize(int):
    """A size in bytes; in TOML an integer or a string like ``"512M"``, ``"4G"``, ``"1.5GiB"``."""


def parse_size(text: str | int) -> ByteSize:
    """Parse ``"512M"``-style sizes (binary units) into bytes; raises ``ValueError``."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return ByteSize(text)
    match = _SIZE.match(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes or a suffix: K, M, G, T, P)")
    return ByteSize(int(float(match[1]) * _UNITS[match[2].lower()]))


def _show_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that divides it: ``1048576`` is ``"1M"``."""
    for suffix in "PTGMK":
        if nbytes and nbytes % _UNITS[suffix.lower()] == 0:
            return f"{nbytes // _UNITS[suffix.lower()]}{suffix}"
    return str(nbytes)


class Runtime(enum.StrEnum):
    ASYNCIO = "asyncio"
    TRIO = "trio"


class TriState(enum.StrEnum):
    """``auto``: use the feature when the system allows it, log when it does not."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class PolicyKind(enum.StrEnum):
    LRU = "lru"
    SLSAP = "slsap"


class LogLevel(enum.StrEnum):
    """The least severe log records written; read in any case (``"INFO"`` is ``info``)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:
        return cls.__members__.get(value.upper()) if isinstance(value, str) else None


Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Count = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]


#: A rule on one field's value alone: what is wrong with it, or ``None``.
FieldRule = Callable[[Any], "str | None"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A table of the configuration. ``field_rules`` judge one field's value alone (the reader
    applies them as it reads each field, so they are reported whatever else is wrong);
    ``_broken_rules`` are the rules between fields, checked once every field is valid. Both are
    checked at construction; each problem's ``where`` is relative to the table (``size``, not
    ``dram.size``), and any broken rule raises one :class:`ConfigError` listing them all."""

    field_rules: ClassVar[Mapping[str, FieldRule]] = {}

    def __post_init__(self) -> None:
        problems = [
            ConfigProblem(field, message)
            for field, rule in self.field_rules.items()
            if (message := rule(getattr(self, field))) is not None
        ]
        problems += self._broken_rules()
        if problems:
            raise ConfigError(f"invalid {type(self).__name__}:", problems)

    def _broken_rules(self) -> Iterator[ConfigProblem]:
        return iter(())


class DaemonConfig(_Section):
    socket: str = ""
    socket_mode: Annotated[
        str, msgspec.Meta(pattern=r"^0?[0-7]{3}$", description='an octal mode such as "0660"')
    ] = "0660"
    socket_group: str = ""
    data_dir: str = ""
    runtime: Runtime = Runtime.ASYNCIO
    log_level: LogLevel = LogLevel.INFO
    max_connections: Count = 256
    max_inflight: Count = 256
    max_frame_bytes: ByteSize = ByteSize(1 << 20)
    metrics_port: Port = 0
    metrics_address: str = "127.0.0.1"
    shutdown_grace_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0

    field_rules: ClassVar[Mapping[str, FieldRule]] = {
        "max_frame_bytes": lambda n: (
            None if 4096 <= n <= 64 << 20 else f"{_show_size(n)} is out of range 4K..64M"
        ),
    }

    def _broken_rules(self) -> Iterator[ConfigProblem]:
        if self.metrics_port and self.metrics_address not in ("127.0.0.1", "::1", "localhost"):
            yield ConfigProblem(
                "metrics_address",
                f"{self.metrics_address!r} is not loopback: metrics are served on "
                "127.0.0.1, ::1 or localhost only",
            )


class DramConfig(_Section):
    size: ByteSize = ByteSize(1 << 30)
    hugepages: TriState = TriState.AUTO
    mlock: TriState = TriState.AUTO
    prefault: bool = True
    policy: PolicyKind = PolicyKind.SLSAP
    #: Background promotions (HINT queues, reuse candidates) stay within this many bytes per
    #: second, and reuse promotions run only while no demand read waits on the disk. 0: none.
    prefetch_bytes_per_s: ByteSize = ByteSize(512 << 20)

    field_rules: ClassVar[Mapping[str, FieldRule]] = {
        "size": lambda n: None if n >= 16 << 20 else f"{_show_size(n)} is below the minimum 16M",
    }


class NvmeConfig(_Section):
    size: ByteSize = ByteSize(4 << 30)
    path: str = ""
    io_backend: IoBackendKind = IoBackendKind.AUTO
    queue_depth: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    segment_bytes: ByteSize = ByteSize(64 << 20)
    writeback_concurrency: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    preallocate: bool = True
    #: LRU by default: the disk tier evicts rarely, and a second reuse model would double the
    #: per-LOOKUP telemetry cost.
    policy: PolicyKind = PolicyKind.LRU

    field_rules: ClassVar[Mapping[str, FieldRule]] = {
        "size": lambda n: (
            None
            if n == 0 or n >= 64 << 20
            else f"{_show_size(n)} is neither 0 (no disk tier) nor at least 64M"
        ),
        "segment_bytes": lambda n: (
            None
            if n >= 1 << 20 and n % 4096 == 0
            else f"must be a multiple of 4K and at least 1M, not {_show_size(n)}"
        ),
    }


class PoolWritePolicy(enum.StrEnum):
    #: COMMIT returns once the pool holds the blocks (what a TP group's lookups rely on).
    WRITE_THROUGH = "write-through"
    #: COMMIT returns at once; a bounded background queue writes to the pool.
    WRITE_BACK = "write-back"


class PoolConfig(_Section):
    """The shared pool (Valkey/Redis) and this daemon's place in its TP group.

    ``url`` empty means no pool. Everything that must agree across a group's ranks enters
    :meth:`digest`; credentials and file paths do not (each host has its own).
    """

    url: str = ""
    cluster: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    username: str = ""
    #: A file holding the password or token, readable by the daemon's user only.
    password_file: str = ""
    allow_plaintext: bool = False
    write_policy: PoolWritePolicy = PoolWritePolicy.WRITE_THROUGH
    #: Bytes of committed blocks that may wait for the pool (write-back); past it, blocks stay
    #: local and are caught up at the next attach.
    writeback_bytes: ByteSize = ByteSize(256 << 20)
    compress: bool = False
    #: FSYNC also waits until the pool holds every block committed before it.
    fsync_waits: bool = True
    key_prefix: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^[A-Za-z0-9_.-]{1,32}$",
            description="a prefix of 1 to 32 letters, digits, '_', '.' or '-'",
        ),
    ] = "kvt"
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    #: The TP group: every rank of it names the same ``group_id`` and ``world_size``.
    group_id: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^[A-Za-z0-9_.:-]{0,128}$",
            description="a group id of up to 128 letters, digits, '_', '.', ':' or '-'",
        ),
    ] = ""
    rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    world_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    vote_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0

    def _broken_rules(self) -> Iterator[ConfigProblem]:
        if not self.url:
            return
        # The url is never quoted back: it may carry a password.
        scheme, separator, rest = self.url.partition("://")
        scheme = scheme.lower() if separator else ""
        if scheme not in ("redis", "rediss"):
            yield ConfigProblem("url", "must be redis://host:port or rediss://host:port")
        if "@" in rest:
            yield ConfigProblem(
                "url", "must not carry credentials: use pool.username and pool.password_file"
            )
        if scheme == "redis" and not self.allow_plaintext:
            yield ConfigProblem(
                "url",
                "is plaintext (redis://): use rediss:// with TLS, or set "
                "pool.allow_plaintext = true to accept an unencrypted pool",
            )
        for name in ("ca_file", "cert_file"):
            if scheme == "redis" and getattr(self, name):
                yield ConfigProblem(name, "is set, but pool.url is not rediss://")
        for given, other in (("cert_file", "key_file"), ("key_file", "cert_file")):
            if getattr(self, given) and not getattr(self, other):
                yield ConfigProblem(given, f"is set without pool.{other} (the two go together)")
        if self.rank >= self.world_size:
            yield ConfigProblem(
                "rank",
                f"{self.rank} is outside world_size {self.world_size} "
                f"(ranks are 0..{self.world_size - 1})",
            )
        if self.world_size > 1 and not self.group_id:
            yield ConfigProblem("group_id", "is required when world_size > 1")

    @property
    def group(self) -> str:
        """The group id, or this host's own one-rank group."""
        return self.group_id or f"solo-{socket.gethostname()}"

    @property
    def tls(self) -> bool:
        return self.url.lower().startswith("rediss://")

    def digest(self) -> str:
        """What every rank of the group must agree on, hashed (no secrets, no local paths)."""
        # Not the url: two hosts may name one pool differently (an address, a name). Ranks on
        # different pools never vote together anyway: the proposal lives in the leader's pool.
        shared = [
            self.cluster,
            self.tls,
            self.compress,
            self.key_prefix,
            self.write_policy.value,
            self.group_id,
            self.world_size,
        ]
        return hashlib.sha256(msgspec.json.encode(shared)).hexdigest()[:16]


class TenantConfig(_Section):
    """Who may open namespaces of tenant ``name``: peers whose uid or gid is listed."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    uids: list[int] = []
    gids: list[int] = []


class Config(_Section):
    daemon: DaemonConfig = msgspec.field(default_factory=DaemonConfig)
    dram: DramConfig = msgspec.field(default_factory=DramConfig)
    nvme: NvmeConfig = msgspec.field(default_factory=NvmeConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    tenants: list[TenantConfig] = []

    def _broken_rules(self) -> Iterator[ConfigProblem]:
        if self.pool.url and self.daemon.runtime is Runtime.TRIO:
            yield ConfigProblem(
                "daemon.runtime",
                "the pool runs on redis-py's asyncio client: use asyncio, or leave pool.url empty",
            )

    @property
    def socket_path(self) -> Path:
        return Path(self.daemon.socket) if self.daemon.socket else default_socket_path()

    @property
    def data_path(self) -> Path:
        return Path(self.daemon.data_dir) if self.daemon.data_dir else default_data_dir()


def _checkout_root() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "kvtierd").is_dir() else None


def default_socket_path() -> Path:
    """Where the daemon listens and clients connect when nothing else is said."""
    if env := os.environ.get("KVTIERD_SOCKET"):
        return Path(env)
    if runtime := os.environ.get("RUNTIME_DIRECTORY"):
        return Path(runtime.split(":")[0]) / "kvtierd.sock"
    if root := _checkout_root():
        return root / ".kvtierd" / "kvtierd.sock"
    return Path("/run/kvtierd/kvtierd.sock")


def default_data_dir() -> Path:
    if state := os.environ.get("STATE_DIRECTORY"):
        return Path(state.split(":")[0])
    if root := _checkout_root():
        return root / ".kvtierd" / "data"
    return Path("/var/lib/kvtierd")


def load_config(
    path: Path | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    flags: Mapping[tuple[str, str], str] | None = None,
) -> Config:
    """Read ``path`` (or only the defaults), apply ``overrides`` (``{"dram": {"size": "2G"}}``)
    and validate everything.

    ``flags`` maps an override's (section, field) to the command-line flag that set it
    (``{("dram", "size"): "--dram-size"}``): a problem in that value names the flag, not the
    file. Raises :class:`ConfigError` whose ``problems`` list everything wrong at once; a file
    that cannot be read or is not TOML is one problem.
    """
    raw = _read_toml(path) if path is not None else {}
    blame: dict[str, str] = {}
    for section, values in (overrides or {}).items():
        table = raw.setdefault(section, {})
        if isinstance(table, dict):  # else the file's value is reported: it is not a table
            table.update(values)
        for name in values:
            if flag := (flags or {}).get((section, name)):
                blame[f"{section}.{name}"] = flag
    return read_config(Config, raw, parsers={ByteSize: parse_size}, blame=blame, source=path)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
