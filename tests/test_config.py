"""Configuration: sizes, defaults, overrides, and errors a person can act on.

Every problem is reported at once, one line each, naming the field (or the flag that set it) and
what is wrong in words: allowed values listed, bounds as a range, never a regex.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.config import (
    ByteSize,
    DaemonConfig,
    DramConfig,
    LogLevel,
    NvmePolicyKind,
    PoolConfig,
    load_config,
    parse_size,
)
from kvtierd.errors import ConfigError, ConfigProblem
from kvtierd.io.base import IoBackendKind

FLAGS = {("dram", "size"): "--dram-size", ("daemon", "runtime"): "--runtime"}
SIZE_HINT = "(use bytes or a suffix: K, M, G, T, P)"


def _problems(text: str, tmp_path: Path) -> tuple[ConfigProblem, ...]:
    path = tmp_path / "k.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return caught.value.problems


@pytest.mark.parametrize(
    ("text", "value"),
    [("512M", 512 << 20), ("4G", 4 << 30), ("1.5GiB", 3 << 29), (4096, 4096), ("64k", 65536)],
)
def test_sizes(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "4X", True])
def test_bad_sizes(text: str | int) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_defaults_load_and_overrides_win(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[dram]\nsize = '2G'\n[nvme]\nsize = 0\n")
    config = load_config(path, {"dram": {"size": "1G"}})
    assert config.dram.size == 1 << 30
    assert config.nvme.size == 0
    assert config.daemon.max_inflight == 256


def test_modes_are_enums_and_the_log_level_ignores_case(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[daemon]\nlog_level = 'WARNING'\n[nvme]\nio_backend = 'threads'\n")
    config = load_config(path)
    assert config.daemon.log_level is LogLevel.WARNING
    assert config.nvme.io_backend is IoBackendKind.THREADS
    assert load_config().daemon.log_level is LogLevel.INFO


def test_the_disk_evicts_by_clock_by_default_and_only_the_disk_can(tmp_path: Path) -> None:
    assert load_config().nvme.policy is NvmePolicyKind.CLOCK
    path = tmp_path / "k.toml"
    path.write_text("[nvme]\npolicy = 'lru'\n")
    assert load_config(path).nvme.policy is NvmePolicyKind.LRU
    (problem,) = _problems("[dram]\npolicy = 'clock'\n", tmp_path)
    assert problem.where == "dram.policy"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("[dram]\nsize = '1M'\n", "dram.size: 1M is below the minimum 16M"),
        ("[dram]\nsize = 'lots'\n", f"dram.size: not a size: 'lots' {SIZE_HINT}"),
        ("[dram]\nsize = 1.5\n", f"dram.size: not a size: 1.5 {SIZE_HINT}"),
        ("[dram]\nsize = -1\n", "dram.size: a size cannot be negative: -1"),
        ("[nvme]\nsize = '32M'\n", "nvme.size: 32M is neither 0 (no disk tier) nor at least 64M"),
        (
            "[nvme]\nsegment_bytes = 1000\n",
            "nvme.segment_bytes: must be a multiple of 4K and at least 1M, not 1000",
        ),
        (
            "[nvme]\ncheckpoint_every_bytes = '4K'\n",
            "nvme.checkpoint_every_bytes: 4K is neither 0 (none) nor >= 1M",
        ),
        (
            "[daemon]\nmax_frame_bytes = '1K'\n",
            "daemon.max_frame_bytes: 1K is out of range 4K..64M",
        ),
        (
            "[nvme]\nio_backend = 'uring'\n",
            "nvme.io_backend: 'uring' is not one of: io_uring, threads, auto",
        ),
        (
            "[daemon]\nlog_level = 'loud'\n",
            "daemon.log_level: 'loud' is not one of: debug, info, warning, error",
        ),
        ("[dram]\nhugepages = true\n", "dram.hugepages: true is not one of: auto, always, never"),
        ("[nvme]\nqueue_depth = 0\n", "nvme.queue_depth: 0 is out of range 1..4096"),
        ("[nvme]\nread_batch_bytes = '1K'\n", "nvme.read_batch_bytes: 1K is outside 4K..256M"),
        ("[nvme]\nread_batch_bytes = '1G'\n", "nvme.read_batch_bytes: 1G is outside 4K..256M"),
        ("[nvme]\nread_batch_blocks = 0\n", "nvme.read_batch_blocks: 0 is out of range 1..64"),
        ("[nvme]\nread_batch_blocks = 65\n", "nvme.read_batch_blocks: 65 is out of range 1..64"),
        (
            "[daemon]\nshutdown_grace_s = 0\n",
            "daemon.shutdown_grace_s: 0 is out of range (more than 0, at most 3600)",
        ),
        ("[pool]\nrank = -1\n", "pool.rank: -1 is out of range (at least 0)"),
        ("[dram]\nprefault = 'yes'\n", "dram.prefault: expected true or false, got 'yes'"),
        (
            "[daemon]\nmax_connections = 'many'\n",
            "daemon.max_connections: expected an integer, got 'many'",
        ),
        ("[daemon]\nsocket = 5\n", "daemon.socket: expected a string, got 5"),
        (
            "[daemon]\nsocket_mode = '999'\n",
            "daemon.socket_mode: '999' is not an octal mode such as \"0660\"",
        ),
        (
            "[pool]\nkey_prefix = 'has space'\n",
            "pool.key_prefix: 'has space' is not a prefix of 1 to 32 letters, digits, "
            "'_', '.' or '-'",
        ),
        (
            "[pool]\ngroup_id = 'a{b}'\n",
            "pool.group_id: 'a{b}' is not a group id of up to 128 letters, digits, "
            "'_', '.', ':' or '-'",
        ),
        (
            "[daemon]\nmetrics_port = 9100\nmetrics_address = '0.0.0.0'\n",
            "daemon.metrics_address: '0.0.0.0' is not loopback: metrics are served on "
            "127.0.0.1, ::1 or localhost only",
        ),
        ("[dram]\nsise = '2G'\n", 'dram.sise: unknown key (did you mean "size"?)'),
        (
            "[dram]\ncolour = 'red'\n",
            "dram.colour: unknown key "
            "(known keys: size, hugepages, mlock, prefault, policy, prefetch_bytes_per_s, "
            "keep_across_restarts)",
        ),
        ("[pol]\nurl = ''\n", "pol: unknown section [pol] (did you mean [pool]?)"),
        ("pol = 5\n", 'pol: unknown key (did you mean "pool"?)'),
        (
            "[colour]\nred = 1\n",
            "colour: unknown section [colour] (known: daemon, dram, nvme, pool, nixl, remote, "
            "limits, tenants)",
        ),
        ("dram = 5\n", "dram: expected a table, got 5"),
        ("[tenants]\nname = 'x'\n", "tenants: expected an array of tables, got a table"),
        ("[[tenants]]\nuids = [1]\n", "tenants[0].name: required, but not given"),
        (
            "[[tenants]]\nname = 't'\nuids = [1, 'a']\n",
            "tenants[0].uids[1]: expected an integer, got 'a'",
        ),
        ("[[tenants]]\nname = ''\n", "tenants[0].name: '' must be 1..255 characters long"),
    ],
)
def test_each_problem_names_the_field_and_says_what_is_wrong(
    tmp_path: Path, text: str, line: str
) -> None:
    where, message = line.split(": ", 1)
    assert _problems(text, tmp_path) == (ConfigProblem(where, message),)


def test_every_problem_is_reported_at_once_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[dram]\nsise = '2G'\n[nvme]\nio_backend = 'uring'\nqueue_depth = 0\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"invalid configuration in {path}:\n"
        '  dram.sise: unknown key (did you mean "size"?)\n'
        "  nvme.io_backend: 'uring' is not one of: io_uring, threads, auto\n"
        "  nvme.queue_depth: 0 is out of range 1..4096"
    )


def test_rules_between_fields_are_all_reported_with_the_field_errors_elsewhere() -> None:
    pool = {"url": "redis://user:hunter2@pool", "cert_file": "/c", "rank": 1}
    with pytest.raises(ConfigError) as caught:
        load_config(overrides={"dram": {"prefault": 1}, "pool": pool})
    assert caught.value.problems == (
        ConfigProblem("dram.prefault", "expected true or false, got 1"),
        ConfigProblem(
            "pool.url", "must not carry credentials: use pool.username and pool.password_file"
        ),
        ConfigProblem(
            "pool.url",
            "is plaintext (redis://): use rediss:// with TLS, or set pool.allow_plaintext = true "
            "to accept an unencrypted pool",
        ),
        ConfigProblem("pool.cert_file", "is set, but pool.url is not rediss://"),
        ConfigProblem("pool.cert_file", "is set without pool.key_file (the two go together)"),
        ConfigProblem("pool.rank", "1 is outside world_size 1 (ranks are 0..0)"),
    )
    assert "hunter2" not in str(caught.value)


def test_a_bad_flag_is_blamed_on_the_flag_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[dram]\nsize = '2G'\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, {"dram": {"size": "lots"}}, flags=FLAGS)
    assert str(caught.value) == (
        "invalid configuration:\n"
        "  --dram-size: not a size: 'lots' (use bytes or a suffix: K, M, G, T, P)"
    )


def test_flag_and_file_problems_are_reported_together(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[pool]\nurl = 'rediss://pool'\n[nvme]\nqueue_depth = 0\n")
    overrides = {"dram": {"size": "1M"}, "daemon": {"runtime": "trio"}}
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides, flags=FLAGS)
    assert str(caught.value) == (
        f"invalid configuration in {path}:\n"
        "  nvme.queue_depth: 0 is out of range 1..4096\n"
        "  --dram-size: 1M is below the minimum 16M"
    )
    path.write_text("[pool]\nurl = 'rediss://pool'\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, {"daemon": {"runtime": "trio"}}, flags=FLAGS)
    assert caught.value.problems == (
        ConfigProblem(
            "--runtime",
            "the pool runs on redis-py's asyncio client: use asyncio, or leave pool.url empty",
        ),
    )


def test_an_override_without_a_flag_names_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(overrides={"dram": {"size": "lots"}}, flags={("nvme", "size"): "--nvme-size"})
    assert caught.value.problems == (
        ConfigProblem("dram.size", "not a size: 'lots' (use bytes or a suffix: K, M, G, T, P)"),
    )


def test_a_one_message_config_error_is_one_problem() -> None:
    error = ConfigError("no pool is configured")
    assert error.problems == (ConfigProblem("", "no pool is configured"),)
    assert str(error) == "no pool is configured"
    assert isinstance(error, ValueError)


def test_an_invalid_struct_built_directly_still_raises() -> None:
    with pytest.raises(ConfigError) as caught:
        DramConfig(size=ByteSize(1 << 20))
    assert caught.value.problems == (ConfigProblem("size", "1M is below the minimum 16M"),)
    with pytest.raises(ValueError, match="is required when world_size > 1"):
        PoolConfig(url="rediss://pool", world_size=2)
    assert DaemonConfig(max_frame_bytes=ByteSize(4096)).max_frame_bytes == 4096


def test_toml_syntax_errors_keep_their_message(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[dram\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (problem,) = caught.value.problems
    assert problem.where == ""
    assert str(caught.value).startswith(f"config {path} is not valid TOML: ")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "absent.toml")
    assert (
        str(caught.value)
        == f"cannot read config {tmp_path / 'absent.toml'}: No such file or directory"
    )


def test_one_field_rules_are_reported_whatever_else_is_wrong(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[dram]\nsize = "1M"\nmlock = "sometimes"\n'
        '[nvme]\nsize = "1M"\nsegment_bytes = "3K"\nqueue_depth = 0\n'
    )
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert [str(problem) for problem in error.value.problems] == [
        "dram.size: 1M is below the minimum 16M",
        "dram.mlock: 'sometimes' is not one of: auto, always, never",
        "nvme.size: 1M is neither 0 (no disk tier) nor at least 64M",
        "nvme.segment_bytes: must be a multiple of 4K and at least 1M, not 3K",
        "nvme.queue_depth: 0 is out of range 1..4096",
    ]
