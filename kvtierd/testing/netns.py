"""Several "hosts" on one machine for multi-host tests: Linux network namespaces, or loopback.

Topology of a :class:`NetnsLab` with K hosts::

    root namespace                                   namespace kvt<pid>l<n>h<i>
    bridge kvb<pidhex>l<n>  10.X.Y.1/24  --+-- veth kvv<pidhex>l<n>h<i> <==> eth0  10.X.Y.(10+i)/24
                                            +-- ...                              lo up

The bridge lives in the root namespace and has an address there. The alternative, a bridge in a
namespace of the lab's own, would isolate the root namespace from the hosts, but then nothing in the
test process (redis-py assertions against the pool, ``RedisServer.start``'s PING) could reach a
server in a host without going through ``ip netns exec`` child processes. With the bridge in root,
the test process reaches every host at its address, while traffic between two hosts still leaves
one namespace through its ``eth0``, crosses the veth pair and the bridge, and enters the other: real
interfaces, with their own counters (:meth:`NetnsHost.link_stats`), which can be taken down
(:meth:`NetnsHost.disconnect`) to cut a host off. Isolation is per namespace: a host has no route
beyond its /24 and its own loopback; a server bound to a host's 127.0.0.1 is invisible to the
others and to the root namespace.

The /24 is picked in 10.200.0.0-10.249.255.0 so that it overlaps no address or route of the root
namespace, under a file lock, so that concurrent test runs never pick the same one. Names carry
the pid of the test process; :func:`cleanup_leftovers` (run once per process, when the first lab
opens) removes namespaces and bridges whose process is gone: what a crashed earlier run left.

:class:`LoopbackLab` has the same interface with every host at 127.0.0.1 and no command prefix:
the issue's fallback when namespaces cannot be created here (:func:`netns_available` says why).
:func:`open_lab` picks one; ``KVTIERD_TEST_NO_NETNS=1`` forces loopback.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtierd.testing import skip

if TYPE_CHECKING:
    from kvtierd.testing import DaemonProcess
    from kvtierd.testing.redis_server import RedisServer

__all__ = [
    "LoopbackHost",
    "LoopbackLab",
    "NetnsHost",
    "NetnsLab",
    "cleanup_leftovers",
    "netns_available",
    "open_lab",
    "pid_alive",
    "require_netns",
]

log = logging.getLogger(__name__)

NO_NETNS_ENV = "KVTIERD_TEST_NO_NETNS"
_LOCK_PATH = Path("/tmp/kvtierd-test-netns.lock")
_NETNS_RE = re.compile(r"^kvt(\d+)l\d+h\d+$")
_BRIDGE_RE = re.compile(r"^kvb([0-9a-f]+)l\d+$")
_VETH_RE = re.compile(r"^kvv([0-9a-f]+)l\d+h\d+$")
_lab_serial = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- availability ------------------------------------------------------------------------------


@functools.cache
def _probe_netns() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    name = f"kvt{os.getpid()}l9999h0"
    veth = f"kvv{os.getpid():x}l9999h0"
    try:
        created = _ip("netns", "add", name, check=False)
        if created.returncode != 0:
            return f"cannot create a network namespace: {created.stderr.strip()}"
        pair = _ip(
            "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name, check=False
        )
        if pair.returncode != 0:
            return f"cannot create a veth pair: {pair.stderr.strip()}"
        inside = subprocess.run(
            ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=30,
        )
        if inside.returncode != 0:
            return f"cannot run a command in a network namespace: {inside.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as error:
        return f"cannot create network namespaces: {error}"
    finally:
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", name, check=False)


def netns_available() -> str | None:
    """None when network namespaces and veth pairs can be created here (tried once per process),
    else why not (also when ``KVTIERD_TEST_NO_NETNS=1``)."""
    if os.environ.get(NO_NETNS_ENV, "") not in ("", "0"):
        return f"{NO_NETNS_ENV}={os.environ[NO_NETNS_ENV]} asks for loopback"
    return _probe_netns()


def require_netns() -> None:
    reason = netns_available()
    if reason is not None:
        skip(f"network namespaces unavailable: {reason}")


# -- leftovers ---------------------------------------------------------------------------------


def cleanup_leftovers() -> list[str]:
    """Delete lab namespaces, veth pairs and bridges whose test process is gone; returns them."""
    removed: list[str] = []
    # Root ends of veth pairs first: a deleted namespace frees its end only later, asynchronously.
    links = json.loads(_ip("-j", "link", "show", check=False).stdout or "[]")
    for pattern in (_VETH_RE, _BRIDGE_RE):
        for link in links:
            name = link.get("ifname", "").split("@")[0]
            match = pattern.match(name)
            dead = match is not None and not pid_alive(int(match.group(1), 16))
            if dead and _ip("link", "del", name, check=False).returncode == 0:
                removed.append(name)
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NETNS_RE.match(name)
        if match and not pid_alive(int(match.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                # A process left in a dead run's namespace is that run's orphan.
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    if removed:
        log.warning("removed leftovers of earlier test runs: %s", ", ".join(removed))
    return removed


@functools.cache
def _cleanup_once() -> None:
    cleanup_leftovers()


# -- hosts -------------------------------------------------------------------------------------


class _HostBase:
    name: str
    address: str
    index: int
    directory: Path

    @property
    def netns(self) -> str | None:
        return None

    @property
    def command_prefix(self) -> list[str]:
        return []

    def command(self, argv: Sequence[str]) -> list[str]:
        return [*self.command_prefix, *argv]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` on this host (stdin from /dev/null unless given; a 60 s timeout)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(argv), **kwargs)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` on this host; the caller waits for it (a lab kills leftovers)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.command(argv), **kwargs)

    def redis_server(self, directory: Path | None = None, **kwargs: Any) -> RedisServer:
        """A (not yet started) :class:`RedisServer` on this host's address, in its namespace."""
        from kvtierd.testing.redis_server import RedisServer

        return RedisServer(
            directory if directory is not None else self.directory / "redis",
            host=self.address,
            netns=self.netns,
            **kwargs,
        )

    def daemon(self, directory: Path | None = None, **kwargs: Any) -> DaemonProcess:
        """A (not yet started) kvtierd :class:`DaemonProcess` running on this host."""
        from kvtierd.testing import DaemonProcess

        return DaemonProcess(
            directory if directory is not None else self.directory / "kvtierd",
            command_prefix=self.command_prefix,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.address}>"


