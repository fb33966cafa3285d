"""bench/naive_server.py: the naive unbatched server answers what the service answers, serves the load
generator, and refuses what it cannot do with a clear status."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.naive_server import NaiveProcess
from client.load import run_load
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import from_tensor, to_tensor
from tests.support.server_process import ServerProcess


@pytest.fixture(scope="module")
def servers(tiny_bundle: Path) -> Iterator[tuple[ServerProcess, NaiveProcess]]:
    service = ServerProcess(tiny_bundle, "--torch-threads", "1", "--log-level", "warning")
    try:
        naive = NaiveProcess(tiny_bundle, "--torch-threads", "1", "--precision", "fp32")
        try:
            yield service, naive
        finally:
            naive.stop()
    finally:
        service.stop()


def stub(target: str) -> Iterator[attention_pb2_grpc.AttentionServiceStub]:
    with grpc.insecure_channel(target) as channel:
        yield attention_pb2_grpc.AttentionServiceStub(channel)


def request(*rows: np.ndarray, **output: object) -> pb.EncodeRequest:
    return pb.EncodeRequest(request_id="r", sequences=[pb.Sequence(token_ids=to_tensor(r)) for r in rows],
                            output=pb.OutputOptions(**output))  # type: ignore[arg-type]


def hidden_states(target: str, call: pb.EncodeRequest) -> tuple[list[np.ndarray], pb.EncodeResponse]:
    for s in stub(target):
        response = s.Encode(call, timeout=30)
    return [from_tensor(o.hidden) for o in response.outputs], response


@pytest.mark.parametrize("lengths", [[5], [1], [3, 17, 64], [64, 2]])
def test_the_naive_servers_hidden_states_equal_the_services(servers: tuple[ServerProcess, NaiveProcess],
                                                             lengths: list[int]) -> None:
    service, naive = servers
    rng = np.random.default_rng(sum(lengths))
    rows = [rng.integers(0, 100, n, dtype=np.int64) for n in lengths]
    want, _ = hidden_states(service.target, request(*rows))
    got, response = hidden_states(naive.target, request(*rows))
    assert [h.shape for h in got] == [(n, 32) for n in lengths] == [h.shape for h in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    assert response.request_id == "r"
    assert [o.token_count for o in response.outputs] == lengths
    meta = response.metadata
    assert (meta.batch_size, meta.padded_length, meta.precision) == (len(lengths), max(lengths), "fp32")


def test_float16_output_is_the_float32_output_rounded(servers: tuple[ServerProcess, NaiveProcess]) -> None:
    _, naive = servers
    row = np.arange(10, dtype=np.int32)
    [fp32], _ = hidden_states(naive.target, request(row))
    [fp16], response = hidden_states(naive.target, request(row, dtype=pb.DTYPE_FLOAT16))
    assert response.outputs[0].hidden.dtype == pb.DTYPE_FLOAT16
    np.testing.assert_array_equal(fp16, fp32.astype(np.float16))


def test_its_model_info_is_the_services_and_the_load_generator_runs_against_it(
        servers: tuple[ServerProcess, NaiveProcess]) -> None:
    service, naive = servers
    infos = []
    for target in (service.target, naive.target):
        for s in stub(target):
            infos.append(s.GetModelInfo(pb.GetModelInfoRequest(), timeout=30))
    fields = ("name", "version", "checksum", "d_model", "n_heads", "n_layers", "vocab_size", "max_length",
              "positional", "precision", "device")
    assert [getattr(infos[1], f) for f in fields] == [getattr(infos[0], f) for f in fields]
    report = asyncio.run(run_load(naive.target, concurrency=4, duration_s=None, max_requests=24, lengths=(4, 64),
                                  pool_size=8))
    assert (report.ok, report.errors, report.sequences) == (24, {}, 24)
    assert 1 <= report.server["padded_length"] <= 64 and report.server["batch_size"] == 1


@pytest.mark.parametrize(("call", "code", "names"), [
    (pb.EncodeRequest(), grpc.StatusCode.INVALID_ARGUMENT, "sequences"),
    (request(np.array([1, 100])), grpc.StatusCode.INVALID_ARGUMENT, "sequences[0].token_ids"),
    (request(np.array([3, -1])), grpc.StatusCode.INVALID_ARGUMENT, "sequences[0].token_ids"),
    (request(np.zeros(65, dtype=np.int64)), grpc.StatusCode.INVALID_ARGUMENT, "sequences[0].token_ids"),
    (request(np.zeros(3, dtype=np.float32)), grpc.StatusCode.INVALID_ARGUMENT, "sequences[0].token_ids"),
    (pb.EncodeRequest(sequences=[pb.Sequence(token_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[3], data=b"x"))]),
     grpc.StatusCode.INVALID_ARGUMENT, "byte size mismatch"),
    (request(np.array([1, 2]), dtype=pb.DTYPE_INT8), grpc.StatusCode.INVALID_ARGUMENT, "output.dtype"),
    (request(np.array([1, 2]), pooling=pb.POOLING_MEAN), grpc.StatusCode.UNIMPLEMENTED, "output.pooling"),
    (pb.EncodeRequest(sequences=[pb.Sequence(text="hi")]), grpc.StatusCode.UNIMPLEMENTED, "sequences[0]"),
])
def test_it_refuses_what_it_cannot_run_with_a_status_naming_the_field(
        servers: tuple[ServerProcess, NaiveProcess], call: pb.EncodeRequest, code: grpc.StatusCode,
        names: str) -> None:
    for s in stub(servers[1].target):
        with pytest.raises(grpc.RpcError) as caught:
            s.Encode(call, timeout=30)
    assert caught.value.code() == code and names in caught.value.details()


def test_every_other_method_is_unimplemented(servers: tuple[ServerProcess, NaiveProcess]) -> None:
    for s in stub(servers[1].target):
        with pytest.raises(grpc.RpcError) as caught:
            s.Tokenize(pb.TokenizeRequest(texts=["hi"]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_the_bundle_is_loaded_and_warmed_on_the_forward_thread(tiny_bundle: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """One OpenMP team, as in process: loading on another thread left a second team there, and the naive server's
    forward then differed from the in-process one (bench/naive_server.py)."""
    import threading

    import bench.naive_server as naive

    loaded_on: list[str] = []
    real = naive.load_bundle

    def load_bundle(*args: object, **kwargs: object) -> object:
        loaded_on.append(threading.current_thread().name)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(naive, "load_bundle", load_bundle)
    servicer = naive.NaiveServicer(tiny_bundle, "fp32", 1)
    try:
        forward_thread = servicer.pool.submit(lambda: threading.current_thread().name).result()
        assert loaded_on == [forward_thread] and forward_thread.startswith("forward")
        hidden, _, _ = servicer.pool.submit(servicer.forward, [np.arange(5, dtype=np.int64)]).result()
        assert hidden[0].shape == (5, 32)
    finally:
        servicer.pool.shutdown()
