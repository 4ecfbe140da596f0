"""A tenant's NIXL peer reaches its own region and nothing else, whatever it does with its
metadata (issue 31, item 3; ``docs/nixl.md``, "What a NIXL peer can reach").

The attack: a client of tenant ``alpha`` widens the registration inside its NIXL_GRANT metadata
(its own NIXL checks forged descriptors against that metadata, nothing on the daemon's side
checks anything over UCX) and READs addresses around its region: its own bytes, the next
16 MiB (tenant ``beta``'s region, in the arena), 64 MiB below it, and an unmapped address, in
that order (:mod:`kvtierd.testing.nixl_reader`, case ``widen``). Against a daemon whose own process
exported the arena, the second probe brought ``beta``'s blocks and the unmapped one killed the
daemon (SIGSEGV). Now each region is exported by a process of its own that maps that region and
nothing else: the attacker gets its own bytes or errors, never a byte of ``beta``'s; the daemon
serves on, ``beta``'s blocks are unchanged and its reader pulls them at once; ``alpha``'s
exporter, if the attack killed it, is restarted and ``alpha``'s reads work again.

Run twice: ``local`` (the reader on the daemon's host, through the Unix socket, UCX choosing
its transports: ``cma`` between two processes of one host) and ``netns`` (the reader on another
"host", a network namespace on a veth pair, over TCP with TLS and ``UCX_TLS=tcp``, as
``test_remote_reads.py`` sets up).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtierd.client import Client, connect
from kvtierd.errors import CorruptBlockError
from kvtierd.nixl.probe import NixlVerdict
from kvtierd.testing import DaemonProcess, free_port
from kvtierd.testing.netns import open_lab
from kvtierd.testing.nixl_reader import TWO_TENANTS, block_content, block_keys
from tests.nixl.children import Child
from tests.nixl.test_remote_reads import _certificates

pytestmark = pytest.mark.timeout(600)

BLOCK = 1 << 20
COUNT = 4
REGION = 16 << 20
#: ``[name, offset from alpha's region base, length]``, pulled in this order.
PROBES = [
    ["own", 0, REGION],
    ["after", REGION, REGION],
    ["below", -(64 << 20), 64 << 20],
    ["unmapped", 0, 4096],
]
#: A variable of the daemon's environment that its exporters must not inherit.
SECRET = "KVTIERD_TEST_SECRET"
#: How many times a test tries a read while an exporter restarts (each try waits a second).
RESTART_TRIES = 60


@dataclass
class Placement:
    """A daemon, and how a reader of tenant ``alpha`` or ``beta`` reaches it."""

    name: str
    daemon: DaemonProcess
    url: str
    prefix: list[str]
    env: dict[str, str]
    tls: Path | None = None

    def reader(self, ns: str, case: str, tenant: str, **env: str) -> Child:
        args = [self.url, tenant, ns, str(BLOCK), str(COUNT), case]
        extra = dict(self.env, **env)
        if self.tls is not None:
            extra["KVTIERD_TEST_TLS"] = str(self.tls / ("engine-a" if tenant == "alpha"
                                                        else "engine-b"))  # fmt: skip
        return Child(*args, module="kvtierd.testing.nixl_reader", prefix=self.prefix, env=extra)


def _config(remote: str = "") -> str:
    return f'[dram]\nsize = "40M"\n\n[nixl]\nenabled = true\n{remote}{TWO_TENANTS}'


@contextlib.contextmanager
def _local(directory: Path) -> Iterator[Placement]:
    daemon = DaemonProcess(directory, dram_size=None, config_text=_config()).start(120)
    try:
        yield Placement("local", daemon, str(daemon.socket), [], {})
    finally:
        daemon.kill()


@contextlib.contextmanager
def _netns(directory: Path) -> Iterator[Placement]:
    with open_lab(directory / "lab", hosts=2) as lab:
        server, reader = lab.hosts
        tls = directory / "tls"
        tls.mkdir()
        _certificates(tls, server.address)
        port = free_port()
        remote = f"""
