"""Per-namespace administration: ``ls --keys``, ``stats --namespace``, ``evict --namespace`` and
``forget --namespace`` (by key, or ``--all``).

A namespace is named by what ``kvtierctl ls`` shows: its name, ``TENANT/NAME``, or its id; the
``--tenant``, ``--rank``, ``--world-size``, ``--block-bytes`` and ``--model-id`` options narrow
the choice. It is looked up among the LIST_NS entries, never opened from the options alone,
because OPEN_NS creates what it does not find: a typo would make a new, empty namespace. When
more than one entry matches, the error lists them by id, which always names exactly one.

``forget --all`` pages through LIST_KEYS and FORGETs each page. The pager's guarantee (see
``docs/protocol.md``) makes that remove every key stored from the first page to the last; a key
committed meanwhile may stay, and the namespace itself (its catalog entry) stays.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd.cli.ctl_commands import CommandOptions, connect_daemon, print_json, show
from kvtierd.cli.ctl_records import keys_record, namespace_stats_record
from kvtierd.cli.ctl_views import keys_view, namespace_stats_view
from kvtierd.client import Client, KvtierError, Layout, Namespace
from kvtierd.printable import printable
from kvtierd.protocol.messages import EvictReply, EvictRequest

__all__ = [
    "CommandError",
    "NamespaceSelector",
    "evict_namespace",
    "find_namespace",
    "forget",
    "list_keys",
    "namespace_stats",
]

#: Keys per LIST_KEYS page when ``forget --all`` pages through a namespace.
_FORGET_PAGE = 4096


class CommandError(KvtierError):
    """The command names something the daemon does not have (exit status 1, like any daemon
    error). Never sent on the wire."""

    errno = errno.ENOENT


@dataclass(frozen=True, slots=True)
class NamespaceSelector:
    """Which namespace a command means: ``name`` is a name, ``TENANT/NAME`` or an id; every
    other field narrows the choice (``None`` matches any value)."""

    name: str
    tenant: str | None = None
    rank: int | None = None
    world_size: int | None = None
    block_bytes: int | None = None
    model_id: str | None = None

    def _named(self, info: Mapping[str, Any]) -> bool:
        return self.name in (info["name"], f"{info['tenant']}/{info['name']}", str(info["ns"]))

    def matches(self, info: Mapping[str, Any]) -> bool:
        layout = info.get("layout")
        return (
            self._named(info)
            and self.tenant in (None, info["tenant"])
            and self.rank in (None, info["rank"])
            and self.world_size in (None, info["world_size"])
            and self.block_bytes in (None, info["block_bytes"])
            and self.model_id in (None, layout["model_id"] if layout else None)
        )

    def describe(self) -> str:
        parts = [repr(self.name)]
        for label, value in (("tenant", self.tenant), ("model", self.model_id)):
            if value is not None:
                parts.append(f"{label} {value!r}")
        if self.rank is not None or self.world_size is not None:
            parts.append(f"rank {_or_any(self.rank)}/{_or_any(self.world_size)}")
        if self.block_bytes is not None:
            parts.append(f"{self.block_bytes} bytes per block")
        return ", ".join(parts)


def _or_any(value: int | None) -> str:
    return "*" if value is None else str(value)


def _identity(info: Mapping[str, Any]) -> str:
    layout = info.get("layout")
    model = f", model {printable(layout['model_id'])}" if layout else ""
    return (
        f"id {info['ns']} ({printable(info['tenant'])}/{printable(info['name'])}, "
        f"rank {info['rank']}/"
        f"{info['world_size']}, {info['block_bytes']} bytes per block{model})"
    )


def find_namespace(
    namespaces: Sequence[Mapping[str, Any]], selector: NamespaceSelector
) -> Mapping[str, Any]:
    """The one listed namespace ``selector`` names; raises :class:`CommandError` otherwise."""
    found = [info for info in namespaces if selector.matches(info)]
    if not found:
        raise CommandError(f"no namespace {selector.describe()} (see kvtierctl ls)")
    if len(found) > 1:
        which = "; ".join(_identity(info) for info in found)
        raise CommandError(
            f"{len(found)} namespaces match {selector.describe()}: {which}; name one by its id "
            "or as TENANT/NAME, or add --rank, --block-bytes or --model-id"
        )
    return found[0]


def _open(client: Client, info: Mapping[str, Any]) -> Namespace:
    """Open the listed namespace ``info`` on ``client`` (it exists, so nothing is created)."""
    layout = info.get("layout")
    return client.namespace(
        str(info["name"]),
        block_bytes=int(info["block_bytes"]),
        # A Layout, not the listed dict: the client cannot convert a dict (array-like struct).
        layout=Layout(**layout) if layout else None,
        rank=int(info["rank"]),
        world_size=int(info["world_size"]),
        tenant=str(info["tenant"]),
        create=False,
    )


def list_keys(
    options: CommandOptions, *, selector: NamespaceSelector, after: bytes, limit: int
) -> int:
    """``ls --keys``: one page of the namespace's keys after ``after``."""
    with connect_daemon(options) as client:
        info = find_namespace(client.namespaces(), selector)
        page = client.list_keys(int(info["ns"]), after=after, limit=limit)
    record = keys_record(info, page)
    return show(options, lambda: record, lambda: keys_view(record))


