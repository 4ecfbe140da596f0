"""``systemd/install.sh``, run against a scratch root, makes what docs/operations.md "Install"
says, and the documented block is exactly the script and the steps it prints.

The script runs as the docs say, with ``--root`` and the pip options that keep it offline: a
scratch root cannot reach a package index, so its environment is made beforehand with this
interpreter's site packages (``--system-site-packages``), and pip builds kvtierd from a copy of
this checkout with ``--no-index --no-build-isolation`` (pip builds in the source tree, which must
stay clean). Then the files, their modes and owners, the user and group that
``systemd-sysusers --root`` made, the directories that ``systemd-tmpfiles --root`` made, and
``systemd-analyze verify --root`` of the unit with its drop-in are checked; a second run, an
upgrade, keeps the configuration. The machine needs no running systemd: the three tools work
on a root directory. Needs root (the script makes root-owned files and chowns them).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.systemd_root import give_systemd

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "systemd" / "install.sh"
OPERATIONS = ROOT / "docs" / "operations.md"
VENV = "/opt/kvtierd/venv"
#: What the script installs from, copied: pip builds in the source tree.
SOURCES = ("kvtierd", "systemd", "docs", "pyproject.toml", "setup.py", "setup.cfg", "README.md")


@dataclass(frozen=True)
class Installed:
    root: Path
    source: Path
    stdout: str


def _needs(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (Debian package 'systemd')")
    return path


def _install(source: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        ["sh", str(source / "systemd" / "install.sh"), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    if os.geteuid() != 0:
        pytest.skip("the install makes a system user and root-owned files: it needs root")
    for tool in ("systemd-sysusers", "systemd-tmpfiles"):
        _needs(tool)
    missing = [m for m in ("setuptools", "cffi") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"building kvtierd offline needs {', '.join(missing)} in this interpreter")
    base = tmp_path_factory.mktemp("install")
    source, root = base / "src", base / "root"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build", "*.c")
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    root.mkdir()
    venv = root / VENV.lstrip("/")
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    done = _install(source, root, "--", "--no-index", "--no-build-isolation")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Installed(root, source, done.stdout)


def _ids(root: Path) -> tuple[int, int]:
    """The uid and gid of kvtierd in ``root``'s /etc/passwd."""
    entry = next(
        line for line in (root / "etc/passwd").read_text().splitlines()
        if line.startswith("kvtierd:")
    )  # fmt: skip
    _, _, uid, gid, *_ = entry.split(":")
    return int(uid), int(gid)


