"""Fuzzing the HTTP door: hypothesis over JSON bodies (shaped like each route's, and arbitrary) and over
raw bytes, against a real `python -m service` process, bounded example counts. Only the documented
statuses come back (docs/http.md; never a 500, never a traceback), every error body is the route's
dialect, and the server is healthy afterwards (also through the edge-process mode)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.server_process import ServerProcess

DOCUMENTED = {200, 400, 404, 405, 408, 413, 422, 429, 503, 504}
FUZZ = {"deadline": None, "database": None, "suppress_health_check": [HealthCheck.too_slow]}
POSTS = ("/v1/embeddings", "/embed", "/embed_all", "/tokenize", "/decode", "/v1/encode", "/v2/models/tiny/infer")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30)
ids = st.lists(st.integers(-3, 120), min_size=0, max_size=12)
inputs = st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=4), ids,
                   st.lists(ids, max_size=4), json_values)
shaped = st.fixed_dictionaries({}, optional={
    "input": inputs, "inputs": inputs, "model": st.sampled_from(["tiny", "other", ""]) | json_values,
    "encoding_format": st.sampled_from(["float", "base64", "hex"]), "dimensions": st.integers(-2, 40) | json_values,
    "normalize": st.booleans() | json_values, "truncate": st.booleans(), "ids": inputs,
    "truncation_direction": st.sampled_from(["right", "Left", "up"]), "prompt_name": st.text(max_size=8),
    "sequences": json_values, "output": json_values, "attention": json_values, "parameters": json_values,
})
tensors = st.fixed_dictionaries({"name": st.sampled_from(["input_ids", "attention_mask", "text", "x"]),
                                 "datatype": st.sampled_from(["INT64", "INT32", "BYTES", "FP32", "BOOL"]),
                                 "shape": st.lists(st.integers(0, 5), max_size=3),
                                 "data": st.lists(st.integers(-5, 120) | st.text(max_size=5), max_size=12)})
infer = st.fixed_dictionaries({"inputs": st.lists(tensors, max_size=3)}, optional={
    "outputs": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["pooled", "last_hidden_state", "attention",
                                                                        "nope"])}), max_size=3),
    "parameters": st.dictionaries(st.sampled_from(["pooling", "truncate", "binary_data_output", "timeout"]),
                                  st.booleans() | st.integers(-1, 10) | st.text(max_size=6), max_size=3)})


@pytest.fixture(scope="module", params=["one process", "edge processes"])
def server(request: pytest.FixtureRequest, tiny_bundle: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ["--max-attention-bytes", "200000", "--max-message-bytes", str(1 << 20),
             "--openai-token-ids"]  # the tiny model takes ids only
    if request.param == "edge processes":
        flags += ["--edge-processes", "2"]
    process = ServerProcess(tiny_bundle, *flags, directory=tmp_path_factory.mktemp("http-fuzz"))
    yield process
    process.kill()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.ports['http_port']}", timeout=30) as client:
        yield client


def check(response: httpx.Response) -> None:
    assert response.status_code in DOCUMENTED, (response.status_code, response.text[:300])
    if response.status_code != 200:
        body = response.json()  # every refusal is JSON in the route's dialect
        assert "error" in body, body
        assert "Traceback" not in response.text and "File \"" not in response.text


def healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": [[1, 2, 3]]})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 32


@settings(max_examples=120, **FUZZ)
@given(path=st.sampled_from(POSTS), body=shaped)
def test_shaped_json_bodies_get_documented_statuses(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    check(http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))


@settings(max_examples=60, **FUZZ)
@given(body=infer, binary=st.binary(max_size=64))
def test_kserve_infer_bodies_json_and_binary(http: httpx.Client, body: dict[str, Any], binary: bytes) -> None:
    header = json.dumps(body).encode()
    check(http.post("/v2/models/tiny/infer", content=header))
    check(http.post("/v2/models/tiny/infer", content=header + binary,
                    headers={"Inference-Header-Content-Length": str(len(header))}))


@settings(max_examples=80, **FUZZ)
@given(path=st.sampled_from(POSTS), raw=st.binary(max_size=200), value=json_values)
def test_raw_bytes_and_arbitrary_json(http: httpx.Client, path: str, raw: bytes, value: Any) -> None:
    check(http.post(path, content=raw))
    check(http.post(path, content=json.dumps(value)))


def test_healthy_after_the_fuzzing(http: httpx.Client) -> None:
    healthy(http)
    for path in ("/health", "/v2/health/ready", "/info", "/v1/models", "/v2", "/v2/models/tiny"):
        assert http.get(path).status_code == 200, path
