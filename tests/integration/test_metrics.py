"""The daemon's metrics as Prometheus reads them: a real daemon on a real redis-server pool,
scraped over HTTP and parsed with prometheus-client's own parser.

The table in ``docs/operations.md`` ("Every metric") is checked against the live registry in
both directions, so the docs cannot drift: every family the daemon exports is documented with
its type and labels, and every documented family exists.
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.client import BlockNotFoundError, chain_keys, connect
from kvtierd.testing import DaemonProcess, free_port
from kvtierd.testing.redis_server import RedisServer, require_redis_server

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
BLOCK_TOKENS = 16
LAYOUT = {
    "model_id": "metrics-test",
    "layers": 2,
    "kv_heads": 2,
    "head_dim": 64,
    "dtype": "float16",
    "block_tokens": BLOCK_TOKENS,
}
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK_TOKENS * 2
T = TypeVar("T")


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for(what: str, probe: Callable[[], T | None], deadline_s: float = 60) -> T:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.2)
    raise AssertionError(what)


@dataclass
class Scraped:
    """One scrape: ``types[family]``, ``labels[family]`` (label names of its samples) and
    ``samples[(sample name, frozenset of label items)] = value``."""

    types: dict[str, str]
    labels: dict[str, set[str]]
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """Sum over the samples of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)


def scrape(port: int) -> Scraped:
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        names = labels.setdefault(family.name, set())
        for sample in family.samples:
            names.update(k for k in sample.labels if k != "le")
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Scraped(types, labels, samples)


@dataclass
class Stack:
    redis: RedisServer
    daemon: DaemonProcess
    port: int


def daemon_config(port: int, redis_url: str, limit: int) -> str:
    return (
        "[daemon]\n"
        f"metrics_port = {port}\n"
        f"metrics_namespace_limit = {limit}\n"
        "shutdown_grace_s = 4\n\n"
        "[pool]\n"
        f'url = "{redis_url}"\n'
        'group_id = "metrics"\n'
        "rank = 0\nworld_size = 1\nallow_plaintext = true\n"
        "vote_timeout_s = 1.0\nheartbeat_s = 0.2\ntimeout_s = 1.0\n"
    )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    require_redis_server()
    port = free_port()
    with RedisServer(tmp_path / "redis", persistence=False) as redis:
        daemon = DaemonProcess(
            tmp_path / "kvtierd",
            dram_size="32M",
            nvme_size="64M",
            config_text=daemon_config(port, redis.url, limit=2),
        )
        with daemon:
            wait_for(
                "the pool never attached", lambda: scrape(port).value("kvtierd_pool_up") or None
            )
            yield Stack(redis, daemon, port)


# -- the docs' table --------------------------------------------------------------------------


def documented() -> dict[str, tuple[str, set[str]]]:
    """``docs/operations.md``'s table: family -> (type, label names)."""
    text = OPERATIONS.read_text()
    section = text.split("### Every metric", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, set[str]]] = {}
    for match in re.finditer(r"^\| `([a-z_:]+)(?:\{([a-z_, ]*)\})?` \| (\w+) \|", section, re.M):
        name, labels, kind = match[1], match[2] or "", match[3]
        rows[name] = (kind, {label.strip() for label in labels.split(",") if label.strip()})
    return rows


def exported_name(family: str, kind: str) -> str:
    """The name the docs use: counters with their ``_total``, like the exposition."""
    return f"{family}_total" if kind == "counter" else family


def exercise(socket_path: Path) -> None:
    """One of each request whose metrics carry labels, so that every family has samples."""
    with connect(socket_path) as client:
        ns = client.namespace("docs", layout=dict(LAYOUT), block_bytes=BLOCK_BYTES)
        keys = chain_keys(range(2 * BLOCK_TOKENS), BLOCK_TOKENS, ns.key_salt)
        ns.put(keys, [bytes(BLOCK_BYTES)] * 2)
        ns.lookup(keys)
        ns.read_into(keys, [bytearray(BLOCK_BYTES), bytearray(BLOCK_BYTES)])
        with pytest.raises(BlockNotFoundError):  # a failed request: the error counter's sample
            ns.read_into([bytes(16)], [bytearray(BLOCK_BYTES)])


