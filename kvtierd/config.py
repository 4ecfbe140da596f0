"""Daemon configuration: a TOML file over embedded defaults, every field validated.

The defaults are the struct defaults below; a file overrides any subset of them and command-line
flags override the file. Unknown keys, wrong types, values out of range and broken rules between
fields are all refused together: one :class:`ConfigError` lists each problem on its own line,
naming the field (``dram.size``), or the flag that set it (``--dram-size``), and what is wrong
(:mod:`kvtierd.config_reader` does the reading). Modes are enums, so a bad value is answered with
the allowed ones. The module is past 600 lines because every section's fields, defaults and
cross-field rules are here, in the order ``docs/configuration.md`` and the example
configuration give them, so that the three read side by side (``tests/test_systemd_unit.py``
keeps them in step).

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
import stat
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar

import humanfriendly
import msgspec

from kvtierd.config_reader import read_config
from kvtierd.errors import ConfigError, ConfigProblem
from kvtierd.io.base import IoBackendKind

__all__ = [
    "MAX_TENANTS",
    "ByteSize",
    "Config",
    "DaemonConfig",
    "DramConfig",
    "LimitsConfig",
    "LogFormat",
    "LogLevel",
    "NixlConfig",
    "NvmeConfig",
    "NvmePolicyKind",
    "PolicyKind",
    "PoolConfig",
    "PoolWritePolicy",
    "RemoteClient",
    "RemoteConfig",
    "RemotePeer",
    "Runtime",
    "TenantConfig",
    "TriState",
    "default_data_dir",
    "default_socket_path",
    "load_config",
    "parse_size",
    "show_size",
]

#: Tenants a configuration may list (each has a DRAM region, a memory file of its own).
MAX_TENANTS = 64

# The accepted spellings; humanfriendly reads the value. It would also take "4 gravy" as 4 GiB
# (any word that starts like a unit), which a typo in a configuration must not become.
_SIZE = re.compile(r"\s*\d+(?:\.\d+)?\s*(?:[kmgtp]i?)?b?\s*", re.I)


class ByteSize(int):
    """A size in bytes; in TOML an integer or a string like ``"512M"``, ``"4G"``, ``"1.5GiB"``."""


def parse_size(text: str | int) -> ByteSize:
    """Parse ``"512M"``-style sizes into bytes; raises ``ValueError``. Units are binary whether
    written ``M``, ``MB`` or ``MiB`` (``humanfriendly.parse_size(binary=True)``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return ByteSize(text)
    if not isinstance(text, str) or not _SIZE.fullmatch(text):
        raise ValueError(f"not a size: {text!r} (use bytes or a suffix: K, M, G, T, P)")
    return ByteSize(humanfriendly.parse_size(text, binary=True))


def show_size(nbytes: int) -> str:
    """``nbytes`` as a size is written in the configuration: ``1048576`` is ``"1M"``, ``1572864``
    ``"1.5M"``; plain bytes where ``humanfriendly.format_size`` would round (``5000``)."""
    shown = humanfriendly.format_size(nbytes, binary=True)  # "1.5 MiB", "4.88 KiB", "1000 bytes"
    number, unit = shown.split()
    if unit[0] in "KMGTP" and humanfriendly.parse_size(shown, binary=True) == nbytes:
        return number + unit[0]
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


class NvmePolicyKind(enum.StrEnum):
    """The disk tier's policies: CLOCK over its rows (a byte a block; it needs the tier's cold
    index, so DRAM cannot choose it), or one of the DRAM policies (an entry per block)."""

    CLOCK = "clock"
    LRU = "lru"
    SLSAP = "slsap"


class LogFormat(enum.StrEnum):
    """How log records are written: ``text`` for people; ``json`` (one object a line) or
    ``logfmt`` (``key=value``) for a log shipper, with the fields a record carries (peer, uid,
    namespace...). Under the journal text lines keep their priority prefix, and the structured
    formats are sent as the journal's own fields (:mod:`kvtierd.cli.logs`)."""

    TEXT = "text"
    JSON = "json"
    LOGFMT = "logfmt"


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
    log_format: LogFormat = LogFormat.TEXT
    max_connections: Count = 256
    #: At most this many connections of one peer uid (root and the daemon's own uid included),
    #: so that no single uid can take every connection slot; capped by ``max_connections``.
    max_connections_per_uid: Count = 64
    #: A connection must have INIT answered within this many seconds, or it is closed.
    handshake_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    #: A connection that sent no request for this long, with nothing in flight, leased or
    #: being written, gives its slot up when a new connection would otherwise be refused
    #: (``max_connections`` or ``max_connections_per_uid`` reached). 0: never.
    idle_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 300.0
    max_inflight: Count = 256
    max_frame_bytes: ByteSize = ByteSize(1 << 20)
    metrics_port: Port = 0
    metrics_address: str = "127.0.0.1"
    #: Metrics connections still sending their request at once (a new one closes the oldest),
    #: and scrapes answered at once (one more is answered 503); the probes need no slot.
    metrics_max_connections: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8
    #: Each write of a metrics answer must go through within this many seconds, or the
    #: connection is closed (a scraper that stops reading).
    metrics_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    #: A metrics request's line and headers must arrive whole within this many seconds; while
    #: they have not, the connection is the first closed when the port is full (slowloris).
    metrics_request_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 2.0
    #: Namespace names that get their own ``namespace`` label in the metrics; the others are
    #: summed into ``namespace="other"``. Empty: the first ``metrics_namespace_limit`` names.
    metrics_namespaces: Annotated[list[str], msgspec.Meta(max_length=1000)] = []
    metrics_namespace_limit: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 20
    shutdown_grace_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    #: The secret mixed into every tenant's key salt (32 random bytes, made at first start,
    #: mode 0600). Hosts that share a pool must share this file. Default: ``<data_dir>/key.secret``.
    key_secret_file: str = ""

    field_rules: ClassVar[Mapping[str, FieldRule]] = {
        "max_frame_bytes": lambda n: (
            None if 4096 <= n <= 64 << 20 else f"{show_size(n)} is out of range 4K..64M"
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
    #: Under systemd, hand the regions and an image of their blocks to its file-descriptor
    #: store at a clean stop, and take them back (verified) at the next start.
    keep_across_restarts: bool = True

    field_rules: ClassVar[Mapping[str, FieldRule]] = {
        "size": lambda n: None if n >= 16 << 20 else f"{show_size(n)} is below the minimum 16M",
    }


class NvmeConfig(_Section):
    size: ByteSize = ByteSize(4 << 30)
    path: str = ""
    io_backend: IoBackendKind = IoBackendKind.AUTO
    queue_depth: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    segment_bytes: ByteSize = ByteSize(64 << 20)
    writeback_concurrency: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    #: A READ's blocks on disk are promoted in batches of at most this many bytes and blocks:
    #: one task, their reads all in flight at once (records side by side in one request), one
    #: hash pass. What a batch holds in DRAM before any of it is verified; a larger block is a
    #: batch of its own.
    read_batch_bytes: ByteSize = ByteSize(4 << 20)
    read_batch_blocks: Annotated[int, msgspec.Meta(ge=1, le=64)] = 16
    #: Daemon-private memory committed blocks are copied into (at COMMIT while there is room,
    #: else at write-back, verified) before they are written: no client can change what
    #: reaches the disk. Used only while blocks await write-back; at least twice the largest
    #: block (limits.max_block_bytes is kept for write-back's own copies).
    staging_bytes: ByteSize = ByteSize(256 << 20)
    preallocate: bool = True
    #: How often the data file is checked to still be the one the tier has open (it is also
    #: checked at every FSYNC), and a block whose write-back failed is tried again.
    health_check_interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 5.0
    #: An existing, non-empty data file whose superblock cannot be read (nor rebuilt from its
    #: first segment header) was truncated or overwritten: by default the daemon refuses to
    #: start rather than initialise it empty. True initialises it (one ERROR line); meant for
    #: one start, where the file cannot be moved aside (a block device).
    reinitialize_unreadable: bool = False
    #: CLOCK by default: a reference byte per row, where LRU's entry costs about 105 bytes a
    #: block and a second reuse model would double the per-LOOKUP telemetry cost.
    policy: NvmePolicyKind = NvmePolicyKind.CLOCK
    #: A checkpoint (the index snapshot, copied a slice at a time and written in a worker
    #: thread) every so many bytes written: a start after a crash then reads it and scans only
    #: the segments written since, so what it costs is bounded by this. 0: none (a crash
    #: restart scans every header, about 71 s at 10M blocks on a disk of 140K IOPS).
    checkpoint_every_bytes: ByteSize = ByteSize(8 << 30)

    field_rules: ClassVar[Mapping[str, FieldRule]] = {
        "size": lambda n: (
            None
            if n == 0 or n >= 64 << 20
            else f"{show_size(n)} is neither 0 (no disk tier) nor at least 64M"
        ),
        "segment_bytes": lambda n: (
            None
            if n >= 1 << 20 and n % 4096 == 0
            else f"must be a multiple of 4K and at least 1M, not {show_size(n)}"
        ),
        "read_batch_bytes": lambda n: (
            None if 4 << 10 <= n <= 256 << 20 else f"{show_size(n)} is outside 4K..256M"
        ),
        "checkpoint_every_bytes": lambda n: (
            None if n == 0 or n >= 1 << 20 else f"{show_size(n)} is neither 0 (none) nor >= 1M"
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


class NixlConfig(_Section):
    """NIXL reads out of the arena (the ``kvtierd[nixl]`` extra, ``docs/nixl.md``).

    With ``enabled`` the daemon proves NIXL in a child process at start and, if it works,
    registers every tenant region with its own agent, so that clients may pull leased blocks
    (READ_NIXL); if the probe fails the daemon serves on without, and says why. UCX chooses its
    transports from its environment (``UCX_TLS``, set in the unit's ``Environment=``).
    """

    enabled: bool = False
    #: How long NIXL's self-test child may take (imports and a loop-back transfer: 1-2 s).
    probe_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 30.0
    #: The user each region's exporter process drops to when the daemon runs as root (its
    #: memory is reachable by NIXL peers, ``docs/nixl.md``): not root. Ignored when the daemon
    #: is not root (the exporters keep its uid); empty keeps root (not advised).
    exporter_user: Annotated[
        str, msgspec.Meta(max_length=255, pattern=r"^(?!root$)[A-Za-z0-9_.-]*$")
    ] = "nobody"


class RemoteClient(_Section):
    """A client on another host: the common name of its TLS certificate, and the uid it acts
    as (tenant checks and connection limits, as ``SO_PEERCRED``'s uid for a local client)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    uid: Annotated[int, msgspec.Meta(ge=1, le=(1 << 32) - 2)]


class RemotePeer(_Section):
    """Another host's daemon this one may restore blocks from (its ``remote.listen``)."""

    address: Annotated[str, msgspec.Meta(min_length=3, max_length=300)]
    #: The name its certificate must carry; default: the host part of ``address``.
    server_name: str = ""

    def host_port(self) -> tuple[str, int]:
        """``address`` as (host, port); raises ``ValueError`` for one that is not host:port."""
        return _host_port(self.address)


class RemoteConfig(_Section):
    """Control connections over TCP, for engines on other hosts that pull blocks over NIXL
    (``docs/remote.md``).

    ``listen`` empty: the Unix socket only. With it, the daemon also accepts TCP connections
    there: TLS with client certificates (``ca_file`` signs them; each client's certificate
    common name must be listed in ``clients``, which gives the uid it acts as) unless
    ``allow_plaintext``, which accepts unencrypted connections acting as ``plaintext_uid``
    (a test network only). A TCP connection passes no descriptors: it reads blocks with
    READ_NIXL and cannot write, so ``nixl.enabled`` must be true.
    """

    listen: str = ""
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    clients: Annotated[list[RemoteClient], msgspec.Meta(max_length=1024)] = []
    allow_plaintext: bool = False
    plaintext_uid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 2)] = 0
    #: TCP connections served at once, after their handshake; one more gets ``EBUSY``. Counted
    #: apart from the Unix socket's ``daemon.max_connections``, which TCP clients never take.
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 64
    #: TCP connections still in their TLS handshake (or being told why they are refused) at
    #: once; one more is closed at once, unanswered.
    max_handshakes: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 32
    #: Of ``max_handshakes``, those one source address may hold; one more from it is closed
    #: at once, unanswered. Must be below ``max_handshakes``.
    max_handshakes_per_host: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 8
    #: Of ``max_connections``, the sessions one client uid may hold (0: a quarter of
    #: ``max_connections``, at least 1); must be below ``max_connections``, so that no one
    #: client takes every remote session.
    max_connections_per_uid: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0
    #: Whether a TCP client may create a namespace (OPEN_NS with create); without it, it opens
    #: only namespaces that exist, and OPEN_NS of an unknown one is answered ``EACCES``.
    allow_create: bool = False
    #: Daemons of other hosts that a block only the pool holds here is pulled from first.
    peers: Annotated[list[RemotePeer], msgspec.Meta(max_length=64)] = []
    #: This daemon's client certificate and key for its peers (TLS), and the CA their
    #: certificates are checked against (default: ``ca_file``).
    peer_cert_file: str = ""
    peer_key_file: str = ""
    peer_ca_file: str = ""

    def _broken_rules(self) -> Iterator[ConfigProblem]:
        yield from self._broken_peer_rules()
        if not self.listen:
            return
        try:
            self.address()
        except ValueError as exc:
            yield ConfigProblem("listen", str(exc))
        if self.tls:
            for name in ("key_file", "ca_file"):
                if not getattr(self, name):
                    yield ConfigProblem(name, "is required with remote.cert_file (TLS)")
            if not self.clients:
                yield ConfigProblem(
                    "clients", "lists no client: no certificate could connect over TLS"
                )
        elif not self.allow_plaintext:
            yield ConfigProblem(
                "cert_file",
                "is not set, so remote.listen would accept unencrypted, unauthenticated "
                "connections: give cert_file, key_file and ca_file, or set "
                "remote.allow_plaintext = true (a test network only)",
            )
        elif not self.plaintext_uid:
            yield ConfigProblem(
                "plaintext_uid",
                "is required with remote.allow_plaintext (the uid plaintext clients act as; "
                "not root)",
            )
        names = [c.name for c in self.clients]
        if len(set(names)) != len(names):
            yield ConfigProblem("clients", "a client name is listed twice")
        if self.uid_cap >= self.max_connections:
            yield ConfigProblem(
                "max_connections_per_uid",
                f"{self.uid_cap} is not below remote.max_connections ({self.max_connections}): "
                "one client could take every remote session",
            )
        if self.max_handshakes_per_host >= self.max_handshakes:
            yield ConfigProblem(
                "max_handshakes_per_host",
                f"{self.max_handshakes_per_host} is not below remote.max_handshakes "
                f"({self.max_handshakes}): one host could take every handshake slot",
            )

    def _broken_peer_rules(self) -> Iterator[ConfigProblem]:
        for index, peer in enumerate(self.peers):
            try:
                peer.host_port()
            except ValueError as exc:
                yield ConfigProblem(f"peers[{index}].address", str(exc))
        if not self.peers:
            return
        if self.peer_cert_file and not self.peer_key_file:
            yield ConfigProblem("peer_key_file", "is required with remote.peer_cert_file")
        if self.peer_cert_file and not (self.peer_ca_file or self.ca_file):
            yield ConfigProblem("peer_ca_file", "is required with remote.peer_cert_file")
        if not self.peer_cert_file and not self.allow_plaintext:
            yield ConfigProblem(
                "peer_cert_file",
                "is not set, so remote.peers would be reached unencrypted: give peer_cert_file, "
                "peer_key_file and peer_ca_file, or set remote.allow_plaintext = true",
            )

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)

    @property
    def uid_cap(self) -> int:
        """The remote sessions one client uid may hold: ``max_connections_per_uid``, or a
        quarter of ``max_connections`` (at least 1) when it is 0."""
        return self.max_connections_per_uid or max(1, self.max_connections // 4)

    @property
    def peer_ca(self) -> str:
        return self.peer_ca_file or self.ca_file

    def address(self) -> tuple[str, int]:
        """``listen`` as (host, port); raises ``ValueError`` for one that is not host:port."""
        return _host_port(self.listen)

    def uid_of(self, name: str) -> int | None:
        """The uid the client whose certificate names ``name`` acts as; ``None``: unknown."""
        return next((c.uid for c in self.clients if c.name == name), None)


def _host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); raises ``ValueError`` otherwise."""
    host, colon, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not host:port (an address or name, and a port 1-65535)")
    return host, int(port)


Share = Annotated[float, msgspec.Meta(ge=0, le=1)]


class TenantConfig(_Section):
    """Who may open namespaces of tenant ``name`` (peers whose uid or gid is listed), and the
    DRAM region its blocks live in: ``dram_size`` bytes, or ``dram_share`` of ``dram.size``;
    with neither, an equal part of what the sized tenants leave. The default region (the
    namespaces of tenants not listed: root's only) gets what the tenants leave."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    uids: Annotated[list[int], msgspec.Meta(max_length=256)] = []
    gids: Annotated[list[int], msgspec.Meta(max_length=256)] = []
    dram_size: ByteSize = ByteSize(0)
    dram_share: Share = 0.0

    def _broken_rules(self) -> Iterator[ConfigProblem]:
        if self.dram_size and self.dram_share:
            yield ConfigProblem("dram_share", "give dram_size or dram_share, not both")


class LimitsConfig(_Section):
    """Bounds on what one request, connection or tenant may ask of the daemon."""

    #: Largest TP group a namespace may declare (work per LOOKUP grows with it).
    max_world_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 256
    #: Largest block a namespace may declare; write-back stages one such block at a time.
    max_block_bytes: ByteSize = ByteSize(64 << 20)
    #: Namespaces one tenant may create, and all tenants together (EDQUOT beyond).
    max_namespaces_per_tenant: Count = 1024
    max_namespaces: Count = 16384
    #: Share of its tenant's DRAM region one connection may hold in leases and pending ALLOCs.
    connection_pinned_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.75
    #: Leases and pending ALLOCs one connection may hold open at once (EDQUOT beyond).
    max_leases_per_connection: Count = 65536
    max_pending_writes_per_connection: Count = 4096
    #: Memory for sparse-attention block summaries; the least recently used go beyond it.
    sparse_summary_bytes: ByteSize = ByteSize(256 << 20)

    field_rules: ClassVar[Mapping[str, FieldRule]] = {
        "max_block_bytes": lambda n: (
            None if 4096 <= n <= 1 << 30 else f"{show_size(n)} is out of range 4K..1G"
        ),
    }


class Config(_Section):
    daemon: DaemonConfig = msgspec.field(default_factory=DaemonConfig)
    dram: DramConfig = msgspec.field(default_factory=DramConfig)
    nvme: NvmeConfig = msgspec.field(default_factory=NvmeConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    nixl: NixlConfig = msgspec.field(default_factory=NixlConfig)
    remote: RemoteConfig = msgspec.field(default_factory=RemoteConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    #: At most 64: each is a DRAM region, a namespace quota, a metric label.
    tenants: Annotated[list[TenantConfig], msgspec.Meta(max_length=MAX_TENANTS)] = []

    def _broken_rules(self) -> Iterator[ConfigProblem]:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            yield ConfigProblem("tenants", "a tenant is listed twice")
        if self.tenants and self.dram.hugepages is TriState.ALWAYS:
            yield ConfigProblem(
                "dram.hugepages",
                '"always" with [[tenants]]: a client that punches a hole in hugetlb memory '
                'while the host\'s pool is empty would make the daemon fault; use "auto"',
            )
        try:
            self.dram_regions()
        except ValueError as exc:
            yield ConfigProblem("tenants", str(exc))
        if self.nvme.size and 2 * self.limits.max_block_bytes > self.nvme.staging_bytes:
            yield ConfigProblem(
                "limits.max_block_bytes",
                f"{show_size(self.limits.max_block_bytes)} exceeds half of nvme.staging_bytes "
                f"({show_size(self.nvme.staging_bytes)}): write-back could not stage it",
            )
        if self.remote.listen and not self.nixl.enabled:
            yield ConfigProblem(
                "remote.listen",
                "needs nixl.enabled = true: a TCP connection reads blocks over NIXL only",
            )
        if self.remote.peers and not (self.nixl.enabled and self.pool.url):
            yield ConfigProblem(
                "remote.peers",
                "needs nixl.enabled = true and a pool.url: peers are asked for blocks the pool "
                "holds, over NIXL",
            )
        if self.pool.url and self.daemon.runtime is Runtime.TRIO:
            yield ConfigProblem(
                "daemon.runtime",
                "the pool runs on redis-py's asyncio client: use asyncio, or leave pool.url empty",
            )

    def dram_regions(self) -> list[tuple[str | None, int]]:
        """The DRAM tier split into regions: ``(tenant name, bytes)``, tenant ``None`` for the
        default region (namespaces of tenants not listed), each a whole number of 2 MiB pages.
        Raises ``ValueError`` when the listed sizes leave a region no room."""
        page = 2 << 20
        total = self.dram.size - self.dram.size % page
        fixed = {
            t.name: t.dram_size or int(t.dram_share * total)
            for t in self.tenants
            if t.dram_size or t.dram_share
        }
        fixed = {name: size - size % page for name, size in fixed.items()}
        for name, size in fixed.items():
            if size < page:
                raise ValueError(f"tenant {name!r} is given less than one 2M page of DRAM")
        rest = total - sum(fixed.values())
        unsized = [t.name for t in self.tenants if t.name not in fixed]
        # The unsized tenants split the rest; the default region (root's only, once tenants
        # are listed) gets what they leave: all of it when every tenant is sized.
        shares = max(1, len(unsized))
        part = (rest // shares) // page * page if rest > 0 else 0
        if rest < 0:
            raise ValueError(
                f"the tenants' DRAM ({show_size(sum(fixed.values()))}) exceeds dram.size "
                f"({show_size(total)})"
            )
        if unsized and part < page:
            raise ValueError(
                f"no DRAM is left for tenant(s) {', '.join(map(repr, unsized))}: give them "
                "dram_size or dram_share, or raise dram.size"
            )
        regions: list[tuple[str | None, int]] = [
            (t.name, fixed.get(t.name, part)) for t in self.tenants
        ]
        default = rest - part * len(unsized)
        default -= default % page
        if default >= page:
            regions.insert(0, (None, default))
        return regions

    @property
    def socket_path(self) -> Path:
        return Path(self.daemon.socket) if self.daemon.socket else default_socket_path()

    @property
    def data_path(self) -> Path:
        return Path(self.daemon.data_dir) if self.daemon.data_dir else default_data_dir()

    @property
    def key_secret_path(self) -> Path:
        secret = self.daemon.key_secret_file
        return Path(secret) if secret else self.data_path / "key.secret"


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


#: The largest configuration file read: a real one is a few KiB; the bound keeps a mistake (a
#: log file named as the config) from filling memory, at start or at SIGHUP.
MAX_CONFIG_BYTES = 1 << 20


def _read_toml(path: Path) -> dict[str, Any]:
    """The TOML tables of the regular file ``path``; every way it cannot be one is a
    :class:`ConfigError` (not a FIFO or a device, which could block or never end; at most
    :data:`MAX_CONFIG_BYTES`; UTF-8; TOML that does not nest past Python's recursion limit)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"config {path} is not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config {path} is {info.st_size} bytes; a configuration is at most "
                f"{MAX_CONFIG_BYTES}"
            )
        with os.fdopen(fd, "rb", closefd=False) as stream:
            data = stream.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path} grew past {MAX_CONFIG_BYTES} bytes while read")
    try:
        return tomllib.loads(data.decode())
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"config {path} nests its tables or arrays too deep") from None
