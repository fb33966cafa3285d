"""What a newcomer sees first (issue 28): help and configuration errors without torch, a port in use
named with the setting that moves it, and log lines that say what happened (the default model built,
and where; the metrics address, or that it is off)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.parametrize("argv", [["--help"], ["--max-batch-size", "0"]])
def test_help_and_configuration_errors_do_not_import_torch(argv: list[str]) -> None:
    result = _run("-X", "importtime", "-m", "service", *argv)
    assert result.returncode == (0 if argv == ["--help"] else 2), result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "service.config" in imported  # the check reads the import log
    assert "torch" not in imported, "torch is imported before the arguments are parsed"


def test_a_grpc_port_in_use_is_named_with_its_setting(tiny_bundle: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _run("-m", "service", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1",
                      "--model", str(tiny_bundle))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.stderr[-2000:]
    assert f"gRPC port 127.0.0.1:{port} is already in use" in errors[0] and "ATTN_PORT / --port" in errors[0]
    assert "GRPC_VERBOSITY" not in result.stderr


def _start(*flags: str, directory: Path) -> tuple[subprocess.Popen[str], Path]:
    ready = directory / "ready.json"
    ready.unlink(missing_ok=True)
    log = directory / "server.log"
    out = open(log, "w")  # noqa: SIM115 (closed with the process below)
    proc = subprocess.Popen([sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", "0",
                             "--http-port", "-1", "--precision", "fp32", "--max-batch-tokens", "1024",
                             "--ready-file", str(ready), *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            text=True)
    out.close()
    end = time.monotonic() + 240
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.05)
    return proc, log


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_the_logs_say_where_the_default_model_is_and_where_metrics_are(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    proc, log = _start("--cache-dir", str(cache), "--metrics-port", "0", "--drain-delay-s", "0",
                       directory=tmp_path)
    _stop(proc)
    first = log.read_text()
    built = next(p for p in cache.iterdir() if p.name.startswith("attention-reference"))
    assert f"building the built-in default model (seeded weights, no download) into {built}" in first
    assert f"built the default model at {built}" in first
    assert "metrics on 127.0.0.1:" in first and "metrics on :" not in first
    proc, log = _start("--cache-dir", str(cache), "--metrics-port", "-1", "--drain-delay-s", "0",
                       directory=tmp_path)
    _stop(proc)
    second = log.read_text()
    assert f"serving the built-in default model from {built}" in second and "building" not in second
    assert "metrics on (off)" in second
