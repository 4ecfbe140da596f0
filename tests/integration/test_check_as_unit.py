"""``kvtierd --check --as-unit`` judges the start the unit will make, through the real command
line and the real start-up checks: as the unit's user, what the unit gives (its directories,
``LimitMEMLOCK=``, ``LimitNOFILE=``) is not a failure or a fallback, and what the unit forbids
(``ProtectSystem=strict``, ``MemoryMax=``) still fails.

The unit runs as ``nobody``, with directories of its own names under the real ``/run`` and
``/var/lib``, which no test creates (the checks only look at them). This interpreter may live
where ``nobody`` cannot read (``/root/.pyenv``), so the child process makes a first, plain check
as root to import everything a check imports, then becomes ``nobody`` (``--as-unit`` does that
itself); its probe processes cannot start as ``nobody`` then, so the configuration turns
io_uring off and ``KVTIERD_COPYHASH_MODULE`` the copy module, whose lines are not asserted.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import resource
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "kvtierd.service"

_CHILD = r"""
import contextlib, io, json, os, sys
from kvtierd.cli import daemon

spec = json.loads(sys.argv[1])
with contextlib.redirect_stdout(io.StringIO()):
    daemon.main(spec["warm"])  # imports what a check imports, while this interpreter is readable
if spec["become"]:
    uid, gid = spec["become"]
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
sys.exit(daemon.main(spec["argv"]))
"""


class Scene:
    """A unit running as ``nobody`` and a directory ``nobody`` can read."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.name = f"kvtierd-test-{uuid.uuid4().hex[:12]}"
        self.run_dir, self.state_dir = Path("/run") / self.name, Path("/var/lib") / self.name
        entry = pwd.getpwnam("nobody")
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self.group = grp.getgrgid(self.gid).gr_name
        self.config = work / "kvtierd.toml"
        self.config.write_text('[nvme]\nio_backend = "threads"\n')
        self.config.chmod(0o644)
        self.unit = work / "kvtierd.service"
        self.unit.write_text(self.unit_text())

    def unit_text(self, **changes: str) -> str:
        """The shipped unit, as ``nobody`` with this scene's directories and ``changes``."""
        values = {
            "User": "nobody",
            "Group": self.group,
            "RuntimeDirectory": self.name,
            "StateDirectory": self.name,
            "ExecStart": f"{shutil.which('true')} --config {self.config}",
            **changes,
        }
        lines = []
        for line in UNIT.read_text().splitlines():
            key = line.partition("=")[0]
            lines.append(f"{key}={values[key]}" if key in values else line)
        return "\n".join(lines) + "\n"

    def drop_in(self, name: str, text: str) -> None:
        directory = self.work / "kvtierd.service.d"
        directory.mkdir(exist_ok=True)
        (directory / name).write_text(f"[Service]\n{text}")

    def check(
        self, *args: str, as_unit: bool = True, become: bool = False
    ) -> tuple[int, dict[str, str]]:
        """``kvtierd --check`` with ``args``: its exit status and its lines by subject."""
        sizes = ["--config", str(self.config), "--dram-size", "32M", "--nvme-size", "128M"]
        scratch = ["--socket", str(self.work / "warm.sock"), "--data-dir", str(self.work / "w")]
        argv = ["--check", *sizes, *args] + (["--as-unit", str(self.unit)] if as_unit else [])
        spec = {
            "warm": ["--check", *sizes, *scratch],
            "become": [self.uid, self.gid] if become else None,
            "argv": argv,
        }
        env = dict(os.environ, PYTHONPATH=str(ROOT), KVTIERD_COPYHASH_MODULE="")
        env.pop("KVTIERD_SOCKET", None)
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=self.work,
        )
        assert "Traceback" not in done.stderr, done.stderr
        lines = done.stdout.splitlines()
        assert lines[-1:] != [], done.stderr
        assert lines[-1].startswith("kvtierd would"), done.stdout + done.stderr
        return done.returncode, {line.split()[1]: line for line in lines[:-1]}


@pytest.fixture
def scene() -> Iterator[Scene]:
    if os.geteuid() != 0:
        pytest.skip("becoming the unit's user takes root")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("there is no user nobody here")
    work = Path(tempfile.mkdtemp(prefix="kvtierd-as-unit-", dir="/var/tmp"))
    work.chmod(0o755)  # nobody reads the unit and the configuration here
    made = Scene(work)
    try:
        yield made
        assert not made.run_dir.exists()  # looked at, never made
        assert not made.state_dir.exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_as_the_service_user_a_shell_lacks_what_the_unit_gives(scene: Scene) -> None:
    """The symptom: run as the service user from a shell, the start looks impossible."""
    status, lines = scene.check(
        "--socket", str(scene.run_dir / "kvtierd.sock"), "--data-dir", str(scene.state_dir),
        as_unit=False, become=True,
    )  # fmt: skip
    assert status == 1
    assert lines["socket"].startswith("fail      socket    --socket ")
    assert lines["socket"].endswith(": /run is not writable by nobody")
    assert lines["data_dir"].endswith(": /var/lib is not writable by nobody")
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if soft != resource.RLIM_INFINITY and soft < 34 << 20:  # as here: 8 MiB
        assert lines["mlock"].startswith("fallback  mlock     RLIMIT_MEMLOCK is ")


