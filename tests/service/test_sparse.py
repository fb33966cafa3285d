"""SPLADE sparse vectors on Encode (output.sparse) and TEI's /embed_sparse (issue 31), through a real server on
127.0.0.1:0: equal to max over tokens of log(1 + relu(MLM logits)) masked by attention, of Hugging Face's
BertForMaskedLM (tiny random-init, pinned transformers), top_k and threshold applied, beside pooled vectors in
one call; bad options refused INVALID_ARGUMENT naming the field, a model without the head too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from tests.support.head_helpers import hf_splade, hf_tokenizer, sparse_bundle
from tests.support.helpers import violated_field

TEXTS = ["the cat", "a b c the cat .", "cats", ""]


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    return sparse_bundle(tmp_path_factory)


def _text_request(texts: list[str], **output: Any) -> pb.EncodeRequest:
    return pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts], output=pb.OutputOptions(**output))


async def test_sparse_vectors_equal_the_masked_lm_splade(start_server: Any, splade: tuple[Path, Path, Any]) -> None:
    bundle, src, model = splade
    served = await start_server(bundle=bundle, http_port=0)
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert list(info.tasks) == ["embed", "sparse"]
    want = hf_splade(model, hf_tokenizer(src, "[PAD]"), TEXTS).numpy()
    r = await served.stub.Encode(_text_request(TEXTS, return_hidden=False, pooling=pb.POOLING_MEAN,
                                               sparse=pb.SparseOptions()), timeout=30)
    for out, w in zip(r.outputs, want, strict=True):
        nonzero = np.flatnonzero(w > 0)
        assert list(out.sparse.indices) == nonzero.tolist() and len(nonzero) > 0
        assert np.abs(np.array(out.sparse.values) - w[nonzero]).max() <= 1e-5
        assert from_tensor(out.pooled).shape == (32,)  # pooled beside it, one forward
    top = await served.stub.Encode(_text_request(TEXTS[:2], return_hidden=False, sparse=pb.SparseOptions(
        top_k=3, threshold=0.01)), timeout=30)
    for out, w in zip(top.outputs, want[:2], strict=True):
        best = sorted(np.flatnonzero(w > 0.01), key=lambda i: (-w[i], i))[:3]
        assert list(out.sparse.indices) == sorted(best) and not out.HasField("pooled")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.server.http_port}", timeout=30) as http:
        resp = await http.post("/embed_sparse", json={"inputs": TEXTS[:2]})
    assert resp.status_code == 200, resp.text
    for entries, w in zip(resp.json(), want[:2], strict=True):
        assert [e["index"] for e in entries] == np.flatnonzero(w > 0).tolist()
        assert max(abs(e["value"] - w[e["index"]]) for e in entries) <= 1e-5


@pytest.mark.parametrize(("output", "field"), [
    ({"sparse": pb.SparseOptions(top_k=-1)}, "output.sparse.top_k"),
    ({"sparse": pb.SparseOptions(threshold=-0.5)}, "output.sparse.threshold"),
    ({"sparse": pb.SparseOptions(threshold=float("nan"))}, "output.sparse.threshold"),
])
async def test_bad_sparse_options_are_refused(start_server: Any, splade: tuple[Path, Path, Any],
                                              output: dict[str, Any], field: str) -> None:
    served = await start_server(bundle=splade[0])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await served.stub.Encode(_text_request(["a"], **output), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violated_field(e.value) == field, e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:  # chunked windows cannot be max-pooled as one sequence
        await served.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text="a")], long_inputs=pb.LONG_INPUTS_CHUNK,
                                                  output=pb.OutputOptions(sparse=pb.SparseOptions())), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violated_field(e.value) == "output.sparse"


async def test_a_model_without_the_head_refuses_sparse(start_server: Any, tiny_text_bundle: Path) -> None:
    served = await start_server(bundle=tiny_text_bundle, http_port=0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await served.stub.Encode(_text_request(["a"], sparse=pb.SparseOptions()), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violated_field(e.value) == "output.sparse"
    assert "'sparse'" in e.value.details()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.server.http_port}", timeout=30) as http:
        resp = await http.post("/embed_sparse", json={"inputs": "a"})
    assert resp.status_code == 422 and resp.json()["error"].startswith("/embed_sparse: "), resp.text
