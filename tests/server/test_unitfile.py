"""Reading the unit as systemd would (:mod:`kvtierd.server.unitfile`): the shipped unit gives
what the start-up checks rely on, drop-ins override and clear as systemd's rules say, and the
sandbox keeps the daemon where the unit lets it write."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.server import unitfile
from kvtierd.server.unitfile import UNLIMITED, parse_unit, read_unit, unit_files

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD / "kvtierd.service"


def test_the_shipped_unit_gives_what_the_checks_rely_on() -> None:
    unit = parse_unit([UNIT.read_text()])
    assert (unit.user, unit.group) == ("kvtierd", "kvtierd")
    assert unit.program == "kvtierd"
    assert unit.runtime_directories == (Path("/run/kvtierd"),)
    assert unit.state_directories == (Path("/var/lib/kvtierd"),)
    assert unit.memlock_bytes is None  # LimitMEMLOCK=infinity
    assert unit.nofile == (65536, 65536)
    assert unit.memory_max_bytes is None  # the example stays commented out
    assert (unit.protect_system, unit.protect_home, unit.private_tmp) == ("strict", "yes", True)
    assert unit.ambient_capabilities == frozenset()


def test_the_shipped_drop_in_names_the_environment() -> None:
    # systemd/ is laid out as installed: kvtierd.service.d/ beside the unit is its drop-ins.
    unit = read_unit(UNIT)
    assert unit.files == (UNIT, SYSTEMD / "kvtierd.service.d" / "venv.conf")
    assert unit.program == "/opt/kvtierd/venv/bin/kvtierd"
    assert unit == parse_unit([f.read_text() for f in unit.files], files=unit.files)


def test_drop_ins_override_and_an_empty_assignment_clears() -> None:
    base = "[Service]\nUser=a\nRuntimeDirectory=one two\nLimitNOFILE=1024\nReadWritePaths=/x\n"
    site = "[Service]\nUser=b\nRuntimeDirectory=\nRuntimeDirectory=three\nReadWritePaths=/y\n"
    unit = parse_unit([base, site])
    assert unit.user == "b"
    assert unit.runtime_directories == (Path("/run/three"),)
    assert unit.read_write_paths == (Path("/x"), Path("/y"))  # lists add up
    assert unit.nofile == (1024, 1024)


def test_only_the_service_section_counts_and_lines_continue() -> None:
    text = (
        "[Unit]\nUser=unit-section\n[Service]\n# User=comment\n; User=comment\n"
        "ExecStart=-/usr/bin/kvtierd \\\n  --config /etc/kvtierd/kvtierd.toml\n"
        "StateDirectory=kvtierd:kvtierd-link\n"
    )
    unit = parse_unit([text])
    assert unit.user == "root"
    assert unit.program == "/usr/bin/kvtierd"
    assert unit.state_directories == (Path("/var/lib/kvtierd"),)


@pytest.mark.parametrize(
    ("memlock", "nofile", "expected"),
    [
        ("", "", (unitfile.DEFAULT_MEMLOCK_BYTES, unitfile.DEFAULT_NOFILE)),
        ("64M", "4096:8192", (64 << 20, (4096, 8192))),
        ("1G:infinity", "infinity", (1 << 30, (UNLIMITED, UNLIMITED))),
        ("infinity", "65536", (None, (65536, 65536))),
    ],
)
def test_limits(memlock: str, nofile: str, expected: tuple[object, object]) -> None:
    text = "[Service]\n" + (f"LimitMEMLOCK={memlock}\n" if memlock else "")
    text += f"LimitNOFILE={nofile}\n" if nofile else ""
    unit = parse_unit([text])
    assert (unit.memlock_bytes, unit.nofile) == expected


def test_an_unreadable_limit_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_unit(["[Service]\nLimitMEMLOCK=lots\n"])


def test_where_the_sandbox_lets_the_daemon_write() -> None:
    unit = parse_unit([UNIT.read_text(), "[Service]\nReadWritePaths=-/srv/nvme0/kvtierd\n"])
    assert unit.provides(Path("/run/kvtierd")) == "RuntimeDirectory=kvtierd"
    assert unit.provides(Path("/var/lib/kvtierd/nvme.data")) == "StateDirectory=kvtierd"
    assert unit.provides(Path("/var/lib/kvtierd-other")) is None
    for writable in ("/run/kvtierd", "/var/lib/kvtierd/x", "/srv/nvme0/kvtierd", "/tmp/x"):
        assert unit.sandbox_denies(Path(writable)) is None, writable
    assert "ProtectSystem=strict" in (unit.sandbox_denies(Path("/srv/other")) or "")
    assert "ProtectHome=yes" in (unit.sandbox_denies(Path("/home/me/kvtierd")) or "")
    relaxed = parse_unit(["[Service]\nProtectSystem=full\n"])
    assert relaxed.sandbox_denies(Path("/srv/other")) is None
    assert "ProtectSystem=full" in (relaxed.sandbox_denies(Path("/etc/kvtierd")) or "")


def test_the_program_must_be_executable(tmp_path: Path) -> None:
    program = tmp_path / "kvtierd"
    unit = parse_unit([f"[Service]\nExecStart={program} --config x\n"])
    assert unit.program_problem() == f"ExecStart= program {program} is not an executable file"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    assert unit.program_problem() is None
    bare = parse_unit(["[Service]\nExecStart=no-such-kvtierd\n"])
    assert "no-such-kvtierd is not an executable file in /usr/local/sbin:" in (
        bare.program_problem() or ""
    )


def test_drop_ins_higher_in_the_search_path_hide_the_same_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    (lib / "kvtierd.service.d").mkdir(parents=True)
    (etc / "kvtierd.service.d").mkdir(parents=True)
    (lib / "kvtierd.service").write_text("[Service]\nUser=lib\n")
    (lib / "kvtierd.service.d" / "a.conf").write_text("[Service]\nUser=lib-a\n")
    (lib / "kvtierd.service.d" / "b.conf").write_text("[Service]\nUser=lib-b\n")
    (etc / "kvtierd.service.d" / "b.conf").write_text("[Service]\nGroup=etc-b\n")
    monkeypatch.setattr(unitfile, "UNIT_PATH", (etc, lib))
    assert unit_files() == [
        lib / "kvtierd.service",
        lib / "kvtierd.service.d" / "a.conf",
        etc / "kvtierd.service.d" / "b.conf",
    ]
    unit = read_unit()
    assert (unit.user, unit.group) == ("lib-a", "etc-b")
    monkeypatch.setattr(unitfile, "UNIT_PATH", (tmp_path / "none",))
    with pytest.raises(FileNotFoundError, match=r"no kvtierd\.service in"):
        read_unit()


def test_exec_starts_prefixes_and_arguments_are_read_as_systemd_reads_them() -> None:
    unit = parse_unit(
        ["[Service]\nExecStart=-@/usr/bin/kvtierd kvtierd --config '/etc/a b.toml'\n"]
    )
    assert unit.program == "/usr/bin/kvtierd"
    assert unit.arguments == ("--config", "/etc/a b.toml")  # "@": the next word is argv[0]
