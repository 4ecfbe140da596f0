"""The daemon's side (:mod:`kvtierd.nixl.export`): an arena of two tenants' regions, each
exported by a process of its own, run in this (the pytest) process on asyncio and trio, which
never loads NIXL itself; pullers and peer owners are children (:mod:`tests.nixl.peer`)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec
import pytest

from kvtierd.config import TriState
from kvtierd.errors import InvalidRequestError, NotSupportedError, TimedOutError
from kvtierd.nixl import descriptors
from kvtierd.nixl.export import RegionExport, open_region_export
from kvtierd.nixl.exporters import ExporterUnavailableError
from kvtierd.nixl.probe import NixlOutcome, NixlVerdict
from kvtierd.store.arena import Arena
from kvtierd.store.records import checksum
from kvtierd.store.regions import Regions, TenantRegion
from tests.nixl.children import Child, pull
from tests.nixl.peer import EXTENTS, REGION_BYTES

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


@dataclass
class Exported:
    arena: Arena
    mine: TenantRegion
    theirs: TenantRegion
    export: RegionExport


@pytest.fixture
def arena() -> Iterator[Arena]:
    """Private memory, then tenant ``a``'s and ``b``'s regions, each of random bytes."""
    made = Arena.create(2 << 20, [("a", REGION_BYTES), ("b", REGION_BYTES)], mlock=TriState.NEVER)
    for region in made.regions:
        made.view[region.base : region.base + REGION_BYTES] = os.urandom(REGION_BYTES)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
async def exported(nixl_works: None, arena: Arena) -> AsyncIterator[Exported]:
    regions = Regions(arena.regions)
    mine, theirs = regions.for_tenant("a"), regions.for_tenant("b")
    assert mine is not None
    assert theirs is not None
    async with open_region_export(f"daemon-{os.getpid()}", arena.address, list(regions)) as export:
        yield Exported(arena, mine, theirs, export)
    assert "nixl._api" not in sys.modules  # the exporters ran NIXL, this process never did


class _Lease:
    """Stands for a NIXL lease the daemon handed out: its exporter drives UCX's progress while
    it exists (a puller child may take longer to start than the linger after a grant)."""


def _hand_over(exported: Exported, directory: Path) -> _Lease:
    """What a client of tenant ``a`` gets, as the files a ``puller`` child reads; the lease to
    keep while it pulls."""
    mine, export = exported.mine, exported.export
    lease = _Lease()
    export.hold(mine, lease)
    offsets = [(mine.mapping.base + offset, length) for offset, length in EXTENTS]
    (directory / "owner.md").write_bytes(export.grant(mine).metadata)
    (directory / "extents.bin").write_bytes(export.describe(mine, offsets))
    view = exported.arena.view
    expected = b"".join(view[offset : offset + length] for offset, length in offsets)
    (directory / "expected.bin").write_bytes(expected)
    return lease


async def test_a_tenant_client_pulls_its_blocks_from_its_regions_exporter(
    exported: Exported, tmp_path: Path
) -> None:
    lease = _hand_over(exported, tmp_path)
    result = await anyio.to_thread.run_sync(pull, tmp_path, "sync")
    del lease
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]


async def test_each_region_has_its_own_exporter_and_agent(exported: Exported) -> None:
    export = exported.export
    mine, theirs = export.grant(exported.mine), export.grant(exported.theirs)
    assert mine.agent != theirs.agent
    pids = {e.pid for e in export.exporters.values()}
    assert len(pids) == len(export.exporters)
    assert None not in pids
    assert os.getpid() not in pids


async def test_the_export_describes_nothing_outside_the_tenant_region(exported: Exported) -> None:
    """Neither an extent of another tenant's region, nor one that starts in the tenant's region
    and runs into the next (the regions are adjacent in the arena)."""
    mine, theirs = exported.mine, exported.theirs
    for extent in [(theirs.mapping.base, 4096), (mine.mapping.base + REGION_BYTES - 1, 2)]:
        with pytest.raises(InvalidRequestError, match="outside region"):
            exported.export.describe(mine, [extent])


async def test_descriptors_are_in_the_exporters_addresses(exported: Exported) -> None:
    """The daemon's own addresses never leave it: a descriptor names the region's place in its
    exporter, which maps nothing else of the daemon's."""
    mine = exported.mine
    data = exported.export.describe(mine, [(mine.mapping.base, 4096)])
    described = msgspec.msgpack.decode(data, type=descriptors.Descriptors)
    assert described.agent == exported.export.grant(mine).agent
    (address, length), *_ = described.extents
    assert length == 4096
    assert address != exported.arena.address + mine.mapping.base


