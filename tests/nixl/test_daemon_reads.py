"""NIXL reads through a real daemon (``nixl.enabled``): NIXL_GRANT and READ_NIXL, and the
client's :class:`~kvtierd.client.nixl.NixlReader`, in real processes.

The daemon runs as a process of its own and loads NIXL after its probe; every reader is a child
(:mod:`kvtierd.testing.nixl_reader`), since a process that loaded NIXL must end through
``os._exit``. The pytest process stores the blocks through the ordinary client and never loads NIXL.
Two tenants (``alpha``: uid 2001, ``beta``: uid 2002) share the daemon, whose socket any uid may
open.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.client import Client, Namespace, connect, ops
from kvtierd.errors import NotSupportedError
from kvtierd.nixl.probe import NixlVerdict
from kvtierd.testing import DaemonProcess
from kvtierd.testing.nixl_reader import TWO_TENANTS, block_content, block_keys
from tests.nixl.children import Child
from tests.support.uids import reachable_directory, require_root

pytestmark = pytest.mark.timeout(300)

ALPHA, BETA = 2001, 2002
BLOCK = 1 << 20
COUNT = 4
CONFIG = (
    """
[daemon]
socket_mode = "0666"

[dram]
size = "40M"

[nixl]
enabled = true
"""
    + TWO_TENANTS
)


@pytest.fixture(scope="module")
def daemon(nixl_verdict: NixlVerdict) -> Iterator[DaemonProcess]:
    if not nixl_verdict.ok:
        pytest.skip(f"NIXL failed its probe: {nixl_verdict.detail}")
    with reachable_directory() as directory:
        process = DaemonProcess(directory, dram_size=None, config_text=CONFIG).start(120)
        try:
            yield process
        finally:
            process.kill()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with connect(daemon.socket) as c:
        yield c


def _store(client: Client, name: str, tenant: str = "alpha") -> tuple[Namespace, list[str]]:
    """``COUNT`` blocks in namespace ``name`` of ``tenant``; their SHA-256s."""
    ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
    blocks = [block_content(name, i, BLOCK) for i in range(COUNT)]
    ns.put(block_keys(name, COUNT), blocks)
    return ns, [hashlib.sha256(b).hexdigest() for b in blocks]


def _reader(daemon: DaemonProcess, name: str, case: str, tenant: str = "alpha",
            uid: int | None = None) -> Child:  # fmt: skip
    args = [str(daemon.socket), tenant, name, str(BLOCK), str(COUNT), case]
    uids = [str(uid)] if uid is not None else []
    return Child(*args, *uids, module="kvtierd.testing.nixl_reader")


def _finish(child: Child) -> dict[str, object]:
    """The reader's last line; it must exit 0 (no 139)."""
    result = child.result()
    child.finish()
    return result


def test_a_pull_is_byte_exact(daemon: DaemonProcess, client: Client) -> None:
    _, expected = _store(client, "pull")
    result = _finish(_reader(daemon, "pull", "pull"))
    assert result["error"] == ""
    assert result["sha256"] == expected


def test_a_tenants_client_is_granted_its_own_region_only(
    daemon: DaemonProcess, client: Client
) -> None:
    require_root()
    alpha, _ = _store(client, "mine", "alpha")
    _, expected = _store(client, "theirs", "beta")
    grant = _finish(_reader(daemon, "theirs", "grant", "beta", uid=BETA))
    assert grant["error"] == ""
    assert grant["region"] == grant["handle_region"] != alpha.handle.region
    pulled = _finish(_reader(daemon, "theirs", "pull", "beta", uid=BETA))
    assert (pulled["error"], pulled["sha256"]) == ("", expected)
    refused = _finish(_reader(daemon, "mine", "pull", "alpha", uid=BETA))
    assert str(refused["error"]).startswith("AccessDeniedError")


def test_a_lease_released_mid_transfer_never_yields_the_bytes(
    daemon: DaemonProcess, client: Client
) -> None:
    """The descriptors of a released lease still work (NIXL does not revoke) and, once the
    slots hold other blocks, bring those blocks' bytes; the reader's check refuses them."""
    ns, expected = _store(client, "released")
    reader = _reader(daemon, "released", "released")
    reader.line_starting('{"leased"')
    keys = block_keys("released", COUNT)
    ns.forget(keys)  # the slots are free: new blocks take them
    others = [block_content("others", i, BLOCK) for i in range(2 * COUNT)]
    ns.put(block_keys("others", 2 * COUNT), others)
    reader.send("go")
    result = _finish(reader)
    assert str(result["error"]).startswith("InvalidRequestError")
    assert "released during its pull" in str(result["error"])
    assert result["stale_sha256"] != expected  # what a pull without the check would have used


def test_a_held_lease_keeps_its_blocks_through_eviction(
    daemon: DaemonProcess, client: Client
) -> None:
    ns, expected = _store(client, "held")
    reader = _reader(daemon, "held", "held")
    reader.line_starting('{"leased"')
    client.evict()  # every namespace's DRAM: leased blocks stay
    ns.put(block_keys("pressure", 12), [block_content("pressure", i, BLOCK) for i in range(12)])
    reader.send("go")
    result = _finish(reader)
    assert (result["error"], result["sha256"]) == ("", expected)