def scrape_when(port: int, ready: Callable[[Scraped], bool]) -> Scraped:
    """The first scrape for which ``ready`` holds: gauges and counters come from a snapshot the
    event loop takes every second, so a scrape right after a request may predate it."""
    return wait_for("the metrics never showed it", lambda: s if ready(s := scrape(port)) else None)


def test_the_docs_table_is_the_registry(stack: Stack) -> None:
    exercise(stack.daemon.socket)
    live = scrape_when(stack.port, lambda s: s.total("kvtierd_namespace_hit_tokens_total") > 0)
    assert not [n for n, _ in live.samples if n.endswith("_created")]  # switched off
    exported = {
        exported_name(name, kind): (kind, live.labels[name]) for name, kind in live.types.items()
    }
    docs = documented()
    assert sorted(set(exported) - set(docs)) == [], "exported but not in docs/operations.md"
    assert sorted(set(docs) - set(exported)) == [], "documented but not exported"
    for name, (kind, labels) in docs.items():
        assert exported[name] == (kind, labels), name


def test_the_docs_check_is_not_vacuous() -> None:
    docs = documented()
    assert len(docs) >= 40
    assert docs["kvtierd_request_duration_seconds"] == ("histogram", {"opcode", "tier"})


# -- what the figures count ---------------------------------------------------------------------


