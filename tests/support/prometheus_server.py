"""A real Prometheus server for tests: started on a free loopback port, scraping given targets every second.

    with prometheus_server(["127.0.0.1:9464"]) as prom:        # job "attention", scrape_interval 1s
        prom.wait_for('up{job="attention"}', lambda r: len(r) == 1 and r[0].value == 1)

Uses the `prometheus` binary (Debian package `prometheus`; `bash deploy/system-deps.sh` installs it, or set
PROMETHEUS_BIN); the test is skipped with a clear message when it is missing. Loopback only. The first
scrape lands about 5 s after start (Prometheus hands new targets to its scrape manager every 5 s), so a
`wait_for` on scraped data needs a timeout of 15 s or more.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import free_port

# Never send loopback requests through an HTTP proxy from the environment (CI machines often set one).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PrometheusError(RuntimeError):
    """Prometheus did not start, or answered a query with an error."""


@dataclass(frozen=True)
class Sample:
    """One element of a query result: the series labels (with `__name__` when present) and its value."""

    labels: dict[str, str]
    value: float


def find_prometheus() -> str | None:
    """The binary: $PROMETHEUS_BIN, else `prometheus` on PATH, else Debian's /usr/bin/prometheus."""
    candidates = [os.environ.get("PROMETHEUS_BIN"), shutil.which("prometheus"), "/usr/bin/prometheus"]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


class PrometheusServer:
    """A running Prometheus process; made by `prometheus_server()`, which also stops it."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, workdir: Path) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.log_path = workdir / "prometheus.log"

    def _get(
        self, path: str, params: dict[str, str] | None = None, timeout: float = 5.0
    ) -> tuple[int, bytes]:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with _OPENER.open(url, timeout=timeout) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as err:
            with err:
                return int(err.code), err.read()

    def _api(self, path: str, params: dict[str, str] | None = None) -> Any:
        status, body = self._get(path, params)
        try:
            payload = json.loads(body)
        except ValueError:
            raise PrometheusError(f"GET {path}: HTTP {status}, not JSON: {body[:200]!r}") from None
        if payload.get("status") != "success":
            error = payload.get("error", payload)
            raise PrometheusError(f"GET {path} {params or ''}: HTTP {status}: {error}")
        return payload["data"]

    def query(self, expr: str) -> list[Sample]:
        """Evaluate `expr` now (/api/v1/query). A scalar comes back as one Sample with no labels; a range
        vector as one Sample per series holding its newest value."""
        data = self._api("/api/v1/query", {"query": expr})
        kind, result = data["resultType"], data["result"]
        if kind in ("scalar", "string"):
            return [Sample({}, float(result[1]))]
        if kind == "vector":
            return [Sample(dict(item["metric"]), float(item["value"][1])) for item in result]
        return [Sample(dict(item["metric"]), float(item["values"][-1][1])) for item in result]

    def wait_for(
        self,
        expr: str,
        predicate: Callable[[list[Sample]], bool] = bool,
        timeout: float = 30.0,
        interval: float = 0.25,
    ) -> list[Sample]:
        """Poll `query(expr)` until `predicate(result)` holds (default: a non-empty result) and return that
        result. Fails the test after `timeout` s, showing the last result and the scrape targets' state."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"Prometheus: {expr!r} did not reach the expected state within {timeout} s; last result "
                    f"{result}; targets {self.targets()}",
                    pytrace=False,
                )
            time.sleep(interval)

    def label_values(self, label: str, match: str) -> list[str]:
        """The values `label` takes on the series `match` selects (/api/v1/label/<label>/values): what a
        Grafana variable `label_values(match, label)` offers."""
        values: list[str] = self._api(f"/api/v1/label/{urllib.parse.quote(label)}/values", {"match[]": match})
        return values

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets in short form: job, url, health and last error."""
        data = self._api("/api/v1/targets", {"state": "active"})
        return [
            {
                "job": t["labels"].get("job"),
                "url": t.get("scrapeUrl"),
                "health": t.get("health"),
                "lastError": t.get("lastError"),
            }
            for t in data["activeTargets"]
        ]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait up to `timeout` s, then SIGKILL. Safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)

    def _flag(self, name: str) -> str | None:
        flags: dict[str, str] = self._api("/api/v1/status/flags")
        return flags.get(name)

    def _wait_ready(self, timeout: float) -> bool:
        """True once /-/ready answers 200; False if the process exited first. Raises on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                status, _ = self._get("/-/ready", timeout=1.0)
                # The port may belong to another server that took it after free_port() (our process then
                # exits on its failed bind): ready only counts if the server runs our config.
                if status == 200 and self._flag("config.file") == str(self.config_path):
                    return True
            except (OSError, PrometheusError):
                pass  # not listening yet, or not ours
            time.sleep(0.1)
        raise PrometheusError(f"Prometheus not ready within {timeout} s on {self.url}:\n{self.log_tail()}")


