"""The shipped Grafana dashboard and Prometheus alert rules, checked by real tools.

* ``promtool check rules`` passes the alert file, and every PromQL expression of the dashboard
  (written into a temporary rule file as recording rules, Grafana's ``$variables`` replaced);
* the alert file's structure: every alert has ``for:``, a severity and both annotations;
* the dashboard's JSON structure (Grafana itself cannot be installed here): schema version,
  unique panel ids, grid positions, a datasource and PromQL targets on every panel;
* a real ``prometheus`` server scrapes a real kvtierd attached to a real redis-server, with the
  rule file loaded: every rule group evaluates healthy, every metric named by the dashboard and
  the rules is in the daemon's live scrape, and the pool-detached alert's expression turns true
  once redis is killed.

Every wait is a poll with a generous deadline; nothing asserts on wall time. The promtool and
Prometheus tests skip when the Debian package ``prometheus`` is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.client import BlockNotFoundError, connect
from kvtierd.testing import DaemonProcess, free_port
from kvtierd.testing.redis_server import RedisServer, require_redis_server

pytestmark = pytest.mark.timeout(240)

MONITORING = Path(__file__).resolve().parents[2] / "systemd" / "monitoring"
ALERTS = MONITORING / "kvtierd-alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
WAIT_S = 60.0
T = TypeVar("T")

#: Grafana's variables, as a Prometheus data source would expand them for one query.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$instance": ".*",
    "$namespace": ".*",
}
#: PromQL words that are not metric names (functions are recognised by their "(").
PROMQL_WORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"and", "or", "unless", "bool", "offset"}
)


# -- reading the files -------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel, those nested in collapsed rows included."""
    panels = []
    for panel in dashboard()["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_exprs() -> list[str]:
    """Every PromQL of the dashboard, Grafana's variables expanded: each target's, and the
    series selector of each ``label_values(selector, label)`` variable."""
    exprs = [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((.+), *\w+\)", variable["definition"])
            assert found, variable["definition"]
            exprs.append(found[1])
    for name, value in GRAFANA_VARIABLES.items():
        exprs = [expr.replace(name, value) for expr in exprs]
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the alert file")
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: what is left once label values, label
    matchers, grouping label lists, ranges, function calls and PromQL keywords are removed."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b[a-zA-Z_]\w*\s*\(", "(", expr)
    words = set(re.findall(r"(?<![\w.])[a-zA-Z_:][\w:]*", expr))
    return words - PROMQL_WORDS


def test_metric_names_are_found_in_promql() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (tier, le) (rate(kvtierd_request_duration_seconds_bucket"
        '{opcode="READ", instance=~"a.*"}[5m]))) > 0.1 and on (instance) kvtierd_ready == 0 '
        'or up{job="kvtierd"} / ignoring(tier) process_open_fds'
    )
    assert metric_names(expr) == {
        "kvtierd_request_duration_seconds_bucket",
        "kvtierd_ready",
        "up",
        "process_open_fds",
    }


# -- static checks ------------------------------------------------------------------------------


def require_prometheus() -> None:
    for tool in ("promtool", "prometheus"):
        if shutil.which(tool) is None:
            pytest.skip(
                f"{tool} is not installed: apt-get install --no-install-recommends prometheus "
                "(tools/setup.sh test does)"
            )


def promtool_check_rules(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_promtool_passes_the_alert_rules() -> None:
    require_prometheus()
    checked = promtool_check_rules(ALERTS)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout


def test_promtool_passes_every_dashboard_expression(tmp_path: Path) -> None:
    require_prometheus()
    exprs = dashboard_exprs()
    rules = [
        {"record": f"kvtierd_dashboard:panel_target_{i}", "expr": expr}
        for i, expr in enumerate(exprs)
    ]
    # JSON is YAML: promtool reads this file as the rule file it is.
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "kvtierd-dashboard", "rules": rules}]}))
    checked = promtool_check_rules(path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in checked.stdout


def test_promtool_rejects_a_broken_expression(tmp_path: Path) -> None:
    """The checks above can fail: promtool refuses what the dashboard must not contain."""
    require_prometheus()
    path = tmp_path / "broken.yml"
    rule = {"record": "broken", "expr": "sum by (tier) (rate(kvtierd_tier_hits_total[$x]))"}
    path.write_text(json.dumps({"groups": [{"name": "broken", "rules": [rule]}]}))
    assert promtool_check_rules(path).returncode != 0


def test_every_alert_has_for_severity_and_what_to_do() -> None:
    rules = alert_rules()
    assert rules
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), names
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert len(rule["annotations"]["description"]) > 80, rule["alert"]
    # The failure modes the operations guide promises an alert for.
    for needed in (
        "KvtierdDown",
        "KvtierdNotReady",
        "KvtierdPoolDetached",
        "KvtierdWritebackBacklogGrowing",
        "KvtierdDiskTierFull",
        "KvtierdCorruptWritebacks",
        "KvtierdReadLatencyHigh",
    ):
        assert needed in names


