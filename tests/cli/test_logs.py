"""Log lines carry their syslog priority exactly when stderr is the journal's stream."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtierd.cli.logs import JournalFormatter, stream_is_journal, syslog_priority


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
