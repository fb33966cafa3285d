"""Matryoshka `dimensions` and quantized pooled vectors through every front door of a real server on
127.0.0.1:0 serving all-MiniLM-L6-v2: attention.v1 through the client, KServe v2 through tritonclient (gRPC)
and JSON (REST), OpenAI through its SDK, TEI through httpx. The vectors equal sentence-transformers'
(`truncate_dim`, `quantize_embeddings`: tests/data/st_vectors_reference.*); every bad option is refused
with the door's status and the field's name."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from client import EncoderClient
from client.errors import InvalidArgument
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from tests.support.helpers import Running, ids_request
from tests.support.vectors_reference import PRECISIONS, VectorsReference, assert_quantized_like, load_vectors_reference

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def ref() -> VectorsReference:
    return load_vectors_reference()


@pytest.fixture(scope="module")
def calibrated_bundle(minilm_bundle: Path, tmp_path_factory: pytest.TempPathFactory, ref: VectorsReference) -> Path:
    """MiniLM with its calibration ranges (the reference's, over 384 dimensions) stated in its manifest."""
    out = tmp_path_factory.mktemp("bundles") / "minilm-calibrated"
    shutil.copytree(minilm_bundle, out)
    manifest = json.loads((out / "manifest.json").read_text())
    low, high = ref.ranges(384)
    manifest["quantization_ranges"] = {"min": low, "max": high}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture
async def served(start_server: Any, calibrated_bundle: Path) -> Running:
    return await start_server(bundle=calibrated_bundle, http_port=0)


def _ranges(ref: VectorsReference, d: int, p: str) -> np.ndarray | None:
    return ref.arrays[f"ranges_{d}"] if p.endswith("int8") else None


# -- attention.v1, through the client ---------------------------------------------------------------

async def test_client_dimensions_and_quantization_equal_sentence_transformers(served: Running,
                                                                             ref: VectorsReference) -> None:
    async with EncoderClient(served.target) as c:
        info = await c.model_info()
        assert info.quantization_ranges is not None and len(info.quantization_ranges[0]) == 384  # the manifest's
        np.testing.assert_array_equal(np.float32(info.quantization_ranges[0]), ref.arrays["ranges_384"][0])
        full = (await c.encode(ref.queries, return_hidden=False)).pooled
        raw = (await c.encode(ref.queries, return_hidden=False, normalize=False)).pooled
        np.testing.assert_allclose(np.stack(full), ref.arrays["float_384"], rtol=0, atol=1e-5)
        for d in ref.dims:
            cut = (await c.encode(ref.queries, return_hidden=False, dimensions=d)).pooled
            assert {v.shape for v in cut} == {(d,)} and {v.dtype for v in cut} == {np.dtype(np.float32)}
            np.testing.assert_allclose(np.stack(cut), ref.arrays[f"float_{d}"], rtol=0, atol=1e-5)  # truncate_dim
            # ... and truncate-then-normalise of the server's own full vector, raw or normalised.
            for whole in (full, raw):
                mine = [v[:d] / np.linalg.norm(v[:d]) for v in whole]
                np.testing.assert_allclose(np.stack(cut), np.stack(mine), rtol=0, atol=1e-6)
            for p in PRECISIONS:
                ranges = _ranges(ref, d, p)
                result = await c.encode(ref.queries, return_hidden=False, dimensions=d, quantization=p,
                                        quantization_ranges=None if ranges is None else (ranges[0], ranges[1]))
                got = np.stack(result.pooled)
                assert got.dtype == (np.int8 if p in ("int8", "binary") else np.uint8)
                assert_quantized_like(got, ref.arrays[f"{p}_{d}"], ref.arrays[f"float_{d}"], p, ranges)
        # int8 with the manifest's ranges (none in the call): the reference's 384-dimension quantization.
        got = np.stack((await c.encode(ref.queries, return_hidden=False, quantization="int8")).pooled)
        assert_quantized_like(got, ref.arrays["int8_384"], ref.arrays["float_384"], "int8", ref.arrays["ranges_384"])
        # One (min, max) pair for every dimension.
        got = np.stack((await c.encode(ref.queries, return_hidden=False, dimensions=100, quantization="uint8",
                                       quantization_ranges=([ref.pair[0]], [ref.pair[1]]))).pooled)
        pair = np.array([[ref.pair[0]], [ref.pair[1]]], np.float32)
        assert_quantized_like(got, ref.arrays["uint8_100_pair"], ref.arrays["float_100"], "uint8", pair)
        # 0 is the model's width on attention.v1 (proto3's unset); hidden states stay float.
        both = await c.encode(ref.queries[:2], dimensions=0, quantization="binary")
        assert both.pooled[0].shape == (48,) and both.hidden[0].dtype == np.float32


BAD_OPTIONS: list[tuple[dict[str, Any], str]] = [
    ({"dimensions": -1}, "output.dimensions"),
    ({"dimensions": 385}, "output.dimensions"),
    ({"dimensions": 8, "pooling": "none"}, "output.dimensions"),
    ({"quantization": "int8", "pooling": "none"}, "output.quantization"),
    ({"quantization": "binary", "quantization_ranges": ([0.0], [1.0])}, "output.quantization_ranges"),
    ({"quantization": "int8", "quantization_ranges": ([0.0] * 7, [1.0] * 7)}, "output.quantization_ranges.min"),
    ({"quantization": "int8", "quantization_ranges": ([0.0], [0.0])}, "output.quantization_ranges.max[0]"),
    ({"quantization": "uint8", "quantization_ranges": ([math.nan], [1.0])}, "output.quantization_ranges.min[0]"),
    ({"quantization": "uint8", "quantization_ranges": ([0.0], [math.inf])}, "output.quantization_ranges.max[0]"),
]


async def test_client_bad_options_are_invalid_argument_naming_the_field(served: Running) -> None:
    async with EncoderClient(served.target) as c:
        for options, field in BAD_OPTIONS:
            with pytest.raises(InvalidArgument) as info:
                await c.encode(["a sentence"], **options)
            assert info.value.code == "INVALID_ARGUMENT" and info.value.field == field, (options, info.value)


async def test_quantization_without_ranges_anywhere_is_refused(start_server: Any, minilm_bundle: Path) -> None:
    served = await start_server(bundle=minilm_bundle)  # no ranges in its manifest
    async with EncoderClient(served.target) as c:
        assert (await c.model_info()).quantization_ranges is None
        for p in ("int8", "uint8"):
            with pytest.raises(InvalidArgument) as info:
                await c.encode(["a sentence"], quantization=p)
            assert info.value.field == "output.quantization_ranges" and "calibration" in str(info.value)
        assert (await c.encode(["a sentence"], quantization="ubinary")).pooled[0].shape == (48,)  # needs none


# -- KServe v2: gRPC through tritonclient, REST as JSON ---------------------------------------------

def _text(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def _csv(values: np.ndarray) -> str:
    return ",".join(repr(float(v)) for v in values)


async def test_kserve_grpc_parameters_and_int8_datatype(served: Running, ref: VectorsReference) -> None:
    client = triton_aio.InferenceServerClient(served.target)
    try:
        d = 100
        for p in PRECISIONS:
            ranges = _ranges(ref, d, p)
            params: dict[str, Any] = {"dimensions": d, "quantization": p}
            if ranges is not None:
                params |= {"quantization_min": _csv(ranges[0]), "quantization_max": _csv(ranges[1])}
            result = await client.infer(MODEL, [_text(ref.queries)], parameters=params,
                                        outputs=[triton.InferRequestedOutput("pooled")], client_timeout=60)
            out = result.get_output("pooled")
            assert out.datatype == ("INT8" if p in ("int8", "binary") else "UINT8")
            assert_quantized_like(result.as_numpy("pooled"), ref.arrays[f"{p}_{d}"], ref.arrays[f"float_{d}"], p,
                                  ranges)
        result = await client.infer(MODEL, [_text(ref.queries)], parameters={"dimensions": 13}, client_timeout=60,
                                    outputs=[triton.InferRequestedOutput("embeddings")])
        np.testing.assert_allclose(result.as_numpy("embeddings"), ref.arrays["float_13"], rtol=0, atol=1e-5)
        bad: list[tuple[dict[str, Any], str]] = [
            ({"dimensions": 0}, "parameters.dimensions"), ({"dimensions": 385}, "parameters.dimensions"),
            ({"dimensions": -2}, "parameters.dimensions"), ({"dimensions": "8"}, "parameters.dimensions"),
            ({"quantization": "int4"}, "parameters.quantization"),
            ({"quantization": "int8", "quantization_min": -0.1}, "parameters.quantization_max"),
            ({"quantization": "int8", "quantization_min": "0,1", "quantization_max": "1,2"},
             "parameters.quantization_min"),
            ({"quantization": "int8", "quantization_min": 0.5, "quantization_max": 0.5},
             "parameters.quantization_max[0]"),
            ({"quantization": "int8", "quantization_min": "nan", "quantization_max": 1.0},
             "parameters.quantization_min[0]"),
            ({"quantization": "int8", "quantization_min": "a,b", "quantization_max": 1.0},
             "parameters.quantization_min"),
            ({"quantization": "binary", "quantization_min": 0.0, "quantization_max": 1.0},
             "parameters.quantization_min"),
        ]
        for params, field in bad:
            with pytest.raises(InferenceServerException) as info:
                await client.infer(MODEL, [_text(["x"])], parameters=params, client_timeout=30)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT", params
            assert info.value.message().startswith(field + ": "), (params, info.value.message())
        with pytest.raises(InferenceServerException) as info:  # no pooled output asked: nothing to quantize
            await client.infer(MODEL, [_text(["x"])], parameters={"quantization": "binary"}, client_timeout=30,
                               outputs=[triton.InferRequestedOutput("last_hidden_state")])
        assert info.value.message().startswith("parameters.quantization: ") and "pooling" in info.value.message()
    finally:
        await client.close()


async def _kserve_rest_json_int8_and_refusals(served: Running, ref: VectorsReference) -> None:
    ranges = ref.arrays["ranges_100"]
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(ref.queries)], "data": ref.queries}],
            "outputs": [{"name": "pooled", "parameters": {"binary_data": False}}],
            "parameters": {"dimensions": 100, "quantization": "int8", "quantization_min": _csv(ranges[0]),
                           "quantization_max": _csv(ranges[1])}}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.server.http_port}", timeout=60) as http:
        response = await http.post(f"/v2/models/{MODEL}/infer", json=body)
        assert response.status_code == 200, response.text
        out = response.json()["outputs"][0]
        assert out["datatype"] == "INT8" and out["shape"] == [len(ref.queries), 100]
        got = np.asarray(out["data"], np.int8).reshape(out["shape"])
        assert all(isinstance(v, int) for v in out["data"])
        assert_quantized_like(got, ref.arrays["int8_100"], ref.arrays["float_100"], "int8", ranges)
        for params, field in (({"dimensions": 0}, "parameters.dimensions"),
                              ({"quantization": "uint8", "quantization_min": [1]}, "parameters.quantization_min")):
            bad = {**body, "parameters": params}
            response = await http.post(f"/v2/models/{MODEL}/infer", json=bad)
            assert response.status_code == 400 and response.json()["error"].startswith(field), response.text


