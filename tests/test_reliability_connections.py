"""Connection-level reliability (issue 16, items 5, 9 and 10): what no handler can bound.

- a flood of header-only streams on one connection must not make other connections' calls fail;
- a request whose message never completes, with no deadline, is ended by the connection limits;
- a metrics port already in use stops start-up with one clean line and exit code 1.

The HTTP/2 side is spoken by hand (`tests/h2_client.py`, PyPI `h2` over a plain socket to 127.0.0.1),
because grpcio never sends such frames. Every flood is bounded in count and in seconds.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.reliability_helpers import REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_metrics_port_in_use_stops_start_up_with_one_clean_line(tiny_bundle: Path):
    grpc_port = _free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(grpc_port),
             "--metrics-port", str(metrics_port), "--model", str(tiny_bundle), "--no-warmup"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output and "Event loop is closed" not in output, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1, output
    assert f"metrics port 127.0.0.1:{metrics_port}" in errors[0] and "in use" in errors[0], errors
    with socket.socket() as again:  # the gRPC port was released (never left bound by a dying process)
        again.bind(("127.0.0.1", grpc_port))
