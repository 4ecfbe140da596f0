"""``kvtierctl``: inspect and administer a running kvtierd.

Commands: ``status``, ``stats``, ``top``, ``ls``, ``flush``, ``evict``, ``forget``, ``pool``,
``doctor``; see ``docs/kvtierctl.md``. Every command takes ``--socket`` (default
``$KVTIERD_SOCKET`` or the configured path) before or after its name.

Exit status: 0 on success; 1 when the daemon is not running, refused the request or failed
(one line on stderr, never a traceback; with ``--json`` a JSON document on stdout instead:
``status --json`` prints ``{"ready": false, ...}``, the other commands ``{"error": ...}``);
2 for a usage error; 3 when the daemon is still starting; 4 from ``status`` while the daemon
serves degraded (a configured pool not attached, or its disk tier failing); 130 when
interrupted.

On a terminal, tables fit its width and cut a long name with an ellipsis rather than fold it;
in a pipe or a file, lines are plain (no colour or escape codes, no trailing blanks) and as
long as their content (:func:`~kvtierd.cli.ctl_commands.stdout_console`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from rich.console import Console

from kvtierd import __version__
from kvtierd.cli import ctl_commands as commands
from kvtierd.cli import ctl_namespaces, ctl_pool, ctl_top
from kvtierd.cli.ctl_namespaces import NamespaceSelector
from kvtierd.cli.ctl_records import error_record
from kvtierd.client import KvtierError
from kvtierd.config import default_socket_path
from kvtierd.errors import StartingError
from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.protocol import MAX_KEYS_PER_REQUEST

__all__ = ["build_parser", "main"]

PROG = "kvtierctl"
_DEFAULT_TIMEOUT_S = 10.0
_STATUS_EXITS = (
    "Exit status: 0 ready, 4 degraded (pool not attached, disk tier failing), 3 starting, "
    "1 not running."
)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return value


def _natural(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _natural(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _page_size(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_KEYS_PER_REQUEST:
        raise argparse.ArgumentTypeError(f"at most {MAX_KEYS_PER_REQUEST} keys per page")
    return value


def _key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a hexadecimal key: {text!r}") from None
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise argparse.ArgumentTypeError(f"a key is 1 to {MAX_KEY_BYTES} bytes: {text!r}")
    return key


def _connection_options(*, top_level: bool) -> argparse.ArgumentParser:
    """``--socket`` and ``--timeout``, accepted before and after the command name.

    Below the command the defaults are suppressed, so an option given before the command is not
    overwritten by the subparser's default."""
    parent = argparse.ArgumentParser(add_help=False)
    default = None if top_level else argparse.SUPPRESS
    parent.add_argument(
        "--socket",
        metavar="PATH",
        default=default,
        help="the daemon's Unix socket (default: $KVTIERD_SOCKET or the configured path)",
    )
    parent.add_argument(
        "--timeout",
        metavar="S",
        type=_positive_float,
        default=_DEFAULT_TIMEOUT_S if top_level else argparse.SUPPRESS,
        help=f"seconds to wait for each reply (default {_DEFAULT_TIMEOUT_S:g}; "
        "flush waits for FSYNC as long as it takes)",
    )
    parent.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return parent


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and administer a running kvtierd.",
        parents=[_connection_options(top_level=True)],
        epilog="Exit status: 0 ok, 1 daemon not running or request failed, 2 usage error, "
        "3 daemon starting, 4 (status) daemon degraded: its pool not attached or its disk tier "
        "failing. In a pipe or a file the output is plain: no colour, no trailing blanks, "
        "every row on one line.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = [_connection_options(top_level=False)]

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, parents=common)

    status = add("status", "Is the daemon up, degraded or starting: version, tiers, pool.")
    status.epilog = _STATUS_EXITS
    _json_option(status)
    stats = add("stats", "The daemon's statistics: tiers, hit ratios, prefetch, backlog.")
    _namespace_options(stats, "one namespace's blocks and counters instead")
    stats.add_argument(
        "--tenants",
        action="store_true",
        help="one row per tenant instead: its DRAM region's fill, blocks, hits, misses, "
        "evictions and traffic (the caller's own tenants, unless it is root or the daemon's "
        "user)",
    )
    _json_option(stats)
    config = add(
        "config",
        "The configuration the running daemon took: where from, its digest, and the fields "
        "that differ from the defaults, as TOML.",
    )
    config.add_argument(
        "--effective", action="store_true", help="every field, defaults included (a whole file)"
    )
    _json_option(config)
    top = add("top", "Live statistics with per-interval rates; waits out restarts (Ctrl-C quits).")
    top.add_argument(
        "--interval",
        metavar="S",
        type=_positive_float,
        default=1.0,
        help="seconds between refreshes (default 1)",
    )
    top.add_argument(
        "--iterations",
        metavar="N",
        type=_positive_int,
        help="stop after N refreshes (default: until Ctrl-C)",
    )
    top.add_argument("--json", action="store_true", help="one JSON object per refresh and line")
    _ls_options(add("ls", "Namespaces with their block counts per tier, or one's keys."))
    _json_option(
        add(
            "doctor",
            "What this host gives the running daemon and what it falls back from (admin; "
            "before a start, run kvtierd --check).",
        )
    )
    flush = add("flush", "Write every dirty block to disk (FSYNC), with a progress bar.")
    flush.add_argument(
        "--interval",
        metavar="S",
        type=_positive_float,
        default=0.1,
        help="seconds between progress updates (default 0.1)",
    )
    _json_option(flush)
    evict = add("evict", "Drop the DRAM copies of clean blocks of every namespace, or of one.")
    _namespace_options(evict, "only this namespace's (its clients may do it too)")
    _json_option(evict)
    forget = add("forget", "Remove blocks, by key or all, from every tier of one namespace.")
    _forget_options(forget)
    _json_option(forget)
    pool = add("pool", "The shared pool: this rank's standing, or a pre-flight check.")
    pool_sub = pool.add_subparsers(dest="pool_command", metavar="POOL_COMMAND", required=True)
    _json_option(
        pool_sub.add_parser(
            "status",
            parents=common,
            help="attached or local and why, epoch, members, refusals, backlog",
        )
    )
    check = pool_sub.add_parser(
        "check",
        parents=common,
        help="run the checks a rank runs before voting (no daemon needed)",
    )
    check.add_argument(
        "--config", metavar="FILE", type=Path, help="the daemon's configuration (TOML)"
    )
    _json_option(check)
    return parser


