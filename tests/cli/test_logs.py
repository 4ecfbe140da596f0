"""Log lines carry their syslog priority exactly when stderr is the journal's stream."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

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
