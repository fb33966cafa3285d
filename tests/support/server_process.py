"""`python -m service` in a subprocess on 127.0.0.1, SERVING when built: the one way the tests and the
benchmarks start a service process. Ports are picked by the service (`--port 0`, `--metrics-port 0`)
and read back from its ready file; its log goes to a file; `terminate()` sends SIGTERM and waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from proto.attention.v1.codec import SERVICE_NAME
from service.device import default_threads, default_workers

ROOT = Path(__file__).resolve().parents[2]
LEDGER_LINE = "stopped; ledger "
DRAIN_LINE = ": draining for up to "  # service/server.py drain_on_signal, in both modes
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"  # logging's asctime, which service/__main__.py's format starts with
PINNED = ("--precision", "fp32", "--max-batch-tokens", "1024",
          "--model-workers", str(default_workers("auto", default_threads())))
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class ServerProcess:
    """`flags` come after the defaults, so they win (`--metrics-port -1` turns the metrics port off).
    `prelude` (Python) runs in the server process before the service starts, and `source` is the tree
    it runs from (bench.ab compares two trees). `pinned` (the default) fixes what the service would
    otherwise measure at warm-up, precision (fp32), max_batch_tokens (1024, the CPU default without
    warm-up) and model_workers (the device's default), so two processes of a test serve alike; bench.ab
    passes False to run the real defaults."""

    def __init__(self, bundle: Path, *flags: str, directory: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 120.0, prelude: str = "", source: Path = ROOT, pinned: bool = True) -> None:
        self._tmp = None if directory is not None else tempfile.TemporaryDirectory(prefix="service-process-")
        self.directory = directory if directory is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.directory.mkdir(parents=True, exist_ok=True)
        ready = self.directory / "ready.json"
        ready.unlink(missing_ok=True)
        self.log = self.directory / "server.log"
        self.stopped_in: float | None = None
        program = ["-m", "service"]
        if prelude:
            program = ["-c", f"import sys\n{prelude}\nfrom service.__main__ import main\nsys.exit(main(sys.argv[1:]))"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *program, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                 "--http-port", "0", "--model", str(bundle), "--ready-file", str(ready),
                 *(PINNED if pinned else ()), *flags],
                cwd=source, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **({"PYTHONPATH": str(source)} if source != ROOT else {}), **(env or {})},
            )
        end = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise RuntimeError(f"server not ready within {timeout:.0f} s (exit {self.proc.returncode}):\n"
                                   f"{self.output()[-3000:]}")
            time.sleep(0.05)
        self.ports: dict[str, int] = json.loads(ready.read_text())
        ready.unlink()  # read: the directory keeps only the log
        self.target = f"127.0.0.1:{self.ports['port']}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def scrape(self) -> Samples:
        """Every sample of the server's /metrics: (name, labels) -> value."""
        url = f"http://127.0.0.1:{self.ports['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {(sample.name, frozenset(sample.labels.items())): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Sum of the samples named `name` whose labels include `labels`."""
        want = set((labels or {}).items())
        return sum(v for (n, ls), v in self.scrape().items() if n == name and want <= ls)

    def started(self) -> float:
        """attention.v1 calls started so far (grpc_server_started_total)."""
        return self.sample("grpc_server_started_total", {"grpc_service": SERVICE_NAME})

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; records how long the exit took."""
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        self.stopped_in = time.monotonic() - sent
        return code

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 30 s), and clean up a temporary directory."""
        if self.proc.poll() is None:
            try:
                self.terminate()
            except subprocess.TimeoutExpired:
                self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def logged_at(self, text: str) -> float:
        """When the service logged its first line holding `text`, by its own clock (the line's asctime), in
        seconds since the epoch. Durations between two of its lines are the service's own account of them,
        which a busy machine's scheduling of this test process does not lengthen."""
        for line in self.output().splitlines():
            if text in line:
                return datetime.strptime(line[:23], LOG_TIME).timestamp()
        raise AssertionError(f"{text!r} not in the server log:\n{self.output()[-3000:]}")

    def drained_in(self, since: str = DRAIN_LINE) -> float:
        """Seconds from the service's log line holding `since` (default: the first signal's "draining")
        to its exit ledger line, as the service's log timestamps tell it."""
        return self.logged_at(LEDGER_LINE) - self.logged_at(since)

    def exit_ledger(self) -> dict[str, Any]:
        """The call ledger the server logs as it exits (service/server.py `ledger`)."""
        lines = [line for line in self.output().splitlines() if LEDGER_LINE in line]
        assert lines, f"no ledger line in the server log:\n{self.output()[-3000:]}"
        result: dict[str, Any] = json.loads(lines[-1].split(LEDGER_LINE, 1)[1])
        return result
