"""bench/doors_bench.py stays runnable: a tiny bounded run (c1 and c4, a few calls a slice) reports every
field for the service and both floors, with every call answered OK, and a profile split by thread and
by where the Python time went. No timing is asserted."""

import json
from pathlib import Path

import pytest

from bench import doors_bench

FIELDS = {"variant", "concurrency", "connections", "rounds", "calls_per_s", "calls_per_s_rounds", "p50_ms", "p99_ms",
          "server_cpu_ms", "loop_cpu_ms", "client_cpu_ms", "ratio_to_floor_aio", "ok", "calls", "errors"}


def test_a_tiny_run_reports_every_field_and_answers_every_call(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "edge.json"
    assert doors_bench.main(["--concurrency", "1", "4", "--connections", "1", "2", "--rounds", "1", "--seconds", "0.5",
                            "--warmup", "0", "--max-calls", "20", "--profile", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["summary"]
    points = {(r["concurrency"], r["connections"]) for r in rows}
    assert points == {(1, 1), (4, 1), (4, 2)}  # one connection per caller at most
    assert {r["variant"] for r in rows} == {"service", "floor-aio", "floor-sync"}
    assert len(rows) == 9
    for row in rows:
        assert set(row) == FIELDS
        assert row["errors"] == {} and 1 <= row["ok"] == row["calls"] <= 20, row
        assert row["calls_per_s"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0
        assert row["server_cpu_ms"] >= 0 and row["client_cpu_ms"] >= 0  # /proc counts 10 ms ticks: 20 calls may be 0
    assert all(r["ratio_to_floor_aio"] == 1.0 for r in rows if r["variant"] == "floor-aio")

    profile = report["profile"]["service c4"]
    assert profile["calls"] > 0 and profile["cpu_ms_per_call"] > 0
    assert any(name.startswith("MainThread") for name in profile["threads_cpu_ms_per_call"])
    if "pyspy_error" in profile:
        pytest.skip(f"py-spy cannot attach here: {profile['pyspy_error']}")
    assert profile["pyspy"]  # threads with at least 5 samples
    for shares in profile["pyspy"].values():
        assert abs(sum(shares.values()) - 1) < 1e-6 and set(shares) <= {*doors_bench.BUCKETS, "(rest)"}
    text = capsys.readouterr().out
    assert "| 4 | 2 | floor-sync |" in text and "Profile of service c4" in text


def test_a_sample_goes_to_its_innermost_matching_frame() -> None:
    base = ["<module> (service/__main__.py:26)", "BaseEventLoop._run_once (asyncio/base_events.py:1922)",
            "Handle._run (asyncio/events.py:80)"]
    assert doors_bench.bucket_of([*base, "AttentionServicer.encode (service/doors/attention_v1.py:40)",
                                 "plan (service/plan.py:60)"]) == "parsing/validation"
    assert doors_bench.bucket_of([*base, "Calls.compute (service/doors/calls.py:110)",
                                 "MutexValue.inc (prometheus_client/values.py:28)"]) == "metrics"
    assert doors_bench.bucket_of(base) == doors_bench.CALLBACK_LEAF  # C code a callback ran (grpc.aio's Cython)
    assert doors_bench.bucket_of(base[:2]) == "event loop"
    assert doors_bench.bucket_of(["<module> (x.py:1)"]) == "other"
    raw = ("thread (11): MainThread;" + ";".join(base) + " 7\n"
           "thread (12): model-runner;Batcher._run (service/batching/batcher.py:250) 3\n")
    assert doors_bench.split_pyspy(raw) == {"MainThread": {doors_bench.CALLBACK_LEAF: 7},
                                           "model-runner": {"batcher handoff": 3}}


def test_the_parts_bench_times_every_piece(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import doors_parts

    assert doors_parts.main(["--number", "5", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "piece" not in line]
    with doors_parts.parts() as pieces:
        assert len(rows) == len(pieces) == 9
    assert all(float(row.rsplit("|", 2)[1]) > 0 for row in rows)
