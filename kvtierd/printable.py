"""Text a peer chose, made safe to print: in a log line, the journal, a terminal or a pipe.

Names and messages that come from clients (a client name, a namespace or tenant name, a
message that quotes a request) reach the journal and ``kvtierctl``'s output. A newline there
would start a line of the attacker's own (a forged log record, a forged verdict), a carriage
return or Unicode's line separators would do the same where journald or a terminal breaks on
them, and an ESC starts a terminal escape sequence. :func:`printable` writes each such character
as a Python escape (``\\x1b``, ``\\u2028``), leaving the rest as it is.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

#: C0 and C1 controls (newline and ESC among them), DEL, and Unicode's line and paragraph
#: separators.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every control character and line separator written as its escape."""
    return _UNSAFE.sub(_escape, text)
