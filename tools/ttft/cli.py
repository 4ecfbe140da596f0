"""The TTFT benchmark's command line: ``python -m tools.ttft --engine hf|vllm [--cases A,B]
[--tokens N ...]``. Its options are the common ones and those of the engine named (another
engine's options are an error); the run goes to the engine's module, the record to
:mod:`tools.ttft.report`.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from tools.benchlib import emit, log
from tools.fidelity import DEFAULT_DATA, DEFAULT_LENGTHS
from tools.ttft.cases import ENGINES, Engine, UnknownCaseError

__all__ = ["main", "parse_args"]

PROG = "python -m tools.ttft"


def _engine_module(engine: str) -> ModuleType:
    return importlib.import_module(f"tools.ttft.{engine}")


def _parser(engine: Engine) -> argparse.ArgumentParser:
    module = _engine_module(engine.name)
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Time to first token per context length, per engine and case, beside "
        "references measured in the same run (see tools/ttft/__init__.py).",
    )
    parser.add_argument("--engine", choices=list(ENGINES), default="hf", help="default hf")
    parser.add_argument(
        "--cases",
        help=f"comma-separated, of {', '.join(engine.cases)} "
        f"(default: {', '.join(engine.default_cases)})",
    )
    lengths = ", ".join(str(n) for n in DEFAULT_LENGTHS)
    parser.add_argument(
        "--tokens", type=int, action="append", help=f"a context length (repeat; default {lengths})"
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LooGLE-format JSONL")
    parser.add_argument(
        "--repeats",
        type=int,
        default=module.DEFAULT_REPEATS,
        help=f"timed runs of every case (default {module.DEFAULT_REPEATS})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-record", action="store_true", help="leave docs/ untouched")
    parser.add_argument("--docs", type=Path, help="write the section into this file instead")
    parser.add_argument("--from-json", type=Path, help="write the docs from a saved result")
    module.add_arguments(parser.add_argument_group(f"engine {engine.name}"))
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, with ``cases`` (the engine's cases asked for, in its order) and ``groups``
    (the groups that measure them); exits with a usage error for an unknown engine or case, or
    another engine's option."""
    first = argparse.ArgumentParser(prog=PROG, add_help=False)
    first.add_argument("--engine", choices=list(ENGINES), default="hf")
    engine = ENGINES[first.parse_known_args(argv)[0].engine]
    parser = _parser(engine)
    args = parser.parse_args(argv)
    names = args.cases.split(",") if args.cases else engine.default_cases
    try:
        args.cases = engine.select(name.strip() for name in names)
    except UnknownCaseError as exc:
        parser.error(str(exc))
    args.groups = engine.groups_for(args.cases)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.docs is not None and args.from_json is None and not engine.records(args.cases):
        parser.error(f"--docs needs every case of the section: {', '.join(engine.default_cases)}")
    return args


def records(args: argparse.Namespace) -> bool:
    """Whether this run rewrites its section: asked to (``--docs``), or the section's every case
    at the default lengths, not told otherwise (``--no-record``)."""
    if args.docs is not None:
        return True
    return not args.tokens and not args.no_record and ENGINES[args.engine].records(args.cases)


def main(argv: Sequence[str] | None = None) -> int:
    from tools.ttft.report import write_docs

    args = parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        log(f"wrote {write_docs(result, args.docs)}")
        return 0
    module = _engine_module(args.engine)
    reason = module.unavailable(args, args.groups)
    if reason is not None:
        log(f"ttft: cannot run: {reason}")
        return 2
    try:
        result = module.run(args, args.cases, args.groups)
    except ValueError as exc:  # the data cannot make the prompts asked for
        log(f"ttft: cannot run: {exc}")
        return 2
    if records(args):
        log(f"wrote {write_docs(result, args.docs)}")
    emit(result, args.json)
    return 0
