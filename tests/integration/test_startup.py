"""What stops the daemon at start-up is found before the arena is touched, and said in one line
per problem with an exit status that says who must act (2 configuration, 1 environment);
``kvtierd --check`` reports the same without starting anything."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd import host
from kvtierd.client import connect
from kvtierd.io.binding import BINDING_ENV
from kvtierd.store.copyhash import DEFAULT_MODULE, MODULE_ENV
from kvtierd.testing import DaemonProcess


def _kvtierd(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The daemon's command line run to completion, with its own socket and data directory
    unless ``args`` name them."""
    own = [] if "--socket" in args else ["--socket", str(tmp_path / "kvtierd.sock")]
    own += [] if "--data-dir" in args else ["--data-dir", str(tmp_path / "data")]
    sizes = ["--dram-size", "32M", "--nvme-size", "128M"]
    return subprocess.run(
        [sys.executable, "-m", "kvtierd", *own, *sizes, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **(env or {})),
    )


def _refused(result: subprocess.CompletedProcess[str], status: int) -> str:
    """The one line a refused start printed; the arena and the data file were never made."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    assert "pre-faulting" not in result.stderr
    assert " INFO " not in result.stderr  # nothing was logged: logging starts after the checks
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_socket_path_too_long_is_named_by_its_flag(tmp_path: Path) -> None:
    path = tmp_path / ("s" * 120)
    line = _refused(_kvtierd(tmp_path, "--socket", str(path)), 2)
    length = len(os.fsencode(path))
    assert line == (
        f"kvtierd: --socket {path} is {length} bytes long; a Unix socket path holds at most 107"
    )
    assert not (tmp_path / "data").exists()


def test_a_socket_group_that_does_not_exist(tmp_path: Path) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text('[daemon]\nsocket_group = "kvtierd-no-such-group"\n')
    line = _refused(_kvtierd(tmp_path, "--config", str(config)), 2)
    assert line == "kvtierd: daemon.socket_group 'kvtierd-no-such-group' does not exist"


def test_a_metrics_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "kvtierd.toml"
        config.write_text(f"[daemon]\nmetrics_port = {port}\n")
        line = _refused(_kvtierd(tmp_path, "--config", str(config)), 1)
    assert line == f"kvtierd: daemon.metrics_port {port} on 127.0.0.1 is in use"


def test_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "data"
    file.write_text("")
    line = _refused(_kvtierd(tmp_path, "--data-dir", str(file)), 1)
    assert line == f"kvtierd: --data-dir {file}: {file} is not a directory"


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A read-only file system (a tmpfs mounted ``ro``), as a root daemon meets it."""
    mount = tmp_path / "ro"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)])
    if done.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_data_dir_on_a_read_only_file_system(tmp_path: Path, read_only: Path) -> None:
    data = read_only / "data"
    line = _refused(_kvtierd(tmp_path, "--data-dir", str(data)), 1)
    assert line == f"kvtierd: --data-dir {data}: {read_only} is on a read-only file system"


def test_a_socket_on_a_read_only_file_system(tmp_path: Path, read_only: Path) -> None:
    path = read_only / "kvtierd.sock"
    line = _refused(_kvtierd(tmp_path, "--socket", str(path)), 1)
    assert line == f"kvtierd: --socket {path}: {read_only} is on a read-only file system"


def test_an_arena_larger_than_the_memory_available(tmp_path: Path) -> None:
    line = _refused(_kvtierd(tmp_path, "--dram-size", "64T"), 1)
    assert line.startswith("kvtierd: --dram-size = 64 TiB needs a 64.0 TiB arena, but only ")
    assert line.endswith("is available (MemAvailable): lower --dram-size or free memory")


def test_an_nvme_tier_larger_than_the_disk(tmp_path: Path) -> None:
    line = _refused(_kvtierd(tmp_path, "--nvme-size", "64P"), 1)
    path = tmp_path / "data" / "nvme.data"
    assert line.startswith(f"kvtierd: --nvme-size = 65536 TiB does not fit in {path}: ")
    assert not path.exists()


