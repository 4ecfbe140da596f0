"""Attacks on what ``kvtierctl`` prints (issue 35): names a client or a configuration chose, shown
to the operator.

A namespace's name (and its tenant, with no tenants listed) is whatever a client said at
OPEN_NS: 1 to 255 characters, any of them. The admin's ``kvtierctl ls`` shows every tenant's
namespaces, so a tenant that names one ``"\\x1b]0;...\\x1b[2J"`` writes escape sequences to the
operator's terminal (and, in a pipe, breaks the promise of "no escape codes whatever the
environment says"); ``evict --namespace`` and ``forget`` pass the name through rich's markup, so
``"[/x]"`` makes them fail after the work is done and ``"[bold]x[/bold]"`` shows another name.
What withstood stays as a regression test. Every command runs in-process, its stdout a pipe
(capsys).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.cli.ctl import main
from kvtierd.client import chain_keys, connect
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.timeout(180)

BLOCK = 16 << 10
#: A name that sets the terminal's title, clears the screen and colours what follows.
ESCAPES = "evil\x1b]0;owned by a tenant\x07\x1b[2J\x1b[31mname"
#: rich markup, as a name: a closing tag nothing opened, and a style around a word.
BAD_TAG = "[/x]"
STYLED = "[bold]x[/bold]"

_CONTROLS = {chr(c) for c in range(32) if chr(c) not in "\n\t"} | {"\x7f"}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon holding one block in each of three namespaces a client named with escape
    sequences and rich markup (the first also its tenant's name)."""
    with DaemonProcess(tmp_path_factory.mktemp("kvtierd")) as daemon:
        with connect(daemon.socket) as client:
            for name, tenant in ((ESCAPES, ESCAPES), (BAD_TAG, "default"), (STYLED, "default")):
                ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
                keys = chain_keys(range(16), 16, ns.key_salt)
                assert ns.put(keys, [np.zeros(BLOCK, np.uint8)]) == 1
        yield daemon


def _ctl(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, *args: str) -> tuple[int, str]:
    status = main([*args, "--socket", str(daemon.socket)])
    out, _ = capsys.readouterr()
    return status, out


def _controls(text: str) -> set[str]:
    return {c for c in text if c in _CONTROLS}


def test_ls_in_a_pipe_writes_no_escape_sequence_a_client_put_in_a_name(
    hostile: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mended: rich strips BEL, BS and CR from a Text but not ESC, so the namespace and tenant
    names reach stdout with their escape sequences whole."""
    status, out = _ctl(capsys, hostile, "ls")
    assert status == 0
    assert "evil" in out  # the namespace is listed ...
    assert _controls(out) == set(), repr(out)  # ... without the sequences its name carries


def test_stats_namespace_in_a_pipe_writes_no_escape_sequence(
    hostile: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mended: ``stats --namespace`` shows the name as given, ESC included."""
    status, out = _ctl(capsys, hostile, "stats", "--namespace", ESCAPES)
    assert status == 0
    assert _controls(out) == set(), repr(out)


@pytest.mark.parametrize("command", [["evict", "--namespace"], ["forget", "--all", "--namespace"]])
def test_a_name_like_a_closing_tag_does_not_break_evict_or_forget(
    hostile: DaemonProcess, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """Mended: the reply line is an f-string printed as rich markup: ``[/x]`` raises
    ``MarkupError`` (a traceback, after the blocks were evicted or forgotten)."""
    status, out = _ctl(capsys, hostile, *command, BAD_TAG)
    assert status == 0
    assert repr(BAD_TAG) in out


@pytest.mark.parametrize("command", [["evict", "--namespace"], ["forget", "--all", "--namespace"]])
def test_a_name_with_markup_is_shown_as_it_is(
    hostile: DaemonProcess, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """Mended: ``[bold]x[/bold]`` is shown as ``'x'``, another namespace's name."""
    status, out = _ctl(capsys, hostile, *command, STYLED)
    assert status == 0
    assert repr(STYLED) in out, out


def test_ls_shows_markup_in_a_name_literally(
    hostile: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """Withstood: table cells are Text, never markup."""
    status, out = _ctl(capsys, hostile, "ls")
    assert status == 0
    assert BAD_TAG in out
    assert STYLED in out


# -- stats --tenants: names from the configuration ----------------------------------------------

TENANT_CONFIG = """
[[tenants]]
name = "{name}"
uids = [4242]
"""


@pytest.mark.parametrize(
    ("name", "shown", "plain"),
    [
        ("[red]acme[/red]", "[red]acme[/red]", True),  # withstood: a Text cell
        ("acme\\u001b[2J\\u001b]0;x\\u0007", "acme", False),  # mended: ESC reached stdout
    ],
    ids=["markup", "escape"],
)
def test_stats_tenants_in_a_pipe_shows_a_tenant_name_without_escapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, shown: str, plain: bool
) -> None:
    config = TENANT_CONFIG.format(name=name)
    with DaemonProcess(tmp_path / "d", config_text=config) as daemon:
        status, out = _ctl(capsys, daemon, "stats", "--tenants")
    assert status == 0
    assert shown in out
    assert _controls(out) == set(), repr(out)