class NetnsHost(_HostBase):
    """A host in a network namespace: ``eth0`` at ``address`` on the lab's bridge, and ``lo``."""

    def __init__(self, name: str, address: str, index: int, directory: Path, veth: str) -> None:
        self.name = name
        self.address = address
        self.index = index
        self.directory = directory
        self.veth = veth  # the root-namespace end of the pair

    @property
    def netns(self) -> str:
        return self.name

    @property
    def command_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def link_stats(self) -> dict[str, int]:
        """Counters of this host's ``eth0`` (``rx_bytes``, ``tx_bytes``, ``rx_packets``, ...)."""
        shown = json.loads(_ip("-n", self.name, "-s", "-j", "link", "show", "dev", "eth0").stdout)
        stats = shown[0]["stats64"]
        return {
            f"{way}_{key}": int(value) for way in ("rx", "tx") for key, value in stats[way].items()
        }

    def disconnect(self) -> None:
        """Cut this host off the lab (its link goes down; connections time out, nothing resets)."""
        _ip("link", "set", "dev", self.veth, "down")

    def reconnect(self) -> None:
        _ip("link", "set", "dev", self.veth, "up")

    def pids(self) -> list[int]:
        """Processes running in this namespace."""
        return [int(pid) for pid in _ip("netns", "pids", self.name, check=False).stdout.split()]


class LoopbackHost(_HostBase):
    """A "host" that is the test machine itself at 127.0.0.1; no isolation, no link to cut."""

    def __init__(self, name: str, index: int, directory: Path) -> None:
        self.name = name
        self.address = "127.0.0.1"
        self.index = index
        self.directory = directory

    def link_stats(self) -> dict[str, int]:
        skip("a loopback lab has no per-host interface")

    def disconnect(self) -> None:
        skip("a loopback lab cannot cut a host off: needs network namespaces")

    def reconnect(self) -> None:
        skip("a loopback lab cannot cut a host off: needs network namespaces")


# -- labs --------------------------------------------------------------------------------------


def _used_networks() -> list[ipaddress.IPv4Network]:
    used: list[ipaddress.IPv4Network] = []
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast", "unreachable", "blackhole", "prohibit", "multicast"):
            first = line.split()[1]
        if first == "default":
            continue
        with contextlib.suppress(ValueError):
            used.append(ipaddress.IPv4Network(first, strict=False))
    return used


