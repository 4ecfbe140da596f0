"""The files under ``systemd/``: the unit passes ``systemd-analyze verify`` without a single
warning, the example configuration is exactly the defaults, the sysusers.d and tmpfiles.d
snippets apply to a scratch root, and the daemon really runs inside the unit's sandbox.

systemd is not PID 1 in CI, so the sandbox is emulated as closely as the kernel allows: the
same system-call allow-list (computed with ``systemd-analyze syscall-filter`` from the unit's
``SystemCallFilter=`` lines, refused calls failing with ``EPERM`` as ``SystemCallErrorNumber=``
says), socket families restricted as ``RestrictAddressFamilies=`` says, ``PR_SET_MDWE`` for
``MemoryDenyWriteExecute=``, ``NoNewPrivileges=``, no capabilities and ``LimitMEMLOCK=infinity``.
The tests need the ``systemd`` package (``systemd-analyze``, ``systemd-sysusers``,
``systemd-tmpfiles``); each one that lacks a tool says so in its skip reason.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from kvtierd.config import Config, default_data_dir, default_socket_path, load_config
from kvtierd.server.fdstore import MAX_STORED
from kvtierd.testing import free_port, wait_until_serving
from tests.support.systemd_root import give_systemd

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "systemd"
UNIT = SYSTEMD / "kvtierd.service"
EXAMPLE = SYSTEMD / "kvtierd.toml"
SOCKET_UNIT = SYSTEMD / "kvtierd.socket"
SYSUSERS = SYSTEMD / "sysusers.d" / "kvtierd.conf"
VENV_DROP_IN = SYSTEMD / "kvtierd.service.d" / "venv.conf"
INSTALL = SYSTEMD / "install.sh"
TMPFILES = SYSTEMD / "tmpfiles.d" / "kvtierd.conf"
CONFIG_DOC = ROOT / "docs" / "configuration.md"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package 'systemd')")
    return path


def _directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment of a unit file, in order."""
    section, out = "", []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def _unit_values(key: str) -> list[str]:
    return [v for _, k, v in _directives(UNIT.read_text()) if k == key]


def _unit_value(key: str) -> str:
    values = _unit_values(key)
    assert len(values) == 1, f"{key}= set {len(values)} times"
    return values[0]


def _entry_point() -> str:
    """The installed ``kvtierd`` for this interpreter (verify needs an existing ExecStart)."""
    beside = Path(sys.executable).parent / "kvtierd"
    found = str(beside) if beside.is_file() else shutil.which("kvtierd")
    if found is None:
        pytest.skip("the kvtierd entry point is not installed (pip install -e .)")
    return found


def _verify(unit_text: str, tmp_path: Path) -> tuple[int, list[str]]:
    """Run ``systemd-analyze verify`` on a copy of the unit; its return code and every line of
    output that concerns the unit (verify exits 0 even for unknown keys, so lines decide)."""
    analyze = _tool("systemd-analyze")
    unit = tmp_path / "kvtierd.service"
    unit.write_text(unit_text)
    shutil.copy(SOCKET_UNIT, tmp_path / "kvtierd.socket")  # Requires= it
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    return proc.returncode, [line for line in lines if "kvtierd" in line]


def _with_exec_start(text: str, binary: str) -> str:
    """The unit with its relative ``ExecStart=kvtierd`` resolved to ``binary``."""
    new, count = re.subn(r"(?m)^ExecStart=kvtierd ", f"ExecStart={binary} ", text)
    assert count == 1, "the unit's ExecStart= should start with the relative name kvtierd"
    return new


# -- the unit ---------------------------------------------------------------------------------


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    code, complaints = _verify(_with_exec_start(UNIT.read_text(), _entry_point()), tmp_path)
    assert complaints == []
    assert code == 0


def test_verify_check_is_not_vacuous(tmp_path: Path) -> None:
    """A bad key and a bad value are reported: the check above would see them."""
    text = _with_exec_start(UNIT.read_text(), _entry_point())
    text = text.replace("UMask=0007", "UMask=0007\nNoSuchKey=1\nWatchdogSec=soon")
    _, complaints = _verify(text, tmp_path)
    assert any("NoSuchKey" in line for line in complaints)
    assert any("soon" in line or "sec value" in line for line in complaints)


