"""Configuration files for the daemons tests start, written from tables (tomli_w), so that a
test names what it sets rather than repeating TOML text."""

from __future__ import annotations

from typing import Any

import tomli_w

__all__ = ["config_text", "tenant_table"]


def tenant_table(
    name: str, *, uids: tuple[int, ...] = (), gids: tuple[int, ...] = (), **more: Any
) -> dict[str, Any]:
    """One ``[[tenants]]`` table."""
    table: dict[str, Any] = {"name": name}
    if uids:
        table["uids"] = list(uids)
    if gids:
        table["gids"] = list(gids)
    return {**table, **more}


def config_text(*tenants: dict[str, Any], **sections: dict[str, Any]) -> str:
    """A configuration file of ``sections`` (``daemon={"socket_mode": "0666"}``) and
    ``tenants``."""
    tables: dict[str, Any] = dict(sections)
    if tenants:
        tables["tenants"] = list(tenants)
    return tomli_w.dumps(tables)
