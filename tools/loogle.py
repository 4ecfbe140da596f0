"""Read LooGLE-format JSONL: one JSON object per line with the long document in ``input``.

The LooGLE files (bigai-nlco/LooGLE) also carry ``title`` and ``qa_pairs``; only ``input`` is
required here, so any JSONL of that shape works (the evaluation tools are run on documents that
are not in the repository). Blank lines are skipped; a line that is not a JSON object with a
string ``input`` raises ``ValueError`` naming the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LoogleDocument", "iter_documents", "read_documents"]


@dataclass(frozen=True)
class LoogleDocument:
    """One document: its text (``input``), its title (or ``line N``) and its 1-based line."""

    text: str
    title: str
    line: int


def iter_documents(path: str | Path) -> Iterator[LoogleDocument]:
    """Yield the documents of ``path`` in file order.

    Raises:
        OSError: the file cannot be read.
        ValueError: a non-blank line is not an object with a string ``input``.
    """
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
            if not isinstance(record, dict) or not isinstance(record.get("input"), str):
                raise ValueError(f"{path}:{number}: expected an object with a string 'input'")
            title = record.get("title")
            yield LoogleDocument(
                text=record["input"],
                title=title if isinstance(title, str) and title else f"line {number}",
                line=number,
            )


def read_documents(path: str | Path, limit: int | None = None) -> list[LoogleDocument]:
    """The first ``limit`` documents of ``path`` (all when ``None``)."""
    out: list[LoogleDocument] = []
    for doc in iter_documents(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(doc)
    return out
