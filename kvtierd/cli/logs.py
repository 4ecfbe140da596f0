"""The daemon's log records: lines on stderr for people, structured records for machines, and
under the journal the journal's own fields.

systemd connects a service's stderr to journald and says so in ``$JOURNAL_STREAM``
(``device:inode`` of that stream). journald gives each line the unit's default priority (info)
unless the line starts with ``<N>``, the syslog priority (``SyslogLevelPrefix=yes``, the
default), which it strips. So under the journal every text line carries its level's prefix, and
``journalctl -p warning -u kvtierd`` shows exactly the warnings and errors. Every line of a
multi-line record (a traceback) carries it, because journald reads each line as an entry. The
journal stamps the time itself; elsewhere the time starts the line.

The structured formats (``json``, ``logfmt``) are for machines: elsewhere one object (one
``key=value`` line) a record; under the journal each record is sent as one journal entry
through journald's native protocol (``logging_journald``'s transport: ``KEY=value`` fields in a
datagram, a sealed memory file when large), with ``MESSAGE``, ``PRIORITY``, the logger and the
code location, and every field the record carries as ``KVTIERD_<FIELD>`` (``KVTIERD_OPCODE``,
``KVTIERD_TENANT``...), so ``journalctl KVTIERD_TENANT=alpha`` selects by field. A record the
journal cannot take is written to stderr in the structured format instead: nothing is lost.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, TextIO

import structlog
from logging_journald import JournaldTransport

from kvtierd.config import LogFormat
from kvtierd.printable import printable

__all__ = [
    "JOURNAL_SOCKET",
    "JournalFieldsHandler",
    "JournalFormatter",
    "StructuredFormatter",
    "configure_logging",
    "print_error",
    "stream_is_journal",
]

_FORMAT = "%(levelname)s %(name)s: %(message)s"

#: ``logging`` levels to syslog priorities (``<syslog.h>``: 2 crit, 3 err, 4 warning, 6 info,
#: 7 debug).
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a ``logging`` level (levels between two take the lower one's)."""
    return next((priority for level, priority in _PRIORITIES if levelno >= level), 7)


def with_priority(text: str, levelno: int) -> str:
    """``text`` with every line (split at newlines only: the values in it are
    :func:`~kvtierd.printable.printable`) prefixed by the journal's ``<priority>`` of
    ``levelno``."""
    prefix = f"<{syslog_priority(levelno)}>"
    return "\n".join(prefix + line for line in text.split("\n"))


def _printable_values(
    _logger: Any, _name: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: every text value of a record :func:`printable`, so that no value a
    peer chose starts a line or a terminal escape, in JSON or logfmt alike."""
    return {k: printable(v) if isinstance(v, str) else v for k, v in event.items()}


class JournalFormatter(logging.Formatter):
    """Prefixes every line of a record with ``<priority>``."""

    def format(self, record: logging.LogRecord) -> str:
        return with_priority(super().format(record), record.levelno)


def stream_is_journal(stream: TextIO) -> bool:
    """Whether ``stream`` is the journal stream systemd named in ``$JOURNAL_STREAM``."""
    named = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = named.partition(":")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return bool(inode) and (str(st.st_dev), str(st.st_ino)) == (device, inode)


class StructuredFormatter(structlog.stdlib.ProcessorFormatter):
    """A record as one JSON object or one logfmt line (structlog renders it): ``timestamp``
    (UTC, ISO 8601), ``level``, ``logger``, ``event`` (the message), the fields the record was
    given (``extra=``: ``pid``, ``uid``, ``client``, ``namespace``...), and ``exception`` with
    the traceback; with ``journal``, the line starts with its priority, as the text does."""

    def __init__(self, log_format: LogFormat, *, journal: bool) -> None:
        renderer: Any = (
            structlog.processors.JSONRenderer(sort_keys=False)
            if log_format is LogFormat.JSON
            else structlog.processors.LogfmtRenderer(
                key_order=["timestamp", "level", "logger", "event"], drop_missing=True
            )
        )
        super().__init__(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _printable_values,
                renderer,
            ],
            foreign_pre_chain=[
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(),
            ],
        )
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return with_priority(text, record.levelno) if self.journal else text


#: journald's native socket.
JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
#: The attributes every ``LogRecord`` has: the rest are the fields a record was given.
_RECORD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_FIELD_NAME = re.compile(r"[^A-Z0-9_]")


def record_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields ``record`` was given (``extra=``), by name."""
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _RECORD_ATTRIBUTES and not key.startswith("_")
    }


class JournalFieldsHandler(logging.Handler):
    """Each record as one journal entry of fields (the module docstring says which); what the
    journal does not take goes to ``fallback`` instead."""

    def __init__(self, fallback: logging.Handler, socket_path: Path | None = None) -> None:
        super().__init__()
        # Addressed at each send, as sd_journal_sendv() does: a journald restarted meanwhile
        # (its socket replaced) is reached again, and an absent one is only a failed send.
        self._transport = JournaldTransport(socket_path or JOURNAL_SOCKET, connected=False)
        self._fallback = fallback
        self.setFormatter(logging.Formatter("%(message)s"))

    def close(self) -> None:
        self._transport.socket.close()
        self._fallback.close()
        super().close()

    def fields(self, record: logging.LogRecord) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = [
            ("MESSAGE", printable(self.format(record))),
            ("PRIORITY", syslog_priority(record.levelno)),
            ("SYSLOG_IDENTIFIER", "kvtierd"),
            ("KVTIERD_LOGGER", record.name),
            ("CODE_FILE", record.pathname),
            ("CODE_LINE", record.lineno),
            ("CODE_FUNC", record.funcName),
        ]
        for key, value in record_fields(record).items():
            name = "KVTIERD_" + _FIELD_NAME.sub("_", key.upper())[:56]
            out.append((name, printable(value) if isinstance(value, str) else str(value)))
        return out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._transport.send(self.fields(record))
        except Exception:  # journald away or refusing: the record still goes somewhere
            self._fallback.handle(record)


def configure_logging(
    level: str, stream: TextIO = sys.stderr, log_format: LogFormat = LogFormat.TEXT
) -> None:
    """Log at ``level`` and above to ``stream`` in ``log_format``; when ``stream`` is the
    journal, text lines carry their priority first and structured records go to the journal
    as fields."""
    handler: logging.Handler = logging.StreamHandler(stream)
    journal = stream_is_journal(stream)
    if log_format is not LogFormat.TEXT:
        handler.setFormatter(StructuredFormatter(log_format, journal=journal))
        if journal:  # the journal's own fields, the structured line where it refuses one
            handler = JournalFieldsHandler(fallback=handler)
    elif journal:
        handler.setFormatter(JournalFormatter(_FORMAT))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s " + _FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def print_error(text: str, stream: TextIO = sys.stderr) -> None:
    """Print why the daemon stops (before or instead of logging): at error priority, every
    line, when ``stream`` is the journal, so ``journalctl -p err`` shows it."""
    print(with_priority(text, logging.ERROR) if stream_is_journal(stream) else text, file=stream)
