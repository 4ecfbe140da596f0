"""A configuration as people and machines compare it: written back as TOML, its digest, and
the fields in which two configurations differ (pure: no I/O).

:func:`render_config` writes a :class:`~kvtierd.config.Config` as a configuration file that
loads back to the same configuration (sizes as the file writes them: ``"1G"``, not
``1073741824``); ``kvtierctl config`` prints it. :func:`config_digest` is a hash of what the
daemon runs, the same for two daemons exactly when their configurations are (``kvtierd_info``
carries it). :func:`differences` names each field whose value differs, with both values as
TOML writes them: what ``kvtierd --check`` says of a file against the running daemon.
"""

from __future__ import annotations

import hashlib
import tomllib
import typing
from dataclasses import dataclass
from typing import Any

import msgspec
import tomli_w

from kvtierd.config import ByteSize, Config, parse_size, show_size
from kvtierd.config_reader import read_config

__all__ = ["Difference", "config_digest", "differences", "load_rendered", "render_config"]


@dataclass(frozen=True, slots=True)
class Difference:
    """Field ``name`` (``dram.size``, ``tenants``) is ``before`` in one configuration and
    ``after`` in the other, each as TOML writes it."""

    name: str
    before: str
    after: str


def config_digest(config: Config) -> str:
    """SHA-256 (hex) of ``config``'s canonical encoding: equal exactly when the configurations
    are."""
    return hashlib.sha256(msgspec.json.encode(_plain(config))).hexdigest()


def render_config(config: Config) -> str:
    """``config`` as a TOML configuration file, every field, sections in their order (no
    ``tenants`` line when none is listed)."""
    tables = _plain(config)
    if not tables["tenants"]:
        del tables["tenants"]
    return tomli_w.dumps(tables)


def load_rendered(text: str) -> Config:
    """The configuration a configuration file's ``text`` gives (one :func:`render_config`
    wrote: CONFIG's reply); raises :class:`~kvtierd.errors.ConfigError` as loading a file
    does."""
    return read_config(
        Config, tomllib.loads(text), parsers={ByteSize: parse_size}, blame={}, source=None
    )


def differences(before: Config, after: Config) -> list[Difference]:
    """Every field (``section.name``; ``tenants`` whole) whose value differs."""
    old, new = _plain(before), _plain(after)
    found = []
    for section in new.keys() | old.keys():
        a, b = old.get(section), new.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            for name in [*a, *(k for k in b if k not in a)]:
                if a.get(name) != b.get(name):
                    found.append(
                        Difference(f"{section}.{name}", _shown(a.get(name)), _shown(b.get(name)))
                    )
        elif a != b:
            found.append(Difference(section, _shown(a), _shown(b)))
    order = list(Config.__struct_fields__)
    return sorted(found, key=lambda d: (order.index(d.name.split(".")[0]), d.name))


def _plain(value: Any, kind: Any = None) -> Any:
    """``value`` as TOML's plain types: structs as tables, sizes as the file writes them."""
    if isinstance(value, msgspec.Struct):
        hints = typing.get_type_hints(type(value), include_extras=True)
        return {
            field.encode_name: _plain(getattr(value, field.name), hints.get(field.name))
            for field in msgspec.structs.fields(value)
        }
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if _is_size(kind):
        return show_size(int(value))
    return msgspec.to_builtins(value)


def _is_size(kind: Any) -> bool:
    base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind
    return base is ByteSize


def _shown(value: Any) -> str:
    """One value as TOML writes it (``<unset>`` for a field one side lacks)."""
    if value is None:
        return "<unset>"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").strip()
