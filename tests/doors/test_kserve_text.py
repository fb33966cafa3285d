"""KServe v2 with text in: a `text` BYTES tensor through tritonclient to all-MiniLM-L6-v2 gives the
sentence-transformers embeddings (the references of tests/support/hf_helpers.py), as attention.v1 does; the
text options are parameters and every text error is INVALID_ARGUMENT naming `text[i]`."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2 as v2
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.support.hf_helpers import Reference

MODEL = "all-MiniLM-L6-v2"


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


async def test_text_through_tritonclient_equals_sentence_transformers(start_server, minilm_bundle: Path,
                                                                      minilm_reference: Reference):
    s = await start_server(bundle=minilm_bundle, max_batch_tokens=8192)
    texts = minilm_reference.texts
    client = triton_aio.InferenceServerClient(s.target)
    try:
        result = await client.infer(MODEL, [text_input(texts)], parameters={"truncate": True}, client_timeout=120,
                                    outputs=[triton.InferRequestedOutput("embeddings"),
                                             triton.InferRequestedOutput("last_hidden_state")])
        embeddings = result.as_numpy("embeddings")
        assert embeddings.shape == (len(texts), 384)
        # The bundle's own pooling (mean) and normalisation, unasked: what sentence-transformers gives.
        np.testing.assert_allclose(embeddings, minilm_reference.embeddings, rtol=0, atol=1e-5)
        hidden = result.as_numpy("last_hidden_state")
        assert hidden.shape == (len(texts), max(len(ids) for ids in minilm_reference.ids), 384)  # padded to T
        for i, rows in enumerate(minilm_reference.hidden_rows):
            np.testing.assert_allclose(hidden[i][rows], minilm_reference.hidden[i], rtol=0, atol=1e-4)
        raw = await client.infer(MODEL, [text_input(texts[:3])], parameters={"normalize": False, "pooling": "cls"},
                                 outputs=[triton.InferRequestedOutput("pooled")], client_timeout=60)
        cls = raw.as_numpy("pooled")
        assert not np.allclose(np.linalg.norm(cls, axis=1), 1.0)  # asked: not normalised, the first token
    finally:
        await client.close()


async def test_text_errors_name_the_text_they_are_about(start_server, minilm_bundle: Path,
                                                        minilm_reference: Reference):
    s = await start_server(bundle=minilm_bundle)
    long = next(i for i, ids in enumerate(minilm_reference.ids) if len(ids) == 256)  # cut to the limit
    client = triton_aio.InferenceServerClient(s.target)
    try:
        with pytest.raises(InferenceServerException) as info:  # too long, and truncate not asked for
            await client.infer(MODEL, [text_input(["short", minilm_reference.texts[long] * 2])], client_timeout=60)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert info.value.message().startswith("text[1]: ") and "limit of 256" in info.value.message()
    finally:
        await client.close()
    stub = service_pb2_grpc.GRPCInferenceServiceStub(s.channel)
    tensor = v2.ModelInferRequest.InferInputTensor
    bad = {
        "text[1]": [tensor(name="text", datatype="BYTES", shape=[2],
                           contents=v2.InferTensorContents(bytes_contents=[b"fine", b"\xff\xfe"]))],  # not UTF-8
        "text": [tensor(name="text", datatype="BYTES", shape=[2],
                        contents=v2.InferTensorContents(bytes_contents=[b"one"]))],  # fewer strings than the shape
    }
    for field, inputs in bad.items():
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.ModelInfer(v2.ModelInferRequest(model_name=MODEL, inputs=inputs), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith(field + ":"), error.value.details()
    assert s.sample("attention_batch_size_count") == 0  # nothing reached a batch