def test_configuration_errors_all_at_once(tmp_path: Path) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text('[dram]\nsise = "1G"\n[nvme]\nio_backend = "uring"\n')
    result = _kvtierd(tmp_path, "--config", str(config), "--dram-size", "lots")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"kvtierd: invalid configuration in {config}:",
        '  dram.sise: unknown key (did you mean "size"?)',
        "  --dram-size: not a size: 'lots' (use bytes or a suffix: K, M, G, T, P)",
        "  nvme.io_backend: 'uring' is not one of: io_uring, threads, auto",
    ]


@pytest.fixture
def sigill_binding(standins: Path) -> dict[str, str]:
    """Point the daemon at a liburing binding that dies with SIGILL, as the PyPI wheel did on
    CPUs without AVX-512."""
    return {BINDING_ENV: "sigill_binding", "PYTHONPATH": str(standins)}


def test_explicit_io_uring_whose_binding_dies_exits_2(
    tmp_path: Path, sigill_binding: dict[str, str]
) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text('[nvme]\nio_backend = "io_uring"\n')
    line = _refused(_kvtierd(tmp_path, "--config", str(config), env=sigill_binding), 2)
    assert line == (
        "kvtierd: nvme.io_backend = io_uring, but the liburing binding sigill_binding died with "
        "SIGILL: this CPU lacks an instruction it was built for"
    )


def test_auto_whose_binding_dies_serves_on_threads_with_one_warning(
    tmp_path: Path, sigill_binding: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in sigill_binding.items():
        monkeypatch.setenv(name, value)
    with DaemonProcess(tmp_path) as daemon, connect(daemon.socket) as client:
        assert client.stats()["io_backend"] == "threads"
        doctor = {check["subject"]: check for check in client.doctor()}
    warnings = [line for line in daemon.log().splitlines() if " WARNING " in line]
    assert warnings == [
        warnings[0].split(" WARNING ")[0] + " WARNING kvtierd.io: io_uring unavailable, falling "
        "back to threads: the liburing binding sigill_binding died with SIGILL: this CPU lacks "
        "an instruction it was built for"
    ]
    assert doctor["io_uring"]["status"] == "fallback"
    assert doctor["io"] == {
        "subject": "io",
        "status": "fallback",
        "detail": "threads in use (nvme.io_backend = auto)",
    }


def test_the_daemon_on_this_machine_uses_io_uring(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path) as daemon, connect(daemon.socket) as client:
        assert client.stats()["io_backend"] == "io_uring"
    assert "io backend: io_uring" in daemon.log()


def _wait_for(predicate: object, timeout_s: float = 30.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.skipif(
    (host.memory_available() or 0) < 8 << 30, reason="needs 8 GiB free for a slow 4 GiB pre-fault"
)
@pytest.mark.parametrize(
    ("runtime", "backend", "faulting"),
    [
        ("asyncio", "io_uring", b"arena: pinning"),  # the registration faults the arena in
        ("trio", "io_uring", b"arena: pinning"),
        ("asyncio", "threads", b"arena: pre-faulting"),  # no fixed buffers: MADV_POPULATE_WRITE
        ("trio", "threads", b"arena: pre-faulting"),
    ],
)
def test_ctrl_c_while_the_arena_is_faulted_in(
    tmp_path: Path, runtime: str, backend: str, faulting: bytes
) -> None:
    # 4 GiB of first touches take seconds here (0.4-3 GB/s): the signal lands inside them.
    log = tmp_path / "daemon.log"
    config = tmp_path / "kvtierd.toml"
    config.write_text(f'[nvme]\nio_backend = "{backend}"\n')
    with open(log, "wb") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvtierd", "--socket", str(tmp_path / "s"), "--data-dir",
             str(tmp_path / "data"), "--dram-size", "4G", "--nvme-size", "128M", "--runtime",
             runtime, "--config", str(config)],
            stdout=out, stderr=out,
        )  # fmt: skip
    try:
        _wait_for(lambda: faulting in log.read_bytes())
        daemon.send_signal(signal.SIGINT)
        assert daemon.wait(timeout=30) == 130
    finally:
        with contextlib.suppress(ProcessLookupError):
            daemon.kill()
    text = log.read_text()
    assert "Traceback" not in text
    assert text.splitlines()[-1] == "kvtierd: interrupted"


