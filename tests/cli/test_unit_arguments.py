"""``kvtierd --check --as-unit`` takes the arguments the unit's ``ExecStart=`` gives: each flag
replaces the one given to ``--check`` (and says so), and what it cannot judge fails the unit
line with a reason, never exits the check."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.cli.daemon import _take_unit_arguments, parse_args
from kvtierd.server.unitfile import parse_unit


def _unit(exec_start: str):  # type: ignore[no-untyped-def]
    return parse_unit([f"[Service]\nExecStart={exec_start}\n"])


def test_the_units_flags_replace_those_given_to_check() -> None:
    args = parse_args(["--check", "--as-unit", "--config", "mine.toml", "--dram-size", "1G"])
    said = _take_unit_arguments(
        args, _unit("/usr/bin/kvtierd --config /etc/kvtierd/kvtierd.toml --nvme-size 8G")
    )
    assert args.config == Path("/etc/kvtierd/kvtierd.toml")
    assert (args.dram_size, args.nvme_size) == ("1G", "8G")  # the unit does not set dram
    assert said == ["--config /etc/kvtierd/kvtierd.toml, not mine.toml as given to --check"]


@pytest.mark.parametrize(
    ("exec_start", "reason"),
    [
        ("/usr/bin/kvtierd --colour red", "does not start with: --colour red"),
        ("/usr/bin/kvtierd --config", "does not start with"),  # no value: argparse would exit
        ("/usr/bin/kvtierd --version", "does not start with"),  # prints and exits otherwise
        ("/usr/bin/kvtierd --runtime tokio", "does not start with"),
        ("/usr/bin/kvtierd --check", "does not start with: --check"),
        ("/usr/bin/kvtierd --config ${CONFIG}", "systemd expands at start"),
        ("/usr/bin/kvtierd --data-dir /srv/%i", "systemd expands at start"),
    ],
)
def test_what_cannot_be_judged_is_a_reason_not_an_exit(exec_start: str, reason: str) -> None:
    args = parse_args(["--check", "--as-unit"])
    with pytest.raises(ValueError, match=reason.replace("$", r"\$")):
        _take_unit_arguments(args, _unit(exec_start))
