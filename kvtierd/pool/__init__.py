"""The shared pool tier (Valkey/Redis) and the TP-group consensus that attaches to it."""

from kvtierd.pool.group import GroupMembership, GroupState, GroupStatus, RedisLike

__all__ = ["GroupMembership", "GroupState", "GroupStatus", "RedisLike"]
