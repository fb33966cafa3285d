"""bench.kserve_bench end to end, bounded and without timing: both front doors are driven and answer."""

from __future__ import annotations

import json
from pathlib import Path

from tritonclient.grpc import service_pb2 as v2

from bench import kserve_bench


def test_both_front_doors_are_measured_under_the_same_load(tiny_bundle: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert kserve_bench.main(["--bundle", str(tiny_bundle), "--concurrency", "2", "--seconds", "0.3",
                              "--warmup", "0", "--rounds", "2", "--length", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert sorted((r["round"], r["door"]) for r in rows) == [(0, "v1"), (0, "v2"), (1, "v1"), (1, "v2")]
    for row in rows:
        assert row["concurrency"] == 2 and row["errors"] == 0 and row["sequences_per_s"] > 0
        assert row["p99_ms"] >= row["p50_ms"] > 0 and row["batch_size"] >= 1
    assert "| 2 | v2 | 1 |" in capsys.readouterr().out


def test_v2_requests_are_valid_model_infer_requests() -> None:
    [raw] = kserve_bench.v2_requests("m", vocab=10, length=5, count=1)
    request = v2.ModelInferRequest.FromString(raw)
    assert request.model_name == "m" and list(request.inputs[0].shape) == [1, 5]
    assert [o.name for o in request.outputs] == ["last_hidden_state"]
    assert len(request.raw_input_contents[0]) == 5 * 8
