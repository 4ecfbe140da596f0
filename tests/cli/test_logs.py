"""Log lines carry their syslog priority exactly when stderr is the journal's stream; under the
journal the structured formats are the journal's own fields."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from kvtierd.cli import logs
from kvtierd.cli.logs import (
    JournalFormatter,
    StructuredFormatter,
    configure_logging,
    stream_is_journal,
    syslog_priority,
)
from kvtierd.config import LogFormat


def test_priorities() -> None:
    assert [syslog_priority(level) for level in (10, 20, 25, 30, 40, 50)] == [7, 6, 6, 4, 3, 2]


def test_every_line_of_a_record_is_prefixed() -> None:
    formatter = JournalFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord("kvtierd.pool", logging.ERROR, __file__, 1, "a\nb", None, None)
    assert formatter.format(record) == "<3>ERROR kvtierd.pool: a\n<3>b"


def test_the_journal_is_recognised_by_device_and_inode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open(tmp_path / "stream", "w") as stream, open(tmp_path / "other", "w") as other:
        st = (tmp_path / "stream").stat()
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert stream_is_journal(stream)
        assert not stream_is_journal(other)
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not stream_is_journal(stream)


def _record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("kvtierd", logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    return record


def test_json_lines_carry_the_records_fields() -> None:
    formatter = StructuredFormatter(LogFormat.JSON, journal=False)
    line = formatter.format(
        _record("READ from %s failed", "pid 7 uid 1000", uid=1000, errno="ENOENT")
    )
    fields = json.loads(line)
    assert fields["event"] == "READ from pid 7 uid 1000 failed"
    assert (fields["level"], fields["logger"], fields["uid"], fields["errno"]) == (
        "warning",
        "kvtierd",
        1000,
        "ENOENT",
    )
    assert fields["timestamp"].endswith("Z")


def test_logfmt_and_the_journal_prefix() -> None:
    formatter = StructuredFormatter(LogFormat.LOGFMT, journal=True)
    line = formatter.format(_record("store ready", blocks=3))
    assert line.startswith("<4>timestamp=")
    assert " level=warning logger=kvtierd event=" in line
    assert line.endswith("blocks=3")


def test_configure_logging_in_json(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w") as stream:
        configure_logging("info", stream, LogFormat.JSON)
        try:
            logging.getLogger("kvtierd.test").info("hello %s", "there", extra={"uid": 5})
        finally:
            configure_logging("warning")  # back to stderr for the other tests
    fields = json.loads((tmp_path / "log").read_text())
    assert (fields["event"], fields["uid"]) == ("hello there", 5)


def _journal_entry(datagram: bytes) -> dict[str, str]:
    """A datagram of journald's native protocol as fields (``KEY=value`` lines, or ``KEY``, a
    little-endian 64-bit length and that many bytes for a value with a newline)."""
    fields: dict[str, str] = {}
    rest = datagram
    while rest:
        head, newline, tail = rest.partition(b"\n")
        assert newline
        if b"=" in head:
            key, _, value = head.partition(b"=")
            fields[key.decode()] = value.decode()
            rest = tail
        else:
            size = int.from_bytes(tail[:8], "little")
            fields[head.decode()] = tail[8 : 8 + size].decode()
            assert tail[8 + size : 9 + size] == b"\n"
            rest = tail[9 + size :]
    return fields


@pytest.mark.parametrize("log_format", [LogFormat.JSON, LogFormat.LOGFMT])
def test_under_the_journal_structured_records_are_the_journals_own_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_format: LogFormat
) -> None:
    """A real datagram socket where journald's is: each record one entry, its fields named,
    a peer's newline kept inside its field (never a new entry)."""
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(str(tmp_path / "journal.sock"))
    journal.settimeout(5)
    monkeypatch.setattr(logs, "JOURNAL_SOCKET", tmp_path / "journal.sock")
    with journal, open(tmp_path / "stderr", "w") as stream:
        st = (tmp_path / "stderr").stat()
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        configure_logging("info", stream, log_format)
        try:
            logging.getLogger("kvtierd.session").warning(
                "READ failed: %s",
                "no space",
                extra={"opcode": "READ", "errno": "ENOSPC", "client": "vllm\nrank 0", "uid": 7},
            )
            entry = _journal_entry(journal.recv(65536))
        finally:
            configure_logging("warning")
    assert entry["MESSAGE"] == "READ failed: no space"
    assert entry["PRIORITY"] == "4"
    assert entry["SYSLOG_IDENTIFIER"] == "kvtierd"
    assert entry["KVTIERD_LOGGER"] == "kvtierd.session"
    assert (entry["KVTIERD_OPCODE"], entry["KVTIERD_ERRNO"], entry["KVTIERD_UID"]) == (
        "READ",
        "ENOSPC",
        "7",
    )
    assert "\n" not in entry["KVTIERD_CLIENT"]  # escaped as every value a peer chose
    assert entry["KVTIERD_CLIENT"].startswith("vllm")
    assert (tmp_path / "stderr").read_text() == ""  # nothing written twice


def test_a_journal_that_refuses_gets_the_record_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "JOURNAL_SOCKET", tmp_path / "no-journal.sock")
    with open(tmp_path / "stderr", "w") as stream:
        st = (tmp_path / "stderr").stat()
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        configure_logging("info", stream, LogFormat.JSON)
        try:
            logging.getLogger("kvtierd").error("pool unreachable", extra={"tenant": "alpha"})
        finally:
            configure_logging("warning")
    line = (tmp_path / "stderr").read_text()
    assert line.startswith("<3>{")
    fields = json.loads(line.removeprefix("<3>"))
    assert (fields["event"], fields["tenant"]) == ("pool unreachable", "alpha")
