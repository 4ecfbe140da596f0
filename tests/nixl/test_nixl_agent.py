"""NIXL agents in two real processes (:mod:`tests.nixl.peer`): what kvtierd's agent owner
promises, and what NIXL itself does not (which is why kvtierd checks leases itself).

Every process that loads NIXL segfaults at interpreter exit, so the pytest process never does:
the children end through ``exit_process``, and each test checks that they exit 0, not 139.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.nixl.children import Child, pull

pytestmark = [pytest.mark.usefixtures("nixl_works"), pytest.mark.timeout(300)]


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[Child]:
    """An owner process, ready: its region's metadata and descriptors are in ``tmp_path``."""
    child = Child("owner", str(tmp_path))
    try:
        child.line_starting("ready")
        yield child
    finally:
        if child.process.returncode is None:
            child.kill()


@pytest.mark.parametrize("case", ["sync", "asyncio", "trio"])
def test_another_process_pulls_extents_of_a_region_byte_exact(
    owner: Child, tmp_path: Path, case: str
) -> None:
    """With the metadata of that one registration, as a tenant's client gets its region's."""
    result = pull(tmp_path, case)
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]
    owner.finish("exit")


def test_the_owner_refuses_to_describe_past_its_region(owner: Child, tmp_path: Path) -> None:
    refused = (tmp_path / "refused.txt").read_text()
    assert refused.startswith("kvtierd.errors.InvalidRequestError"), refused
    assert "outside registered memory" in refused
    owner.finish("exit")


def test_truncated_descriptors_are_refused_before_nixl_sees_them(
    owner: Child, tmp_path: Path
) -> None:
    result = pull(tmp_path, "short")
    assert result["error"].startswith("kvtierd.errors.InvalidRequestError"), result
    owner.finish("exit")


def test_a_transfer_nixl_refuses_raises_transfer_error(owner: Child, tmp_path: Path) -> None:
    """NIXL's own exception (``nixlNotFoundError`` for an agent never loaded) comes out as
    kvtierd's ``TransferError``, and the puller still exits cleanly."""
    result = pull(tmp_path, "unknown-peer")
    assert result["error"].startswith("kvtierd.nixl.agent.TransferError"), result
    assert "nixlNotFoundError" in result["error"]
    owner.finish("exit")


def test_nixl_does_not_revoke_a_peer_after_deregistration(owner: Child, tmp_path: Path) -> None:
    """NIXL 1.5.1 over UCX: a peer that loaded the metadata still pulls the old bytes after the
    owner deregistered them. So deregistration is no access control, and a kvtierd client
    re-checks its lease's generation after every transfer (docs/nixl.md). If this starts
    failing, NIXL began to revoke: say so in docs/nixl.md."""
    puller = Child("puller", str(tmp_path), "again")
    puller.line_starting("pulled")
    owner.send("deregister")
    owner.line_starting("deregistered")
    puller.send("go")
    result = puller.result()
    puller.finish()
    owner.finish("exit")
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]


def test_the_owner_serves_on_after_a_puller_is_killed(owner: Child, tmp_path: Path) -> None:
    first = Child("puller", str(tmp_path), "again")
    first.line_starting("pulled")
    first.kill()
    assert first.process.returncode == -signal.SIGKILL
    result = pull(tmp_path, "sync")
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]
    owner.finish("exit")
