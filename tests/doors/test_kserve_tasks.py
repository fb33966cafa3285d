"""KServe v2 outputs by name for the task heads (issue 31), through tritonclient against a real server on
127.0.0.1:0: `logits` of a classifier (text in) equal to Hugging Face's AutoModelForSequenceClassification,
`sparse` of a masked-LM (SPLADE weights, dense [batch, vocab]) equal to max over tokens of log(1 + relu(MLM
logits)); both listed in ModelMetadata only for a model that has the head, and unknown outputs otherwise."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from tests.support.head_helpers import head_bundle, hf_logits, hf_splade, hf_tokenizer, sparse_bundle

TEXTS = ["the cat", "a b c the cat .", "cats"]


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


async def test_logits_and_sparse_outputs_equal_hf(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    bundle, src, model = head_bundle(tmp_path_factory, "bert-classifier")
    s = await start_server(bundle=bundle)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        meta = await client.get_model_metadata("bert-classifier")
        assert [o.name for o in meta.outputs if o.name in ("logits", "sparse")] == ["logits"]
        result = await client.infer("bert-classifier", [text_input(TEXTS)], client_timeout=60,
                                    outputs=[triton.InferRequestedOutput("logits")])
        want = hf_logits(model, hf_tokenizer(src, "[PAD]"), TEXTS).numpy()
        np.testing.assert_allclose(result.as_numpy("logits"), want, rtol=0, atol=1e-5)
        with pytest.raises(InferenceServerException) as info:  # no SPLADE head on a classifier
            await client.infer("bert-classifier", [text_input(TEXTS)], client_timeout=60,
                               outputs=[triton.InferRequestedOutput("sparse")])
        assert "INVALID_ARGUMENT" in str(info.value) and "unknown output 'sparse'" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            await client.infer("bert-classifier", [text_input(TEXTS)], client_timeout=60, outputs=[
                triton.InferRequestedOutput("logits"), triton.InferRequestedOutput("pooled")])
        assert "logits comes alone" in str(info.value)
    finally:
        await client.close()
    bundle, src, model = sparse_bundle(tmp_path_factory)
    s = await start_server(bundle=bundle)
    client = triton_aio.InferenceServerClient(s.target)
    try:
        result = await client.infer("bert-splade", [text_input(TEXTS)], client_timeout=60,
                                    outputs=[triton.InferRequestedOutput("sparse"),
                                             triton.InferRequestedOutput("pooled")])
        want = hf_splade(model, hf_tokenizer(src, "[PAD]"), TEXTS).numpy()
        np.testing.assert_allclose(result.as_numpy("sparse"), want, rtol=0, atol=1e-5)
        assert result.as_numpy("pooled").shape == (3, 32)
        with pytest.raises(InferenceServerException) as info:
            await client.infer("bert-splade", [text_input(TEXTS)], client_timeout=60,
                               outputs=[triton.InferRequestedOutput("logits")])
        assert "INVALID_ARGUMENT" in str(info.value) and "unknown output 'logits'" in str(info.value)
    finally:
        await client.close()
