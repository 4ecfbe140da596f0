"""The daemon's side (:mod:`kvtierd.nixl.export`): an arena of two tenants' regions, each
registered on its own behind the probe, and a client of one tenant pulling from its region."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.errors import NotSupportedError
from kvtierd.nixl.export import start_region_export
from kvtierd.nixl.probe import NixlOutcome, NixlVerdict
from tests.nixl.children import Child, pull

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def daemon_side(nixl_works: None, tmp_path: Path) -> Iterator[Child]:
    """An ``arena-owner`` child, ready: what a client of tenant ``a`` gets is in ``tmp_path``."""
    child = Child("arena-owner", str(tmp_path))
    try:
        child.line_starting("ready")
        yield child
    finally:
        if child.process.returncode is None:
            child.kill()


def test_a_tenant_client_pulls_its_blocks_with_its_region_grant(
    daemon_side: Child, tmp_path: Path
) -> None:
    result = pull(tmp_path, "sync")
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]
    daemon_side.finish("exit")


def test_the_export_describes_nothing_outside_the_tenant_region(
    daemon_side: Child, tmp_path: Path
) -> None:
    """Neither an extent of another tenant's region, nor one that starts in the tenant's region
    and runs into the next (the regions are adjacent in the arena)."""
    other_tenant, past_the_end = (tmp_path / "refused.txt").read_text().splitlines()
    for refusal in (other_tenant, past_the_end):
        assert refusal.startswith("kvtierd.errors.InvalidRequestError"), refusal
        assert "outside registered memory" in refusal
    daemon_side.finish("exit")


def test_a_forged_descriptor_of_another_tenant_is_refused_by_nixl(
    daemon_side: Child, tmp_path: Path
) -> None:
    """The grant names tenant ``a``'s registration alone, so a pull of tenant ``b``'s extents
    (descriptors a client forged) finds no registration in the loaded metadata: NIXL refuses
    it. This is NIXL's behaviour, measured; kvtierd's guarantee is not to hand them out."""
    result = pull(tmp_path, "forged")
    assert result["error"].startswith("kvtierd.nixl.agent.TransferError"), result
    assert "nixlNotFoundError" in result["error"]
    daemon_side.finish("exit")


@pytest.mark.anyio
async def test_without_a_working_nixl_nothing_is_exported_or_loaded() -> None:
    """A failed probe leaves the daemon without NIXL reads, and without NIXL loaded."""
    verdict = NixlVerdict(NixlOutcome.IMPORT_ERROR, "NIXL does not import: stand-in")
    with pytest.raises(NotSupportedError, match="stand-in"):
        await start_region_export("daemon", 1 << 40, [], probe=lambda: verdict)
    assert "nixl._api" not in sys.modules