def _scratch_root(tmp_path: Path, *, kvtierd_at: str | None, drop_in: str = "") -> Path:
    """A root for ``systemd-analyze verify --root=``: systemd's own units, the unit as installed
    (``/etc/systemd/system``, with ``drop_in`` as ``venv.conf``), and a copy of the
    installed entry point at ``kvtierd_at`` (verify only checks that it is executable there)."""
    root = tmp_path / "root"
    give_systemd(root)
    system = root / "etc/systemd/system"
    system.mkdir(parents=True)
    shutil.copy(UNIT, system / "kvtierd.service")
    shutil.copy(SOCKET_UNIT, system / "kvtierd.socket")
    if drop_in:
        (system / "kvtierd.service.d").mkdir()
        (system / "kvtierd.service.d" / "venv.conf").write_text(drop_in)
    if kvtierd_at is not None:
        binary = root / kvtierd_at.lstrip("/")
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_entry_point(), binary)
        binary.chmod(0o755)
    return root


def _verify_installed(root: Path) -> list[str]:
    analyze = _tool("systemd-analyze")
    proc = subprocess.run(
        [analyze, "verify", "--man=no", f"--root={root}", "kvtierd.service"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
    )
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line]
    assert (proc.returncode == 0) == (lines == []), lines
    return lines


@pytest.mark.parametrize("directory", ["/usr/local/bin", "/usr/bin"])
def test_exec_start_finds_kvtierd_in_systemds_search_path(tmp_path: Path, directory: str) -> None:
    """The shipped unit, unchanged, as docs/operations.md "Install" says: its relative
    ``ExecStart=kvtierd`` is found where ``pip install`` as root or a package puts it."""
    assert _verify_installed(_scratch_root(tmp_path, kvtierd_at=f"{directory}/kvtierd")) == []


def test_exec_start_elsewhere_needs_the_shipped_drop_in(tmp_path: Path) -> None:
    venv = "/opt/kvtierd/venv/bin/kvtierd"
    missing = _verify_installed(_scratch_root(tmp_path / "bare", kvtierd_at=venv))
    assert missing == [
        "kvtierd.service: Command kvtierd is not executable: No such file or directory"
    ]
    drop_in = VENV_DROP_IN.read_text()
    assert (
        _verify_installed(_scratch_root(tmp_path / "venv", kvtierd_at=venv, drop_in=drop_in)) == []
    )
    # the drop-in docs/operations.md shows, line for line
    settings = "".join(f"   {line}\n" for line in drop_in.splitlines() if line[:1] != "#")
    assert f"   ```ini\n{settings}   ```" in _install_section_text()


def _install_section_text() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    return text[text.index("## Install") : text.index("### What the unit does")]


