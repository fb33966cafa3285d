"""The compiled backend (config `backend`, model.pt2): a real service with --backend aoti answers as --backend
torchscript does, the calls the compiled graph does not cover run on TorchScript, ModelInfo says which backend
runs, and --backend aoti without a usable artefact fails start-up clearly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from model.bundle import BundleError, load_bundle
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import from_tensor
from service.config import ServiceConfig
from service.jobs import POOL_MEAN, Job
from service.runner import Runner
from tests.service.test_pipeline import Observed
from tests.support import helpers
from tests.support.aoti_helpers import AOTI_CONFIG, AOTI_MAX_BATCH
from tests.support.helpers import ids_request
from tests.support.server_process import ServerProcess

LENGTHS = (32, 17, 5, 1, 29, 9)  # one call: batched together, padded


def _sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, AOTI_CONFIG.vocab_size, n) for n in LENGTHS]


async def _encode(served: Any, **fields: Any) -> list[np.ndarray]:
    response = await served.stub.Encode(ids_request(*_sequences(), **fields), timeout=30)
    return [from_tensor(out.hidden) for out in response.outputs]


async def test_aoti_answers_as_torchscript(start_server: Any, aoti_bundle: Path) -> None:
    compiled = await start_server(bundle=aoti_bundle, backend="aoti")
    scripted = await start_server(bundle=aoti_bundle, backend="torchscript")
    for served, backend in ((compiled, "aoti"), (scripted, "torchscript")):
        info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.backend == backend
    got, want = await _encode(compiled), await _encode(scripted)
    assert [h.shape for h in got] == [(n, AOTI_CONFIG.d_model) for n in LENGTHS]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # Attention weights asked for: not in the compiled graph, so TorchScript answers it (hidden states too).
    options = pb.AttentionOptions(return_attention=True)
    response = await compiled.stub.Encode(ids_request(*_sequences(), attention=options), timeout=30)
    reference = await scripted.stub.Encode(ids_request(*_sequences(), attention=options), timeout=30)
    for a, b in zip(response.outputs, reference.outputs, strict=True):
        np.testing.assert_array_equal(from_tensor(a.attention), from_tensor(b.attention))
        np.testing.assert_array_equal(from_tensor(a.hidden), from_tensor(b.hidden))


@pytest.mark.parametrize(("which", "overrides", "backend"), [
    ("aoti", {}, "aoti"),  # cpu, fp32, a model.pt2 that passes its checks
    ("aoti", {"precision": "bf16"}, "torchscript"),  # compiled for fp32: refused, and auto falls back
    ("tiny", {}, "torchscript"),  # no model.pt2
])
async def test_auto_serves_the_compiled_backend_where_it_can(start_server: Any, aoti_bundle: Path, tiny_bundle: Path,
                                                             which: str, overrides: dict[str, Any],
                                                             backend: str) -> None:
    served = await start_server(bundle=aoti_bundle if which == "aoti" else tiny_bundle, backend="auto", **overrides)
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.backend == backend


async def test_aoti_without_the_artefact_fails_start_up(start_server: Any, tiny_bundle: Path) -> None:
    served = await start_server(bundle=tiny_bundle, backend="aoti", wait_ready=False)
    with pytest.raises(BundleError, match=r"backend aoti: .* has no compiled artefact \(manifest\.aoti\); build one "
                                          r"with `python -m model compile-aoti"):
        await served.server.ready()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Encode(ids_request([1, 2]), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_aoti_for_another_precision_fails_start_up(start_server: Any, aoti_bundle: Path) -> None:
    served = await start_server(bundle=aoti_bundle, backend="aoti", precision="bf16", wait_ready=False)
    with pytest.raises(BundleError, match="backend aoti: .*compiled for float32, the service serves bfloat16"):
        await served.server.ready()


def test_runner_sends_only_the_covered_calls_to_the_compiled_graph(aoti_bundle: Path) -> None:
    runner = Runner(helpers.test_config(aoti_bundle, backend="aoti"), str(aoti_bundle), Observed())
    runner.load()
    ids = np.arange(1, 21) % AOTI_CONFIG.vocab_size
    d = AOTI_CONFIG.d_model
    uncovered = [
        [Job(ids, None, attn_layers=(0,))],  # attention weights
        [Job(ids, None, causal=True)],  # causal
        [Job(None, np.zeros((4, d), np.float32))],  # embeddings in
        [Job(ids, None)] * (AOTI_MAX_BATCH + 1),  # a larger batch than compiled
    ]
    for jobs in uncovered:
        outputs, _ = runner.execute(jobs)
        assert all(not isinstance(o, Exception) for o in outputs)
    assert runner.compiled_forwards == 0
    outputs, _ = runner.execute([Job(ids, None, pooling=POOL_MEAN), Job(ids[:3], None)])
    assert runner.compiled_forwards == 1
    assert all(not isinstance(o, Exception) for o in outputs)


def test_backend_is_validated() -> None:
    with pytest.raises(ValueError, match="backend"):
        ServiceConfig(backend="onnx")


@pytest.mark.slow
async def test_a_real_process_with_edges_serves_and_reports_the_compiled_backend(aoti_bundle: Path,
                                                                                  tmp_path: Path) -> None:
    # `python -m service --backend aoti` behind an edge process: the backend travels in the model process's HELLO.
    server = ServerProcess(aoti_bundle, "--backend", "aoti", "--edge-processes", "1", "--precision", "fp32",
                           directory=tmp_path)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            response = await stub.Encode(ids_request(*_sequences()), timeout=30)
    finally:
        server.stop()
    assert info.backend == "aoti"
    want = load_bundle(aoti_bundle).module
    for seq, out in zip(_sequences(), response.outputs, strict=True):
        with torch.inference_mode():
            hidden, _ = want(torch.from_numpy(seq)[None], None, torch.tensor([len(seq)]), False, [])
        np.testing.assert_allclose(from_tensor(out.hidden), hidden[0].numpy(), rtol=0, atol=1e-5)