def _owned(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def test_the_script_is_posix_sh_and_clean() -> None:
    assert subprocess.run(["sh", "-n", str(SCRIPT)], timeout=30).returncode == 0
    commands = [line.split("#")[0] for line in SCRIPT.read_text().splitlines()]
    assert not [c for c in commands if re.search(r"\bsudo\b", c)]  # minimal Debian has none
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (Debian package 'shellcheck')")
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


def test_the_user_and_group_come_from_sysusers(installed: Installed) -> None:
    uid, gid = _ids(installed.root)
    passwd = (installed.root / "etc/passwd").read_text()
    assert re.search(rf"(?m)^kvtierd:x:{uid}:{gid}:[^:]*:/var/lib/kvtierd:/usr/sbin/nologin$",
                     passwd)  # fmt: skip
    assert uid < 1000  # a system user
    assert re.search(rf"(?m)^kvtierd:x:{gid}:$", (installed.root / "etc/group").read_text())


def test_files_and_directories_in_place(installed: Installed) -> None:
    root, source = installed.root, installed.source
    uid, gid = _ids(root)
    files = {
        "etc/systemd/system/kvtierd.service": source / "systemd/kvtierd.service",
        "etc/sysusers.d/kvtierd.conf": source / "systemd/sysusers.d/kvtierd.conf",
        "etc/tmpfiles.d/kvtierd.conf": source / "systemd/tmpfiles.d/kvtierd.conf",
        "usr/share/doc/kvtierd/operations.md": source / "docs/operations.md",
    }
    for path, origin in files.items():
        assert _owned(root / path) == (0o644, 0, 0), path
        assert (root / path).read_bytes() == origin.read_bytes(), path
    # tmpfiles.d, after sysusers.d: the directories belong to the new user and group.
    assert _owned(root / "etc/kvtierd") == (0o750, 0, gid)
    assert _owned(root / "var/lib/kvtierd") == (0o700, uid, gid)
    config = root / "etc/kvtierd/kvtierd.toml"
    assert _owned(config) == (0o640, 0, gid)
    assert config.read_bytes() == (source / "systemd/kvtierd.toml").read_bytes()
    # Every file the unit's Documentation= names is there.
    unit = (root / "etc/systemd/system/kvtierd.service").read_text()
    for doc in re.findall(r"(?m)^Documentation=file:(\S+)$", unit):
        assert (root / doc.lstrip("/")).is_file(), doc


def test_the_drop_in_runs_kvtierd_from_the_environment(installed: Installed) -> None:
    drop_in = installed.root / "etc/systemd/system/kvtierd.service.d/venv.conf"
    assert _owned(drop_in) == (0o644, 0, 0)
    lines = [line for line in drop_in.read_text().splitlines() if line and line[0] != "#"]
    assert lines == [
        "[Service]",
        "ExecStart=",
        f"ExecStart={VENV}/bin/kvtierd --config /etc/kvtierd/kvtierd.toml",
    ]
    # pip put a working entry point there (run here under its scratch-root path).
    entry = installed.root / VENV.lstrip("/") / "bin" / "kvtierd"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([entry, "--version"], capture_output=True, text=True, env=env,
                          timeout=60, cwd=installed.root)  # fmt: skip
    assert done.stdout.startswith("kvtierd "), done.stderr


def test_the_installed_unit_passes_systemd_analyze_verify(installed: Installed) -> None:
    analyze = _needs("systemd-analyze")
    give_systemd(installed.root)
    assert (installed.root / "etc/systemd/system/kvtierd.socket").is_file()
    done = subprocess.run(
        [analyze, "verify", "--man=no", f"--root={installed.root}", "kvtierd.service"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
    )
    # Lines decide (verify exits 0 on unknown keys); without the drop-in it would say
    # "Command kvtierd is not executable" (tests/test_systemd_unit.py shows it does).
    assert (done.stdout + done.stderr).strip() == ""
    assert done.returncode == 0


def test_a_second_run_upgrades_and_keeps_the_configuration(installed: Installed) -> None:
    config = installed.root / "etc/kvtierd/kvtierd.toml"
    edited = config.read_text() + "\n# edited on site\n"
    config.write_text(edited)
    passwd = (installed.root / "etc/passwd").read_text()
    done = _install(installed.source, installed.root, "--no-pip")
    assert done.returncode == 0, done.stderr
    assert "kept /etc/kvtierd/kvtierd.toml" in done.stdout
    assert config.read_text() == edited
    assert (installed.root / "etc/passwd").read_text() == passwd  # no second user


def test_refusals(tmp_path: Path) -> None:
    """Bad arguments stop the script before it changes anything."""
    for args, message in [
        (["--venv", "/root/kvtierd"], "ProtectHome= hides /home and /root"),
        (["--venv", "opt/kvtierd"], "give an absolute path"),
        (["--venv"], "--venv needs a value"),
        (["--frobnicate"], "unknown argument: --frobnicate"),
    ]:
        done = _install(ROOT, tmp_path, *args)
        assert done.returncode != 0
        assert message in done.stderr, (args, done.stderr)
    assert list(tmp_path.iterdir()) == []


# -- the documented install is the script --------------------------------------------------


def _install_section() -> str:
    text = OPERATIONS.read_text()
    return text[text.index("## Install") : text.index("### What the unit does")]


def _documented_block() -> list[str]:
    """The commands of the sh block of "Install" that runs the script, without comments."""
    blocks = re.findall(r"```sh\n(.*?)```", _install_section(), re.S)
    [block] = [b for b in blocks if "systemd/install.sh" in b]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0]]


def _usage_options() -> set[str]:
    usage = subprocess.run(
        ["sh", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    return set(re.findall(r"(?m)^\s+(--[a-z-]+)", usage))


def test_the_documented_block_is_the_script_and_its_next_steps(installed: Installed) -> None:
    commands = _documented_block()
    [at] = [i for i, c in enumerate(commands) if c.split()[:2] == ["sh", "systemd/install.sh"]]
    assert set(re.findall(r"--[a-z-]+", commands[at])) <= _usage_options()
    # What follows it is what the script prints as the next steps, line for line.
    printed = installed.stdout[installed.stdout.index("Next, as root:") :].splitlines()[1:]
    assert commands[at + 1 :] == [line.strip() for line in printed]
    # Before it, only packages are installed.
    assert all(c.startswith("apt-get install ") for c in commands[:at])


def test_the_docs_explain_every_option_and_use_no_sudo() -> None:
    section = _install_section()
    assert _usage_options() == {"--root", "--venv", "--python", "--package", "--no-pip"}
    for option in _usage_options():
        assert f"`{option}" in section, option
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        assert not re.search(r"\bsudo\b", block), block
