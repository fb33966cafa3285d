"""perf_analyzer 2.60.0 against the KServe v2 gRPC door of a real server process: it discovers the
model from the metadata (ids, or a text model's `text`), measures a fixed number of calls, reads the
server-side statistics at the end (where it used to abort on unequal compute counts), and writes its
CSV. Skipped, saying why, where the tool cannot be prepared."""

from __future__ import annotations

from pathlib import Path

import pytest
import tritonclient.grpc as triton

from tests.support import perf_analyzer
from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.slow

LENGTH = 16


@pytest.fixture(scope="module")
def tool() -> Path:
    found, why = perf_analyzer.prepare()
    if found is None:
        pytest.skip(why)
    return found


def test_perf_analyzer_measures_the_kserve_door_and_writes_its_csv(tool: Path, tiny_bundle: Path, tmp_path: Path):
    # Without the attention output: perf_analyzer asks for every output the metadata lists.
    server = ServerProcess(tiny_bundle, "--no-allow-attention", directory=tmp_path / "server")
    try:
        data = perf_analyzer.ids_data(tmp_path / "ids.json", length=LENGTH, vocab=100)
        result = perf_analyzer.run(tool, "tiny", server.target, data, tmp_path / "pa.csv", length=LENGTH,
                                   concurrency=2, requests=200, timeout=180)
        client = triton.InferenceServerClient(server.target)
        try:
            [stats] = client.get_inference_statistics("tiny").model_stats
        finally:
            client.close()
    finally:
        server.stop()
    assert result.returncode == 0, result.output[-3000:]
    assert "compute counts must be the same" not in result.output
    [row] = result.rows
    assert row["Concurrency"] == 2
    assert row["Inferences/Second"] > 0  # plausible: positive, and the server saw every call it counted
    assert result.request_count == 200 and stats.inference_stats.success.count >= 200
    assert stats.inference_stats.fail.count == 0
    # The server-side columns come from ModelStatistics: queue and compute per request, input/output 0.
    assert row["Server Compute Infer"] > 0 and row["Server Compute Input"] == row["Server Compute Output"] == 0


def test_perf_analyzer_finds_a_text_models_text_input_from_the_metadata(tool: Path, tiny_text_bundle: Path,
                                                                       tmp_path: Path):
    server = ServerProcess(tiny_text_bundle, "--no-allow-attention", directory=tmp_path / "server")
    try:
        data = perf_analyzer.text_data(tmp_path / "text.json", ["a cat", "the cats .", "b c"])
        result = perf_analyzer.run(tool, "tiny-bert", server.target, data, tmp_path / "pa.csv", length=None,
                                   concurrency=1, requests=30, timeout=180)
        assert server.sample("attention_requests_total", {"method": "ModelInfer", "code": "OK"}) >= 30
    finally:
        server.stop()
    assert result.returncode == 0, result.output[-3000:]
    [row] = result.rows
    assert row["Inferences/Second"] > 0 and result.request_count == 30
