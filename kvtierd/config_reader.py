"""Reading configuration tables into structs, with every problem found in one pass.

msgspec's own conversion stops at the first error and words it for a programmer (a regex, a
JSON path). This reader walks a struct's fields itself: each raw value is converted alone
(msgspec for the plain types, a parser for custom types such as sizes, the enum's own lookup,
which may ignore case), its ``Annotated`` bounds are checked here, and each problem becomes one
:class:`ConfigProblem` worded for a person: where it is, what is wrong, which values are allowed.

A struct is built only from valid fields. Its ``__post_init__`` (the rules that relate fields)
raises a :class:`ConfigError` listing each broken rule with ``where`` relative to the struct;
the reader collects those too. A struct with a bad field is not built, so its cross-field rules
are checked in the run after that field is fixed, not against a value already known to be wrong.
"""

from __future__ import annotations

import difflib
import enum
import operator
import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.structs

from kvtierd.errors import ConfigError, ConfigProblem

__all__ = ["read_config"]

S = TypeVar("S", bound=msgspec.Struct)

#: Custom types and how to read them; a parser raises ``ValueError`` with the human message.
Parsers = Mapping[type, Callable[[Any], Any]]

_NOUNS: dict[object, str] = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
}


class _Invalid:
    """What :meth:`_Reader.read` returns for a value it reported."""


_INVALID = _Invalid()


def read_config(
    kind: type[S],
    raw: Mapping[str, Any],
    *,
    parsers: Parsers,
    blame: Mapping[str, str],
    source: Path | None,
) -> S:
    """Build ``kind`` from the parsed TOML ``raw``, or raise :class:`ConfigError` listing every
    problem. ``blame`` maps a field's path (``dram.size``) to the flag that set it; problems in
    that value name the flag. The heading names ``source`` when a problem came from the file."""
    reader = _Reader(parsers, blame)
    config = reader.read(kind, raw, "")
    if isinstance(config, _Invalid) or reader.problems:
        where = f" in {source}" if source is not None and reader.from_file else ""
        raise ConfigError(f"invalid configuration{where}:", reader.problems)
    return typing.cast(S, config)