async def test_a_peer_restore_pulls_through_the_slots_exporter(
    exported: Exported, tmp_path: Path
) -> None:
    """:meth:`RegionExport.pull_into`: the exporter of the slot's region reads a peer's extent
    into its landing buffer (it maps the region read-only), the daemon copies it into the slot
    (what a peer restore does) and returns the hash of the slot's bytes."""
    owner = await anyio.to_thread.run_sync(lambda: Child("owner", str(tmp_path)))
    try:
        await anyio.to_thread.run_sync(owner.line_starting, "ready")
        metadata = (tmp_path / "owner.md").read_bytes()
        remote = (tmp_path / "first.bin").read_bytes()
        length = EXTENTS[0][1]
        slot = exported.theirs.mapping.base + (1 << 20)
        target = exported.arena.view[slot : slot + length]
        copied = await exported.export.pull_into(
            target,
            agent=descriptors.agent_of(remote),
            metadata=metadata,
            remote=remote,
            timeout_s=30,
        )
        assert bytes(target) == (tmp_path / "expected.bin").read_bytes()[:length]
        assert copied == checksum(target)
        outside = exported.arena.view[: exported.mine.mapping.base][:length]  # private memory
        with pytest.raises(InvalidRequestError, match="no exported region"):
            await exported.export.pull_into(
                outside, agent="x", metadata=b"x", remote=remote, timeout_s=30
            )
    finally:
        await anyio.to_thread.run_sync(owner.finish, "exit")


async def test_a_killed_exporter_is_restarted_with_a_new_agent(
    exported: Exported, tmp_path: Path
) -> None:
    export, mine = exported.export, exported.mine
    exporter = export.exporters[mine.id]
    before, agent = exporter.pid, export.grant(mine).agent
    other = export.grant(exported.theirs).agent
    assert before is not None
    os.kill(before, signal.SIGKILL)
    with anyio.fail_after(120):
        while exporter.pid in (before, None):
            if exporter.pid is None:  # down: answered with the reason, never with a crash
                with pytest.raises(ExporterUnavailableError, match=r"region \d+ \(a\)"):
                    export.grant(mine)
            await anyio.sleep(0.05)
    assert export.grant(mine).agent != agent
    assert export.grant(exported.theirs).agent == other  # tenant b's never noticed
    lease = _hand_over(exported, tmp_path)
    result = await anyio.to_thread.run_sync(pull, tmp_path, "sync")
    del lease
    assert (result["error"], result["sha256"]) == ("", result["expected"])


async def test_a_hung_exporter_is_killed_and_restarted(exported: Exported) -> None:
    """An exporter that does not answer a pull within its deadline and the slack after it is
    killed (no transfer may go on into a slot the daemon gave up on) and started again."""
    export, theirs = exported.export, exported.theirs
    exporter = export.exporters[theirs.id]
    hung = exporter.pid
    assert hung is not None
    os.kill(hung, signal.SIGSTOP)
    slot = exported.arena.view[theirs.mapping.base : theirs.mapping.base + 4096]
    with pytest.raises(TimedOutError, match="did not answer a pull"):
        await export.pull_into(slot, agent="peer", metadata=b"m", remote=b"d", timeout_s=0.5)
    with anyio.fail_after(120):  # a bound on the wait for the restart
        while True:
            if exporter.pid not in (hung, None):
                break
            await anyio.sleep(0.05)
    assert export.grant(theirs).agent.endswith("-2")


async def test_without_a_working_nixl_nothing_is_exported_or_loaded() -> None:
    """A failed probe leaves the daemon without NIXL reads and starts no exporter."""
    verdict = NixlVerdict(NixlOutcome.IMPORT_ERROR, "NIXL does not import: stand-in")
    with pytest.raises(NotSupportedError, match="stand-in"):
        async with open_region_export("daemon", 1 << 40, [], probe=lambda: verdict):
            pass
    assert "nixl._api" not in sys.modules
