"""What ``kvtierctl`` prints where people and scripts read it: a real 80-column terminal (a tmux
pane, read back with ``capture-pane -p``) and a pipe.

In the terminal a name or identifier too long for its column is cut with an ellipsis, never
folded onto the next line; a key is whole where there is room. In a pipe nothing is cut,
folded, padded or coloured, whatever ``$COLUMNS`` or ``FORCE_COLOR`` say: each row is one line
whose fields ``awk`` splits. Each tmux server has a private socket in the test's directory and
is killed at the end; waiting for the pane polls with a generous deadline and nothing asserts
on how long anything took.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import Layout, chain_keys, connect
from tests.support.daemon import DaemonProcess

CHECKOUT = Path(__file__).resolve().parents[2]
BLOCK = 16 << 10

#: Longer than an 80-column table leaves for any of them.
NAME = "a-rather-long-namespace-name-for-the-llama-70b-prefix-cache"
TENANT = "tenant-with-a-long-name-acme-research"
MODEL = "meta-llama/Llama-3.1-70B-Instruct-with-a-very-long-model-identifier"
LAYOUT = Layout(MODEL, layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
LAYOUT_BLOCK = 2 * 2 * 2 * 64 * 16 * 2


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, list[str]]]:
    """A daemon with one namespace of long names (3 blocks) and one short one; the long
    namespace's keys in hex."""
    with DaemonProcess(tmp_path_factory.mktemp("kvtierd")) as daemon:
        with connect(daemon.socket) as client:
            ns = client.namespace(NAME, block_bytes=LAYOUT_BLOCK, layout=LAYOUT, tenant=TENANT)
            keys = chain_keys(range(16 * 3), 16, ns.key_salt)
            assert ns.put(keys, [np.full(LAYOUT_BLOCK, i, np.uint8) for i in range(3)]) == 3
            short = client.namespace("short", block_bytes=BLOCK)
            assert (
                short.put(chain_keys(range(16), 16, short.key_salt), [np.zeros(BLOCK, np.uint8)])
                == 1
            )
        yield daemon, [key.hex() for key in keys]


# -- a real terminal ----------------------------------------------------------------------------


class Terminal:
    """A tmux server of its own (socket ``directory/tmux.sock``) with one 80x50 pane."""

    def __init__(self, directory: Path) -> None:
        self.socket = directory / "tmux.sock"

    def tmux(self, *args: str) -> str:
        command = ["tmux", "-S", str(self.socket), "-f", "/dev/null", *args]
        return subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=30
        ).stdout

    def run(self, arguments: str, deadline_s: float = 60) -> tuple[list[str], int]:
        """``kvtierctl ARGUMENTS`` in the pane (once per terminal): the lines it showed and
        its exit status."""
        command = (
            f"cd {shlex.quote(str(CHECKOUT))} && {shlex.quote(sys.executable)} -m "
            f"kvtierd.cli.ctl {arguments}; echo EXIT=$?; sleep 600"
        )
        self.tmux("new-session", "-d", "-x", "80", "-y", "50", f"bash -c {shlex.quote(command)}")
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            lines = self.tmux("capture-pane", "-p").rstrip("\n").splitlines()
            ended = [line for line in lines if line.startswith("EXIT=")]
            if ended:
                return lines[: lines.index(ended[0])], int(ended[0].removeprefix("EXIT="))
            time.sleep(0.1)
        raise AssertionError(
            f"kvtierctl {arguments} never ended:\n{self.tmux('capture-pane', '-p')}"
        )

    def close(self) -> None:
        subprocess.run(
            ["tmux", "-S", str(self.socket), "kill-server"], capture_output=True, check=False
        )


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    made = Terminal(tmp_path)
    yield made
    made.close()


def _rows(lines: list[str]) -> list[str]:
    """A table's rows: what follows the rule under its header."""
    rule = next(i for i, line in enumerate(lines) if line.strip().startswith("───"))
    return lines[rule + 1 :]


