"""The daemon process: start-up errors, both runtimes, connection limits, metrics, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import BusyError, chain_keys, connect
from kvtierd.testing import DaemonProcess, free_port

BLOCK = 256 << 10


def _kvtierd(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the daemon's command line to completion (for start-up failures)."""
    return subprocess.run(
        [sys.executable, "-m", "kvtierd", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dram-size", "lots"], "--dram-size: not a size: 'lots'"),
        (["--nvme-size", "1M"], "--nvme-size: 1M is neither 0 (no disk tier) nor at least 64M"),
        (["--runtime", "curio"], "invalid choice"),
    ],
)
def test_a_bad_flag_is_blamed_on_the_flag_and_exits_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = _kvtierd("--socket", str(tmp_path / "s"), "--data-dir", str(tmp_path), *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_config_key_names_the_field(tmp_path: Path) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text("[dram]\nsize = '64M'\nhuge_pages = 'yes'\n")
    result = _kvtierd("--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"kvtierd: invalid configuration in {config}:",
        '  dram.huge_pages: unknown key (did you mean "hugepages"?)',
    ]


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_daemon_serves_on_both_runtimes(tmp_path: Path, runtime: str) -> None:
    with DaemonProcess(tmp_path, runtime=runtime) as d, connect(d.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(64), 16, ns.key_salt)
        blocks = [np.full(BLOCK, i, np.uint8) for i in range(4)]
        assert ns.put(keys, blocks) == 4
        client.fsync()
        client.evict()
        with ns.get(keys) as views:
            assert [v[0] for v in views] == [0, 1, 2, 3]
        assert client.stats()["io_backend"] in ("io_uring", "threads")
    assert d.process is not None
    assert d.process.returncode == 0


def test_connections_beyond_the_limit_get_ebusy(tmp_path: Path) -> None:
    config = "[daemon]\nmax_connections = 2\n"
    with DaemonProcess(tmp_path, config_text=config) as d:
        first, second = connect(d.socket), connect(d.socket)
        try:
            with pytest.raises(BusyError, match="too many connections"):
                connect(d.socket)
        finally:
            first.close()
            second.close()


def test_metrics_are_served_on_loopback(tmp_path: Path) -> None:
    port = free_port()
    config = f"[daemon]\nmetrics_port = {port}\n"
    with DaemonProcess(tmp_path, config_text=config) as d, connect(d.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        ns.put([b"k" * 16], [bytes(BLOCK)])
        text = ""
        for _ in range(50):
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                .read()
                .decode()
            )
            if "kvtierd_requests" in text and 'kvtierd_tier_blocks{tier="dram"} 1.0' in text:
                break
            threading.Event().wait(0.1)
        assert 'kvtierd_tier_blocks{tier="dram"} 1.0' in text


def test_sigterm_writes_back_committed_blocks_and_exits_0(tmp_path: Path) -> None:
    blocks = [np.full(BLOCK, i, np.uint8) for i in range(32)]
    with DaemonProcess(tmp_path) as d:
        with connect(d.socket) as client:
            ns = client.namespace("t", block_bytes=BLOCK)
            keys = chain_keys(range(16 * 32), 16, ns.key_salt)
            ns.put(keys, blocks)  # no FSYNC: the clean stop must write them back itself
        assert d.stop() == 0
    with DaemonProcess(tmp_path) as d, connect(d.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        assert ns.lookup(keys) == 32
        assert "recovered by snapshot" in d.log()


def test_a_second_daemon_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "a") as first:
        result = _kvtierd(
            "--socket",
            str(tmp_path / "other.sock"),
            "--data-dir",
            str(first.data_dir),
            "--dram-size",
            "32M",
            "--nvme-size",
            "128M",
        )
        assert result.returncode == 1
        assert "in use by another kvtierd" in result.stderr
        result = _kvtierd(
            "--socket",
            str(first.socket),
            "--data-dir",
            str(tmp_path / "b"),
            "--dram-size",
            "32M",
            "--nvme-size",
            "128M",
        )
        assert result.returncode == 1
        assert "another process listens on it" in result.stderr
        with connect(first.socket) as client:  # the first daemon still serves
            assert client.stats()["connections"] == 1


def test_filling_the_arena_never_hands_out_memory_past_its_end(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, dram_size="16M", nvme_size="128M") as d, connect(d.socket) as c:
        ns = c.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 200), 16, ns.key_salt)
        for i in range(0, 200, 8):
            chunk = keys[i : i + 8]
            assert ns.put(chunk, [np.full(BLOCK, i, np.uint8)] * len(chunk)) == len(chunk)
        c.fsync()
        assert ns.lookup(keys) == 200
        with ns.get(keys[-8:]) as views:
            assert all(v[0] == 192 for v in views)


# -- what the journal says (issue 35) ------------------------------------------------------------