def test_unit_sandbox_exposure_stays_low(tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze")
    unit = tmp_path / "kvtierd.service"
    unit.write_text(_with_exec_start(UNIT.read_text(), _entry_point()))
    proc = subprocess.run(
        [analyze, "security", "--offline=yes", "--threshold=25", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "Unknown option" in proc.stderr or "unrecognized option" in proc.stderr:
        pytest.skip("this systemd-analyze has no offline security analysis (systemd < 250)")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


def test_unit_matches_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the unit promises agrees with what the daemon does."""
    assert _unit_value("Type") == "notify"
    assert _unit_value("NotifyAccess") == "main"
    assert _unit_value("LimitMEMLOCK") == "infinity"
    assert _unit_value("ExecStart") == "kvtierd --config /etc/kvtierd/kvtierd.toml"
    assert _unit_value("RestartPreventExitStatus") == "2"  # kvtierd: 2 = invalid configuration
    # The stop timeout covers the drain grace plus the write-back flush and the snapshot.
    grace = Config().daemon.shutdown_grace_s
    assert _seconds(_unit_value("TimeoutStopSec")) >= 2 * grace + 30
    assert 0 < _seconds(_unit_value("WatchdogSec")) <= 60
    # Long start-ups extend the start timeout themselves (EXTEND_TIMEOUT_USEC), so the
    # timeout stays short, and a failing daemon does not restart forever.
    assert _seconds(_unit_value("TimeoutStartSec")) <= 120
    assert _unit_value("StartLimitBurst").isdigit()
    assert _seconds(_unit_value("StartLimitIntervalSec")) >= 60
    docs = _unit_values("Documentation")
    assert docs
    for doc in docs:  # each names a file of docs/ that the install steps copy there
        assert doc.startswith("file:/usr/share/doc/kvtierd/"), doc
        assert (ROOT / "docs" / Path(doc).name).is_file(), doc
    assert 'install -D -m644 -t "$R/usr/share/doc/kvtierd" "$src"/docs/*.md' in INSTALL.read_text()
    # The daemon finds its socket and data where the unit's directories are.
    monkeypatch.delenv("KVTIERD_SOCKET", raising=False)
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/" + _unit_value("RuntimeDirectory"))
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/" + _unit_value("StateDirectory"))
    assert default_socket_path() == Path("/run/kvtierd/kvtierd.sock")
    assert default_data_dir() == Path("/var/lib/kvtierd")
    # The user the unit runs as is the one sysusers.d creates.
    user = _unit_value("User")
    assert _unit_value("Group") == user
    assert re.search(rf"(?m)^u\s+{user}\s", SYSUSERS.read_text())
    # io_uring survives the system-call filter, and a refused call is an error, not a kill.
    assert {"io_uring_setup", "io_uring_enter", "io_uring_register"} <= set(
        _unit_values("SystemCallFilter")[0].split()
    )
    assert _unit_value("SystemCallErrorNumber") == "EPERM"
    # Room in the file-descriptor store for every region and the DRAM image.
    assert int(_unit_value("FileDescriptorStoreMax")) >= MAX_STORED


def _seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 1e-3}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert match, f"unexpected time span {value!r}"
    assert match[2] in units, f"unexpected time unit in {value!r}"
    return float(match[1]) * units[match[2]]


# -- the example configuration and its reference --------------------------------------------


def _fields() -> list[tuple[str, str]]:
    """(section, field) for every scalar setting of :class:`Config`."""
    out = []
    for section in ("daemon", "dram", "nvme", "pool", "nixl", "remote", "limits"):
        struct = getattr(Config(), section)
        out += [(section, name) for name in struct.__struct_fields__]
    return out


def test_example_config_is_exactly_the_defaults() -> None:
    assert load_config(EXAMPLE) == Config()


def test_example_config_lists_every_field() -> None:
    text = EXAMPLE.read_text()
    sections = re.split(r"(?m)^\[(\w+)\]$", text)
    body = dict(zip(sections[1::2], sections[2::2], strict=True))
    missing = [
        f"{section}.{name}"
        for section, name in _fields()
        if not re.search(rf"(?m)^{name} = ", body.get(section, ""))
    ]
    assert missing == []
    assert "# [[tenants]]" in text


def test_example_tenants_block_loads_when_uncommented(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    tenants = text[text.index("# [[tenants]]") :]
    uncommented = "\n".join(line.removeprefix("# ") for line in tenants.splitlines())
    path = tmp_path / "kvtierd.toml"
    path.write_text(uncommented)
    config = load_config(path)
    assert [t.name for t in config.tenants] == ["team-a", "team-b"]


def test_configuration_reference_documents_every_field() -> None:
    text = CONFIG_DOC.read_text()
    missing = [f"{s}.{n}" for s, n in _fields() if f"`{s}.{n}`" not in text]
    assert missing == []
    for name in (
        "tenants.name",
        "tenants.uids",
        "tenants.gids",
        "tenants.dram_size",
        "tenants.dram_share",
    ):
        assert f"`{name}`" in text


def test_documented_defaults_match_the_code() -> None:
    """Each row ``| `section.field` | type | `default` | ...`` names the real default."""
    text = CONFIG_DOC.read_text()
    for section, name in _fields():
        row = re.search(rf"(?m)^\| `{section}\.{name}` \|[^|]*\| `([^`]*)` \|", text)
        assert row, f"no table row for {section}.{name}"
        documented = load_config(None, {section: {name: _toml_value(row[1])}})
        expected = getattr(getattr(Config(), section), name)
        assert getattr(getattr(documented, section), name) == expected, f"{section}.{name}"


def _toml_value(text: str) -> object:
    import tomllib

    return tomllib.loads(f"v = {text}")["v"]


# -- sysusers.d and tmpfiles.d -------------------------------------------------------------


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_sysusers_and_tmpfiles_apply_to_a_scratch_root(tmp_path: Path) -> None:
    sysusers = _tool("systemd-sysusers")
    if os.geteuid() != 0:
        proc = subprocess.run(
            [sysusers, "--dry-run", str(SYSUSERS)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        pytest.skip("applying tmpfiles.d to a scratch root needs root (ownership changes)")
    tmpfiles = _tool("systemd-tmpfiles")
    (tmp_path / "etc").mkdir()
    proc = _run([sysusers, f"--root={tmp_path}", str(SYSUSERS)])
    assert proc.returncode == 0, proc.stderr
    assert "kvtierd" in proc.stderr + proc.stdout
    passwd = (tmp_path / "etc" / "passwd").read_text()
    group = (tmp_path / "etc" / "group").read_text()
    entry = next(line for line in passwd.splitlines() if line.startswith("kvtierd:"))
    _, _, uid, gid, _, home, shell = entry.split(":")
    assert int(uid) < 1000
    assert home == "/var/lib/kvtierd"
    assert shell.endswith("nologin")
    assert re.search(rf"(?m)^kvtierd:x:{gid}:", group)

    proc = _run([tmpfiles, f"--root={tmp_path}", "--create", str(TMPFILES)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    etc, state = (tmp_path / "etc" / "kvtierd").stat(), (tmp_path / "var/lib/kvtierd").stat()
    assert (stat.S_IMODE(etc.st_mode), etc.st_uid, etc.st_gid) == (0o750, 0, int(gid))
    assert (stat.S_IMODE(state.st_mode), state.st_uid, state.st_gid) == (0o700, int(uid), int(gid))
    # StateDirectory= in the unit creates the same directory with the same mode.
    assert _unit_value("StateDirectoryMode") == "0700"


# -- the daemon inside the unit's sandbox ---------------------------------------------------

_LAUNCHER = r"""
import ctypes, ctypes.util, errno, json, os, resource, sys

spec = json.loads(sys.argv[1])
hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
if spec["uid"] is not None:
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
else:  # stay uid 0, but with no capability (CapabilityBoundingSet=) except those kept
    for cap in range(64):
        if cap not in spec["keep_caps"]:
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    print("sandbox: PR_SET_MDWE unavailable, W^X not enforced", file=sys.stderr)

class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

sc = ctypes.CDLL(ctypes.util.find_library("seccomp"))
sc.seccomp_init.restype = ctypes.c_void_p
sc.seccomp_init.argtypes = [ctypes.c_uint32]
sc.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                      ctypes.c_uint, ctypes.c_void_p]
sc.seccomp_load.argtypes = [ctypes.c_void_p]
sc.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
ALLOW = 0x7FFF0000
ctx = sc.seccomp_init(0x00050000 | errno.EPERM)  # SCMP_ACT_ERRNO(EPERM)
for name in spec["allow"]:
    nr = sc.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0 and name != "socket":
        sc.seccomp_rule_add_array(ctx, ALLOW, nr, 0, None)
socket_nr = sc.seccomp_syscall_resolve_name(b"socket")
for family in spec["families"]:
    cmp = ArgCmp(0, 4, family, 0)  # SCMP_CMP_EQ on the first argument
    assert sc.seccomp_rule_add_array(ctx, ALLOW, socket_nr, 1, ctypes.byref(cmp)) == 0
assert sc.seccomp_load(ctx) == 0
os.execv(spec["argv"][0], spec["argv"])
"""

_ALWAYS_ALLOWED = {"execve", "exit", "exit_group", "getrlimit", "rt_sigreturn", "sigreturn"}


def _expand(analyze: str, name: str, cache: dict[str, set[str]]) -> set[str]:
    if not name.startswith("@"):
        return {name}
    if name not in cache:
        out = subprocess.run(
            [analyze, "syscall-filter", "--no-pager", name],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        items = [line.strip() for line in out.splitlines()[1:]]
        cache[name] = set()
        for item in items:
            if item and not item.startswith("#"):
                cache[name] |= _expand(analyze, item, cache)
    return cache[name]


def _unit_syscall_allow_list(analyze: str) -> set[str]:
    """What the unit's ``SystemCallFilter=`` lines allow, applied in order as systemd does."""
    lines = _unit_values("SystemCallFilter")
    assert lines, "the unit has no SystemCallFilter="
    assert not lines[0].startswith("~"), "the first filter line must be an allow-list"
    cache: dict[str, set[str]] = {}
    allowed: set[str] = set(_ALWAYS_ALLOWED)
    for line in lines:
        deny = line.startswith("~")
        names = set().union(*(_expand(analyze, n, cache) for n in line.lstrip("~").split()))
        allowed = allowed - names if deny else allowed | names
    return allowed


def _reachable_by_others(path: Path) -> bool:
    """Whether an unprivileged user can execute ``path`` (every parent searchable)."""
    path = path.resolve()
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents])


