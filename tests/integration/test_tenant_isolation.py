"""Hostile clients against the real daemon, as real other uids: issue 14's table, row by row.

Two tenants (``alpha``: uid 2001, ``beta``: uid 2002) and a stranger (uid 2003, admitted to no
tenant) reach a daemon whose socket any uid may open (mode 0666), so the only thing that keeps
them apart is the daemon. Each test names the row of the review it replays; each failed on the
daemon that handed the whole arena to every client at INIT.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash

from kvtierd.client import Client, connect
from kvtierd.errors import (
    AccessDeniedError,
    CorruptBlockError,
    InvalidRequestError,
    KvtierError,
    NoSpaceError,
    QuotaError,
)
from kvtierd.keys import chain_keys
from kvtierd.store.namespaces import NamespaceSpec
from kvtierd.store.records import RecordHeader
from kvtierd.testing import DaemonProcess
from tests.support.configs import config_text, tenant_table
from tests.support.uids import call_as, client_as, reachable_directory, require_root

pytestmark = pytest.mark.timeout(300)

ALPHA, BETA, STRANGER = 2001, 2002, 2003
BLOCK = 64 << 10
CONFIG = config_text(
    tenant_table("alpha", uids=(ALPHA,)),
    tenant_table("beta", uids=(BETA,)),
    daemon={"socket_mode": "0666"},
    dram={"size": "96M"},
)


#: Staging memory for two blocks, one of them kept for write-back: most blocks are then
#: hashed in their slot at COMMIT and copied (and verified) by write-back instead.
TINY_STAGING = '\n[nvme]\nstaging_bytes = "256K"\n\n[limits]\nmax_block_bytes = "128K"\n'


def _daemon(config: str) -> Iterator[DaemonProcess]:
    require_root()
    with reachable_directory() as directory:
        process = DaemonProcess(directory, dram_size=None, config_text=config).start()
        try:
            yield process
        finally:
            process.kill()


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    yield from _daemon(CONFIG)


@pytest.fixture(params=["copied at commit", "copied at write-back"])
def writeback_daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A daemon whose write-back writes copies made at COMMIT, or (staging memory too small
    for them) copies it makes and verifies itself."""
    yield from _daemon(CONFIG if request.param == "copied at commit" else CONFIG + TINY_STAGING)