def test_one_start_up_summary_line_and_no_connection_churn_at_info(tmp_path: Path) -> None:
    """One line says where the daemon listens, what it holds and which configuration it took
    (sizes as ``--check`` gives them); connections come and go at DEBUG, not in the journal."""
    config = '[dram]\nsize = "64M"\n\n[nvme]\nsize = "128M"\n'
    with DaemonProcess(tmp_path / "d", dram_size=None, nvme_size=None, config_text=config) as d:
        for _ in range(3):
            with connect(d.socket, client_name="probe") as client:
                client.stats()
        log = d.log()
    [ready] = [line for line in log.splitlines() if " ready on " in line]
    assert f"ready on {d.socket} (config {d.directory / 'kvtierd.toml'}): DRAM 64 MiB" in ready
    assert "NVMe 128 MiB at " in ready
    assert "I/O io_uring" in ready or "I/O threads" in ready
    assert "connection from" not in log
    assert "disconnected" not in log


def test_an_unclean_stop_is_said_at_the_next_start_and_a_clean_one_is_not(
    tmp_path: Path,
) -> None:
    unclean = "did not stop cleanly last time"
    daemon = DaemonProcess(tmp_path / "d").start()
    try:
        with connect(daemon.socket) as client:
            ns = client.namespace("t", block_bytes=4096)
            ns.put([bytes(16)], [bytes(4096)])
            client.fsync()
        daemon.kill()  # kill -9: no snapshot of a clean stop
        daemon.start()
        assert daemon.log().count(unclean) == 1
        with connect(daemon.socket) as client:  # what FSYNC acknowledged is kept
            ns = client.namespace("t", block_bytes=4096)
            assert ns.lookup([bytes(16)]) == 1
        assert daemon.stop() == 0
        daemon.start()  # after a clean stop: nothing to say
        assert daemon.log().count(unclean) == 1
    finally:
        daemon.kill()


def test_sighup_applies_what_can_change_live_and_names_what_needs_a_restart(
    tmp_path: Path,
) -> None:
    """The log level changes at once (connection lines appear at DEBUG), a size does not and is
    named; an invalid file changes nothing; the daemon serves on, DRAM untouched."""
    config = '[daemon]\nlog_level = "info"\n\n[dram]\nsize = "64M"\n'
    with DaemonProcess(tmp_path / "d", dram_size=None, config_text=config) as daemon:
        path = daemon.directory / "kvtierd.toml"
        with connect(daemon.socket) as client:
            ns = client.namespace("kept", block_bytes=4096)
            ns.put([bytes(16)], [bytes(4096)])
        path.write_text('[daemon]\nlog_level = "debug"\n\n[dram]\nsize = "96M"\n')
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGHUP)
        _wait_for_line(daemon, "SIGHUP: not applied until a restart")
        log = daemon.log()
        assert 'SIGHUP: daemon.log_level "info" -> "debug"' in log
        assert 'SIGHUP: not applied until a restart: dram.size "64M" -> "96M"' in log
        with connect(daemon.socket, client_name="after-hup") as client:
            running = client.configuration()
            assert client.namespace("kept", block_bytes=4096).lookup_tiers([bytes(16)]) == ["dram"]
        assert 'log_level = "debug"' in running["toml"]
        assert 'size = "64M"' in running["toml"]  # held
        _wait_for_line(daemon, "(client 'after-hup') disconnected")  # DEBUG now
        path.write_text("[dram]\nsize = 5\n")
        daemon.process.send_signal(signal.SIGHUP)
        _wait_for_line(daemon, "SIGHUP: nothing changed, the configuration is invalid")
        with connect(daemon.socket) as client:
            assert client.configuration()["digest"] == running["digest"]
        assert daemon.running


def _wait_for_line(daemon: DaemonProcess, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()[-3000:]
        time.sleep(0.05)


def test_json_logs_carry_the_fields_of_a_failed_request(tmp_path: Path) -> None:
    config = '[daemon]\nlog_format = "json"\n'
    with DaemonProcess(tmp_path / "d", config_text=config) as daemon:
        with connect(daemon.socket, client_name="json-probe") as client:
            ns = client.namespace("logged", block_bytes=4096)
            with pytest.raises(KeyError):
                ns.read_into([bytes(16)], [bytearray(4096)])
        _wait_for_line(daemon, "json-probe")
        records = [json.loads(line) for line in daemon.log().splitlines()]
    failed = next(r for r in records if r.get("errno") == "ENOENT")
    assert (failed["opcode"], failed["client"], failed["namespace"]) == (
        "READ",
        "json-probe",
        "logged",
    )
    assert (failed["pid"], failed["uid"]) == (os.getpid(), os.getuid())
    assert failed["level"] == "info"
    assert failed["logger"] == "kvtierd.session"
    assert any(" ready on " in r["event"] for r in records)
