"""``kvtierctl`` against a real daemon: what each command prints, and its exit status.

Most tests call ``main()`` in-process (fast, output through ``capsys``); ``top`` and some of what
a user sees when the daemon is not running run the real command as a subprocess. To keep the
file fast, tests share one daemon (``shared``) and each uses namespaces of its own name; a test
that needs the daemon's global counters to be its own takes a fresh ``daemon``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from kvtierd import __version__
from kvtierd.cli.ctl import build_parser, main
from kvtierd.cli.ctl_commands import daemon_health
from kvtierd.cli.ctl_records import DaemonHealth
from kvtierd.cli.ctl_views import checkpoint_summary
from kvtierd.client import Layout, chain_keys, connect
from kvtierd.config import load_config
from kvtierd.config_render import config_digest
from kvtierd.testing import free_port
from tests.support.daemon import DaemonProcess
from tests.support.uids import client_as, reachable_directory, require_root

BLOCK = 16 << 10
LAYOUT = Layout(
    "test/model-1b", layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16
)
LAYOUT_BLOCK = 2 * 2 * 2 * 64 * 16 * 2  # K and V, layers, kv_heads, head_dim, tokens, float16


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("kvtierd"), dram_size="64M") as process:
        yield process


def _blocks(n: int, size: int = BLOCK) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _put(daemon: DaemonProcess, name: str, n: int, **options: Any) -> list[bytes]:
    block_bytes = options.pop("block_bytes", BLOCK)
    with connect(daemon.socket) as client:
        ns = client.namespace(name, block_bytes=block_bytes, **options)
        keys = chain_keys(range(16 * n), 16, ns.key_salt)
        assert ns.put(keys, _blocks(n, block_bytes)) == n
    return keys


def _listed(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess) -> dict[str, Any]:
    """``ls --json``, by namespace name."""
    return {ns["name"]: ns for ns in _ctl_json(capsys, daemon, "ls")["namespaces"]}


def _lookup(daemon: DaemonProcess, name: str, keys: list[bytes], **options: Any) -> int:
    block_bytes = options.pop("block_bytes", BLOCK)
    with connect(daemon.socket) as client:
        return client.namespace(name, block_bytes=block_bytes, **options).lookup(keys)


def _ctl(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, *args: str) -> tuple[int, str]:
    """Run ``kvtierctl ARGS --socket <daemon>`` in-process; its exit status and stdout."""
    status = main([*args, "--socket", str(daemon.socket)])
    out, err = capsys.readouterr()
    assert err == "" or status != 0, err
    return status, out


def _ctl_json(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, *args: str) -> Any:
    status, out = _ctl(capsys, daemon, *args, "--json")
    assert status == 0
    return json.loads(out)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvtierd.cli.ctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# -- status, stats, ls ---------------------------------------------------------------------------


def test_status_json_says_ready_with_version_and_tiers(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    _put(daemon, "status", 5)
    status = _ctl_json(capsys, daemon, "status")
    assert status["ready"] is True
    assert status["version"] == __version__
    assert status["socket"] == str(daemon.socket)
    assert status["io_backend"] in ("io_uring", "threads")
    assert status["uptime_s"] > 0
    assert status["namespaces"] == 1
    tiers = {t["name"]: t for t in status["tiers"]}
    assert set(tiers) == {"dram", "nvme"}
    assert tiers["dram"]["blocks"] == 5
    assert 5 * BLOCK <= tiers["dram"]["used_bytes"] <= tiers["dram"]["capacity_bytes"]
    assert (status["degraded"], status["pool"]["state"], status["disk_failing"]) == (
        False,
        "none",
        "",
    )


def test_status_for_people_names_the_daemon_and_socket(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = _ctl(capsys, shared, "status")
    assert status == 0
    assert f"kvtierd {__version__} is running on" in out
    assert "io backend" in out


def test_status_says_how_recent_the_last_checkpoint_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint every 1 MiB written: once blocks reach the disk, ``status`` says how many
    were written, how long ago the last one was and how much was written since."""
    config = '[nvme]\ncheckpoint_every_bytes = "1M"\n'
    with DaemonProcess(tmp_path / "kvtierd", config_text=config) as daemon:
        before = _ctl_json(capsys, daemon, "status")["checkpoints"]
        assert (before["state"], before["written"], before["age_s"]) == ("on", 0, -1.0)
        _, out = _ctl(capsys, daemon, "status")
        assert re.search(r"checkpoints\s+on, none written yet", out)
        with connect(daemon.socket) as client:
            ns = client.namespace("checkpointed", block_bytes=BLOCK)
            assert ns.put(chain_keys(range(16 * 160), 16, ns.key_salt), _blocks(160)) == 160
            client.fsync()  # 160 blocks of 16 KiB on the disk: past 1 MiB, a checkpoint is due
        deadline = time.monotonic() + 30
        while (after := _ctl_json(capsys, daemon, "status")["checkpoints"])["written"] == 0:
            assert time.monotonic() < deadline, after
            time.sleep(0.05)
        assert after["state"] == "on"
        assert after["age_s"] >= 0
        assert 0 <= after["bytes_since"] < 160 * (BLOCK + 4096)  # at most what was written
        status, out = _ctl(capsys, daemon, "status")
        assert status == 0
        assert re.search(r"checkpoints\s+on, \d+ written, the last .* ago; .* written since", out)


