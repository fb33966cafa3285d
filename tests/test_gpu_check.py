"""bench/gpu_check.py (`make gpu-check`) stays runnable without a GPU: its CPU smoke mode runs every phase
end to end on the TINY preset, and asking for CUDA where there is none exits 2 with a clear message."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "cuda_available: False" in proc.stdout and f"torch: {torch.__version__}" in proc.stdout
    assert "CUDA is not available" in proc.stderr and "--device cpu" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_smoke_run_reports_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, TMPDIR=str(tmp_path), OUT=str(out))  # $OUT is the default --out
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--preset", "tiny",
         "--loadgen-procs", "2", "--duration", "1", "--warmup", "0.5", "--budget-s", "200"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # The summary table comes last (before the line naming the files), after the detail tables.
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("results: ")
    head = lines.index("| check | result | target | verdict |")
    assert all(line.startswith("|") for line in lines[head:-1])
    summary = "\n".join(lines[head:-1])
    for label in ("CUDA tests (tests/test_gpu.py)", "model T=16", "model T=64", "service T=64, c64, 2 load procs",
                  "phases"):
        assert f"| {label} |" in summary, label
    assert "| phases | tests ok" in summary and "model ok" in summary and "service ok" in summary
    text = proc.stdout
    assert text.index("Model ceiling") < text.index("Service under load") < text.index("| check | result |")

    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["device"] == "cpu" and results["meta"]["torch"] == torch.__version__
    phases = results["phases"]
    assert {name: p["status"] for name, p in phases.items()} == {"tests": "ok", "model": "ok", "service": "ok"}
    gpu_tests = phases["tests"]["runs"]["gpu"]
    assert gpu_tests["counts"].get("skipped", 0) > 0 and set(gpu_tests["counts"]) == {"skipped"}  # no CUDA here
    assert "existing" not in phases["tests"]["runs"]  # never the rest of the suite on a CPU
    measured = [r for r in phases["model"]["rows"] if "seq_s" in r]
    assert {r["length"] for r in measured} == {16, 64} and all(r["seq_s"] > 0 for r in measured)
    assert set(phases["model"]["service_path"]) == {"16", "64"}
    runs = phases["service"]["runs"]
    assert {(r["length"], r["concurrency"], r["procs"], r["output"]) for r in runs} == {
        (T, 64, procs, output) for T in (16, 64) for procs, output in ((2, "pooled"), (1, "pooled"), (2, "hidden"))}
    for r in runs:
        assert r["sequences_per_s"] > 0 and r["errors"] == {} and r["ratio"] > 0, r
        assert r["loadgen_cpu"] > 0 and r["latency_ms"]["p99"] >= r["latency_ms"]["p50"] > 0
    assert (out / "results.md").read_text().rstrip().endswith(lines[-2])
    assert {p.name for p in out.iterdir()} == {"results.json", "results.md", "pytest_gpu.log", "server.log"}


def test_the_gpu_wheels_are_the_versions_the_project_pins() -> None:
    """`make gpu-wheels` downloads for the GPU machines exactly the versions requirements*.txt pin (their
    dependencies that gpu-check needs are pinned there too, so a later install cannot drift from them)."""
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    listed = re.search(r"^GPU_WHEELS := (.*)$", makefile, re.M)
    assert listed is not None
    wheels = dict(w.split("==") for w in listed[1].split())
    lines = [line.split("#")[0].strip() for name in ("requirements.txt", "requirements-dev.txt")
             for line in (REPO / name).read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if "==" in line)
    assert {"grpcio", "protobuf", "pytest", "pytest-asyncio", "pytest-timeout"} <= set(wheels)
    for name, pinned in wheels.items():
        assert pins.get(name) == pinned, name
    assert ".whl/" in (REPO / ".gitignore").read_text().splitlines()
