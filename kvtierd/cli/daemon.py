"""``kvtierd``: run the daemon in the foreground (systemd's ``Type=notify`` service).

Flags override the configuration file, which overrides the embedded defaults. Before the arena
is created the daemon checks everything that could stop it (:mod:`kvtierd.server.preflight`)
and refuses to start on the first run of any failure, one line each. ``kvtierd --check`` runs
the same checks, prints what the host gives the daemon and what it would fall back from, and
exits. ``kvtierd --check --as-unit`` judges the start the installed systemd unit will make
(:mod:`kvtierd.server.unitfile`): run as root, it becomes the unit's ``User=`` first.

Exit status: 0 after a clean stop (``--check``: the daemon would start), 2 for an invalid
configuration or command line, 1 when the environment stops the daemon (no memory for the
arena, no room for the data file, socket or port in use, a read-only directory), 130 when
interrupted before it was serving.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import re
import shlex
import sys
import threading
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from kvtierd import __version__
from kvtierd.cli.logs import configure_logging, print_error
from kvtierd.client import connect
from kvtierd.config import Config, Runtime, load_config
from kvtierd.config_render import Difference, config_digest, differences, load_rendered
from kvtierd.errors import AccessDeniedError, ConfigError, KvtierError
from kvtierd.nixl.agent import exit_process, nixl_loaded
from kvtierd.printable import printable
from kvtierd.server import activation
from kvtierd.server.checks import CheckStatus, Fault, HostCheck, exit_status, render
from kvtierd.server.daemon import serve_daemon
from kvtierd.server.preflight import (
    check_config_error,
    check_copy_module,
    check_host,
    lock_holder,
    probe_io_uring,
)
from kvtierd.server.reload import LIVE_FIELDS
from kvtierd.server.unitfile import ServiceUnit, assume_user, read_unit
from kvtierd.store.copyhash import CopyHasher

__all__ = ["main", "parse_args"]

#: Each flag that overrides a configuration field: (section, field) -> (flag, help).
FLAGS: dict[tuple[str, str], tuple[str, str]] = {
    ("daemon", "socket"): ("--socket", "Unix socket path"),
    ("daemon", "data_dir"): ("--data-dir", "state directory"),
    ("dram", "size"): ("--dram-size", "arena size, e.g. 512M or 4G"),
    ("nvme", "size"): ("--nvme-size", "NVMe tier size, 0 disables it"),
    ("daemon", "runtime"): ("--runtime", "event loop: asyncio or trio"),
    ("daemon", "log_level"): ("--log-level", "debug, info, warning or error"),
}


def _attribute(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _parser(*, exit_on_error: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtierd", description=__doc__.splitlines()[0], exit_on_error=exit_on_error
    )
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    for (section, field), (flag, text) in FLAGS.items():
        choices = [r.value for r in Runtime] if flag == "--runtime" else None
        parser.add_argument(flag, choices=choices, help=f"{text} ({section}.{field})")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the configuration and what this host gives the daemon, one line each, "
        "then exit: 0 when the daemon would start as configured",
    )
    parser.add_argument(
        "--as-unit",
        nargs="?",
        const="",
        metavar="UNIT_FILE",
        help="with --check: judge the start the systemd unit will make (its User=, the "
        "directories it makes, its limits and sandbox), reading kvtierd.service as installed "
        "or UNIT_FILE, with its drop-ins; run as root, the checks run as the unit's user",
    )
    parser.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.as_unit is not None and not args.check:
        parser.error("--as-unit goes with --check")
    return args


def _given(args: argparse.Namespace) -> dict[tuple[str, str], tuple[str, Any]]:
    """The fields the command line set: (section, field) -> (flag, value)."""
    return {
        where: (flag, getattr(args, _attribute(flag)))
        for where, (flag, _) in FLAGS.items()
        if getattr(args, _attribute(flag)) is not None
    }


def build_config(args: argparse.Namespace) -> Config:
    """The configuration the flags and the file give; raises :class:`ConfigError`."""
    overrides: dict[str, dict[str, Any]] = {}
    for (section, field), (_, value) in _given(args).items():
        overrides.setdefault(section, {})[field] = value
    flags = {where: flag for where, (flag, _) in _given(args).items()}
    return load_config(args.config, overrides, flags=flags)


def blame(args: argparse.Namespace) -> dict[str, str]:
    """``"dram.size" -> "--dram-size"`` for every field a flag set."""
    return {f"{section}.{field}": flag for (section, field), (flag, _) in _given(args).items()}


def main(argv: list[str] | None = None) -> int:
    """The daemon's entry point; its exit status. A daemon that loaded NIXL (``nixl.enabled``)
    ends here through :func:`~kvtierd.nixl.agent.exit_process`, since NIXL's native objects
    crash in the interpreter's shutdown and would turn any status into 139."""
    try:
        status = _main(argv)
    except BaseException:
        if not nixl_loaded():
            raise
        traceback.print_exc()
        status = 1
    if nixl_loaded():
        logging.shutdown()
        exit_process(status)
    return status


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    try:
        return check(args) if args.check else run(args)
    except KeyboardInterrupt:
        print_error("kvtierd: interrupted")
        return 130


