"""bench/http_load.py: the HTTP door's closed loop draws what client/load.py sends over gRPC, and its calls
really go through the HTTP door's routes (counted there by the service itself)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from bench.http_load import EMBED, EMBEDDINGS, id_bodies, run_http_load, text_bodies
from client import ModelInfo, SyncEncoderClient
from client.load import prepare_requests
from client.messages import EncodeOptions, Limits
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from tests.support.server_process import ServerProcess

INFO = ModelInfo(name="m", version="1", checksum="", d_model=32, n_heads=4, n_layers=2, vocab_size=100,
                 max_length=64, positional="sinusoidal", precision="fp32", device="cpu", limits=Limits(8, 512, 0, 0))


def test_id_bodies_hold_the_sequences_run_load_sends_for_the_same_seed() -> None:
    grpc_side = prepare_requests(INFO, lengths=(8, 200), sequences_per_request=1, count=40, seed=3,
                                 options=EncodeOptions())
    want = [from_tensor(pb.EncodeRequest.FromString(p.raw).sequences[0].token_ids).tolist() for p in grpc_side]
    got = [json.loads(body)["inputs"] for body in id_bodies(INFO.vocab_size, INFO.max_length, (8, 200), 40, seed=3)]
    assert all(len(g) == 1 for g in got)
    assert [g[0] for g in got] == want
    assert all(8 <= len(w) <= 64 for w in want)  # clipped to max_length, as run_load clips


def test_text_bodies_hold_the_texts_run_load_sends_for_the_same_seed() -> None:
    texts = [f"text number {i}" for i in range(30)]
    grpc_side = prepare_requests(INFO, lengths=(1, 1), sequences_per_request=1, count=50, seed=5,
                                 options=EncodeOptions(), texts=[(t, 3) for t in texts])
    want = [pb.EncodeRequest.FromString(p.raw).sequences[0].text for p in grpc_side]
    got = [json.loads(body) for body in text_bodies("m", texts, 50, seed=5)]
    assert [g["input"] for g in got] == [[w] for w in want]
    assert {g["model"] for g in got} == {"m"}


@pytest.mark.slow
def test_the_load_goes_through_the_http_routes_and_is_counted_there(tiny_text_bundle: Path) -> None:
    server = ServerProcess(tiny_text_bundle)
    try:
        base = f"http://127.0.0.1:{server.ports['http_port']}"
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            name = json.loads(r.read())["data"][0]["id"]
        with SyncEncoderClient(server.target) as client:
            info = client.model_info()
        for path, bodies in ((EMBEDDINGS, text_bodies(name, ["a short text", "another one here"], 16, seed=0)),
                             (EMBED, id_bodies(info.vocab_size, info.max_length, (2, 8), 16, seed=0))):
            report = asyncio.run(run_http_load(base, path, bodies, concurrency=3, duration_s=0.5, warmup_s=0.2))
            assert report.errors == {} and report.ok == report.requests > 0, report
            assert report.warmup_requests > 0 and report.sequences_per_s > 0
            assert 0 < report.latency_ms["p50"] <= report.latency_ms["p99"]
            # every call the loop made (and its one checked call first) reached this route, all OK
            counted = server.sample("attention_requests_total", {"method": f"POST {path}", "code": "OK"})
            assert counted == report.requests + report.warmup_requests + 1
            assert np.isclose(server.sample("attention_requests_total", {"method": f"POST {path}"}), counted)
    finally:
        server.stop()


@pytest.mark.slow
def test_a_door_that_does_not_answer_with_a_vector_stops_the_run_before_it_starts(tiny_bundle: Path) -> None:
    server = ServerProcess(tiny_bundle)
    try:
        base = f"http://127.0.0.1:{server.ports['http_port']}"
        bad = [json.dumps({"inputs": [[1000]]}).encode()]  # out of the tiny model's vocabulary (100): 422
        with pytest.raises(RuntimeError, match="HTTP 422"):
            asyncio.run(run_http_load(base, EMBED, bad, concurrency=1, duration_s=0.2))
    finally:
        server.stop()