def test_daemon_serves_inside_the_unit_sandbox() -> None:
    """Start, mlock, io_uring with fixed buffers, write-back, FSYNC, reads from NVMe, SIGTERM
    and the snapshot: all under the unit's system-call filter, W^X memory, no capabilities."""
    analyze = _tool("systemd-analyze")
    if os.geteuid() != 0:
        pytest.skip("emulating the unit's sandbox needs root (rlimits, identity)")
    if ctypes.util.find_library("seccomp") is None:
        pytest.skip("libseccomp is not installed (Debian package libseccomp2)")
    families = [1, 2, 10]  # AF_UNIX AF_INET AF_INET6, as RestrictAddressFamilies= says
    assert _unit_value("RestrictAddressFamilies").split() == ["AF_UNIX", "AF_INET", "AF_INET6"]
    work = Path(tempfile.mkdtemp(prefix="kvtierd-sandbox-", dir="/tmp"))
    uid = gid = None
    keep_caps = []
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[1] != resource.RLIM_INFINITY:
        # This machine cannot grant LimitMEMLOCK=infinity (it takes CAP_SYS_RESOURCE): keep
        # CAP_IPC_LOCK instead, which is exactly the right to ignore that limit.
        keep_caps = [14]
    elif _reachable_by_others(Path(sys.executable)) and _reachable_by_others(ROOT / "kvtierd"):
        uid = gid = 65534  # nobody, like a system user without privileges
        os.chown(work, uid, gid)
    sock = work / "kvtierd.sock"
    port = free_port()
    config = work / "kvtierd.toml"
    config.write_text(f'[daemon]\nmetrics_port = {port}\nmetrics_address = "localhost"\n')
    argv = [sys.executable, "-m", "kvtierd", "--config", str(config), "--socket", str(sock),
            "--data-dir", str(work / "data"), "--dram-size", "16M",
            "--nvme-size", "64M"]  # fmt: skip
    spec = {
        "uid": uid,
        "gid": gid,
        "keep_caps": keep_caps,
        "allow": sorted(_unit_syscall_allow_list(analyze)),
        "families": families,
        "argv": argv,
    }
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    log = work / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, json.dumps(spec)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
    try:
        wait_until_serving(sock, proc, log)
        _exercise(sock)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"kvtierd_requests_total" in reply.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        text = log.read_text()
        assert "io backend: io_uring" in text, text
        assert "mlock=True" in text, text
        assert "stopped cleanly" in text, text
        assert " WARNING " not in text, text
        assert " ERROR " not in text, text
        assert (work / "data" / "index.snapshot").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def _exercise(sock: Path) -> None:
    """Write blocks, make them durable, drop them from DRAM and read them back from NVMe."""
    from kvtierd.client import connect

    block = 256 << 10
    payloads = [bytes([i]) * block for i in range(32)]
    keys = [i.to_bytes(16, "little") for i in range(len(payloads))]
    with connect(str(sock)) as client:
        ns = client.namespace("sandbox", block_bytes=block)
        ns.put(keys, payloads)
        assert client.fsync() >= len(keys)
        assert client.evict() >= len(keys)
        assert ns.lookup(keys) == len(keys)
        with ns.get(keys) as views:
            assert [bytes(v) for v in views] == payloads
        stats = client.stats()
        assert stats["io_backend"] == "io_uring"
        assert stats["promotions"] >= len(keys), stats


def test_the_socket_unit_passes_verify_and_listens_where_the_daemon_serves(
    tmp_path: Path,
) -> None:
    """kvtierd.socket's ListenStream= is the socket the unit's daemon serves
    ($RUNTIME_DIRECTORY/kvtierd.sock, RuntimeDirectory=kvtierd, which the service keeps across
    its stop), with the daemon's mode; systemd-analyze finds nothing to say of it."""
    text = SOCKET_UNIT.read_text()
    assert re.search(r"(?m)^ListenStream=/run/kvtierd/kvtierd\.sock$", text)
    assert re.search(r"(?m)^SocketMode=0660$", text)
    assert _unit_value("RuntimeDirectory") == "kvtierd"
    assert _unit_value("RuntimeDirectoryPreserve") == "yes"
    assert _unit_value("Requires") == "kvtierd.socket"
    _verify(_with_exec_start(UNIT.read_text(), _entry_point()), tmp_path)  # places the socket
    analyze = _tool("systemd-analyze")
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(tmp_path / "kvtierd.socket")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
    )
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if "kvtierd" in line]
    assert complaints == []
