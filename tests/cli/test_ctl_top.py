"""``kvtierctl top`` in a real terminal: a tmux pane against a real daemon that restarts.

The pane is read with ``tmux capture-pane -p`` (what a person would see), keys go in with
``send-keys``. Each test runs its own tmux server (``-L``) so nothing else on the machine is
touched. Waiting for what the pane shows polls with a generous deadline; nothing asserts on
how long anything took.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtierd.cli.ctl import main
from tests.support.daemon import DaemonProcess

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
    pytest.mark.timeout(180),
]

CHECKOUT = Path(__file__).resolve().parents[2]


class Pane:
    """One tmux pane running a command, on a tmux server of its own."""

    def __init__(self, server: str, command: str) -> None:
        self.server = server
        self._tmux("new-session", "-d", "-s", "top", "-x", "100", "-y", "50", command)

    def _tmux(self, *args: str) -> str:
        result = subprocess.run(
            ["tmux", "-L", self.server, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return result.stdout

    def text(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "top")

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def wait_for(self, seen: Callable[[str], bool], what: str, deadline_s: float = 60) -> str:
        """The pane's text once ``seen`` accepts it."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            text = self.text()
            if seen(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"the pane never showed {what}:\n{self.text()}")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True, check=False)


@pytest.fixture
def pane_for(tmp_path: Path) -> Iterator[Callable[[str], Pane]]:
    panes: list[Pane] = []

    def start(arguments: str) -> Pane:
        status = tmp_path / "status"
        command = (
            f"cd {shlex.quote(str(CHECKOUT))} && {shlex.quote(sys.executable)} -m "
            f"kvtierd.cli.ctl {arguments}; echo EXIT=$? > {shlex.quote(str(status))}; "
            "echo done; sleep 600"
        )
        pane = Pane(f"kvtierd-top-{os.getpid()}-{len(panes)}", f"bash -c {shlex.quote(command)}")
        panes.append(pane)
        return pane

    yield start
    for pane in panes:
        pane.kill()


def _live(text: str) -> bool:
    """Live figures of a connected daemon, with the rates of an interval."""
    return "requests 0.0/s" in text and "hits/s" in text and "restarting" not in text


def test_top_waits_out_a_restart_and_resumes(
    tmp_path: Path, pane_for: Callable[[str], Pane]
) -> None:
    daemon = DaemonProcess(tmp_path / "kvtierd").start()
    try:
        pane = pane_for(f"top --interval 0.2 --socket {shlex.quote(str(daemon.socket))}")
        first = pane.wait_for(_live, "an idle daemon's figures")
        assert "kvtierctl top:" in first
        daemon.stop()
        waiting = pane.wait_for(lambda t: "kvtierd restarting: waiting for" in t, "the wait")
        assert str(daemon.socket) in "".join(waiting.split())  # a long path wraps
        assert "uptime" in waiting  # the last figures seen stay on screen
        daemon.start()
        pane.wait_for(_live, "live figures again after the restart")
        pane.send("C-c")
        pane.wait_for(lambda t: "done" in t.split(), "the command's end")
    finally:
        daemon.kill()
    assert (tmp_path / "status").read_text() == "EXIT=0\n"


def test_top_json_says_connected_then_restarting(tmp_path: Path) -> None:
    """``top --json`` in a pipe: one object per interval; an idle daemon has 0 requests/s."""
    daemon = DaemonProcess(tmp_path / "kvtierd").start()
    try:
        command = [
            *(sys.executable, "-m", "kvtierd.cli.ctl", "top", "--json"),
            *("--interval", "0.1", "--socket", str(daemon.socket)),
        ]
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=CHECKOUT) as top:
            assert top.stdout is not None
            lines = [json.loads(top.stdout.readline()) for _ in range(3)]
            daemon.stop()
            while (line := json.loads(top.stdout.readline()))["state"] == "connected":
                pass
            top.terminate()
    finally:
        daemon.kill()
    assert [entry["state"] for entry in lines] == ["connected"] * 3
    assert lines[0]["rates"] is None  # one sample: no interval yet
    assert lines[2]["rates"]["requests"] == 0.0
    assert {t["name"] for t in lines[2]["stats"]["tiers"]} == {"dram", "nvme"}
    assert lines[2]["stats"]["requests"] > lines[1]["stats"]["requests"]  # top's own STATFS
    assert line["state"] == "restarting"
    assert "reason" in line


def test_top_without_a_daemon_ever_seen_fails_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    socket = tmp_path / "absent.sock"
    assert main(["top", "--socket", str(socket)]) == 1
    assert capsys.readouterr().err == f"kvtierctl: kvtierd is not running (no daemon on {socket})\n"