def _pick_subnet(seed: str) -> ipaddress.IPv4Network:
    used = _used_networks()
    start = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "big")
    for step in range(50 * 256):
        value = (start + step) % (50 * 256)
        candidate = ipaddress.IPv4Network(f"10.{200 + value // 256}.{value % 256}.0/24")
        if not any(candidate.overlaps(network) for network in used):
            return candidate
    raise RuntimeError("no free /24 in 10.200.0.0/16-10.249.255.0/24 for a test lab")


@contextlib.contextmanager
def _allocation_lock() -> Iterator[None]:
    with open(_LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class NetnsLab:
    """``hosts`` network namespaces on a bridge in the root namespace; see the module docstring.

    Always close it (``with`` or :meth:`close`): it deletes the namespaces, the veth pairs and the
    bridge, and kills whatever still runs in its namespaces, even after a failed set-up.
    """

    kind = "netns"

    def __init__(self, directory: Path, hosts: int = 3) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError("a lab has 1 to 200 hosts")
        _cleanup_once()
        self.directory = Path(directory)
        self.reason: str | None = None
        pid = os.getpid()
        serial = next(_lab_serial)
        self.bridge = f"kvb{pid:x}l{serial}"
        self.hosts: list[NetnsHost] = []
        self._closed = False
        try:
            with _allocation_lock():
                self.subnet = _pick_subnet(f"{pid}/{serial}")
                addresses = list(self.subnet.hosts())
                self.gateway = str(addresses[0])
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
                _ip("link", "set", self.bridge, "up")
            for index in range(hosts):
                name = f"kvt{pid}l{serial}h{index}"
                veth = f"kvv{pid:x}l{serial}h{index}"
                if len(veth) > 15 or len(self.bridge) > 15:
                    raise RuntimeError(f"interface name too long: {veth}")
                host = NetnsHost(
                    name, str(addresses[9 + index]), index, self.directory / f"h{index}", veth
                )
                _ip("netns", "add", name)
                self.hosts.append(host)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                _ip(
                    "-n",
                    name,
                    "addr",
                    "add",
                    f"{host.address}/{self.subnet.prefixlen}",
                    "dev",
                    "eth0",
                )
                _ip("-n", name, "link", "set", "eth0", "up")
                host.directory.mkdir(parents=True, exist_ok=True)
        except BaseException:
            self.close()
            raise
        log.info(
            "netns lab %s: bridge %s %s, hosts %s",
            self.directory,
            self.bridge,
            self.subnet,
            ", ".join(f"{host.name}={host.address}" for host in self.hosts),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            leftovers = [pid for pid in host.pids() if pid != os.getpid()]
            if leftovers:
                log.warning("killing processes left in %s: %s", host.name, leftovers)
                for pid in leftovers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        for host in self.hosts:
            _ip("link", "del", host.veth, check=False)
            _ip("netns", "del", host.name, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> NetnsLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<NetnsLab {self.subnet} {[host.address for host in self.hosts]}>"


class LoopbackLab:
    """The same interface as :class:`NetnsLab`, every host at 127.0.0.1 in the root namespace."""

    kind = "loopback"

    def __init__(self, directory: Path, hosts: int = 3, *, reason: str | None = None) -> None:
        self.directory = Path(directory)
        self.reason = reason
        self.gateway = "127.0.0.1"
        self.hosts: list[LoopbackHost] = []
        for index in range(hosts):
            host = LoopbackHost(f"h{index}", index, self.directory / f"h{index}")
            host.directory.mkdir(parents=True, exist_ok=True)
            self.hosts.append(host)

    def close(self) -> None:
        pass

    def __enter__(self) -> LoopbackLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<LoopbackLab {len(self.hosts)} hosts ({self.reason})>"


def open_lab(directory: Path, hosts: int = 3) -> NetnsLab | LoopbackLab:
    """A :class:`NetnsLab` when namespaces work here, else a :class:`LoopbackLab` (logged, and
    its ``reason`` says why); ``KVTIERD_TEST_NO_NETNS=1`` forces loopback."""
    reason = netns_available()
    if reason is None:
        return NetnsLab(directory, hosts)
    log.warning("network namespaces unavailable (%s): the lab runs over loopback", reason)
    return LoopbackLab(directory, hosts, reason=reason)