class _Reader:
    def __init__(self, parsers: Parsers, blame: Mapping[str, str]) -> None:
        self.parsers = parsers
        self.blame = blame
        self.problems: list[ConfigProblem] = []
        self.from_file = False

    def report(self, path: str, message: str) -> _Invalid:
        flag = self.blame.get(path)
        self.from_file = self.from_file or flag is None
        self.problems.append(ConfigProblem(flag or path, message))
        return _INVALID

    def read(self, kind: Any, value: Any, path: str) -> Any:
        """``value`` read as ``kind``, or :data:`_INVALID` once the problem is reported."""
        base, metas = _unwrap(kind)
        if _is_struct(base):
            return self.read_struct(base, value, path)
        if typing.get_origin(base) is list:
            items = self.read_list(typing.get_args(base)[0], value, path)
            most = min((m.max_length for m in metas if m.max_length is not None), default=None)
            if most is not None and isinstance(items, list) and len(items) > most:
                return self.report(path, f"{len(items)} entries; at most {most}")
            return items
        if isinstance(base, type) and issubclass(base, enum.Enum):
            return self.read_enum(base, value, path)
        if base in self.parsers:
            try:
                return self.parsers[base](value)
            except ValueError as exc:
                return self.report(path, str(exc))
        try:
            converted = msgspec.convert(value, base, strict=True)
        except msgspec.ValidationError:
            return self.report(path, f"expected {_noun(base)}, got {_show(value)}")
        for meta in metas:
            if message := _violation(converted, meta, _show(value)):
                return self.report(path, message)
        return converted

    def read_struct(self, kind: type[msgspec.Struct], value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            return self.report(path, f"expected a table, got {_show(value)}")
        fields = {field.encode_name: field for field in msgspec.structs.fields(kind)}
        values: dict[str, Any] = {}
        for key, item in value.items():
            if key not in fields:
                self.report(
                    _join(path, key), _unknown(key, list(fields), table=isinstance(item, dict))
                )
            else:
                name = fields[key].name
                values[name] = self.read(fields[key].type, item, _join(path, key))
                values[name] = self.apply_rule(kind, name, values[name], _join(path, key))
        missing = [key for key, field in fields.items() if field.required and key not in value]
        for key in missing:
            self.report(_join(path, key), "required, but not given")
        if missing or any(isinstance(item, _Invalid) for item in values.values()):
            return _INVALID
        try:
            return kind(**values)
        except ConfigError as exc:
            for problem in exc.problems:
                self.report(_join(path, problem.where), problem.message)
            return _INVALID

    def apply_rule(self, kind: type[msgspec.Struct], name: str, value: Any, path: str) -> Any:
        """``value``, or the report of the one-field rule of ``kind`` it breaks."""
        rule = getattr(kind, "field_rules", {}).get(name)
        if rule is None or isinstance(value, _Invalid) or (message := rule(value)) is None:
            return value
        return self.report(path, message)

    def read_list(self, item_kind: Any, value: Any, path: str) -> Any:
        if not isinstance(value, list):
            noun = "an array of tables" if _is_struct(item_kind) else "an array"
            return self.report(path, f"expected {noun}, got {_show(value)}")
        items = [self.read(item_kind, item, f"{path}[{i}]") for i, item in enumerate(value)]
        return _INVALID if any(isinstance(item, _Invalid) for item in items) else items

    def read_enum(self, kind: type[enum.Enum], value: Any, path: str) -> Any:
        try:
            return kind(value)
        except (ValueError, TypeError):
            allowed = ", ".join(str(member.value) for member in kind)
            return self.report(path, f"{_show(value)} is not one of: {allowed}")


def _unwrap(kind: Any) -> tuple[Any, tuple[msgspec.Meta, ...]]:
    """The type under ``Annotated[...]`` and its msgspec constraints."""
    if typing.get_origin(kind) is typing.Annotated:
        base, *extras = typing.get_args(kind)
        return base, tuple(extra for extra in extras if isinstance(extra, msgspec.Meta))
    return kind, ()


def _is_struct(kind: Any) -> bool:
    base = _unwrap(kind)[0]
    return isinstance(base, type) and issubclass(base, msgspec.Struct)


def _violation(value: Any, meta: msgspec.Meta, shown: str) -> str | None:
    """What ``value`` (written ``shown``) breaks of ``meta``'s constraints, in words, or None."""
    if isinstance(value, str):
        if meta.pattern is not None and not re.search(meta.pattern, value):
            # The description says in words what the pattern allows; the pattern is never shown.
            return f"{shown} is not {meta.description or 'in the expected form'}"
        low, high = meta.min_length or 0, meta.max_length
        if len(value) < low or (high is not None and len(value) > high):
            span = f"{low}..{high}" if high is not None else f"at least {low}"
            return f"{shown} must be {span} characters long"
        return None
    bounds = [
        (meta.ge, "at least", operator.ge),
        (meta.gt, "more than", operator.gt),
        (meta.le, "at most", operator.le),
        (meta.lt, "less than", operator.lt),
    ]
    if all(bound is None or holds(value, bound) for bound, _, holds in bounds):
        return None
    if meta.ge is not None and meta.le is not None:
        return f"{shown} is out of range {meta.ge}..{meta.le}"
    limits = ", ".join(f"{word} {bound}" for bound, word, _ in bounds if bound is not None)
    return f"{shown} is out of range ({limits})"


def _unknown(key: str, known: list[str], *, table: bool = False) -> str:
    """Why ``key`` is refused: an unknown key, or (``table``: its value is a table) an unknown
    section, with the nearest known name."""
    close = difflib.get_close_matches(key, known, n=1)
    if table:
        if close:
            return f"unknown section [{key}] (did you mean [{close[0]}]?)"
        return f"unknown section [{key}] (known: {', '.join(known)})"
    if close:
        return f'unknown key (did you mean "{close[0]}"?)'
    return f"unknown key (known keys: {', '.join(known)})"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and key else path or key


def _noun(kind: Any) -> str:
    return _NOUNS.get(kind, getattr(kind, "__name__", str(kind)))


def _show(value: Any) -> str:
    """``value`` as a person wrote it in TOML, or what kind of value it was."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return str(value)