def test_requests_tokens_and_transfers_are_counted(stack: Stack) -> None:
    before = scrape(stack.port)
    with connect(stack.daemon.socket) as client:
        ns = client.namespace("with-layout", layout=dict(LAYOUT), block_bytes=BLOCK_BYTES)
        keys = chain_keys(range(8 * BLOCK_TOKENS), BLOCK_TOKENS, ns.key_salt)
        ns.put(keys[:6], [bytes([i]) * BLOCK_BYTES for i in range(6)])
        assert ns.lookup(keys) == 6  # 8 looked up, 6 hit
        ns.read_into(keys[:6], [bytearray(BLOCK_BYTES) for _ in range(6)])
        with pytest.raises(BlockNotFoundError):
            ns.read_into(keys[6:7], [bytearray(BLOCK_BYTES)])
        client.fsync()
    after = scrape_when(
        stack.port,
        lambda s: s.total("kvtierd_namespace_hit_tokens_total", namespace="with-layout") > 0,
    )

    def grew(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    label = {"namespace": "with-layout"}
    assert grew("kvtierd_namespace_lookup_blocks_total", **label) == 8
    assert grew("kvtierd_namespace_hit_blocks_total", **label) == 6
    assert grew("kvtierd_namespace_lookup_tokens_total", **label) == 8 * BLOCK_TOKENS
    assert grew("kvtierd_namespace_hit_tokens_total", **label) == 6 * BLOCK_TOKENS
    assert grew("kvtierd_namespace_committed_blocks_total", **label) == 6
    assert grew("kvtierd_namespace_read_bytes_total", **label) == 6 * BLOCK_BYTES
    # one observation per request, by opcode; the READ under the tier that served it
    assert grew("kvtierd_request_duration_seconds_count", opcode="LOOKUP") == 1
    assert grew("kvtierd_request_duration_seconds_count", opcode="READ", tier="dram") == 1
    assert grew("kvtierd_request_duration_seconds_count", opcode="READ", tier="none") == 1
    assert grew("kvtierd_request_duration_seconds_count", opcode="FSYNC") == 1
    assert grew("kvtierd_request_duration_seconds_count", opcode="COMMIT") >= 1
    # bytes by direction: in from the client, out to it, down to NVMe (FSYNC waited for it)
    direction = "kvtierd_transfer_bytes_total"
    assert grew(direction, direction="client_to_dram") >= 6 * BLOCK_BYTES
    assert grew(direction, direction="dram_to_client") >= 6 * BLOCK_BYTES
    assert grew(direction, direction="dram_to_nvme") >= 6 * BLOCK_BYTES
    assert after.value("process_resident_memory_bytes") > 0
    assert after.value("kvtierd_ready") == 1
    # checkpoints are on by default; none is due after a few blocks written
    assert after.value("kvtierd_checkpoints_on") == 1
    assert after.total("kvtierd_checkpoints_written_total") == 0


def test_failed_requests_are_counted_by_opcode_errno_and_tenant_and_said(stack: Stack) -> None:
    before = scrape(stack.port)
    with connect(stack.daemon.socket, client_name="failing-engine") as client:
        ns = client.namespace("failing", block_bytes=4096)
        for _ in range(3):
            with pytest.raises(BlockNotFoundError):
                ns.read_into([bytes(16)], [bytearray(4096)])
        with pytest.raises(BlockNotFoundError):
            client.namespace("absent", block_bytes=4096, create=False)
    after = scrape(stack.port)  # counted as they are answered: no snapshot to wait for

    def grew(**labels: str) -> float:
        name = "kvtierd_request_errors_total"
        return after.total(name, **labels) - before.total(name, **labels)

    assert grew(opcode="READ", errno="ENOENT", tenant="(unlisted)") == 3
    assert grew(opcode="OPEN_NS", errno="ENOENT", tenant="none") == 1
    log = stack.daemon.log()
    # the first failure of this peer is said, the others held back for a minute
    said = [line for line in log.splitlines() if "failed: ENOENT" in line]
    assert len(said) == 1, said
    assert f"pid {os.getpid()} uid {os.getuid()}" in said[0]
    assert "client 'failing-engine'" in said[0]
    assert "namespace 'failing' of tenant 'default'" in said[0]


TENANTS = """
[daemon]
metrics_port = {port}

[[tenants]]
name = "alpha"
uids = [{uid}]
dram_share = 0.25

[[tenants]]
name = "beta"
uids = [{uid}]
dram_share = 0.25
"""


def test_tenants_are_told_apart_in_every_figure(tmp_path: Path) -> None:
    """Per-tenant figures, the error counter's tenant and the namespace families' tenant label:
    the same namespace name in two tenants is two series."""
    port = free_port()
    config = TENANTS.format(port=port, uid=os.getuid())
    with DaemonProcess(tmp_path / "k", dram_size="64M", nvme_size="64M", config_text=config) as d:
        with connect(d.socket) as client:
            for tenant, count in (("alpha", 3), ("beta", 1)):
                ns = client.namespace("same-name", block_bytes=4096, tenant=tenant)
                keys = chain_keys(range(count), 1, ns.key_salt)
                ns.put(keys, [bytes([count]) * 4096] * count)
                ns.read_into(keys, [bytearray(4096) for _ in keys])
            with pytest.raises(BlockNotFoundError):
                ns.read_into([bytes(16)], [bytearray(4096)])  # beta's
            client.fsync()
            assert client.evict() >= 4
            digest = client.configuration()["digest"]
        live = scrape_when(
            port,
            lambda s: s.value("kvtierd_tenant_evictions_total", tenant="alpha", tier="dram") >= 3,
        )
    for tenant, count in (("alpha", 3), ("beta", 1)):
        assert live.value("kvtierd_tenant_blocks", tenant=tenant, tier="nvme") == count
        assert live.value("kvtierd_tenant_blocks", tenant=tenant, tier="dram") == 0  # evicted
        assert live.value("kvtierd_tenant_capacity_bytes", tenant=tenant, tier="dram") == 16 << 20
        assert live.value("kvtierd_tenant_hits_total", tenant=tenant, tier="dram") == count
        assert (
            live.value("kvtierd_tenant_bytes_total", tenant=tenant, direction="client_to_dram")
            == count * 4096
        )
        label = {"tenant": tenant, "namespace": "same-name", "rank": "0"}
        assert live.value("kvtierd_namespace_committed_blocks_total", **label) == count
    assert live.value("kvtierd_tenant_misses_total", tenant="beta") == 1
    assert live.value("kvtierd_tenant_misses_total", tenant="alpha") == 0
    errors = {"opcode": "READ", "errno": "ENOENT"}
    assert live.value("kvtierd_request_errors_total", tenant="beta", **errors) == 1
    assert live.value("kvtierd_request_errors_total", tenant="alpha", **errors) == 0
    # the disk: every write-back and the sync were timed, none is in flight now
    assert live.value("kvtierd_io_queue_depth") == 64
    assert live.value("kvtierd_io_in_flight") == 0
    assert (
        live.value("kvtierd_disk_operation_seconds_count")
        == live.value("kvtierd_io_operations_total")
        >= 5
    )
    assert live.value("kvtierd_disk_operation_seconds_bucket", le="+Inf") >= 5
    assert live.value("kvtierd_prefetch_queue_blocks") == 0
    [info] = [dict(ls) for (n, ls) in live.samples if n == "kvtierd_info"]
    assert info["config_digest"] == digest[:16]  # the configuration kvtierctl config shows


def test_namespace_label_is_bounded(stack: Stack) -> None:
    with connect(stack.daemon.socket) as client:
        for i in range(5):
            ns = client.namespace(f"many-{i}", block_bytes=4096)
            ns.lookup(chain_keys(range(3), 1, ns.key_salt))
    live = scrape_when(stack.port, lambda s: s.total("kvtierd_namespace_lookup_blocks_total") >= 15)
    names = {
        dict(ls).get("namespace")
        for (n, ls) in live.samples
        if n == "kvtierd_namespace_lookup_blocks_total"
    }
    assert len(names) <= 3  # metrics_namespace_limit = 2, plus "other"
    assert "other" in names
    assert live.total("kvtierd_namespace_lookup_blocks_total") == 15  # nothing lost


def test_eviction_and_promotion_are_counted_by_direction(stack: Stack) -> None:
    before = scrape(stack.port)
    with connect(stack.daemon.socket) as client:
        ns = client.namespace("promoted", layout=dict(LAYOUT), block_bytes=BLOCK_BYTES)
        keys = chain_keys(range(4 * BLOCK_TOKENS), BLOCK_TOKENS, ns.key_salt)
        ns.put(keys, [bytes([i + 1]) * BLOCK_BYTES for i in range(4)])
        client.fsync()  # written back: every block is clean and on NVMe
        assert client.evict() >= 4
        buffers = [bytearray(BLOCK_BYTES) for _ in range(4)]
        ns.read_into(keys, buffers)  # back up from NVMe
        assert [bytes(b[:1]) for b in buffers] == [bytes([i + 1]) for i in range(4)]
    after = scrape_when(
        stack.port,
        lambda s: (
            s.value("kvtierd_transfer_blocks_total", direction="nvme_to_dram")
            >= before.value("kvtierd_transfer_blocks_total", direction="nvme_to_dram") + 4
        ),
    )

    def grew(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    assert grew("kvtierd_transfer_blocks_total", direction="dram_to_nvme") == 4
    assert grew("kvtierd_transfer_bytes_total", direction="dram_to_nvme") >= 4 * BLOCK_BYTES
    assert grew("kvtierd_transfer_bytes_total", direction="nvme_to_dram") >= 4 * BLOCK_BYTES
    assert grew("kvtierd_tier_evictions_total", tier="dram") >= 4
    assert grew("kvtierd_request_duration_seconds_count", opcode="READ", tier="nvme") == 1
    assert grew("kvtierd_request_duration_seconds_count", opcode="READ", tier="dram") == 0