# -- the HTTP door: KServe REST, OpenAI, TEI ------------------------------------------------------

async def test_http_door_kserve_rest_openai_and_tei(served: Running, ref: VectorsReference) -> None:
    """KServe REST (int8 as JSON integers), OpenAI and TEI (dimensions equal truncate_dim), on one server."""
    await _kserve_rest_json_int8_and_refusals(served, ref)
    texts = [q for q in ref.queries if q]  # OpenAI refuses an empty text
    rows = [i for i, q in enumerate(ref.queries) if q]
    base = f"http://127.0.0.1:{served.server.http_port}"
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for d in ref.dims:
            got = await client.embeddings.create(model=MODEL, input=texts, dimensions=d)
            vectors = np.array([e.embedding for e in got.data], np.float32)
            np.testing.assert_allclose(vectors, ref.arrays[f"float_{d}"][rows], rtol=0, atol=1e-5)
        for d in (0, -1, 385):
            with pytest.raises(openai.BadRequestError) as info:
                await client.embeddings.create(model=MODEL, input=texts, dimensions=d)
            error = info.value.body
            assert isinstance(error, dict) and error["param"] == "dimensions" and "1..384" in error["message"]
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        response = await http.post("/embed", json={"inputs": texts, "dimensions": 13})
        assert response.status_code == 200
        np.testing.assert_allclose(np.array(response.json(), np.float32), ref.arrays["float_13"][rows], rtol=0,
                                   atol=1e-5)
        # normalize false: the cut of the un-normalised vector, not renormalised (TEI's order).
        whole = np.array((await http.post("/embed", json={"inputs": texts, "normalize": False})).json(), np.float32)
        cut = np.array((await http.post("/embed", json={"inputs": texts, "normalize": False, "dimensions": 13})).json(),
                       np.float32)
        np.testing.assert_allclose(cut, whole[:, :13], rtol=0, atol=1e-6)
        for d in (0, 385, "8"):
            response = await http.post("/embed", json={"inputs": texts, "dimensions": d})
            assert response.status_code == 422 and "dimensions" in response.json()["error"], response.text


async def test_chunked_sequences_are_cut_after_stitching(start_server: Any) -> None:
    """A sequence over the model's length, encoded in windows: its stitched vector is cut, then renormalised."""
    served = await start_server()  # the tiny model: d_model 32, max_length 64
    ids = np.arange(1, 101) % 97 + 1

    async def pooled(**output: Any) -> np.ndarray:
        response = await served.stub.Encode(ids_request(ids, long_inputs=pb.LONG_INPUTS_CHUNK, output=pb.OutputOptions(
            return_hidden=False, pooling=pb.POOLING_MEAN, **output)), timeout=30)
        assert response.outputs[0].windows > 1
        return np.asarray(from_tensor(response.outputs[0].pooled))

    whole = await pooled(normalize=False)
    cut = await pooled(normalize=True, dimensions=8)
    np.testing.assert_allclose(cut, whole[:8] / np.linalg.norm(whole[:8]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(await pooled(normalize=False, dimensions=8), whole[:8], rtol=0, atol=1e-6)
    bits = await pooled(normalize=True, dimensions=12, quantization=pb.QUANTIZATION_UBINARY)
    assert bits.dtype == np.uint8 and np.array_equal(bits, np.packbits(whole[:12] > 0))