def test_a_block_scribbled_by_its_tenant_is_a_miss(daemon: DaemonProcess, client: Client) -> None:
    _store(client, "scribble")
    result = _finish(_reader(daemon, "scribble", "scribble"))
    assert str(result["error"]).startswith("CorruptBlockError")


def test_the_daemon_survives_a_reader_killed_mid_transfer(
    daemon: DaemonProcess, client: Client
) -> None:
    _, expected = _store(client, "killed")
    looping = _reader(daemon, "killed", "loop")
    looping.line_starting('{"pulled": 2')
    looping.kill()
    result = _finish(_reader(daemon, "killed", "pull"))
    assert (result["error"], result["sha256"]) == ("", expected)
    assert client.stats()["leases"] == 0  # the killed reader's leases ended with it


def test_a_daemon_that_loaded_nixl_stops_with_status_0(
    nixl_verdict: NixlVerdict, tmp_path: Path
) -> None:
    if not nixl_verdict.ok:
        pytest.skip(f"NIXL failed its probe: {nixl_verdict.detail}")
    process = DaemonProcess(tmp_path, config_text="[nixl]\nenabled = true\n").start(120)
    assert "exported by an exporter process each" in process.log()
    assert process.process is not None
    exporters = _children(process.process.pid)
    assert exporters
    assert process.stop() == 0, process.log()[-2000:]
    assert not [pid for pid in exporters if _running(pid)]  # killed with it


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_the_exporters_end_with_a_killed_daemon(nixl_verdict: NixlVerdict, tmp_path: Path) -> None:
    """kill -9 of the daemon closes its end of every control socket: each exporter sees it and
    exits (none is left serving its region with nobody to supervise it)."""
    if not nixl_verdict.ok:
        pytest.skip(f"NIXL failed its probe: {nixl_verdict.detail}")
    process = DaemonProcess(tmp_path, config_text="[nixl]\nenabled = true\n").start(120)
    assert process.process is not None
    exporters = _children(process.process.pid)
    assert exporters
    process.kill()
    for _ in range(600):  # a bound on the wait, not a timing assertion
        if not any(_running(pid) for pid in exporters):
            break
        time.sleep(0.1)
    assert not [pid for pid in exporters if _running(pid)]


def test_without_nixl_enabled_read_nixl_is_not_supported(tmp_path: Path) -> None:
    """Needs no NIXL: the daemon answers EOPNOTSUPP with the reason."""
    with DaemonProcess(tmp_path) as process, connect(process.socket) as c:
        ns = c.namespace("off", block_bytes=4096)
        ns.put([b"k" * 16], [bytes(4096)])
        with pytest.raises(NotSupportedError, match=r"nixl\.enabled is false"):
            ns._run(lambda: ops.read_nixl(ns.handle.ns, [b"k" * 16], c.max_keys))
        with pytest.raises(NotSupportedError, match=r"nixl\.enabled is false"):
            ns._run(lambda: ops.nixl_grant(ns.handle.ns))
        assert ns.lookup([b"k" * 16]) == 1  # the refused READ_NIXL leased nothing it kept


def test_a_failed_probe_leaves_the_daemon_serving_without_nixl(
    nixl_verdict: NixlVerdict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCX_TLS", "posix,sysv")  # shared memory only: NIXL's UCX cannot start
    with DaemonProcess(tmp_path, config_text="[nixl]\nenabled = true\n") as process:
        with connect(process.socket) as c:
            ns = c.namespace("probe", block_bytes=4096)
            with pytest.raises(NotSupportedError, match="NIXL failed its probe"):
                ns._run(lambda: ops.nixl_grant(ns.handle.ns))
        assert "NIXL reads are off" in process.log()
        assert process.stop() == 0


def _children(pid: int) -> list[int]:
    """Process ``pid``'s children (the daemon's: its NIXL exporters)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` and of its children (all their threads),
    from ``/proc``: the daemon and its NIXL exporters."""
    total = 0.0
    for one in [pid, *_children(pid)]:
        with contextlib.suppress(FileNotFoundError):
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def test_an_idle_nixl_daemon_does_not_spin(daemon: DaemonProcess, client: Client) -> None:
    """NIXL's progress thread busy-waits a whole core for as long as an agent lives; the
    daemon's exporters drive progress themselves only while peers may read
    (``kvtierd.nixl.exporter``). Once every lease is released and the linger is over, the
    daemon and its exporters together use next to no CPU."""
    from kvtierd.nixl.export import LINGER_S

    _store(client, "idle")
    _finish(_reader(daemon, "idle", "pull"))
    assert daemon.process is not None
    pid = daemon.process.pid

    def share_of_a_core(seconds: float) -> float:
        cpu, started = _cpu_seconds(pid), time.monotonic()
        time.sleep(seconds)
        return (_cpu_seconds(pid) - cpu) / (time.monotonic() - started)

    lingering = share_of_a_core(2)  # within LINGER_S of the lease: the pump runs
    assert lingering < 0.5, f"the exporters' progress pumps used {lingering:.0%} of a core"
    time.sleep(LINGER_S)
    idle = share_of_a_core(3)
    assert idle < 0.3, f"an idle daemon used {idle:.0%} of a core"