@pytest.mark.usefixtures("standins")
def test_ctrl_c_while_the_binding_is_probed(tmp_path: Path) -> None:
    pidfile = tmp_path / "probe.pid"
    env = dict(os.environ, **{BINDING_ENV: "hang_binding"}, KVTIERD_TEST_HANG_PIDFILE=str(pidfile))
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", "--socket", str(tmp_path / "s"), "--data-dir",
         str(tmp_path / "data"), "--dram-size", "32M", "--nvme-size", "128M"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        _wait_for(pidfile.exists)
        _wait_for(lambda: pidfile.read_text() != "")
        daemon.send_signal(signal.SIGINT)
        _, err = daemon.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            daemon.kill()
    assert daemon.returncode == 130
    assert err.splitlines() == ["kvtierd: interrupted"]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)  # the probe's child did not outlive it


@pytest.mark.usefixtures("standins")
def test_journal_lines_carry_their_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = DaemonProcess(tmp_path)
    daemon.log_path.parent.mkdir(parents=True, exist_ok=True)
    daemon.log_path.touch()
    st = daemon.log_path.stat()
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    monkeypatch.setenv(BINDING_ENV, "sigill_binding")  # for one WARNING
    with daemon:
        pass
    lines = daemon.log().splitlines()
    assert "<6>INFO kvtierd: kvtierd " in "\n".join(lines)  # "... ready on ..."
    assert [line for line in lines if line.startswith("<4>")] == [
        "<4>WARNING kvtierd.io: io_uring unavailable, falling back to threads: the liburing "
        "binding sigill_binding died with SIGILL: this CPU lacks an instruction it was built for"
    ]
    assert all(line[:3] in ("<6>", "<4>") for line in lines), lines


# -- kvtierd --check ------------------------------------------------------------------------


def test_check_says_what_differs_from_the_running_daemon(tmp_path: Path) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text('[daemon]\nlog_level = "debug"\n')
    with DaemonProcess(tmp_path / "d", dram_size="32M", nvme_size="128M") as daemon:
        own = ["--socket", str(daemon.socket), "--data-dir", str(daemon.data_dir)]
        same = _check(tmp_path, *own)
        changed = _check(tmp_path, *own, "--config", str(config), "--dram-size", "64M")
    where = f"running daemon on {daemon.socket} (the embedded defaults, digest "
    assert where in same.stdout
    assert same.stdout.splitlines()[-2].endswith(": runs exactly this configuration")
    lines = changed.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(where))
    assert lines[start].endswith(
        "differs in 2 field(s), applied by systemctl reload (SIGHUP) or by a restart, as each says:"
    )
    assert lines[start + 1 : start + 3] == [
        '  daemon.log_level: "info" -> "debug" (reload)',
        '  dram.size: "32M" -> "64M" (restart)',
    ]


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _kvtierd(tmp_path, "--check", *args)


def test_check_reports_every_subject_and_changes_nothing(tmp_path: Path) -> None:
    result = _check(tmp_path)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert lines[-2] == f"no running daemon to compare with (none holds {tmp_path}/data)"
    subjects = [line.split()[1] for line in lines[:-2]]
    assert subjects == [
        "config", "io_uring", "hugepages", "thp", "mlock", "memory", "data_dir", "nvme",
        "socket", "metrics", "nofile", "pool", "copyhash",
    ]  # fmt: skip
    assert lines[0].split()[0] == "ok"
    assert lines[1].startswith("ok        io_uring  kernel.io_uring_disabled = "), lines[1]
    assert lines[-1] == "kvtierd would start (the embedded defaults)"
    assert list(tmp_path.iterdir()) == []  # no data dir, no socket, no cache


def _copyhash_line(tmp_path: Path, module: str | None) -> str:
    env = {} if module is None else {MODULE_ENV: module}
    result = _kvtierd(tmp_path, "--check", env=env)
    assert result.returncode == 0, result.stdout
    [line] = [line for line in result.stdout.splitlines() if line.split()[1:2] == ["copyhash"]]
    return line