def test_as_unit_judges_what_the_unit_gives(scene: Scene) -> None:
    status, lines = scene.check()
    assert status == 0, lines
    assert lines["unit"] == (
        f"ok        unit      {scene.unit}: as nobody:{scene.group}; "
        f"ExecStart={shutil.which('true')} --config {scene.config}; {scene.run_dir} "
        "(RuntimeDirectory=) and "
        f"{scene.state_dir} (StateDirectory=) made at start; LimitMEMLOCK=infinity; "
        "LimitNOFILE=65536"
    )
    # The unit's environment names the socket and the data directory, made at start.
    socket = scene.run_dir / "kvtierd.sock"
    assert lines["socket"] == (
        f"ok        socket    {socket} ({len(str(socket))} of 107 bytes), directory given to "
        f"nobody at start (RuntimeDirectory={scene.name})"
    )
    assert lines["data_dir"].startswith(
        f"ok        data_dir  {scene.state_dir} is given to nobody at start "
        f"(StateDirectory={scene.name}), "
    )
    assert lines["nvme"].startswith(f"ok        nvme      {scene.state_dir}/nvme.data: 128 MiB")
    assert lines["mlock"] == (
        "ok        mlock     RLIMIT_MEMLOCK unlimited (LimitMEMLOCK= of the unit) holds the "
        "34 MiB arena"
    )
    assert lines["nofile"].endswith("within RLIMIT_NOFILE 65536 (LimitNOFILE= of the unit)")
    # The flags that name the same places are judged the same way.
    status, flagged = scene.check(
        "--socket", str(socket), "--data-dir", str(scene.state_dir)
    )  # fmt: skip
    assert status == 0
    assert flagged["socket"].endswith(f"given to nobody at start (RuntimeDirectory={scene.name})")


def test_what_the_unit_forbids_still_fails(scene: Scene) -> None:
    data = scene.work / "data"
    data.mkdir()
    os.chown(data, scene.uid, scene.gid)  # writable by nobody: only the sandbox forbids it
    scene.drop_in("10-site.conf", "PrivateTmp=no\nMemoryMax=16M\n")
    status, lines = scene.check("--data-dir", str(data))
    assert status == 1
    assert lines["data_dir"] == (
        f"fail      data_dir  --data-dir {data}: {data} is not writable in the unit: "
        "ProtectSystem=strict makes it read-only (add ReadWritePaths= in a drop-in)"
    )
    assert lines["memory"].startswith("fail      memory    --dram-size = 32 MiB needs a ")
    assert lines["memory"].endswith("(MemoryMax= of the unit): lower --dram-size or free memory")
    # A later drop-in opens the directory and clears the limit: the start would go ahead.
    scene.drop_in("20-site.conf", f"ReadWritePaths={scene.work}\nMemoryMax=\n")
    status, lines = scene.check("--data-dir", str(data))
    assert status == 0, lines
    assert lines["data_dir"].startswith(f"ok        data_dir  {data} is writable, ")
    assert "10-site.conf" in lines["unit"]
    assert "20-site.conf" in lines["unit"]


@pytest.mark.parametrize(
    ("changes", "become", "line"),
    [
        (
            {"User": "kvtierd-no-such-user", "Group": ""},
            False,
            "User=kvtierd-no-such-user does not exist (systemd-sysusers makes it)",
        ),
        (
            {"User": "daemon", "Group": ""},
            True,
            "run it as root or as daemon, not as nobody: the checks judge the rights of the "
            "user the unit runs as",
        ),
    ],
)
def test_the_unit_line_fails_without_its_user(
    scene: Scene, changes: dict[str, str], become: bool, line: str
) -> None:
    scene.unit.write_text(scene.unit_text(**changes))
    status, lines = scene.check(become=become)
    assert status == 1
    assert lines == {"unit": f"fail      unit      {line}"}  # nothing judged as the wrong user


def test_the_unit_line_fails_without_its_program(scene: Scene) -> None:
    missing = scene.work / "venv" / "bin" / "kvtierd"
    scene.unit.write_text(scene.unit_text(ExecStart=f"{missing} --config {scene.config}"))
    status, lines = scene.check()
    assert status == 1
    assert lines["unit"] == (
        f"fail      unit      ExecStart= program {missing} is not an executable file"
    )
    assert lines["socket"].startswith("ok")  # the other checks still ran


def test_the_units_own_arguments_are_judged_not_the_shells(scene: Scene) -> None:
    """The configuration ``ExecStart=`` names is the one the start reads: a check given another
    judges the unit's and says so; words kvtierd would refuse fail the unit line."""
    other = scene.work / "unit.toml"
    other.write_text('[nvme]\nio_backend = "threads"\n')
    other.chmod(0o644)
    true = shutil.which("true")
    scene.unit.write_text(scene.unit_text(ExecStart=f"{true} --config {other} --log-level info"))
    status, lines = scene.check()
    assert status == 0, lines
    assert lines["config"] == f"ok        config    valid: {other}"
    assert lines["unit"].endswith(
        f"(judged with ExecStart='s --config {other}, not {scene.config} as given to --check)"
    )
    scene.unit.write_text(scene.unit_text(ExecStart=f"{true} --config {other} --colour red"))
    status, lines = scene.check()
    assert status != 0
    assert lines["unit"].startswith("fail")
    assert "does not start with: --colour red" in lines["unit"]