_NAMES = "a name, TENANT/NAME or the id kvtierctl ls shows"


def _narrowing_options(parser: argparse.ArgumentParser) -> None:
    """What chooses among namespaces of one name (default: any value)."""
    parser.add_argument("--tenant", metavar="T", help="the namespace's tenant")
    parser.add_argument("--rank", metavar="R", type=_natural, help="its TP rank")
    parser.add_argument("--world-size", metavar="W", type=_positive_int, help="its TP world size")
    parser.add_argument("--block-bytes", metavar="N", type=_positive_int, help="its block size")
    parser.add_argument("--model-id", metavar="ID", help="its layout's model id")


def _namespace_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--namespace", metavar="NAME", help=f"{what}: {_NAMES}")
    _narrowing_options(parser)


def _ls_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", metavar="NAME", help=f"list one namespace's keys: {_NAMES}")
    parser.add_argument(
        "--limit",
        metavar="N",
        type=_page_size,
        default=100,
        help=f"keys per page, 1 to {MAX_KEYS_PER_REQUEST} (default 100)",
    )
    parser.add_argument(
        "--after", metavar="KEYHEX", type=_key, help="start after this key (the last one shown)"
    )
    _narrowing_options(parser)
    _json_option(parser)


def _forget_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", metavar="NAME", required=True, help=_NAMES)
    _narrowing_options(parser)
    parser.add_argument(
        "--all", action="store_true", help="every key of the namespace (the namespace stays)"
    )
    parser.add_argument(
        "keys", metavar="KEYHEX", nargs="*", type=_key, help="block keys in hexadecimal"
    )


def _selector(name: str, args: argparse.Namespace) -> NamespaceSelector:
    return NamespaceSelector(
        name, args.tenant, args.rank, args.world_size, args.block_bytes, args.model_id
    )