def pattern(tag: bytes, key: bytes) -> bytes:
    """A block nobody could mistake for another: the tag and key, repeated."""
    unit = tag + key
    return (unit * (BLOCK // len(unit) + 1))[:BLOCK]


def keys_of(client: Client, tenant: str, name: str, count: int) -> list[bytes]:
    ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
    return chain_keys(range(16 * count), 16, ns.key_salt)


def put_blocks(client: Client, tenant: str, name: str, count: int, tag: bytes) -> list[bytes]:
    ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
    keys = chain_keys(range(16 * count), 16, ns.key_salt)
    assert ns.put(keys, [pattern(tag, k) for k in keys]) == count
    return keys


def read_blocks(client: Client, tenant: str, name: str, count: int) -> list[bytes | None]:
    """Each block's bytes as read through the library (``None``: a miss)."""
    ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
    out: list[bytes | None] = []
    for key in chain_keys(range(16 * count), 16, ns.key_salt):
        buffer = bytearray(BLOCK)
        try:
            ns.read_into([key], [buffer])
        except (CorruptBlockError, KeyError):
            out.append(None)
            continue
        out.append(bytes(buffer))
    return out


def region_fd(client: Client, tenant: str, name: str) -> tuple[int, int]:
    ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
    arena = ns.arena
    return arena.fd, arena.size_bytes


def memfds() -> list[str]:
    """The memory files this process holds open (what it could map)."""
    # A process that changed its uid is not dumpable, so its /proc/self/fd is root's: undo that.
    ctypes.CDLL(None, use_errno=True).prctl(4, 1)  # PR_SET_DUMPABLE
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:"):  # "/memfd:kvtierd-alpha (deleted)"
            names.append(target.split(" ")[0].lstrip("/"))
    return names


# -- rows 1 and 2: the descriptor cannot be truncated; holes hurt only their own tenant --------


def truncate_then_write(client: Client) -> dict[str, Any]:
    fd, size = region_fd(client, "alpha", "t")
    outcome: dict[str, Any] = {}
    for what, call in (
        ("shrink", lambda: os.ftruncate(fd, 0)),
        ("grow", lambda: os.ftruncate(fd, size * 2)),
    ):
        try:
            call()
            outcome[what] = "allowed"
        except OSError as exc:
            outcome[what] = exc.errno
    outcome["stored"] = len(put_blocks(client, "alpha", "t", 4, b"ALPHA"))
    return outcome


def punch_own_region(client: Client) -> int:
    fd, size = region_fd(client, "alpha", "t")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: what "truncate and grow back" did before
    return int(libc.fallocate(fd, 3, 0, size))


def test_row_1_2_a_sealed_region_cannot_shrink_and_a_hole_hurts_only_its_tenant(
    daemon: DaemonProcess,
) -> None:
    client_as(BETA, BETA, daemon.socket, put_blocks, "beta", "victim", 8, b"BETA")
    client_as(ALPHA, ALPHA, daemon.socket, put_blocks, "alpha", "t", 8, b"ALPHA")
    outcome = client_as(ALPHA, ALPHA, daemon.socket, truncate_then_write)
    assert (outcome["shrink"], outcome["grow"]) == (1, 1)  # EPERM: F_SEAL_SHRINK | GROW
    assert outcome["stored"] == 4
    assert client_as(ALPHA, ALPHA, daemon.socket, punch_own_region) == 0
    beta = client_as(BETA, BETA, daemon.socket, read_blocks, "beta", "victim", 8)
    with connect(daemon.socket) as root:
        keys = keys_of(root, "beta", "victim", 8)
    assert beta == [pattern(b"BETA", k) for k in keys]
    alpha = client_as(ALPHA, ALPHA, daemon.socket, read_blocks, "alpha", "t", 8)
    assert alpha == [None] * 8  # zeros fail their checksum: misses, never data
    assert daemon.process is not None
    assert daemon.process.poll() is None


# -- row 3 and item 2: what reaches the disk is what was committed ----------------------------


def forge_and_scribble(client: Client, beta_digest: bytes, rounds: int) -> list[bytes]:
    """Commit blocks whose payloads are forged record headers for beta's namespace, and keep
    scribbling forged headers over the whole region (committed slots included) while they are
    written back; then FSYNC. Returns alpha's keys."""
    ns = client.namespace("forger", block_bytes=BLOCK, tenant="alpha")
    arena = ns.arena
    mapping = mmap.mmap(arena.fd, arena.size_bytes)
    forged = RecordHeader(beta_digest, b"\x01" * 16, BLOCK, BLOCK, 0, 1 << 60).pack()
    page = np.frombuffer(forged + bytes(4096 - len(forged)), np.uint8)
    region = np.frombuffer(mapping, np.uint8).reshape(-1, 4096)
    keys = chain_keys(range(16 * 64), 16, ns.key_salt)
    blocks = [np.tile(page, BLOCK // 4096).tobytes() for _ in keys]
    for start in range(0, len(keys), 8):
        ns.put(keys[start : start + 8], blocks[start : start + 8])
        for _ in range(rounds):
            region[:] = page
    client.fsync()
    del region
    mapping.close()
    return keys


def test_row_3_forged_headers_and_scribbles_never_reach_the_disk_as_another_block(
    writeback_daemon: DaemonProcess,
) -> None:
    daemon = writeback_daemon
    beta_keys = client_as(BETA, BETA, daemon.socket, put_blocks, "beta", "victim", 16, b"BETA")
    spec = NamespaceSpec("victim", "beta", BLOCK, None, 0, 1)
    digest = xxhash.xxh3_128_digest(spec.identity(with_rank=True))  # public: computable
    client_as(ALPHA, ALPHA, daemon.socket, forge_and_scribble, digest, 3)
    with connect(daemon.socket) as root:
        root.fsync()
    daemon.kill()  # kill -9 right after: recovery scans the records on disk
    daemon.start()
    beta = client_as(BETA, BETA, daemon.socket, read_blocks, "beta", "victim", 16)
    assert beta == [pattern(b"BETA", k) for k in beta_keys]
    with connect(daemon.socket) as root:
        ns = root.namespace("forger", block_bytes=BLOCK, tenant="alpha")
        keys = chain_keys(range(16 * 64), 16, ns.key_salt)
        stats = root.stats()
    # every record recovered is a committed block: beta's 16 and at most alpha's 64
    nvme = next(t for t in stats["tiers"] if t["name"] == "nvme")
    assert 16 <= nvme["blocks"] <= 16 + len(keys)
    alpha = client_as(ALPHA, ALPHA, daemon.socket, read_blocks, "alpha", "forger", 64)
    committed = np.tile(
        np.frombuffer(
            RecordHeader(digest, b"\x01" * 16, BLOCK, BLOCK, 0, 1 << 60).pack().ljust(4096, b"\0"),
            np.uint8,
        ),
        BLOCK // 4096,
    ).tobytes()
    assert all(block is None or block == committed for block in alpha)


# -- rows 4 and 5: a client maps its own tenant's bytes and nobody else's ----------------------


def what_a_stranger_gets(client: Client) -> dict[str, Any]:
    outcome: dict[str, Any] = {"memfds": memfds()}
    for tenant in ("beta", "default"):
        try:
            client.namespace("victim", block_bytes=BLOCK, tenant=tenant)
            outcome[tenant] = "opened"
        except AccessDeniedError:
            outcome[tenant] = "denied"
    outcome["memfds_after"] = memfds()
    return outcome


def search_and_overwrite(client: Client, needle: bytes) -> dict[str, Any]:
    fd, size = region_fd(client, "alpha", "t")
    with mmap.mmap(fd, size) as mapping:
        found = mapping.find(needle) >= 0
        mapping[:] = b"\xee" * size  # every byte this client can reach
    return {"found": found, "memfds": memfds()}


def test_row_4_5_no_client_maps_another_tenants_bytes(daemon: DaemonProcess) -> None:
    keys = client_as(BETA, BETA, daemon.socket, put_blocks, "beta", "victim", 8, b"BETA-SECRET")
    stranger = client_as(STRANGER, STRANGER, daemon.socket, what_a_stranger_gets)
    assert stranger == {"memfds": [], "beta": "denied", "default": "denied", "memfds_after": []}
    alpha = client_as(ALPHA, ALPHA, daemon.socket, search_and_overwrite, b"BETA-SECRET")
    assert alpha["found"] is False
    assert set(alpha["memfds"]) == {"memfd:kvtierd-alpha"}  # mmap holds a dup of it
    beta = client_as(BETA, BETA, daemon.socket, read_blocks, "beta", "victim", 8)
    assert beta == [pattern(b"BETA-SECRET", k) for k in keys]


# -- row 6: salts need the daemon's secret ----------------------------------------------------


def salt_of(client: Client) -> bytes:
    return client.namespace("victim", block_bytes=BLOCK, tenant="beta").key_salt


def test_row_6_a_salt_cannot_be_computed_from_public_inputs(daemon: DaemonProcess) -> None:
    salt = client_as(BETA, BETA, daemon.socket, salt_of)
    spec = NamespaceSpec("victim", "beta", BLOCK, None, 0, 1)
    group = xxhash.xxh3_128_digest(spec.identity(with_rank=False))
    assert salt != xxhash.xxh3_128_digest(b"kvtierd/key-salt/v1" + group)  # the old formula
    secret = daemon.data_dir / "key.secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert len(secret.read_bytes()) == 32
    # another daemon, another secret: the same namespace has another salt
    daemon.stop()
    secret.unlink()
    daemon.start()
    assert client_as(BETA, BETA, daemon.socket, salt_of) != salt


# -- row 7: STATFS shows a tenant its own figures only ----------------------------------------


def tenant_stats(client: Client) -> dict[str, Any]:
    client.namespace("victim", block_bytes=BLOCK, tenant="beta")
    return client.stats()


def read_a_lot(client: Client, rounds: int) -> None:
    ns = client.namespace("t", block_bytes=BLOCK, tenant="alpha")
    keys = chain_keys(range(16 * 4), 16, ns.key_salt)
    for _ in range(rounds):
        with ns.get(keys):
            pass


def test_row_7_statfs_shows_a_tenant_nothing_of_another(daemon: DaemonProcess) -> None:
    client_as(ALPHA, ALPHA, daemon.socket, put_blocks, "alpha", "t", 4, b"ALPHA")
    client_as(ALPHA, ALPHA, daemon.socket, put_blocks, "alpha", "u", 4, b"ALPHA")
    before = client_as(BETA, BETA, daemon.socket, tenant_stats)
    client_as(ALPHA, ALPHA, daemon.socket, read_a_lot, 50)
    after = client_as(BETA, BETA, daemon.socket, tenant_stats)
    assert before["scope"] == after["scope"] == "tenant"
    assert after["namespaces"] == 1  # beta's own; alpha's two are not counted
    dram = [next(t for t in s["tiers"] if t["name"] == "dram") for s in (before, after)]
    assert dram[0]["hits"] == dram[1]["hits"] == 0
    assert dram[1]["blocks"] == 0
    with connect(daemon.socket) as root:  # the admin sees the host
        host = root.stats()
    assert host["scope"] == "host"
    assert next(t for t in host["tiers"] if t["name"] == "dram")["hits"] >= 200


# -- rows 8 and 9: bounds before work; a refusal never evicts another tenant ------------------


def open_huge(client: Client, options: dict[str, int]) -> str:
    try:
        client.namespace("huge", tenant="alpha", **{"block_bytes": BLOCK, **options})  # type: ignore[arg-type]
    except (InvalidRequestError, NoSpaceError) as exc:
        return type(exc).__name__
    return "opened"


def tiers_of(client: Client, tenant: str, name: str, count: int) -> list[str]:
    ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
    return ns.lookup_tiers(chain_keys(range(16 * count), 16, ns.key_salt), promote=False)


def test_row_8_9_absurd_numbers_are_refused_before_any_work(daemon: DaemonProcess) -> None:
    client_as(BETA, BETA, daemon.socket, put_blocks, "beta", "victim", 8, b"BETA")
    for options, refusal in (
        ({"world_size": 2**48 - 1}, "InvalidRequestError"),
        ({"world_size": 257}, "InvalidRequestError"),
        ({"block_bytes": 2**48 - 1}, "InvalidRequestError"),
        ({"block_bytes": 60 << 20}, "NoSpaceError"),  # within the bound, beyond alpha's 48M
    ):
        assert client_as(ALPHA, ALPHA, daemon.socket, open_huge, options) == refusal
    assert client_as(ALPHA, ALPHA, daemon.socket, open_huge, {"world_size": 256}) == "opened"
    # beta's blocks are still in DRAM: nothing was evicted for alpha's requests
    assert client_as(BETA, BETA, daemon.socket, tiers_of, "beta", "victim", 8) == ["dram"] * 8


# -- row 12: quotas per connection, refusals EDQUOT -------------------------------------------


def hog_and_neighbour(socket: str) -> dict[str, Any]:
    """One connection allocates without committing until refused; a second connection of the
    same tenant still stores."""
    outcome: dict[str, Any] = {}
    with connect(socket) as hog, connect(socket) as good:
        ns = hog.namespace("hog", block_bytes=BLOCK, tenant="alpha")
        writes = []
        try:
            for i in range(10_000):
                keys = chain_keys(range(16 * (i + 1)), 16, ns.key_salt)[-1:]
                write = ns.write(keys)
                write.__enter__()
                writes.append(write)
        except QuotaError as exc:
            outcome["refusal"] = f"QuotaError: {exc}"
        outcome["held"] = len(writes)
        outcome["stored"] = len(put_blocks(good, "alpha", "neighbour", 16, b"GOOD"))
    return outcome


def test_row_12_one_connection_cannot_take_its_tenants_whole_region(daemon: DaemonProcess) -> None:
    client_as(BETA, BETA, daemon.socket, put_blocks, "beta", "victim", 8, b"BETA")
    outcome = call_as(ALPHA, ALPHA, hog_and_neighbour, str(daemon.socket))
    assert outcome["refusal"].startswith("QuotaError")
    # alpha's region is half of the 96M (two unsized tenants); connection_pinned_share 0.75
    assert outcome["held"] == (48 << 20) * 3 // 4 // BLOCK
    assert outcome["stored"] == 16
    assert client_as(BETA, BETA, daemon.socket, tiers_of, "beta", "victim", 8) == ["dram"] * 8


# -- a misspelt tenant is answered as such (issue 35) ------------------------------------------


def open_tenant(client: Client, tenant: str) -> str:
    try:
        client.namespace("t", block_bytes=BLOCK, tenant=tenant)
    except KvtierError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "opened"


def test_a_tenant_that_is_not_listed_is_named_as_unknown_not_as_no_space(
    daemon: DaemonProcess,
) -> None:
    with connect(daemon.socket) as root:  # root may name any tenant; there is no default region
        assert open_tenant(root, "alfa") == (
            "AccessDeniedError: no tenant 'alfa': the daemon's tenants are 'alpha', 'beta', "
            "and every byte of DRAM went to them (no default region for others)"
        )
    # a tenant's uid that misspells its tenant is told which it may use, and nothing more
    assert client_as(ALPHA, ALPHA, daemon.socket, open_tenant, "alfa") == (
        "AccessDeniedError: no tenant 'alfa': uid 2001 may use 'alpha'"
    )
    # another tenant's name stays a refusal, and a stranger learns no names
    assert client_as(ALPHA, ALPHA, daemon.socket, open_tenant, "beta") == (
        "AccessDeniedError: uid 2001 may not use tenant 'beta'"
    )
    assert client_as(STRANGER, STRANGER, daemon.socket, open_tenant, "alfa") == (
        "AccessDeniedError: uid 2003 may not use tenant 'alfa'"
    )
    assert client_as(ALPHA, ALPHA, daemon.socket, open_tenant, "alpha") == "opened"