def check(args: argparse.Namespace) -> int:
    """``kvtierd --check``: print every check, one line each; the exit status of a start. With
    ``--as-unit`` the ``unit`` line comes first (:func:`adopt_unit`), alone when the unit
    cannot be adopted."""
    unit, checks = None, []
    if args.as_unit is not None:
        unit, adopted = adopt_unit(args)  # with the arguments the unit's ExecStart= gives
        checks.append(adopted)
    source = str(args.config) if args.config else "the embedded defaults"
    judged = unit is not None or args.as_unit is None
    if judged:
        checks += _checks(args, source, unit)
    print(render(checks))
    if judged:
        with contextlib.suppress(ConfigError):  # the config lines say why: nothing to compare
            print(against_running(build_config(args)))
    status = exit_status(checks)
    failed = sum(c.status is CheckStatus.FAIL for c in checks)
    print(
        f"kvtierd would start ({source})"
        if status == 0
        else f"kvtierd would not start: {failed} problem(s) above (exit status {status})"
    )
    return status


#: How long ``--check`` waits for the running daemon's configuration, in all.
COMPARE_TIMEOUT_S = 10.0


def against_running(config: Config) -> str:
    """What ``config`` changes against the daemon that runs on its socket now (CONFIG): each
    field that differs, old and new; or why there is nothing to compare. At most
    :data:`COMPARE_TIMEOUT_S` (the exchange runs in a thread given up after it), and whatever
    the other side answers is printed escaped: it may not be a kvtierd."""
    answer: list[str] = []
    asking = threading.Thread(target=lambda: answer.append(_compare(config)), daemon=True)
    asking.start()
    asking.join(COMPARE_TIMEOUT_S)
    if not answer:
        return (
            f"running daemon on {config.socket_path}: no configuration within "
            f"{COMPARE_TIMEOUT_S:g} s, nothing compared"
        )
    return answer[0]


def _compare(config: Config) -> str:
    socket = config.socket_path
    if lock_holder(config.data_path) is None:  # never connect then: systemd's socket would
        return f"no running daemon to compare with (none holds {config.data_path})"  # start one
    try:
        with connect(socket, client_name="kvtierd --check", timeout_s=2.0) as client:
            running = client.configuration()
    except AccessDeniedError:
        return f"running daemon on {socket}: its configuration is shown to root and its own user"
    except KvtierError as exc:
        return f"no running daemon to compare with on {socket} ({printable(str(exc))})"
    digest = str(running["digest"])
    if re.fullmatch(r"[0-9a-f]{64}", digest) is None:
        return f"running daemon on {socket}: answered no configuration digest, nothing compared"
    source = str(running["source"])
    if printable(source) != source:  # what answered is not a kvtierd: say nothing it wrote
        source = "a source with control characters, not shown"
    where = f"running daemon on {socket} ({source}, digest {digest[:16]})"
    if digest == config_digest(config):
        return f"{where}: runs exactly this configuration"
    try:
        found = differences(load_rendered(str(running["toml"])), config)
    except Exception as exc:  # not a configuration: whatever answered, --check goes on
        return f"{where}: answered a configuration that cannot be read ({printable(repr(exc))})"

    def line(d: Difference) -> str:
        how = "reload" if d.name in LIVE_FIELDS else "restart"
        return f"  {d.name}: {printable(d.before)} -> {printable(d.after)} ({how})"

    head = (
        f"{where}: this configuration differs in {len(found)} field(s), applied by "
        "systemctl reload (SIGHUP) or by a restart, as each says:"
    )
    return "\n".join([head, *map(line, found)])


def _checks(args: argparse.Namespace, source: str, unit: ServiceUnit | None) -> list[HostCheck]:
    try:
        config = build_config(args)
    except ConfigError as exc:
        return check_config_error(exc)
    verdict = probe_io_uring(config, use_cache=False)
    valid = HostCheck("config", CheckStatus.OK, f"valid: {source}")
    checks = [valid, *check_host(config, verdict, blame(args), restart=True, unit=unit)]
    return [*checks, check_copy_module(CopyHasher().verdict(wait=True))]


