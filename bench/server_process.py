"""`python -m service` in a subprocess on 127.0.0.1, for the benchmarks: a bounded start, the log kept
(in `log`, or a temporary file), SIGTERM on stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ServerProcess:
    def __init__(self, bundle: Path, *flags: str, log: Path | None = None, timeout: float = 300.0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-server-")
        ready = Path(self._tmp.name) / "ready.json"
        self.log = log or Path(self._tmp.name) / "server.log"
        self._log = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", "0", "--metrics-port", "-1", "--model", str(bundle),
             "--ready-file", str(ready), "--log-level", "warning", *flags],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )
        end = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                tail = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
                raise RuntimeError(f"server not ready within {timeout:.0f} s (exit {self.proc.returncode}): {tail}")
            time.sleep(0.1)
        self.target = f"127.0.0.1:{json.loads(ready.read_text())['port']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._tmp.cleanup()