def test_check_names_the_copy_kernel(tmp_path: Path) -> None:
    line = _copyhash_line(tmp_path, DEFAULT_MODULE)
    if importlib.util.find_spec(DEFAULT_MODULE) is None:  # not built here: said so
        assert line.startswith("fallback  copyhash  python, "), line
        assert "is not built" in line
    else:
        assert re.fullmatch(r"ok        copyhash  (avx2|sse2): one pass copies and hashes .*", line)


@pytest.mark.parametrize(
    ("module", "why"),
    [
        ("tests.store.standins.sigill_copyhash", "failed its probe: .* died with SIGILL"),
        ("tests.store.standins.no_such_module", "is not built .*ModuleNotFoundError"),
        ("", "KVTIERD_COPYHASH_MODULE is empty"),
    ],
)
def test_check_says_why_copies_are_hashed_in_python(tmp_path: Path, module: str, why: str) -> None:
    line = _copyhash_line(tmp_path, module)
    assert line.startswith("fallback  copyhash  python, 256 KiB at a time"), line
    assert re.search(why, line), line


def test_check_lists_every_problem_and_exits_with_the_worst(tmp_path: Path) -> None:
    result = _check(tmp_path, "--nvme-size", "64P", "--socket", str(tmp_path / ("s" * 120)))
    assert result.returncode == 2
    failed = [line for line in result.stdout.splitlines() if line.startswith("fail")]
    assert [line.split()[1] for line in failed] == ["nvme", "socket"]
    assert result.stdout.splitlines()[-1] == (
        "kvtierd would not start: 2 problem(s) above (exit status 2)"
    )


def test_check_of_an_invalid_configuration(tmp_path: Path) -> None:
    result = _check(tmp_path, "--dram-size", "lots", "--nvme-size", "1M")
    assert result.returncode == 2
    assert result.stdout.splitlines() == [
        "fail      config    --dram-size: not a size: 'lots' "
        "(use bytes or a suffix: K, M, G, T, P)",
        "fail      config    --nvme-size: 1M is neither 0 (no disk tier) nor at least 64M",
        "kvtierd would not start: 2 problem(s) above (exit status 2)",
    ]


def test_check_beside_the_running_daemon_judges_a_restart(tmp_path: Path) -> None:
    """What the running daemon holds (its data directory, its socket) is released by the
    restart the operator checks for: not a failure."""
    with DaemonProcess(tmp_path, dram_size="32M", nvme_size="128M") as daemon:
        assert daemon.process is not None
        pid = daemon.process.pid
        result = _check(
            tmp_path, "--socket", str(daemon.socket), "--data-dir", str(daemon.data_dir)
        )
        assert result.returncode == 0, result.stdout
        lines = {line.split()[1]: line for line in result.stdout.splitlines()[:-1]}
        assert lines["data_dir"].endswith(
            f"the running kvtierd (pid {pid}) holds it until it stops"
        )
        assert lines["socket"].endswith(f"the running kvtierd (pid {pid}) listens until it stops")
        assert "with the running daemon's" in lines["memory"]
        # Starting a second daemon there is refused, naming what it collides with.
        second = _kvtierd(
            tmp_path, "--socket", str(daemon.socket), "--data-dir", str(daemon.data_dir)
        )
        assert second.returncode == 1
        assert second.stderr.splitlines() == [
            f"kvtierd: --data-dir {daemon.data_dir} is in use by another kvtierd (pid {pid})",
            f"kvtierd: --socket {daemon.socket}: another process listens on it (a kvtierd, or "
            "systemd's kvtierd.socket: start the daemon through the unit then)",
        ]


def test_a_refused_start_under_the_journal_is_an_error(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as out:
        st = stderr.stat()
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        done = subprocess.run(
            [sys.executable, "-m", "kvtierd", "--socket", str(tmp_path / ("s" * 120))],
            stderr=out, env=env, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2
    assert stderr.read_text().startswith("<3>kvtierd: --socket ")
