"""``kvtierctl pool status`` and ``kvtierctl pool check``.

``status`` asks the running daemon where it stands with the shared pool: attached or local and
why, the epoch and members of the last group decision, which rank refused, the write-back
backlog, what a restore found and what never reached the pool.

``check`` needs no daemon: it reads the daemon's configuration and runs, from this process, the
checks a rank runs before it votes (connect, TLS, authenticate, a write/read probe), printing each
step, so an operator can tell a wrong CA from a wrong password before starting the group.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvtierd.cli.ctl_commands import CommandOptions, connect_daemon, print_json, show
from kvtierd.cli.ctl_views import format_bytes, format_duration
from kvtierd.config import PoolConfig, load_config
from kvtierd.errors import ConfigError, KvtierError
from kvtierd.pool.connect import connect_pool, pool_address, probe, read_secret

__all__ = ["CheckStep", "pool_check", "pool_status", "pool_status_view"]

_STATE_STYLE = {"attached": "bold green", "local": "bold yellow", "voting": "cyan", "none": "dim"}


def pool_status(options: CommandOptions) -> int:
    with connect_daemon(options) as client:
        record = client.pool_status()
    return show(options, lambda: record, lambda: pool_status_view(record))


def pool_status_view(record: Mapping[str, Any]) -> RenderableType:
    state = str(record["state"])
    headline = Text.assemble(("pool: ", "bold"), (state, _STATE_STYLE.get(state, "bold")))
    if record.get("reason"):
        headline.append(f"  ({record['reason']})")
    if state == "none":
        return headline
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(overflow="ellipsis")  # wraps between words; a longer word is cut
    since = time.time() - float(record["changed_at"]) if record["changed_at"] else None
    members = ", ".join(str(m) for m in record["members"]) or "–"
    rows = [
        ("address", str(record["address"])),
        ("group", f"{record['group']}  (rank {record['rank']} of {record['world_size']})"),
        ("epoch", f"{record['epoch']}  members: {members}"),
        ("since", format_duration(since) if since is not None else "–"),
        ("write policy", str(record["write_policy"])),
        (
            "backlog",
            f"{record['backlog_blocks']} blocks, {format_bytes(record['backlog_bytes'])}",
        ),
        ("written", f"{record['written']} blocks ({record['write_failures']} failed batches)"),
        ("restored", f"{record['restored']} blocks indexed from the pool"),
        ("read from pool", f"{record['pool_hits']} blocks"),
    ]
    if record["skipped"]:
        rows.append(("skipped", f"{record['skipped']} blocks over the backlog limit"))
    for rank, reason in sorted(record["refusals"].items(), key=lambda item: int(item[0])):
        rows.append((f"rank {rank} refused", str(reason)))
    for label, value in rows:
        table.add_row(label, value)
    parts: list[RenderableType] = [headline, table]
    if record["unreached"]:
        parts.append(
            Text(
                f"{record['unreached']} block(s) committed on this rank never reached the pool "
                "and are gone locally: they are not served",
                style="bold red",
            )
        )
    return Group(*parts)


# -- check -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckStep:
    name: str
    ok: bool
    detail: str


async def _check(config: PoolConfig) -> list[CheckStep]:
    steps = [CheckStep("configuration", True, f"{pool_address(config)}, digest {config.digest()}")]
    if config.password_file:
        try:
            read_secret(config.password_file)
            steps.append(CheckStep("credentials", True, f"{config.password_file} is private"))
        except KvtierError as exc:
            return [*steps, CheckStep("credentials", False, str(exc))]
    try:
        client = await connect_pool(config)
    except KvtierError as exc:
        return [*steps, CheckStep("connect", False, str(exc))]
    how = "TLS" if config.tls else "plaintext"
    user = config.username or "default user"
    steps.append(CheckStep("connect", True, f"{how}, authenticated as {user}"))
    try:
        await probe(client, config)
        steps.append(CheckStep("probe", True, "wrote, read back and deleted a value"))
    except KvtierError as exc:
        steps.append(CheckStep("probe", False, str(exc)))
    finally:
        await client.aclose()
    return steps


def pool_check(options: CommandOptions, *, config_path: Path | None) -> int:
    """Run a rank's pre-vote checks against the pool in ``config_path``; 0 when all pass. A
    configuration that names no pool (or does not load) fails the first step."""
    try:
        config = load_config(config_path).pool
        if not config.url:
            where = config_path or "the defaults"
            raise ConfigError(f"no pool is configured in {where} (pool.url)")
    except ConfigError as exc:
        if not options.json:
            raise
        detail = " ".join(str(exc).splitlines())
        steps = [CheckStep("configuration", False, detail)]
    else:
        steps = anyio.run(_check, config)
    ok = all(step.ok for step in steps)
    if options.json:
        print_json({"ok": ok, "steps": [dataclasses.asdict(s) for s in steps]})
    else:
        for step in steps:
            mark = Text("ok  ", style="green") if step.ok else Text("FAIL", style="bold red")
            options.console.print(Text.assemble(mark, f" {step.name}: ", step.detail))
    return 0 if ok else 1