def test_status_says_checkpoints_are_off_when_configured_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = "[nvme]\ncheckpoint_every_bytes = 0\n"
    with DaemonProcess(tmp_path / "kvtierd", config_text=config) as daemon:
        _put(daemon, "no-checkpoints", 3)
        assert _ctl_json(capsys, daemon, "status")["checkpoints"]["state"] == "off"
        _, out = _ctl(capsys, daemon, "status")
        assert re.search(r"checkpoints\s+off", out)


def _wait_for(what: str, done: Any, deadline_s: float = 60) -> Any:
    """``done()`` once it is true; fails saying ``what`` after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while not (result := done()):
        assert time.monotonic() < end, what
        time.sleep(0.1)
    return result


def _status(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, *flags: str) -> Any:
    """``status FLAGS``: its exit status and what it printed (parsed with ``--json``)."""
    code = main(["status", *flags, "--socket", str(daemon.socket)])
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in flags else out


def test_status_exits_4_and_says_why_while_the_pool_is_not_attached(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pool configured where nothing listens: the daemon serves from its local tiers
    (``local``), and ``status`` says so with the reason instead of a capacity of "–"."""
    config = (
        f'[pool]\nurl = "redis://127.0.0.1:{free_port()}"\nallow_plaintext = true\n'
        "vote_timeout_s = 1.0\nheartbeat_s = 0.2\ntimeout_s = 1.0\n"
    )
    with DaemonProcess(tmp_path / "kvtierd", config_text=config) as daemon:
        _wait_for(
            "the pool never went local",
            lambda: _ctl_json(capsys, daemon, "pool", "status")["state"] == "local",
        )
        code, record = _status(capsys, daemon, "--json")
        assert (code, record["ready"], record["degraded"]) == (4, True, True)
        assert record["pool"]["state"] == "local"
        assert "unreachable" in record["pool"]["reason"]
        code, out = _status(capsys, daemon)
    assert code == 4
    assert f"is running on {daemon.socket}, degraded (pool local)" in out
    assert re.search(r"\npool\s+local, \d+ blocks?, [\d.]+ \w+ \(pool unreachable: ", out), out
    assert "of –" not in out