def write_config(
    path: Path,
    targets: Sequence[str],
    *,
    job: str,
    scrape_interval: str,
    self_target: str | None = None,
    rule_files: Sequence[str | os.PathLike[str]] = (),
) -> None:
    """A minimal prometheus.yml (JSON is valid YAML): `targets` under `job`, plus Prometheus itself under
    job "prometheus" when `self_target` is given."""
    scrape_configs: list[dict[str, Any]] = []
    if targets:
        scrape_configs.append({"job_name": job, "static_configs": [{"targets": list(targets)}]})
    if self_target:
        scrape_configs.append({"job_name": "prometheus", "static_configs": [{"targets": [self_target]}]})
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": scrape_interval,
        },
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": scrape_configs,
    }
    path.write_text(json.dumps(config, indent=2) + "\n")


@contextlib.contextmanager
def prometheus_server(
    targets: Sequence[str] = (),
    *,
    job: str = "attention",
    scrape_interval: str = "1s",
    scrape_self: bool = False,
    rule_files: Sequence[str | os.PathLike[str]] = (),
    startup_timeout: float = 30.0,
    attempts: int = 5,
) -> Iterator[PrometheusServer]:
    """Run Prometheus on 127.0.0.1 with a temporary TSDB, scraping `targets` ("127.0.0.1:PORT") as `job`
    (and itself as job "prometheus" if `scrape_self`), loading `rule_files`; yield it once /-/ready answers,
    and stop it on exit. Retries with another port when the chosen one was taken meanwhile."""
    binary = find_prometheus()
    if binary is None:
        pytest.skip(
            "the prometheus binary is not installed: run `bash deploy/system-deps.sh` as root "
            "(Debian: apt-get install --no-install-recommends prometheus) or set PROMETHEUS_BIN"
        )
    with tempfile.TemporaryDirectory(prefix="prometheus-test-") as tmp:
        server = _start(
            binary, Path(tmp), targets, job, scrape_interval, scrape_self, rule_files,
            startup_timeout, attempts,
        )
        try:
            yield server
        finally:
            server.stop()


def _start(
    binary: str,
    workdir: Path,
    targets: Sequence[str],
    job: str,
    scrape_interval: str,
    scrape_self: bool,
    rule_files: Sequence[str | os.PathLike[str]],
    startup_timeout: float,
    attempts: int,
) -> PrometheusServer:
    last_log = ""
    for attempt in range(attempts):
        port = free_port()
        attempt_dir = workdir / f"attempt-{attempt}"
        (attempt_dir / "data").mkdir(parents=True)
        config = attempt_dir / "prometheus.yml"
        write_config(
            config,
            targets,
            job=job,
            scrape_interval=scrape_interval,
            self_target=f"127.0.0.1:{port}" if scrape_self else None,
            rule_files=rule_files,
        )
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={attempt_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=info",
        ]
        with open(attempt_dir / "prometheus.log", "wb") as log:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        server = PrometheusServer(process, port, attempt_dir)
        try:
            if server._wait_ready(startup_timeout):
                return server
        except BaseException:
            server.stop()
            raise
        server.stop()
        last_log = server.log_tail()
        if "address already in use" not in last_log:
            break  # not a port race: retrying will not help
    raise PrometheusError(f"Prometheus failed to start ({binary}):\n{last_log}")


def is_one(result: list[Sample]) -> bool:
    """Predicate for `wait_for`: exactly one sample, equal to 1 (e.g. `up` of a single target)."""
    return len(result) == 1 and result[0].value == 1
