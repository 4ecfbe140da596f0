"""Fixtures for the pool tests: real ``redis-server`` processes and a lab of "hosts".

Every Redis fixture skips when ``redis-server`` is missing; mark the tests that use them with
``pytestmark = pytest.mark.redis``. ``lab`` is three hosts (``hosts[0]`` and ``hosts[1]`` for two TP
ranks, ``hosts[2]`` for the pool) in network namespaces, or over loopback when namespaces cannot be
made here (``lab.kind`` and ``lab.reason`` say which; the session summary lists it too).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.testing.netns import LoopbackLab, NetnsLab, open_lab
from kvtierd.testing.redis_server import (
    RedisCluster,
    RedisServer,
    TlsFiles,
    make_tls,
    require_redis_cli,
    require_redis_server,
)

_lab_kinds: Counter[str] = Counter()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A plaintext server with persistence (AOF, fsync always), stopped after the test."""
    require_redis_server()
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def redis_tls(tmp_path: Path) -> Iterator[tuple[RedisServer, TlsFiles]]:
    """A TLS-only server (client certificates optional) and its certificates."""
    require_redis_server()
    tls = make_tls(tmp_path / "tls")
    with RedisServer(tmp_path / "redis-tls", tls=tls) as server:
        yield server, tls


@pytest.fixture
def redis_acl(tmp_path: Path) -> Iterator[tuple[RedisServer, str, str]]:
    """A server whose only user is ``kvtierd`` with a random password: (server, user, password)."""
    require_redis_server()
    user, password = "kvtierd", secrets.token_urlsafe(24)
    with RedisServer(tmp_path / "redis-acl", users={user: password}) as server:
        yield server, user, password


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """Three masters in cluster mode, no replicas, every slot covered."""
    require_redis_server()
    require_redis_cli()
    with RedisCluster(tmp_path / "cluster", 3) as cluster:
        yield cluster


@pytest.fixture
def lab(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NetnsLab | LoopbackLab]:
    """Three hosts: ``hosts[0]``, ``hosts[1]`` for the ranks, ``hosts[2]`` for the pool server."""
    with open_lab(tmp_path / "lab", hosts=3) as opened:
        _lab_kinds[
            opened.kind if opened.reason is None else f"{opened.kind} ({opened.reason})"
        ] += 1
        request.node.user_properties.append(("lab", opened.kind))
        yield opened


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _lab_kinds:
        kinds = ", ".join(f"{count} over {kind}" for kind, count in sorted(_lab_kinds.items()))
        terminalreporter.write_line(f"kvtierd pool labs: {kinds}")