[remote]
listen = "{server.address}:{port}"
cert_file = "{tls / "server.pem"}"
key_file = "{tls / "server.pem"}"
ca_file = "{tls / "ca.pem"}"
clients = [{{name = "engine-a", uid = 2001}}, {{name = "engine-b", uid = 2002}}]
"""
        daemon = DaemonProcess(
            directory,
            dram_size=None,
            config_text=_config(remote),
            command_prefix=server.command_prefix,
        ).start(120)
        try:
            yield Placement(
                "netns",
                daemon,
                f"tls://{server.address}:{port}",
                reader.command_prefix,
                {"UCX_TLS": "tcp"},
                tls,
            )
        finally:
            daemon.kill()


@pytest.fixture(scope="module", params=["local", "netns"])
def placement(
    request: pytest.FixtureRequest,
    nixl_verdict: NixlVerdict,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Placement]:
    if not nixl_verdict.ok:
        pytest.skip(f"NIXL failed its probe: {nixl_verdict.detail}")
    directory = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRET, "the daemon's secret")  # in the daemon's environment only
        with (_local if request.param == "local" else _netns)(directory) as made:
            yield made


@pytest.fixture
def client(placement: Placement) -> Iterator[Client]:
    with connect(placement.daemon.socket) as c:
        yield c


def _store(client: Client, name: str, tenant: str) -> list[bytes]:
    """``COUNT`` blocks in namespace ``name`` of ``tenant``; their contents."""
    ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
    blocks = [block_content(name, i, BLOCK).tobytes() for i in range(COUNT)]
    ns.put(block_keys(name, COUNT), blocks)
    return blocks


def _finish(child: Child) -> dict[str, object]:
    result = child.result()
    child.finish()
    return result


def _samples(blocks: list[bytes]) -> list[bytes]:
    """64-byte pieces of every block, every 64 KiB: random bytes, found nowhere else."""
    return [b[i : i + 64] for b in blocks for i in range(0, len(b), 64 << 10)]


def _pull_eventually(placement: Placement, ns: str, tenant: str) -> dict[str, object]:
    """A ``pull``, tried again while it fails (an exporter restarting answers EAGAIN)."""
    for _ in range(RESTART_TRIES):
        result = _finish(placement.reader(ns, "pull", tenant))
        if result["error"] == "":
            return result
        time.sleep(1)
    return result


def test_a_widened_grant_reaches_its_own_region_only(
    placement: Placement, client: Client, tmp_path: Path
) -> None:
    tag = placement.name
    alpha = _store(client, f"alpha-{tag}", "alpha")
    beta = _store(client, f"beta-{tag}", "beta")
    out = tmp_path / "probes"
    out.mkdir()
    attacker = placement.reader(
        f"alpha-{tag}", "widen", "alpha",
        KVTIERD_TEST_PROBES=json.dumps(PROBES), KVTIERD_TEST_OUT=str(out),
    )  # fmt: skip
    result = _finish(attacker)
    assert result["error"] == "", result
    probes = result["probes"]
    assert isinstance(probes, dict)
    # Its own bytes, or an error (a transport may refuse): never another tenant's.
    own = (out / "own.bin").read_bytes()
    assert probes["own"] != "" or all(block in own for block in alpha)
    stolen = [
        name
        for name, _, _ in PROBES
        if any(s in (out / f"{name}.bin").read_bytes() for s in _samples(beta))
    ]
    assert stolen == [], f"probes {stolen} brought tenant beta's bytes ({probes})"
    # The daemon serves on, and beta's blocks are intact and pulled at once (its exporter is
    # not alpha's).
    assert placement.daemon.running, placement.daemon.log()[-3000:]
    with connect(placement.daemon.socket) as fresh:
        ns = fresh.namespace(f"beta-{tag}", block_bytes=BLOCK, tenant="beta", create=False)
        with ns.get(block_keys(f"beta-{tag}", COUNT)) as views:
            assert [bytes(v[:BLOCK]) for v in views] == beta
    theirs = _finish(placement.reader(f"beta-{tag}", "pull", "beta"))
    assert theirs["error"] == ""
    assert theirs["sha256"] == [hashlib.sha256(b).hexdigest() for b in beta]
    # alpha's exporter, if the attack killed it, is back.
    mine = _pull_eventually(placement, f"alpha-{tag}", "alpha")
    assert (mine["error"], mine["sha256"]) == ("", [hashlib.sha256(b).hexdigest() for b in alpha])


def _exporters(daemon: DaemonProcess) -> dict[str, int]:
    """The daemon's exporter children: tenant (``default``) -> pid."""
    assert daemon.process is not None
    found = {}
    for pid in _children(daemon.process.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"kvtierd.nixl.exporter" in argv:
            found[argv[argv.index(b"--tenant") + 1].decode()] = pid
    return found


def _children(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def _mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_nixl_runs_only_in_one_exporter_per_region(placement: Placement, client: Client) -> None:
    """The daemon loads no NIXL (no UCX, no agent); each exporter maps its own region's memory
    file and no other tenant's, and has none of the daemon's environment but UCX's, NIXL's and
    the interpreter's."""
    _store(client, f"mapped-{placement.name}", "alpha")
    _finish(placement.reader(f"mapped-{placement.name}", "pull", "alpha"))
    assert placement.daemon.process is not None
    daemon_maps = _mapped(placement.daemon.process.pid)
    assert "libnixl" not in daemon_maps
    assert "libucp" not in daemon_maps
    exporters = _exporters(placement.daemon)
    assert set(exporters) == {"alpha", "beta", "default"}
    for tenant, pid in exporters.items():
        regions = {
            line.split()[-2] if line.endswith("(deleted)") else line.split()[-1]
            for line in _mapped(pid).splitlines()
            if "memfd:kvtierd-" in line
        }
        assert regions == {f"/memfd:kvtierd-{tenant}"}, (tenant, regions)
        assert "libucp" in _mapped(pid)
        assert SECRET.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    assert SECRET.encode() in Path(f"/proc/{placement.daemon.process.pid}/environ").read_bytes()


def test_a_killed_exporter_is_restarted(placement: Placement, client: Client) -> None:
    tag = f"killed-{placement.name}"
    alpha = _store(client, tag, "alpha")
    before = _exporters(placement.daemon)
    os.kill(before["alpha"], signal.SIGKILL)
    result = _pull_eventually(placement, tag, "alpha")
    expected = [hashlib.sha256(b).hexdigest() for b in alpha]
    assert (result["error"], result["sha256"]) == ("", expected)
    after = _exporters(placement.daemon)
    assert after["alpha"] != before["alpha"]
    assert after["beta"] == before["beta"]  # the other tenants' exporters were not touched
    assert "NIXL exporter of region" in placement.daemon.log()


def test_a_nixl_write_with_the_honest_grant_changes_no_byte(
    placement: Placement, client: Client
) -> None:
    """A client of ``alpha`` (read-only by design) NIXL WRITEs over its whole region with its
    honest grant: over its own committed blocks and over a slot allocated and filled by an
    engine of its tenant but not yet committed. The exporter maps the region read-only, so the
    WRITE fails (``cma``: the kernel refuses the write) or faults the exporter (TCP: it is
    restarted); the committed blocks read back exactly, the slot commits exactly the engine's
    bytes, and the daemon serves on. Before the region was mapped read-only the poison was
    committed, FSYNCed and served."""
    tag = f"overwrite-{placement.name}"
    alpha = _store(client, tag, "alpha")
    before = _exporters(placement.daemon)
    attacker = placement.reader(tag, "overwrite", "alpha",
                                KVTIERD_TEST_WRITE_BYTES=str(REGION))  # fmt: skip
    attacker.line_starting('{"leased"')
    ns = client.namespace(tag, block_bytes=BLOCK, tenant="alpha", create=False)
    fresh = block_keys(f"{tag}-fresh", 1)
    engine = block_content(f"{tag}-fresh", 0, BLOCK).tobytes()
    with ns.write(fresh) as slots:
        (view,) = slots.views
        assert view is not None
        view[:BLOCK] = engine
        attacker.send("write")  # between the engine's fill and its COMMIT
        result = _finish(attacker)
    assert result["error"] == "", result
    assert placement.daemon.running, placement.daemon.log()[-3000:]
    client.fsync()
    got: list[bytes | str] = []
    for key in block_keys(tag, COUNT) + fresh:
        try:
            with ns.get([key]) as (view,):
                got.append(bytes(view[:BLOCK]))
        except CorruptBlockError as exc:  # poisoned after its COMMIT
            got.append(str(exc))
    poisoned = [i for i, (g, w) in enumerate(zip(got, [*alpha, engine], strict=True)) if g != w]
    assert poisoned == [], f"the WRITE ({result['write']}) changed blocks {poisoned}"
    restarted = _exporters(placement.daemon).get("alpha") != before["alpha"]
    assert result["write"] != "DONE" or restarted, result
    mine = _pull_eventually(placement, tag, "alpha")
    assert (mine["error"], mine["sha256"]) == ("", [hashlib.sha256(b).hexdigest() for b in alpha])


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def test_exporters_run_unprivileged_undumpable_and_with_no_inherited_descriptor(
    placement: Placement, client: Client
) -> None:
    """The daemon runs as root here: each exporter, whose memory NIXL peers can reach, runs as
    ``nobody`` (``nixl.exporter_user``) with no supplementary groups, no new privileges and not
    dumpable (``/proc/PID/mem`` then belongs to root, not to its uid), and holds none of the
    daemon's descriptors but its region's and landing buffer's memory files, its control
    socket, ``/dev/null`` and the pipe of its stderr."""
    assert placement.daemon.process is not None
    assert os.stat(f"/proc/{placement.daemon.process.pid}").st_uid == 0
    _store(client, f"confined-{placement.name}", "alpha")
    _finish(placement.reader(f"confined-{placement.name}", "pull", "alpha"))
    exporters = _exporters(placement.daemon)
    daemon_fds = {
        os.readlink(fd)
        for fd in Path(f"/proc/{placement.daemon.process.pid}/fd").iterdir()
        if os.readlink(fd).startswith("/")
    }
    for tenant, pid in exporters.items():
        for task in Path(f"/proc/{pid}/task").iterdir():  # every thread (UCX makes some)
            status = _status(int(task.name))
            assert status["Uid"].split() == ["65534"] * 4, (tenant, task.name, status["Uid"])
            assert status["Gid"].split() == ["65534"] * 4, (tenant, task.name, status["Gid"])
            assert status["Groups"].strip() == "", (tenant, status["Groups"])
            assert status["NoNewPrivs"].strip() == "1", (tenant, task.name)
        assert os.stat(f"/proc/{pid}/mem").st_uid == 0  # not dumpable
        opened = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        files = {name for name in opened if name.startswith("/") and name != "/dev/null"}
        files = {name.removesuffix(" (deleted)") for name in files}
        assert {f"/memfd:kvtierd-{tenant}", f"/memfd:nixl-landing-{tenant}"} <= files, files
        # Nothing else the daemon has open (its log, data files, sockets' paths).
        leaked = {
            name
            for name in files & {n.removesuffix(" (deleted)") for n in daemon_fds}
            if not name.startswith("/memfd:")
        }
        assert leaked == set(), (tenant, leaked)