def namespace_stats(options: CommandOptions, *, selector: NamespaceSelector) -> int:
    """``stats --namespace``: the namespace's LIST_NS entry, counters included."""
    with connect_daemon(options) as client:
        info = find_namespace(client.namespaces(), selector)
    record = namespace_stats_record(info)
    return show(options, lambda: record, lambda: namespace_stats_view(record))


def _evict(ns: int) -> Any:
    """EVICT of the namespace open as ``ns`` (an operation for ``Client.run``)."""
    reply: EvictReply = yield EvictRequest(), ns
    return reply.evicted


def evict_namespace(options: CommandOptions, *, selector: NamespaceSelector) -> int:
    """``evict --namespace``: drop the DRAM copies of the namespace's clean, unleased blocks."""
    with connect_daemon(options) as client:
        info = find_namespace(client.namespaces(), selector)
        namespace = _open(client, info)
        evicted = int(client.run(_evict(namespace.handle.ns)))
    if options.json:
        print_json({"namespace": info["name"], "ns": info["ns"], "evicted_blocks": evicted})
    else:
        options.console.print(
            f"evicted {evicted:,} clean blocks of namespace {printable(info['name'])!r} from DRAM"
        )
    return 0


def _forget_all(client: Client, namespace: Namespace, ns_id: int) -> tuple[int, int]:
    """FORGET every key LIST_KEYS shows, a page at a time: ``(listed, forgotten)``."""
    listed = forgotten = 0
    after = b""
    while True:
        page = client.list_keys(ns_id, after=after, limit=_FORGET_PAGE)
        keys = [bytes(k["key"]) for k in page["keys"]]
        if keys:
            listed += len(keys)
            forgotten += namespace.forget(keys)
            after = keys[-1]
        if not page["more"]:
            return listed, forgotten


def forget(
    options: CommandOptions, *, selector: NamespaceSelector, keys: Sequence[bytes] | None
) -> int:
    """Remove ``keys`` (``None``: every key) from every tier of the selected namespace."""
    with connect_daemon(options) as client:
        info = find_namespace(client.namespaces(), selector)
        namespace = _open(client, info)
        if keys is None:
            requested, forgotten = _forget_all(client, namespace, int(info["ns"]))
        else:
            requested, forgotten = len(keys), namespace.forget(keys)
    if options.json:
        print_json({"namespace": info["name"], "requested": requested, "forgotten": forgotten})
    else:
        options.console.print(
            f"forgot {forgotten:,} of {requested:,} keys from namespace {printable(info['name'])!r}"
        )
    return 0