def test_status_exits_4_while_the_disk_tier_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The data file removed under the daemon: acknowledged data is at risk until a restart,
    and ``status`` says so (the DOCTOR report's failed ``nvme`` line)."""
    config = "[nvme]\nhealth_check_interval_s = 0.2\n"
    with DaemonProcess(tmp_path / "kvtierd", config_text=config) as daemon:
        assert _status(capsys, daemon)[0] == 0
        (daemon.data_dir / "nvme.data").unlink()
        code, record = _wait_for(
            "status never said degraded",
            lambda: (result := _status(capsys, daemon, "--json"))[0] == 4 and result,
        )
        assert (record["degraded"], record["pool"]["state"]) == (True, "none")
        assert "(removed)" in record["disk_failing"]
        code, out = _status(capsys, daemon)
    assert code == 4
    assert "degraded (disk tier failing)" in out
    assert re.search(r"\ndisk\s+failing: .*\(removed\)", out), out


def test_status_judges_a_user_who_may_not_see_the_host_report_by_the_pool_alone() -> None:
    """DOCTOR is for the daemon's user and root: for anyone else the disk tier's state is
    unknown (``None``), not failing, and the pool's state still counts."""
    require_root()
    with reachable_directory() as directory:
        config = '[daemon]\nsocket_mode = "0666"\n'
        with DaemonProcess(directory, config_text=config) as daemon:
            health = client_as(4321, 4321, daemon.socket, daemon_health)
    assert health == DaemonHealth("none", "no pool is configured (pool.url is empty)", None)
    assert health.degraded is False


def test_stats_json_has_tier_counters_and_derived_ratios(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = _put(daemon, "stats", 6)
    with connect(daemon.socket) as client:
        ns = client.namespace("stats", block_bytes=BLOCK)
        with ns.get(keys[:4]):
            pass
    stats = _ctl_json(capsys, daemon, "stats")
    for field in ("connections", "leases", "dirty_blocks", "dirty_bytes", "durable_blocks"):
        assert isinstance(stats[field], int)
    assert stats["leases"] == 0
    assert stats["prefetch_accuracy"] is None or 0 <= stats["prefetch_accuracy"] <= 1
    dram = next(t for t in stats["tiers"] if t["name"] == "dram")
    assert dram["blocks"] == 6
    assert dram["bytes_written"] >= 6 * BLOCK
    assert dram["hits"] + dram["misses"] >= 4
    assert dram["hit_ratio"] == pytest.approx(dram["hits"] / (dram["hits"] + dram["misses"]))
    for tier in stats["tiers"]:
        assert {"used_bytes", "capacity_bytes", "evictions", "bytes_read"} <= set(tier)


def test_stats_by_tenant(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> None:
    keys = _put(daemon, "by-tenant", 4)
    with connect(daemon.socket) as client:
        ns = client.namespace("by-tenant", block_bytes=BLOCK)
        ns.read_into(keys[:3], [bytearray(BLOCK) for _ in range(3)])
        with pytest.raises(KeyError):
            ns.read_into([bytes(16)], [bytearray(BLOCK)])
    [row] = _ctl_json(capsys, daemon, "stats", "--tenants")["tenants"]  # no [[tenants]]: one
    assert row["tenant"] == "(unlisted)"
    assert (row["namespaces"], row["dram_blocks"], row["dram_hits"], row["misses"]) == (1, 4, 3, 1)
    assert row["bytes_committed"] == 4 * BLOCK
    assert row["dram_fill"] == row["dram_used_bytes"] / row["dram_capacity_bytes"] > 0
    assert row["hit_ratio"] == pytest.approx(3 / 4)
    status, out = _ctl(capsys, daemon, "stats", "--tenants")
    assert status == 0
    assert "(unlisted)" in out
    assert "75.0%" in out  # the hit ratio (hits of READ blocks)
    with pytest.raises(SystemExit) as usage:
        main(["--socket", str(daemon.socket), "stats", "--tenants", "--namespace", "x"])
    assert usage.value.code == 2
    assert "--tenants and --namespace exclude each other" in capsys.readouterr().err


def test_config_shows_what_the_running_daemon_took(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = '[daemon]\nlog_level = "debug"\n\n[dram]\nsize = "48M"\n'
    with DaemonProcess(tmp_path / "d", dram_size=None, config_text=config) as daemon:
        status, out = _ctl(capsys, daemon, "config")
        assert status == 0
        source = f"config {daemon.directory / 'kvtierd.toml'}"
        assert out.startswith(
            f"# kvtierd's running configuration, from {source}: 5 field(s) not at their "
            "defaults\n# digest "
        )
        # the changed fields, as a file: the file's and the command line's
        assert tomllib.loads(out) == {
            "daemon": {
                "data_dir": str(daemon.data_dir),
                "log_level": "debug",
                "socket": str(daemon.socket),
            },
            "dram": {"size": "48M"},
            "nvme": {"size": "256M"},
        }
        status, whole = _ctl(capsys, daemon, "config", "--effective")
        assert "every field" in whole.splitlines()[0]
        path = tmp_path / "again.toml"
        path.write_text(whole)
        record = _ctl_json(capsys, daemon, "config")
    again = load_config(path)  # the whole file loads back to what the daemon runs
    assert (again.dram.size, again.daemon.log_level.value, again.nvme.size) == (
        48 << 20,
        "debug",
        256 << 20,
    )
    assert record["changed"] == [
        "daemon.data_dir", "daemon.log_level", "daemon.socket", "dram.size", "nvme.size",
    ]  # fmt: skip
    assert record["config"]["dram"]["size"] == "48M"
    assert record["digest"] == config_digest(again)
    assert record["source"] == source


def test_stats_for_people_shows_both_tiers(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = _ctl(capsys, shared, "stats")
    assert status == 0
    assert "dram" in out
    assert "nvme" in out
    assert "hit ratio" in out
    assert "dirty backlog" in out


def test_ls_lists_namespaces_with_blocks_per_tier_and_layout(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    _put(shared, "ls-plain", 3)
    _put(shared, "ls-model", 2, block_bytes=LAYOUT_BLOCK, layout=LAYOUT, rank=1, world_size=2)
    listed = _listed(capsys, shared)
    plain, model = listed["ls-plain"], listed["ls-model"]
    assert (plain["dram_blocks"], plain["block_bytes"], plain["layout"]) == (3, BLOCK, None)
    assert (model["rank"], model["world_size"], model["block_bytes"]) == (1, 2, LAYOUT_BLOCK)
    assert model["layout"]["model_id"] == "test/model-1b"
    assert model["dram_blocks"] == 2
    assert isinstance(model["nvme_blocks"], int)
    status, out = _ctl(capsys, shared, "ls")
    assert status == 0
    assert "ls-model" in out
    assert "test/model-1b" in out


# -- flush, evict, forget --------------------------------------------------------------------------


def test_flush_reports_every_block_durable(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    _put(daemon, "flush", 12)
    assert _ctl_json(capsys, daemon, "flush")["durable_blocks"] == 12
    stats = _ctl_json(capsys, daemon, "stats")
    assert (stats["dirty_blocks"], stats["durable_blocks"]) == (0, 12)
    assert _listed(capsys, daemon)["flush"]["nvme_blocks"] == 12
    status, out = _ctl(capsys, daemon, "flush")
    assert status == 0
    assert "12 blocks are durable" in out


def test_evict_drops_every_dram_copy_and_keeps_the_blocks(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = _put(shared, "evict", 8)
    _ctl_json(capsys, shared, "flush")
    assert _ctl_json(capsys, shared, "evict")["evicted_blocks"] >= 8
    tiers = {t["name"]: t for t in _ctl_json(capsys, shared, "stats")["tiers"]}
    assert tiers["dram"]["blocks"] == 0
    assert _listed(capsys, shared)["evict"]["nvme_blocks"] == 8
    assert _lookup(shared, "evict", keys) == 8
    # The lookup promoted the blocks back into DRAM.
    status, out = _ctl(capsys, shared, "evict")
    assert status == 0
    assert re.fullmatch(r"evicted \d+ clean blocks from DRAM\n", out)


def test_forget_removes_the_given_keys(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = _put(shared, "forget", 4)
    other = _put(shared, "forget-other", 4)
    args = ["forget", "--namespace", "forget", keys[2].hex(), keys[3].hex()]
    assert _ctl_json(capsys, shared, *args) == {
        "namespace": "forget",
        "requested": 2,
        "forgotten": 2,
    }
    assert _lookup(shared, "forget", keys) == 2
    status, out = _ctl(capsys, shared, "forget", "--namespace", "forget", keys[0].hex())
    assert status == 0
    assert "forgot 1 of 1 keys" in out
    assert _lookup(shared, "forget", keys) == 0
    assert _lookup(shared, "forget-other", other) == 4


def test_forget_finds_a_namespace_by_its_full_identity(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    identity = {"block_bytes": LAYOUT_BLOCK, "layout": LAYOUT, "rank": 1, "world_size": 2}
    keys = _put(shared, "forget-model", 3, **identity)
    # Flushed first: a block forgotten while its write-back is in flight is counted in DRAM
    # until that write ends.
    _ctl_json(capsys, shared, "flush")
    result = _ctl_json(
        capsys,
        shared,
        "forget",
        "--namespace=forget-model",
        "--rank=1",
        "--world-size=2",
        f"--block-bytes={LAYOUT_BLOCK}",
        "--model-id=test/model-1b",
        keys[1].hex(),
    )
    assert result["forgotten"] == 1
    # Rank 0 holds nothing, so a lookup answers 0 for the group; count the rank's own blocks.
    listed = _listed(capsys, shared)["forget-model"]
    assert (listed["dram_blocks"], listed["nvme_blocks"]) == (2, 2)


def test_forget_in_an_unknown_namespace_fails_without_creating_it(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["forget", "--namespace", "chta", "00ff", "--socket", str(shared.socket)])
    out, err = capsys.readouterr()
    assert status == 1
    assert out == ""
    assert err.startswith("kvtierctl: no namespace 'chta'")
    assert err.count("\n") == 1
    assert "chta" not in _listed(capsys, shared)


def test_forget_asks_which_namespace_when_names_collide(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    small = _put(shared, "forget-twin", 2, block_bytes=BLOCK)
    large = _put(shared, "forget-twin", 2, block_bytes=2 * BLOCK)
    assert (
        main(["forget", "--namespace=forget-twin", small[0].hex(), "--socket", str(shared.socket)])
        == 1
    )
    assert "2 namespaces match" in capsys.readouterr().err
    args = ["forget", "--namespace=forget-twin", f"--block-bytes={2 * BLOCK}", large[1].hex()]
    assert _ctl_json(capsys, shared, *args)["forgotten"] == 1
    assert _lookup(shared, "forget-twin", large, block_bytes=2 * BLOCK) == 1
    assert _lookup(shared, "forget-twin", small, block_bytes=BLOCK) == 2


# -- per namespace ---------------------------------------------------------------------------------


def test_ls_keys_pages_through_a_namespace_in_hex(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = _put(shared, "keys", 5)
    first = _ctl_json(capsys, shared, "ls", "--keys", "keys", "--limit", "3")
    assert (first["blocks"], first["more"], first["namespace"]["name"]) == (5, True, "keys")
    assert first["next_after"] == first["keys"][-1]["key"]
    rest = _ctl_json(capsys, shared, "ls", "--keys", "keys", "--after", first["next_after"])
    assert (rest["more"], rest["next_after"]) == (False, None)
    listed = [k["key"] for k in first["keys"] + rest["keys"]]
    assert listed == sorted(k.hex() for k in keys)
    assert {(tuple(k["tiers"][:1]), k["raw_bytes"]) for k in rest["keys"]} == {(("dram",), BLOCK)}
    status, out = _ctl(capsys, shared, "ls", "--keys", "keys", "--limit", "3")
    assert status == 0
    assert listed[0] in out
    assert f"more: --after {listed[2]}" in out


def test_a_namespace_is_named_by_id_or_tenant_and_name_when_names_collide(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    _put(shared, "twin", 2)
    _put(shared, "twin", 3, tenant="other")
    status = main(["stats", "--namespace", "twin", "--socket", str(shared.socket)])
    err = capsys.readouterr().err
    assert status == 1
    assert "2 namespaces match 'twin'" in err
    assert "default/twin" in err
    assert "other/twin" in err
    assert "name one by its id or as TENANT/NAME" in err
    listed = [n for n in _ctl_json(capsys, shared, "ls")["namespaces"] if n["name"] == "twin"]
    other = next(n for n in listed if n["tenant"] == "other")
    by_id = _ctl_json(capsys, shared, "stats", "--namespace", str(other["ns"]))
    by_tenant = _ctl_json(capsys, shared, "stats", "--namespace", "other/twin")
    with_option = _ctl_json(capsys, shared, "stats", "--namespace", "twin", "--tenant", "other")
    assert by_id == by_tenant == with_option
    assert (by_id["blocks"], by_id["committed_blocks"]) == (3, 3)


def test_stats_for_one_namespace_counts_its_lookups_and_reads(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    identity: dict[str, Any] = {"block_bytes": LAYOUT_BLOCK, "layout": LAYOUT}
    keys = _put(shared, "counted", 4, **identity)
    assert _lookup(shared, "counted", [*keys[:2], b"absent-key"], **identity) == 2
    with connect(shared.socket) as client, client.namespace("counted", **identity).get(keys[:1]):
        pass
    record = _ctl_json(capsys, shared, "stats", "--namespace", "counted")
    assert (record["blocks"], record["dram_blocks"]) == (4, 4)
    assert (record["lookup_blocks"], record["hit_blocks"], record["hit_ratio"]) == (3, 2, 2 / 3)
    assert (record["read_blocks"], record["committed_blocks"]) == (1, 4)
    assert record["committed_tokens"] == 4 * 16
    status, out = _ctl(capsys, shared, "stats", "--namespace", "counted")
    assert status == 0
    assert "committed   4 (64 tokens)" in out
    assert "test/model-1b" in out


def test_evict_one_namespace_leaves_the_others_in_dram(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    _put(shared, "evict-one", 3)
    _put(shared, "evict-kept", 2)
    _ctl_json(capsys, shared, "flush")
    result = _ctl_json(capsys, shared, "evict", "--namespace", "evict-one")
    assert result["evicted_blocks"] == 3
    listed = _listed(capsys, shared)
    assert (listed["evict-one"]["dram_blocks"], listed["evict-one"]["nvme_blocks"]) == (0, 3)
    assert listed["evict-kept"]["dram_blocks"] == 2


def test_forget_all_empties_one_namespace_in_every_tier(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = _put(shared, "drop", 6)
    other = _put(shared, "drop-other", 2)
    _ctl_json(capsys, shared, "flush")
    result = _ctl_json(capsys, shared, "forget", "--namespace", "drop", "--all")
    assert result == {"namespace": "drop", "requested": 6, "forgotten": 6}
    assert _lookup(shared, "drop", keys) == 0
    assert _ctl_json(capsys, shared, "ls", "--keys", "drop")["keys"] == []
    assert _listed(capsys, shared)["drop"]["blocks"] == 0
    assert _lookup(shared, "drop-other", other) == 2


def test_pool_check_json_without_a_pool_is_one_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text('[dram]\nsize = "64M"\n')
    assert main(["pool", "check", "--config", str(config), "--json"]) == 1
    out, err = capsys.readouterr()
    assert err == ""
    document = json.loads(out)
    assert document["ok"] is False
    [step] = document["steps"]
    assert (step["name"], step["ok"]) == ("configuration", False)
    assert "no pool is configured" in step["detail"]


def test_status_says_starting_while_the_daemon_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 2 GiB arena takes a while to pre-fault: meanwhile status exits 3, then 0."""
    daemon = DaemonProcess(tmp_path / "kvtierd", dram_size="2G")
    daemon.process = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", *daemon.args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 90
        while 0 not in seen and time.monotonic() < deadline:
            status = main(["status", "--json", "--socket", str(daemon.socket)])
            seen.setdefault(status, json.loads(capsys.readouterr().out))
            time.sleep(0.01)
        assert 3 in seen, seen
        starting = seen[3]
        assert (starting["ready"], starting["starting"]) == (False, True)
        assert starting["error"].startswith("starting: ")
        assert seen[0]["ready"] is True
    finally:
        daemon.kill()


# -- top -------------------------------------------------------------------------------------------


def test_top_with_iterations_prints_each_sample_and_exits_0(shared: DaemonProcess) -> None:
    result = _run("top", "--iterations", "2", "--interval", "0.05", "--socket", str(shared.socket))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("kvtierctl top:") == 2
    assert "hits/s" in result.stdout
    assert result.stderr == ""


# -- doctor --------------------------------------------------------------------------------------


def test_doctor_json_is_the_host_as_the_daemon_sees_it(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    checks = {c["subject"]: c for c in _ctl_json(capsys, shared, "doctor")}
    assert list(checks)[:2] == ["io_uring", "io"]
    assert checks["io_uring"]["status"] == "ok"
    assert checks["io"]["detail"].startswith("io_uring in use; ")
    assert checks["memory"]["detail"].startswith("the arena holds 66 MiB; ")
    assert checks["nvme"]["detail"].endswith(" of 256 MiB in use")
    assert checks["socket"]["detail"].startswith(f"{shared.socket} (")
    assert {c["status"] for c in checks.values()} <= {"ok", "fallback"}


def test_doctor_for_people_is_a_table(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = _ctl(capsys, shared, "doctor")
    assert status == 0
    assert re.search(r"ok\s+io\s+io_uring in use", out), out
    assert "what the host gives the daemon" in out


def test_doctor_says_fallback_when_the_kernel_refused_the_fixed_buffers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under an 8 MiB RLIMIT_MEMLOCK (and, for root, without CAP_IPC_LOCK) io_uring opens but
    refuses to register the 66 MiB arena: the daemon runs on, each transfer pinning its pages,
    and the io line says so instead of "ok"."""
    limit = ["prlimit", f"--memlock={8 << 20}", "--"]
    if os.geteuid() == 0:  # root registers past the limit by CAP_IPC_LOCK: drop it
        limit = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *limit]
    if not all(shutil.which(tool) for tool in (limit[0], "prlimit")):
        pytest.skip(f"needs {limit[0]} and prlimit (util-linux)")
    with DaemonProcess(tmp_path / "kvtierd", command_prefix=limit) as daemon:
        checks = {c["subject"]: c for c in _ctl_json(capsys, daemon, "doctor")}
        status, out = _ctl(capsys, daemon, "doctor")
    io = checks["io"]
    assert io["status"] == "fallback", io
    assert io["detail"].startswith(
        "io_uring in use without fixed buffers (the kernel refused to register them: "
        "[Errno 12] Cannot allocate memory (RLIMIT_MEMLOCK: LimitMEMLOCK=infinity)); 0 of "
    )
    assert status == 0  # a fallback is no failure
    assert re.search(r"\nfallback\s+io\s+io_uring in use without fixed buffers \(", out), out


# -- failures --------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["status"], ["flush"], ["top", "--iterations", "1"]])
def test_no_daemon_gives_one_line_and_exit_1(tmp_path: Path, command: list[str]) -> None:
    socket = tmp_path / "absent.sock"
    result = _run(*command, "--socket", str(socket))
    assert result.returncode == 1
    assert result.stderr == f"kvtierctl: kvtierd is not running (no daemon on {socket})\n"
    assert result.stdout == ""


@pytest.mark.parametrize(
    "command",
    [
        ["stats"],
        ["ls"],
        ["evict"],
        ["doctor"],
        ["forget", "--namespace", "chat", "00"],
        ["ls", "--keys", "chat"],
        ["stats", "--namespace", "chat"],
        ["pool", "status"],
    ],
)
def test_no_daemon_fails_the_same_way_in_every_command(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    socket = tmp_path / "absent.sock"
    assert main([*command, "--socket", str(socket)]) == 1
    out, err = capsys.readouterr()
    assert err == f"kvtierctl: kvtierd is not running (no daemon on {socket})\n"
    assert out == ""


#: Every command that takes --json, with what it needs besides.
JSON_COMMANDS = [
    ["status"],
    ["stats"],
    ["stats", "--namespace", "chat"],
    ["stats", "--tenants"],
    ["config"],
    ["ls"],
    ["ls", "--keys", "chat"],
    ["flush"],
    ["evict"],
    ["evict", "--namespace", "chat"],
    ["forget", "--namespace", "chat", "00"],
    ["forget", "--namespace", "chat", "--all"],
    ["doctor"],
    ["pool", "status"],
    ["top", "--iterations", "1"],
]


@pytest.mark.parametrize("command", JSON_COMMANDS)
def test_json_commands_print_one_document_without_a_daemon(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    socket = tmp_path / "absent.sock"
    assert main([*command, "--json", "--socket", str(socket)]) == 1
    out, err = capsys.readouterr()
    assert err == ""
    document = json.loads(out)
    assert document["error"] == f"kvtierd is not running (no daemon on {socket})"
    if command != ["status"]:
        assert document["errno"] == "ECONNREFUSED"


def test_every_json_command_is_audited() -> None:
    """A command that gains --json must be added to JSON_COMMANDS above."""
    parser = build_parser()
    group = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
    commands = cast(dict[str, argparse.ArgumentParser], group.choices)
    with_json = set()
    for name, sub in commands.items():
        for action in sub._actions:
            if "--json" in action.option_strings:
                with_json.add(name)
            if action.dest == "pool_command":
                choices = cast(dict[str, argparse.ArgumentParser], action.choices)
                with_json |= {
                    f"pool {n}"
                    for n, p in choices.items()
                    if any("--json" in a.option_strings for a in p._actions)
                }
    listed = {c[0] if c[0] != "pool" else " ".join(c[:2]) for c in JSON_COMMANDS}
    assert with_json - {"pool"} == listed | {"pool check"}


def test_status_json_without_daemon_says_not_ready(tmp_path: Path) -> None:
    socket = tmp_path / "absent.sock"
    result = _run("status", "--json", "--socket", str(socket))
    assert result.returncode == 1
    status = json.loads(result.stdout)
    assert status["ready"] is False
    assert "not running" in status["error"]
    assert "Traceback" not in result.stderr


def test_socket_defaults_to_kvtierd_socket_env(
    shared: DaemonProcess, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIERD_SOCKET", str(shared.socket))
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["socket"] == str(shared.socket)


def test_socket_option_goes_before_or_after_the_command(
    shared: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--socket", str(shared.socket), "ls", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out)["namespaces"], list)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["forget", "--namespace", "chat", "not-hex"],
        ["forget", "--namespace", "chat", "00" * 33],
        ["forget", "00ff"],
        ["top", "--interval", "0"],
        ["top", "--iterations", "-1"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: kvtierctl" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--version"], ["stats", "--version"]])
def test_version(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvtierctl {__version__}\n"


@pytest.mark.parametrize(
    "command", ["status", "stats", "top", "ls", "flush", "evict", "forget", "doctor"]
)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: kvtierctl {command}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"checkpoints": "off"}, "off"),
        ({"scope": "tenant", "checkpoints": "off"}, "the host's (not shown to a tenant)"),
        (
            {"checkpoints": "given up: [Errno 28] No space left on device"},
            "given up: [Errno 28] No space left on device (a crash restart scans every header)",
        ),
        (
            {"checkpoints": "on", "checkpoints_written": 0, "bytes_since_checkpoint": 3 << 20},
            "on, none written yet in this run (3.0 MiB written since start)",
        ),
        (
            {
                "checkpoints": "on",
                "checkpoints_written": 1200,
                "checkpoint_age_s": 250.0,
                "bytes_since_checkpoint": 1 << 30,
            },
            "on, 1,200 written, the last 4m 10s ago; 1.0 GiB written since",
        ),
    ],
)
def test_the_checkpoint_line_says_what_a_crash_restart_would_scan(
    fields: dict[str, Any], line: str
) -> None:
    assert checkpoint_summary(fields) == line
