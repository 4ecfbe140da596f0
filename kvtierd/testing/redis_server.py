"""Real ``redis-server`` processes for tests: standalone, TLS, ACL users, cluster, in a namespace.

Each :class:`RedisServer` lives in a directory of its own (``redis.conf``, ``redis.log`` and a
``data/`` directory that survives :meth:`RedisServer.restart`), listens on one port (a free one
unless given; the TLS port only when ``tls`` is given) and is stopped with SIGTERM or killed with
SIGKILL. With ``netns`` it runs under ``ip netns exec <netns>``; ``ip netns exec`` execs the
server, so the process the harness signals is the server itself. The harness talks to it with
redis-py from the test process (``client()``), which is why a namespaced server must be reachable
from the root namespace: :class:`kvtierd.testing.netns.NetnsLab` gives its bridge an address there.

:class:`RedisCluster` starts N such servers in cluster mode and joins them with
``redis-cli --cluster create``.

Certificates come from :func:`make_tls` (``trustme``: one CA, a server certificate for the given
names and addresses, a client certificate) and :func:`make_other_ca` (a CA that signed nothing
here, for "wrong CA is refused" tests).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtierd.testing import free_port, skip, terminate

if TYPE_CHECKING:
    import redis
    import redis.cluster

__all__ = [
    "RedisCluster",
    "RedisServer",
    "RedisServerError",
    "TlsFiles",
    "free_port",
    "make_other_ca",
    "make_tls",
    "require_redis_cli",
    "require_redis_server",
]

DEFAULT_HOSTNAMES = ("127.0.0.1", "localhost")


class RedisServerError(RuntimeError):
    """The server did not start, or the cluster did not form; the message carries the log."""


def require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        skip("redis-server is not installed: apt-get install redis-server (tools/setup.sh does)")


def require_redis_cli() -> None:
    if shutil.which("redis-cli") is None:
        skip("redis-cli is not installed: apt-get install redis-tools (tools/setup.sh does)")


# -- certificates ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def make_tls(directory: Path, *, hostnames: Iterable[str] = DEFAULT_HOSTNAMES) -> TlsFiles:
    """A CA, a server certificate valid for ``127.0.0.1``, ``localhost`` and every name or IP in
    ``hostnames`` (a lab host's address, say), and a client certificate, as PEM files in
    ``directory`` (keys mode 0600)."""
    import trustme

    directory.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys([*DEFAULT_HOSTNAMES, *hostnames]))
    ca = trustme.CA(organization_name="kvtierd test CA")
    server = ca.issue_cert(*names, common_name="kvtierd-pool")
    client = ca.issue_cert("kvtierd-client", common_name="kvtierd-client")
    files = TlsFiles(
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
    ca.cert_pem.write_to_path(str(files.ca_cert))
    files.server_cert.write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    _write_private(files.server_key, server.private_key_pem.bytes())
    files.client_cert.write_bytes(b"".join(blob.bytes() for blob in client.cert_chain_pems))
    _write_private(files.client_key, client.private_key_pem.bytes())
    return files


def make_other_ca(directory: Path) -> Path:
    """The certificate of a CA that signed nothing the server presents (``other-ca.crt``)."""
    import trustme

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "other-ca.crt"
    trustme.CA(organization_name="kvtierd unrelated CA").cert_pem.write_to_path(str(path))
    return path


# -- one server --------------------------------------------------------------------------------


class RedisServer:
    """One ``redis-server`` 7.0 in ``directory``; see the module docstring.

    ``users`` maps ACL user names to passwords, each with full access; when given, the ``default``
    user is disabled, so an unauthenticated client is refused. ``persistence`` turns on the
    append-only file with ``appendfsync always``: a write acknowledged before a kill survives it.
    """

    def __init__(
        self,
        directory: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        tls: TlsFiles | None = None,
        require_client_cert: bool = False,
        users: dict[str, str] | None = None,
        persistence: bool = True,
        cluster: bool = False,
        netns: str | None = None,
        extra_config: Sequence[str] = (),
    ) -> None:
        self.directory = Path(directory)
        self._host = host
        self._port = port
        self._port_given = port is not None
        self.tls = tls
        self.require_client_cert = require_client_cert
        self.users = dict(users) if users else {}
        self.persistence = persistence
        self.cluster = cluster
        self.netns = netns
        self.extra_config = list(extra_config)
        self.data_dir = self.directory / "data"
        self.config_path = self.directory / "redis.conf"
        self.process: subprocess.Popen[bytes] | None = None

    # -- addresses

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        if self._port is None:
            self._port = free_port(self._host, also_free=(10000,) if self.cluster else ())
        return self._port

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    @property
    def command_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.running and self.process is not None else None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- configuration

    def config_lines(self) -> list[str]:
        lines = [
            f"bind {self.host}",
            "protected-mode no",
            "daemonize no",
            'logfile ""',
            f"dir {self.data_dir}",
            'save ""',
            "loglevel notice",
        ]
        if self.tls is not None:
            lines += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {self.tls.server_cert}",
                f"tls-key-file {self.tls.server_key}",
                f"tls-ca-cert-file {self.tls.ca_cert}",
                f"tls-auth-clients {'yes' if self.require_client_cert else 'optional'}",
            ]
            if self.cluster:
                lines += ["tls-cluster yes", "tls-replication yes"]
        else:
            lines.append(f"port {self.port}")
        if self.persistence:
            lines += ["appendonly yes", "appendfsync always", "appendfilename appendonly.aof"]
        else:
            lines.append("appendonly no")
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                "cluster-node-timeout 3000",
                "cluster-require-full-coverage yes",
            ]
        if self.users:
            lines.append("user default off")
            for name, password in self.users.items():
                lines.append(f"user {name} on >{password} ~* &* +@all")
        lines += self.extra_config
        return lines

    def connection_kwargs(
        self, *, username: str | None = None, password: str | None = None
    ) -> dict[str, Any]:
        """Keyword arguments for ``redis.Redis``/``redis.asyncio.Redis`` (host, port, TLS files, the
        first ACL user unless another is named)."""
        kwargs: dict[str, Any] = {"host": self.host, "port": self.port}
        if self.tls is not None:
            kwargs.update(
                ssl=True,
                ssl_ca_certs=str(self.tls.ca_cert),
                ssl_certfile=str(self.tls.client_cert),
                ssl_keyfile=str(self.tls.client_key),
            )
        if username is None and password is None and self.users:
            username, password = next(iter(self.users.items()))
        if username is not None:
            kwargs["username"] = username
        if password is not None:
            kwargs["password"] = password
        return kwargs

    def cli_args(self) -> list[str]:
        """``redis-cli`` options that reach this server (TLS, first ACL user), without host/port."""
        args: list[str] = []
        if self.tls is not None:
            args += [
                "--tls",
                "--cacert",
                str(self.tls.ca_cert),
                "--cert",
                str(self.tls.client_cert),
                "--key",
                str(self.tls.client_key),
            ]
        if self.users:
            name, password = next(iter(self.users.items()))
            args += ["--user", name, "--pass", password, "--no-auth-warning"]
        return args

    def client(self, **kwargs: Any) -> redis.Redis:
        """A sync ``redis.Redis`` connected to this server; close it (or use ``with``). It does
        not retry (redis-py's default retries a refused connection with back-off, which turns
        every "refused" assertion into seconds); pass ``retry=`` to change that."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        options = self.connection_kwargs(
            username=kwargs.pop("username", None), password=kwargs.pop("password", None)
        )
        options.setdefault("socket_timeout", 10)
        options.setdefault("socket_connect_timeout", 5)
        options.setdefault("retry", Retry(NoBackoff(), 0))
        options.update(kwargs)
        return redis.Redis(**options)

    # -- life cycle

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.running:
            raise RedisServerError(f"redis-server on {self.url} is already running")
        for attempt in range(3):
            try:
                return self._start_once(timeout_s)
            except _PortTaken:
                if self._port_given or attempt == 2:
                    raise RedisServerError(f"port {self.port} is taken:\n{self.log()}") from None
                self._port = None  # a free port picked by another test meanwhile: pick again
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> RedisServer:
        import redis

        self.directory.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text("\n".join(self.config_lines()) + "\n")
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*self.command_prefix, "redis-server", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.directory,
            )
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process.wait()
                text = self.log()[log_offset:]
                if "Address already in use" in text:
                    raise _PortTaken()
                raise RedisServerError(
                    f"redis-server exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                with self.client(socket_timeout=2, socket_connect_timeout=1) as probe:
                    if probe.ping():
                        return self
            except (redis.RedisError, OSError) as error:
                last_error = error
            time.sleep(0.05)
        self.kill()
        raise RedisServerError(
            f"redis-server on {self.url} did not answer PING in {timeout_s} s"
            f" ({last_error!r}):\n{self.log()}"
        )

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (redis shuts down cleanly, flushing the AOF) and wait; returns its status."""
        if self.process is None:
            return None
        try:
            return terminate(self.process, timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RedisServerError(
                f"redis-server did not stop in {timeout_s} s:\n{self.log()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL: the crash case. Whatever was acknowledged with ``persistence`` is on disk."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait()

    def restart(self, *, kill: bool = False, timeout_s: float = 10.0) -> RedisServer:
        """Stop (or kill) and start again on the same port with the same data directory."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()

    def __repr__(self) -> str:
        where = f" in netns {self.netns}" if self.netns else ""
        return f"<RedisServer {self.url}{where} running={self.running}>"


class _PortTaken(Exception):
    pass


# -- a cluster ---------------------------------------------------------------------------------


class RedisCluster:
    """``masters`` cluster-mode servers in ``directory/node<i>``, joined with ``redis-cli --cluster
    create`` (no replicas); :meth:`start` returns once every node says ``cluster_state:ok``."""

    def __init__(
        self,
        directory: Path,
        masters: int = 3,
        *,
        host: str = "127.0.0.1",
        tls: TlsFiles | None = None,
        users: dict[str, str] | None = None,
        persistence: bool = True,
        netns: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.nodes = [
            RedisServer(
                self.directory / f"node{index}",
                host=host,
                tls=tls,
                users=users,
                persistence=persistence,
                cluster=True,
                netns=netns,
            )
            for index in range(masters)
        ]

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(node.host, node.port) for node in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        require_redis_cli()
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start()
            first = self.nodes[0]
            create = subprocess.run(
                [
                    *first.command_prefix,
                    "redis-cli",
                    *first.cli_args(),
                    "--cluster",
                    "create",
                    *(f"{host}:{port}" for host, port in self.startup_nodes),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
                stdin=subprocess.DEVNULL,
            )
            if create.returncode != 0:
                raise RedisServerError(
                    f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}"
                )
            self._wait_ok(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, deadline: float) -> None:
        import redis

        pending = list(self.nodes)
        info = ""
        while pending and time.monotonic() < deadline:
            node = pending[0]
            try:
                with node.client() as client:
                    state = client.execute_command("CLUSTER INFO")  # parsed into a dict
                info = repr(state)
                if state.get("cluster_state") == "ok":
                    pending.pop(0)
                    continue
            except redis.RedisError as error:
                info = repr(error)
            time.sleep(0.05)
        if pending:
            raise RedisServerError(f"cluster not ok on {pending[0].url}: {info}")

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A sync ``redis.cluster.RedisCluster`` over every node; close it (or use ``with``)."""
        from redis.cluster import ClusterNode
        from redis.cluster import RedisCluster as ClusterClient

        options = self.nodes[0].connection_kwargs()
        options.pop("host")
        options.pop("port")
        options.setdefault("socket_timeout", 10)
        options.setdefault("socket_connect_timeout", 5)
        options.update(kwargs)
        nodes = [
            ClusterNode(host, port)  # type: ignore[no-untyped-call]
            for host, port in self.startup_nodes
        ]
        return ClusterClient(startup_nodes=nodes, **options)

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(RedisServerError):
                node.stop()
            node.kill()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
