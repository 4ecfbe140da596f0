"""``kvtierctl pool status`` and ``kvtierctl pool check`` against real daemons and servers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvtierd.cli.ctl import main
from kvtierd.testing.redis_server import RedisServer, TlsFiles, make_other_ca
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.redis


def _ctl_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    status = main([*argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def _pool_toml(url: str, **extra: object) -> str:
    lines = [
        "[pool]",
        f'url = "{url}"',
        "vote_timeout_s = 1.0",
        "heartbeat_s = 0.2",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def test_status_without_a_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with DaemonProcess(tmp_path / "d") as daemon:
        status, record = _ctl_json(capsys, "--socket", str(daemon.socket), "pool", "status")
    assert status == 0
    assert record["state"] == "none"


def test_status_follows_the_pool(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _pool_toml(redis_server.url, allow_plaintext=True)
    with DaemonProcess(tmp_path / "d", config_text=config) as daemon:
        argv = ("--socket", str(daemon.socket), "pool", "status")
        status, record = _ctl_json(capsys, *argv)
        assert (status, record["state"], record["rank"]) == (0, "attached", 0)
        assert record["members"] == [0]
        assert record["address"] == redis_server.url + "/0"
        redis_server.stop()
        deadline = time.monotonic() + 30
        while record["state"] == "attached" and time.monotonic() < deadline:
            time.sleep(0.1)
            _, record = _ctl_json(capsys, *argv)
        assert record["state"] == "local"
        assert "unreachable" in record["reason"]
        capsys.readouterr()
        assert main(list(argv)) == 0
        shown = capsys.readouterr().out
        assert "pool: local" in shown
        assert "unreachable" in shown


def test_check_passes_against_a_reachable_pool(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text(_pool_toml(redis_server.url, allow_plaintext=True))
    status, record = _ctl_json(capsys, "pool", "check", "--config", str(config))
    assert status == 0
    assert [step["name"] for step in record["steps"]] == ["configuration", "connect", "probe"]
    assert all(step["ok"] for step in record["steps"])
    assert redis_server.client().keys("*") == []  # the probe cleans up after itself


def test_check_names_the_failing_step(
    tmp_path: Path, redis_acl: tuple[RedisServer, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    server, user, password = redis_acl
    secret = tmp_path / "secret"
    secret.write_text("wrong-" + password)
    os.chmod(secret, 0o600)
    config = tmp_path / "kvtierd.toml"
    toml = _pool_toml(server.url, allow_plaintext=True, username=user)
    config.write_text(toml + f'password_file = "{secret}"\n')
    status, record = _ctl_json(capsys, "pool", "check", "--config", str(config))
    assert status == 1
    assert record["steps"][-1]["name"] == "connect"
    assert "authentication refused" in record["steps"][-1]["detail"]
    assert password not in json.dumps(record)

    secret.write_text(password)
    assert _ctl_json(capsys, "pool", "check", "--config", str(config))[0] == 0

    os.chmod(secret, 0o644)
    status, record = _ctl_json(capsys, "pool", "check", "--config", str(config))
    assert status == 1
    assert record["steps"][-1]["name"] == "credentials"
    assert "chmod 600" in record["steps"][-1]["detail"]


def test_check_refuses_a_server_signed_by_another_ca(
    tmp_path: Path, redis_tls: tuple[RedisServer, TlsFiles], capsys: pytest.CaptureFixture[str]
) -> None:
    server, tls = redis_tls
    config = tmp_path / "kvtierd.toml"
    config.write_text(_pool_toml(server.url, ca_file=str(make_other_ca(tmp_path / "other"))))
    status, record = _ctl_json(capsys, "pool", "check", "--config", str(config))
    assert status == 1
    assert "TLS failed" in record["steps"][-1]["detail"]
    config.write_text(_pool_toml(server.url, ca_file=str(tls.ca_cert)))
    assert _ctl_json(capsys, "pool", "check", "--config", str(config))[0] == 0


def test_check_without_a_pool_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text('[dram]\nsize = "64M"\n')
    assert main(["pool", "check", "--config", str(config)]) != 0
    assert "no pool is configured" in capsys.readouterr().err