def _run(args: argparse.Namespace, options: commands.CommandOptions) -> int:
    command: str = args.command
    named = getattr(args, "namespace", None) or getattr(args, "keys", None)
    if command == "ls" and args.keys is not None:
        selector = _selector(args.keys, args)
        after = args.after or b""
        return ctl_namespaces.list_keys(options, selector=selector, after=after, limit=args.limit)
    if command == "stats" and args.tenants:
        return commands.tenant_stats(options)
    if command == "config":
        return commands.configuration(options, effective=args.effective)
    if command in ("stats", "evict") and named is not None:
        run = (
            ctl_namespaces.namespace_stats if command == "stats" else ctl_namespaces.evict_namespace
        )
        return run(options, selector=_selector(named, args))
    simple: dict[str, Callable[[commands.CommandOptions], int]] = {
        "status": commands.status,
        "stats": commands.stats,
        "ls": commands.ls,
        "evict": commands.evict,
        "doctor": commands.doctor,
    }
    if command in simple:
        return simple[command](options)
    if command == "top":
        return ctl_top.top(options, interval_s=args.interval, iterations=args.iterations)
    if command == "flush":
        return commands.flush(options, interval_s=args.interval)
    if command == "pool":
        if args.pool_command == "status":
            return ctl_pool.pool_status(options)
        return ctl_pool.pool_check(options, config_path=args.config)
    assert command == "forget"
    keys = None if args.all else args.keys
    return ctl_namespaces.forget(options, selector=_selector(args.namespace, args), keys=keys)


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _expected(error: BaseException) -> bool:
    return isinstance(error, KvtierError | TimeoutError)


def _describe(error: BaseException) -> str:
    if not isinstance(error, KvtierError):
        return "the daemon did not answer in time"  # anyio.fail_after's TimeoutError
    if isinstance(error, StartingError):
        phase = str(error).removeprefix("starting: ")
        return f"kvtierd is starting ({phase}); try again when it is ready"
    return " ".join((str(error) or type(error).__name__).splitlines())


def _status_of(error: BaseException) -> int:
    return commands.STARTING_STATUS if isinstance(error, StartingError) else 1


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot say: option combinations (exit status 2)."""
    if args.command == "forget" and bool(args.all) == bool(args.keys):
        parser.error("forget takes KEYHEX... or --all (one of the two)")
    narrowed = any(
        getattr(args, o, None) is not None
        for o in ("tenant", "rank", "world_size", "block_bytes", "model_id")
    )
    named = {"ls": "keys", "stats": "namespace", "evict": "namespace"}.get(args.command)
    if named is not None and narrowed and getattr(args, named) is None:
        parser.error(f"--tenant, --rank, ... narrow --{named}: give it too")
    if args.command == "ls" and args.after is not None and args.keys is None:
        parser.error("--after pages through --keys: give it too")
    if args.command == "stats" and args.tenants and args.namespace is not None:
        parser.error("--tenants and --namespace exclude each other")


def _silence_stdout() -> None:
    """After a broken pipe (``kvtierctl ls | head``), so the interpreter's final flush of
    stdout does not fail again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvtierctl`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Expected failures (the daemon is not running, refused or did not answer) print one line on
    stderr and return 1; anything else is a bug and keeps its traceback. Task groups
    (``flush``) wrap what their tasks raised, so the leaves of a group are judged."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_usage(parser, args)
    options = commands.CommandOptions(
        socket=default_socket_path() if args.socket is None else Path(args.socket),
        timeout_s=args.timeout,
        json=getattr(args, "json", False),
        console=commands.stdout_console(sys.stdout),
        error_console=Console(stderr=True),
    )
    try:
        return _run(args, options)
    except (Exception, KeyboardInterrupt, BaseExceptionGroup) as error:
        leaves = list(_leaves(error))
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
        if any(isinstance(e, BrokenPipeError) for e in leaves):
            _silence_stdout()
            return 1
        if not all(_expected(e) for e in leaves):
            raise
        first = leaves[0]
        if options.json:  # the --json promise: one document on stdout, also on failure
            number = first.errno if isinstance(first, KvtierError) else None
            commands.print_json(error_record(_describe(first), number))
        else:
            print(f"{PROG}: {_describe(first)}", file=sys.stderr)
        return _status_of(first)


if __name__ == "__main__":
    sys.exit(main())