def adopt_unit(args: argparse.Namespace) -> tuple[ServiceUnit | None, HostCheck]:
    """For ``--check --as-unit``: read the unit, then stand where its start will: the unit's
    user (as root, become it), its working directory ``/`` (the paths of ``args`` made absolute
    first), the environment it gives (``$RUNTIME_DIRECTORY``, ``$STATE_DIRECTORY``, none of
    the shell's ``$KVTIERD_SOCKET``). The unit, or ``None`` with the failed ``unit`` line."""
    try:
        unit = read_unit(Path(args.as_unit) if args.as_unit else None)
    except (OSError, ValueError) as exc:
        why = f"cannot read the unit: {exc}"
        return None, HostCheck("unit", CheckStatus.FAIL, why, Fault.ENVIRONMENT)
    try:
        overridden = _take_unit_arguments(args, unit)
    except ValueError as exc:
        return None, HostCheck("unit", CheckStatus.FAIL, str(exc), Fault.CONFIGURATION)
    for attribute in ("config", "socket", "data_dir"):
        if (value := getattr(args, attribute)) is not None:
            setattr(args, attribute, type(value)(os.path.abspath(value)))
    try:
        assume_user(unit)
    except (KeyError, PermissionError) as exc:
        why = str(exc.args[0] if isinstance(exc, KeyError) else exc.strerror)
        return None, HostCheck("unit", CheckStatus.FAIL, why, Fault.ENVIRONMENT)
    os.environ.pop("KVTIERD_SOCKET", None)
    for variable, directories in (
        ("RUNTIME_DIRECTORY", unit.runtime_directories),
        ("STATE_DIRECTORY", unit.state_directories),
    ):
        os.environ.pop(variable, None)
        if directories:
            os.environ[variable] = ":".join(str(d) for d in directories)
    if (problem := unit.program_problem()) is not None:
        return unit, HostCheck("unit", CheckStatus.FAIL, problem, Fault.ENVIRONMENT)
    note = f" (judged with ExecStart='s {'; '.join(overridden)})" if overridden else ""
    return unit, HostCheck("unit", CheckStatus.OK, unit.describe() + note)


def _take_unit_arguments(args: argparse.Namespace, unit: ServiceUnit) -> list[str]:
    """Make ``args`` what the unit's ``ExecStart=`` gives the daemon (``--config`` and every
    flag it sets), as the start will have them; what differed from the flags given to
    ``--check``, one phrase each. Raises ``ValueError`` for words kvtierd would refuse."""
    words = list(unit.arguments)
    expanded = [w for w in words if "$" in w or "%" in w]
    if expanded:  # systemd expands them at start; what they become is not known here
        raise ValueError(
            f"ExecStart= gives kvtierd {shlex.join(expanded)}, which systemd expands at start: "
            "--check --as-unit cannot judge that; write the values in ExecStart="
        )
    refused = "ExecStart= gives kvtierd arguments it does not start with: {}"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            given, unknown = _parser(exit_on_error=False).parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as exc:  # a bad value; --help, --version
        why = exc if isinstance(exc, argparse.ArgumentError) else shlex.join(words)
        raise ValueError(refused.format(why)) from None
    if unknown or given.check or given.as_unit is not None:
        raise ValueError(refused.format(shlex.join(unknown or ["--check"])))
    overridden = []
    for flag in ("--config", *(flag for flag, _ in FLAGS.values())):
        attribute = _attribute(flag)
        value = getattr(given, attribute)
        if value is None:
            continue
        before = getattr(args, attribute)
        if before is not None and str(before) != str(value):
            overridden.append(f"{flag} {value}, not {before} as given to --check")
        setattr(args, attribute, value)
    return overridden


def run(args: argparse.Namespace) -> int:
    """Check, then serve until stopped."""
    try:
        config = build_config(args)
    except ConfigError as exc:
        print_error(f"kvtierd: {exc}")  # the file, then one line per problem
        return 2
    try:  # before anything opens a descriptor: LISTEN_FDS names descriptors from 3 on
        activation.claim(config.socket_path)
    except ConfigError as exc:
        print_error(f"kvtierd: {exc}")
        return 2
    configure_logging(config.daemon.log_level.value, log_format=config.daemon.log_format)
    verdict = probe_io_uring(config, use_cache=True)
    checks = check_host(config, verdict, blame(args))
    if exit_status(checks):
        return _refuse(checks)
    backend = config.daemon.runtime.value
    options = {"use_uvloop": True} if backend == "asyncio" and _have_uvloop() else {}
    source = f"config {args.config}" if args.config else "the embedded defaults"
    serve = partial(
        serve_daemon,
        config,
        startup=checks,
        io_verdict=verdict,
        source=source,
        reread=partial(build_config, args),
    )
    try:
        anyio.run(serve, backend=backend, backend_options=options)
    except BaseExceptionGroup as group:
        return _report(_first_leaf(group))
    except (KvtierError, OSError) as exc:
        return _report(exc)
    return 0


def _refuse(checks: list[HostCheck]) -> int:
    """Print each failed check as one line; the exit status they call for."""
    for failure in (c for c in checks if c.status is CheckStatus.FAIL):
        print_error(f"kvtierd: {failure.detail}")
    return exit_status(checks)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _report(exc: BaseException) -> int:
    """Print a start-up failure as one line; re-raise what is not an expected failure."""
    if isinstance(exc, ConfigError):
        print_error(f"kvtierd: {exc}")
        return 2
    if isinstance(exc, KvtierError | OSError):
        print_error(f"kvtierd: cannot run: {exc}")
        return 1
    raise exc


def _have_uvloop() -> bool:
    return importlib.util.find_spec("uvloop") is not None


if __name__ == "__main__":
    sys.exit(main())