@pytest.mark.timeout(180)
def test_ls_at_80_columns_cuts_long_names_and_never_folds_them(
    named: tuple[DaemonProcess, list[str]], terminal: Terminal
) -> None:
    daemon, _ = named
    lines, status = terminal.run(f"ls --socket {shlex.quote(str(daemon.socket))}")
    assert status == 0
    rows = _rows(lines)
    assert len(rows) == 2, lines  # one line per namespace
    long_row = next(row for row in rows if NAME[:4] in row)
    assert long_row.count("…") == 3, long_row  # name, tenant and model, each cut
    for whole in (NAME, TENANT, MODEL):
        assert whole[-8:] not in "\n".join(lines)  # no tail folded onto a line of its own
    assert "16.0 KiB" in long_row  # the numbers beside them keep their room
    assert "short" in rows[1]
    assert max(len(line) for line in lines) <= 80


@pytest.mark.timeout(180)
def test_keys_at_80_columns_are_whole_and_the_long_headline_is_cut(
    named: tuple[DaemonProcess, list[str]], terminal: Terminal
) -> None:
    daemon, keys = named
    arguments = f"ls --keys {NAME} --limit 2 --socket {shlex.quote(str(daemon.socket))}"
    lines, status = terminal.run(arguments)
    assert status == 0
    rows = _rows(lines)
    assert [row.split()[0] for row in rows[:2]] == sorted(keys)[:2]  # whole: there is room
    assert rows[2] == f"more: --after {sorted(keys)[1]}"
    assert NAME[-8:] not in "\n".join(lines)


# -- a pipe -----------------------------------------------------------------------------------


def _piped(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvtierctl ARGS`` with stdout a pipe, in an environment that would colour and narrow a
    terminal's output."""
    env = dict(os.environ, COLUMNS="60", FORCE_COLOR="1", TERM="xterm-256color")
    return subprocess.run(
        [sys.executable, "-m", "kvtierd.cli.ctl", *args, "--socket", str(daemon.socket)],
        capture_output=True,  # stdout and stderr pipes
        text=True,
        cwd=CHECKOUT,
        env=env,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["ls"],
        ["ls", "--keys", NAME],
        ["stats"],
        ["stats", "--tenants"],
        ["stats", "--namespace", NAME],
        ["pool", "status"],
        ["doctor"],
        ["top", "--iterations", "1"],
    ],
)
def test_a_pipe_gets_plain_lines_without_escapes_or_trailing_blanks(
    named: tuple[DaemonProcess, list[str]], command: list[str]
) -> None:
    daemon, _ = named
    result = _piped(daemon, *command)
    assert (result.returncode, result.stderr) == (0, "")
    assert "\x1b" not in result.stdout
    padded = [line for line in result.stdout.splitlines() if line != line.rstrip()]
    assert padded == []
    assert "…" not in result.stdout  # nothing cut


def test_a_pipe_gets_each_row_whole_on_one_line_for_awk(
    named: tuple[DaemonProcess, list[str]],
) -> None:
    daemon, keys = named
    listed = _piped(daemon, "ls").stdout.splitlines()
    fields = [line.split() for line in listed[2:]]
    assert [(f[1], f[2], f[-1]) for f in fields if f[1] == NAME] == [(NAME, TENANT, MODEL)]
    assert len(fields) == 2
    shown = _piped(daemon, "ls", "--keys", NAME).stdout.splitlines()
    assert [line.split()[0] for line in shown[3:6]] == sorted(keys)
    doctor = _piped(daemon, "doctor").stdout.splitlines()
    socket_line = next(line for line in doctor if line.split()[1:2] == ["socket"])
    assert socket_line.split()[2] == str(daemon.socket)  # one line per check, never wrapped
    assert len(doctor) == 2 + len({line.split()[1] for line in doctor[2:]})
