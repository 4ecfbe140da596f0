"""The TTFT benchmark's command line and records, without a model or an engine: the engines,
cases and groups a command names, what it records, and the sections re-rendered from the saved
results in ``docs/benchmarks/``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools import benchlib
from tools.ttft import cli
from tools.ttft.cases import ENGINES, HF_CASES
from tools.ttft.report import write_docs


def test_an_unknown_engine_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["--engine", "sglang"])
    assert exit_.value.code == 2
    assert "invalid choice: 'sglang'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "unknown"),
    [
        (["--cases", "pool,vllm_prefix"], "engine hf has no case vllm_prefix"),
        (
            ["--engine", "vllm", "--cases", "kvtierd_dram, partial"],
            "engine vllm has no case partial",
        ),
    ],
)
def test_an_unknown_case_is_a_usage_error_naming_the_engines_cases(
    argv: list[str], unknown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert unknown in err
    engine = ENGINES["vllm" if "vllm" in argv else "hf"]
    assert f"its cases: {', '.join(engine.cases)}" in err


def test_another_engines_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--engine", "vllm", "--stock-attention"])
    assert "unrecognized arguments: --stock-attention" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "cases", "groups"),
    [
        ([], HF_CASES, ("daemon",)),
        (["--cases", "pool"], ("pool",), ("pool",)),
        (["--cases", "pool,partial"], ("partial", "pool"), ("daemon", "pool")),
        (
            ["--engine", "vllm", "--cases", "kvtierd_nvme_cold"],
            ("kvtierd_nvme_cold",),
            ("vllm", "kvtierd"),
        ),
        (
            ["--engine", "vllm"],
            ENGINES["vllm"].cases,
            ("vllm", "kvtierd", "kvtierd_whole", "vllm_fs", "kvtierd_tier"),
        ),
    ],
)
def test_cases_run_in_their_groups_the_reference_always(
    argv: list[str], cases: tuple[str, ...], groups: tuple[str, ...]
) -> None:
    args = cli.parse_args(argv)
    assert (args.cases, args.groups) == (cases, groups)


@pytest.mark.parametrize(("engine", "repeats"), [("hf", 5), ("vllm", 3)])
def test_repeats_default_per_engine(engine: str, repeats: int) -> None:
    assert cli.parse_args(["--engine", engine]).repeats == repeats


@pytest.mark.parametrize(
    ("argv", "recorded"),
    [
        ([], True),
        (["--engine", "vllm"], True),
        (["--tokens", "1024"], False),
        (["--no-record"], False),
        (["--cases", "pool"], False),
        (["--engine", "vllm", "--cases", "kvtierd_dram"], False),
        (["--cases", ",".join((*HF_CASES, "pool"))], True),
        (["--tokens", "1024", "--docs", "elsewhere.md"], True),
    ],
)
def test_only_a_full_run_or_docs_records(argv: list[str], recorded: bool) -> None:
    assert cli.records(cli.parse_args(argv)) is recorded


def test_docs_needs_every_case_of_the_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--cases", "dram", "--docs", "elsewhere.md"])
    assert "--docs needs every case of the section" in capsys.readouterr().err


def _section(text: str, name: str) -> list[str]:
    """The lines of section ``name`` but its machine line (whose format has grown since)."""
    found = re.search(rf"<!-- BEGIN {name} -->\n(.*?)<!-- END {name} -->", text, re.S)
    assert found is not None
    return [line for line in found.group(1).splitlines() if not line.startswith("Machine:")]


@pytest.mark.parametrize("section", ["ttft", "vllm_ttft"])
def test_a_saved_result_renders_the_recorded_section(tmp_path: Path, section: str) -> None:
    docs = tmp_path / "benchmarks.md"
    saved = benchlib.ASSETS / f"{section}.json"
    assert cli.main(["--from-json", str(saved), "--docs", str(docs)]) == 0
    assert _section(docs.read_text(), section) == _section(benchlib.DOC.read_text(), section)
    assert (tmp_path / "benchmarks" / f"{section}.png").stat().st_size > 0
    assert json.loads((tmp_path / "benchmarks" / f"{section}.json").read_text()) == json.loads(
        saved.read_text()
    )
    assert benchlib.DOC == benchlib.ROOT / "docs" / "benchmarks.md"


def test_another_benchmarks_result_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a TTFT result: benchmark 'pool'"):
        write_docs({"benchmark": "pool", "results": {}}, tmp_path / "benchmarks.md")
    assert not (tmp_path / "benchmarks.md").exists()
