"""The shared pool tier (Valkey/Redis) and the TP-group consensus that attaches to it.

The group names below are loaded on first use: importing a pure module of this package
(``kvtierd.pool.consensus``) does not import redis-py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtierd.pool.group import GroupMembership, GroupState, GroupStatus, RedisLike

__all__ = ["GroupMembership", "GroupState", "GroupStatus", "RedisLike"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtierd.pool import group

        return getattr(group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
