"""Real prompts for the engine tools: LooGLE-format documents turned into chat prompts of an
exact token length, and follow-up turns that extend a conversation token for token.

LooGLE files (``../shared/data/loogle/*.jsonl``) hold one JSON object per line with the
document in ``input`` and, in the QA sets, ``qa_pairs``: a list of ``{"Q": ..., "A": ...}``
(stored as a Python literal string in the released files). A conversation is built by
concatenating token ids (never by re-tokenising the whole text), so every later turn starts
with exactly the tokens of the turns before it: the property prefix caching relies on.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["QaDocument", "document_prompt", "follow_up", "read_qa_documents"]

_MARK = "\x00kvtierd-document\x00"
_DEFAULT_QUESTION = "Summarise the document in three sentences."


@dataclass(frozen=True)
class QaDocument:
    """A long document, its title and its questions (possibly none), with each question's
    reference answer and the passage of the document it rests on (``""`` where the file
    gives none)."""

    title: str
    text: str
    questions: tuple[str, ...]
    answers: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()


def _pairs(raw: Any) -> list[dict[str, Any]]:
    """The ``{"Q", "A", "S"}`` objects of ``qa_pairs`` that have a question."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            try:
                raw = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                return []
    if not isinstance(raw, list):
        return []
    return [p for p in raw if isinstance(p, dict) and isinstance(p.get("Q"), str)]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def read_qa_documents(path: str | Path) -> list[QaDocument]:
    """Every document of a LooGLE-format JSONL file, in file order.

    Raises:
        OSError: the file cannot be read.
        ValueError: a non-blank line is not a JSON object with a string ``input``.
    """
    documents: list[QaDocument] = []
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
            pairs = _pairs(record.get("qa_pairs"))
            documents.append(
                QaDocument(
                    title=title if isinstance(title, str) and title else f"line {number}",
                    text=record["input"],
                    questions=tuple(p["Q"] for p in pairs),
                    answers=tuple(_text(p.get("A")) for p in pairs),
                    evidence=tuple(_text(p.get("S")) for p in pairs),
                )
            )
    return documents


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return str(text)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def document_prompt(
    tokenizer: Any, document: str, question: str | None, *, tokens: int
) -> list[int]:
    """Token ids of a one-turn chat prompt of exactly ``tokens`` tokens: the chat template
    around the start of ``document`` (cut to fit) followed by ``question``.

    Raises:
        ValueError: ``document`` is too short for ``tokens``, or ``tokens`` cannot even hold
            the template and the question.
    """
    question = question or _DEFAULT_QUESTION
    content = f"Read this document.\n\n{_MARK}\n\nQuestion: {question}"
    head_text, tail_text = _render(tokenizer, [{"role": "user", "content": content}]).split(_MARK)
    head, tail = _encode(tokenizer, head_text), _encode(tokenizer, tail_text)
    room = tokens - len(head) - len(tail)
    if room <= 0:
        raise ValueError(f"{tokens} tokens cannot hold the template and the question")
    body = _encode(tokenizer, document)
    if len(body) < room:
        raise ValueError(f"the document has {len(body)} tokens, the prompt needs {room}")
    return head + body[:room] + tail


def follow_up(
    tokenizer: Any, conversation: list[int], answer: list[int], question: str
) -> list[int]:
    """The next turn's prompt: ``conversation`` (the previous prompt), the ``answer`` generated
    for it, then ``question`` as a new user turn and the assistant's opening."""
    closing = "" if answer and answer[-1] == tokenizer.eos_token_id else str(tokenizer.eos_token)
    turn = _render(tokenizer, [{"role": "user", "content": question}])
    # The template repeats its system turn for a lone message: keep the user turn only.
    user = turn[turn.rindex("<|im_start|>user") :] if "<|im_start|>user" in turn else turn
    return conversation + answer + _encode(tokenizer, closing + "\n" + user)