def test_the_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    board = dashboard()
    assert isinstance(board["schemaVersion"], int)
    assert board["schemaVersion"] >= 36
    assert board["uid"]
    assert board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard_panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert min(grid["w"], grid["h"]) > 0, panel
        assert min(grid["x"], grid["y"]) >= 0, panel
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        covered = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & covered, f"panel {panel['title']!r} overlaps another"
        cells |= covered
        if panel["type"] == "row":
            continue
        assert panel["title"], panel["id"]
        assert panel["description"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert metric_names(target["expr"]), panel["title"]
    kinds = {panel["type"] for panel in panels}
    assert kinds <= {"row", "timeseries", "stat"}, kinds


# -- a live Prometheus scraping a live kvtierd ----------------------------------------------------


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        body: bytes = reply.read()
        return body


def wait_for(what: str, probe: Callable[[], T | None], diagnose: Callable[[], str]) -> T:
    """Poll ``probe`` until it returns something other than ``None`` (or fail after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.5)
    pytest.fail(f"{what} within {WAIT_S} s\n{diagnose()}")


class Prometheus:
    """A ``prometheus`` server in ``directory``: scrapes ``target`` as job ``kvtierd`` every
    second and evaluates ``rule_file`` every second."""

    def __init__(self, directory: Path, target: str, rule_file: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "prometheus.log"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rule_file)],
            "scrape_configs": [{"job_name": "kvtierd", "static_configs": [{"targets": [target]}]}],
        }
        self.config_path = directory / "prometheus.yml"
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(config))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.directory / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=log,
            )
        wait_for("prometheus did not become ready", self._ready, self.log)
        return self

    def _ready(self) -> bool | None:
        assert self.process is not None
        if self.process.poll() is not None:
            pytest.fail(f"prometheus exited with {self.process.returncode}\n{self.log()}")
        try:
            http_get(f"{self.url}/-/ready")
        except OSError:
            return None
        return True

    def api(self, path: str, **params: str) -> Any:
        """The ``data`` of a successful reply; fails the test with Prometheus's error."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            reply = json.loads(http_get(f"{self.url}/api/v1/{path}{query}"))
        except urllib.error.HTTPError as exc:  # 400/422: a bad or failing query
            pytest.fail(f"{path} {params}: {exc.read().decode(errors='replace')}")
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Stack:
    redis: RedisServer
    daemon: DaemonProcess
    metrics_url: str
    prometheus: Prometheus

    def scrape(self) -> str:
        return http_get(self.metrics_url).decode()

    def diagnose(self) -> str:
        return f"daemon log:\n{self.daemon.log()[-3000:]}\nprometheus log:\n{self.prometheus.log()}"


def daemon_config(metrics_port: int, redis_url: str) -> str:
    """One rank (TP 1) with a pool on ``redis_url`` and short pool timings."""
    return (
        "[daemon]\n"
        f"metrics_port = {metrics_port}\n"
        "shutdown_grace_s = 4\n"
        "\n"
        "[pool]\n"
        f'url = "{redis_url}"\n'
        'group_id = "monitoring"\n'
        "rank = 0\n"
        "world_size = 1\n"
        "allow_plaintext = true\n"
        "vote_timeout_s = 1.0\n"
        "heartbeat_s = 0.2\n"
        "timeout_s = 1.0\n"
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """redis-server, a kvtierd using it as its pool with metrics on, a prometheus scraping it
    with the alert rules loaded; the daemon has served LOOKUP, READ, COMMIT and FSYNC."""
    require_prometheus()
    require_redis_server()
    root = tmp_path_factory.mktemp("monitoring")
    metrics_port = free_port()
    with RedisServer(root / "redis", persistence=False) as redis:
        daemon = DaemonProcess(
            root / "kvtierd",
            dram_size="32M",
            nvme_size="64M",
            config_text=daemon_config(metrics_port, redis.url),
        )
        with daemon:
            prometheus = Prometheus(root / "prometheus", f"127.0.0.1:{metrics_port}", ALERTS)
            try:
                prometheus.start()
                made = Stack(redis, daemon, f"http://127.0.0.1:{metrics_port}/metrics", prometheus)
                wait_for("the pool did not attach", lambda: _pool_up(made), made.diagnose)
                _serve_some_requests(daemon)
                # The registry is refreshed from the store once a second: wait for the requests.
                wait_for("the requests are not counted", lambda: _counted(made), made.diagnose)
                yield made
            finally:
                prometheus.stop()


def _pool_up(stack: Stack) -> bool | None:
    return True if re.search(r"^kvtierd_pool_up 1\.0$", stack.scrape(), re.M) else None


def _counted(stack: Stack) -> bool | None:
    served = r'^kvtierd_namespace_read_bytes_total\{[^}]*namespace="monitoring"[^}]*\} [1-9]'
    return True if re.search(served, stack.scrape(), re.M) else None


def _serve_some_requests(daemon: DaemonProcess) -> None:
    keys = [bytes([i]) * 16 for i in range(8)]
    with connect(daemon.socket, timeout_s=30) as client:
        ns = client.namespace("monitoring", block_bytes=64 << 10)
        ns.put(keys, [bytes([i]) * (64 << 10) for i in range(8)])
        client.fsync()
        assert ns.lookup(keys) == len(keys)
        with ns.get(keys) as views:
            assert bytes(views[3][:4]) == b"\x03" * 4
        with pytest.raises(BlockNotFoundError):  # one failed request: the error counter
            ns.read_into([b"\xff" * 16], [bytearray(64 << 10)])


def _rule_groups(stack: Stack) -> list[dict[str, Any]] | None:
    """The rule groups, once every rule has been evaluated at least once."""
    groups: list[dict[str, Any]] = stack.prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    if not rules or any(rule["lastEvaluation"].startswith("0001-") for rule in rules):
        return None
    return groups


def test_prometheus_loads_every_rule_group_healthy(stack: Stack) -> None:
    groups = wait_for(
        "the rules were not all evaluated", lambda: _rule_groups(stack), stack.diagnose
    )
    assert {group["file"] for group in groups} == {str(ALERTS)}
    loaded = {rule["name"] for group in groups for rule in group["rules"]}
    assert loaded == {rule["alert"] for rule in alert_rules()}
    for group in groups:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
            assert rule["labels"]["severity"] in ("critical", "warning")
            assert rule["duration"] > 0, rule["name"]


def test_every_metric_of_the_dashboard_and_the_rules_is_in_the_live_scrape(stack: Stack) -> None:
    exprs = dashboard_exprs() + [rule["expr"] for rule in alert_rules()]
    wanted = set().union(*(metric_names(expr) for expr in exprs))
    scraped = {
        sample.name
        for family in text_string_to_metric_families(stack.scrape())
        for sample in family.samples
    }
    # ``up`` is Prometheus's own series for the target, not the daemon's.
    assert wanted - {"up"} <= scraped, sorted(wanted - {"up"} - scraped)
    up = wait_for(
        "prometheus did not scrape kvtierd",
        lambda: stack.prometheus.query('up{job="kvtierd"} == 1') or None,
        stack.diagnose,
    )
    assert len(up) == 1
    # promtool only parses; evaluation finds what only data shows (a many-to-many match).
    for expr in dashboard_exprs():
        stack.prometheus.query(expr)
    # READ latencies by tier, which the dashboard and the READ p99 alert aggregate.
    tiers = wait_for(
        "no READ latency histogram in prometheus",
        lambda: (
            stack.prometheus.query(
                'count by (tier) (kvtierd_request_duration_seconds_bucket{opcode="READ"})'
            )
            or None
        ),
        stack.diagnose,
    )
    assert {series["metric"]["tier"] for series in tiers} <= {"dram", "nvme", "pool", "none"}


def _alert_expr(name: str) -> str:
    return next(str(rule["expr"]) for rule in alert_rules() if rule["alert"] == name)


def test_the_pool_detached_alert_turns_true_when_redis_dies(stack: Stack) -> None:
    detached = _alert_expr("KvtierdPoolDetached")
    wait_for(
        "the pool did not show as attached in prometheus",
        lambda: stack.prometheus.query("kvtierd_pool_up == 1") or None,
        stack.diagnose,
    )
    assert stack.prometheus.query(detached) == []
    stack.redis.kill()
    firing = wait_for(
        "KvtierdPoolDetached's expression did not turn true",
        lambda: stack.prometheus.query(detached) or None,
        stack.diagnose,
    )
    assert [series["metric"]["job"] for series in firing] == ["kvtierd"]
    # The daemon keeps serving from its local tiers, and prometheus says it is up and ready.
    assert stack.prometheus.query(_alert_expr("KvtierdDown")) == []
    assert stack.prometheus.query('kvtierd_ready{job="kvtierd"} == 1')
