"""The client library against real servers on 127.0.0.1:0: outputs equal the direct model call,
options, errors, deadlines, round-robin over several servers, and importability without torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

import client
from client import (
    ClientError,
    DeadlineExceeded,
    EncodeOptions,
    EncoderClient,
    EncodeResult,
    InvalidArgument,
    Overloaded,
    ServerError,
    StreamRequest,
    SyncEncoderClient,
    Unavailable,
)
from client.channel import channel_options, resolve_target, service_config
from client.errors import ERROR_OF, error_for
from tests.support.helpers import Running

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (1, 7, 33, 64)


def random_ids(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, n) for n in lengths]


async def test_async_round_trip_equals_the_direct_model_call(served: Running, reference_model):
    sequences = random_ids()
    async with EncoderClient(served.target) as c:
        together = await c.encode(sequences, request_id="together")
        alone = [await c.encode([ids]) for ids in sequences]
    assert together.request_id == "together"
    assert len(together) == len(sequences) and together.pooled == [] and together.attention == []
    for ids, hidden, single in zip(sequences, together.hidden, alone, strict=True):
        expected = reference_model(ids)[0]
        assert hidden.dtype == np.float32 and hidden.shape == (len(ids), 32)
        np.testing.assert_allclose(hidden, expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(single.hidden[0], expected, atol=1e-5, rtol=0)
    assert together.metadata.model_name == "tiny" and together.metadata.batch_size >= 1
    assert together.nonfinite == [False] * len(sequences)


async def test_sync_round_trip_equals_the_direct_model_call(served: Running, reference_model):
    sequences = random_ids(seed=1)

    def call() -> EncodeResult:  # in a thread: the in-process server runs on this test's event loop
        with SyncEncoderClient(served.target) as c:
            return c.encode(np.stack([s[:5] for s in sequences[1:]]))  # a 2-D id array is rows of ids

    result = await asyncio.to_thread(call)
    assert len(result) == 3
    for ids, hidden in zip(sequences[1:], result.hidden, strict=True):
        np.testing.assert_allclose(hidden, reference_model(ids[:5])[0], atol=1e-5, rtol=0)
    # The returned arrays are the caller's own: writable, not views of the message.
    result.hidden[0][0, 0] = 1.0


async def test_pooling_mean_and_cls_equal_the_reference_hidden_states(served: Running, reference_model):
    sequences = random_ids((3, 20, 64), seed=2)
    async with EncoderClient(served.target) as c:
        mean = await c.encode(sequences, pooling="mean")
        cls = await c.encode(sequences, pooling="cls", return_hidden=False)
    assert cls.hidden == [] and len(cls.pooled) == 3
    for i, ids in enumerate(sequences):
        hidden = reference_model(ids)[0]
        np.testing.assert_allclose(mean.pooled[i], hidden.mean(axis=0), atol=1e-5, rtol=0)
        np.testing.assert_allclose(cls.pooled[i], hidden[0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(mean.hidden[i], hidden, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("dtype", "significant_bits"), [("float16", 11), ("bfloat16", 8)])
async def test_reduced_precision_outputs_are_the_fp32_outputs_rounded(served: Running, dtype, significant_bits):
    sequences = random_ids((5, 64), seed=3)
    async with EncoderClient(served.target) as c:
        full = await c.encode(sequences, pooling="mean")
        reduced = await c.encode(sequences, pooling="mean", output_dtype=dtype)
    for exact, rounded in zip(full.hidden + full.pooled, reduced.hidden + reduced.pooled, strict=True):
        # float16 arrives as float16 arrays; bfloat16, which numpy lacks, as float32 holding its values.
        assert rounded.dtype == (np.float16 if dtype == "float16" else np.float32)
        # Round to nearest: off by at most half a unit in the last place, i.e. |x| * 2^-bits. The two calls
        # are two forwards, which may differ in the last bits of fp32 (batched differently, or one run
        # narrow by a second model worker): atol covers that, near zero where the rtol bound vanishes.
        np.testing.assert_allclose(rounded, exact, rtol=2.0**-significant_bits, atol=1e-6)
        assert not np.array_equal(rounded, exact)  # it really travelled in reduced precision
        if dtype == "bfloat16":
            assert not (rounded.view(np.uint32) & 0xFFFF).any()  # bf16 is the upper half of the fp32


async def test_attention_only_when_asked_with_layer_and_head_selection(served: Running, reference_model):
    ids = random_ids((12,), seed=4)[0]
    expected = reference_model(ids, layers=(0, 1))[1]  # [L=2, H=4, T, T]
    async with EncoderClient(served.target) as c:
        plain = await c.encode([ids])
        every = await c.encode([ids], attention=True)
        last = await c.encode([ids], layers=[-1])  # naming layers asks for attention
        mean = await c.encode([ids], attention=True, layers=[1, 0], heads="mean", return_hidden=False)
        half = await c.encode([ids], attention=True, attention_dtype="float16")
    assert plain.attention == []
    assert every.attention[0].shape == (2, 4, 12, 12)
    np.testing.assert_allclose(every.attention[0], expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(last.attention[0], expected[1:], atol=1e-5, rtol=0)
    assert mean.hidden == [] and mean.attention[0].shape == (2, 1, 12, 12)
    np.testing.assert_allclose(mean.attention[0][:, 0], expected[[1, 0]].mean(axis=1), atol=1e-5, rtol=0)
    np.testing.assert_allclose(half.attention[0], expected, atol=2.0**-11, rtol=0)  # weights are in [0, 1]


async def test_causal_equals_the_causal_reference(served: Running, reference_model):
    ids = random_ids((9,), seed=5)[0]
    async with EncoderClient(served.target) as c:
        result = await c.encode([ids], causal=True, attention=True)
    hidden, attention = reference_model(ids, causal=True, layers=(0, 1))
    np.testing.assert_allclose(result.hidden[0], hidden, atol=1e-5, rtol=0)
    np.testing.assert_allclose(result.attention[0], attention, atol=1e-5, rtol=0)
    assert not np.triu(result.attention[0][0, 0], k=1).any()


async def test_embeddings_input_and_its_shape_errors(served: Running):
    rng = np.random.default_rng(6)
    async with EncoderClient(served.target) as c:
        result = await c.encode([rng.standard_normal((5, 32)), rng.standard_normal((3, 32)).astype(np.float16)],
                                pooling="cls")
        with pytest.raises(InvalidArgument) as wrong_width:
            await c.encode([rng.standard_normal((5, 31))])
    assert [h.shape for h in result.hidden] == [(5, 32), (3, 32)]
    assert wrong_width.value.field == "sequences[0].embeddings"


async def test_invalid_argument_names_the_field(served: Running):
    async with EncoderClient(served.target) as c:
        with pytest.raises(InvalidArgument) as first:
            await c.encode([[1, 2, 1000]])
        with pytest.raises(InvalidArgument) as second:
            await c.encode([[1], [5, 100]])
        with pytest.raises(InvalidArgument) as too_long:
            await c.encode([np.zeros(65, np.int64)])
    assert first.value.code == "INVALID_ARGUMENT"
    assert first.value.field == "sequences[0].token_ids[2]"
    assert "1000" in first.value.message
    assert isinstance(first.value, ClientError) and isinstance(first.value, ValueError)
    assert second.value.field == "sequences[1].token_ids[1]"
    assert too_long.value.field == "sequences[0].token_ids"


async def test_malformed_input_is_refused_before_sending(served: Running):
    async with EncoderClient(served.target, max_message_bytes=1000) as c:
        with pytest.raises(InvalidArgument, match="list of sequences") as flat:
            await c.encode([1, 2, 3])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument) as strings:
            await c.encode([np.array(["a", "b"])])
        with pytest.raises(InvalidArgument, match="pooling"):
            await c.encode([[1]], pooling="max")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="max_message_bytes") as big:
            await c.encode([np.zeros(64, np.int64)] * 8)
        # A response over the client's receive limit (RELIABILITY.md row 12) fails at the client.
        with pytest.raises(Overloaded, match="larger than max"):
            await c.encode([np.zeros(64, np.int64)])
    assert flat.value.field == "sequences" and strings.value.field == "sequences[0]"
    assert big.value.field == "sequences"
    assert served.sample("attention_requests_total", {"method": "Encode", "code": "INVALID_ARGUMENT"}) == 0


async def test_a_tiny_timeout_fails_the_call_with_deadline_exceeded(served: Running):
    async with EncoderClient(served.target) as c:
        with pytest.raises(DeadlineExceeded) as encode:
            await c.encode([[1, 2, 3]], timeout=1e-6)
        with pytest.raises(ValueError, match="timeout"):
            await c.encode([[1]], timeout=0)
    assert encode.value.code == "DEADLINE_EXCEEDED"
    with pytest.raises(ValueError, match="timeout"):
        EncoderClient(served.target, timeout=0)


async def test_every_call_has_a_deadline(silent_target: str):
    """Against a peer that accepts TCP but never answers, a call without a deadline would hang."""
    async with EncoderClient(silent_target, timeout=0.2) as c:  # the client's default applies
        for call in (c.encode([[1, 2, 3]]), c.model_info(), c.health()):
            with pytest.raises(DeadlineExceeded):
                await call
        with pytest.raises(DeadlineExceeded):
            async for _ in c.encode_stream([StreamRequest([[1, 2]])]):
                pass
    async with EncoderClient(silent_target, timeout=60) as c:  # a call's own timeout wins
        with pytest.raises(DeadlineExceeded):
            await c.encode([[1]], timeout=0.2)

    def sync_calls() -> list[str]:
        codes = []
        with SyncEncoderClient(silent_target, timeout=0.2) as c:
            for call in (lambda: c.encode([[1]]), c.model_info, c.health):
                try:
                    call()
                except ClientError as exc:
                    codes.append(exc.code)
        return codes

    assert await asyncio.to_thread(sync_calls) == ["DEADLINE_EXCEEDED"] * 3


async def test_model_info_and_health(served: Running):
    async with EncoderClient(served.target) as c:
        info = await c.model_info()
        statuses = [await c.health(), await c.health("attention.v1.AttentionService"), await c.health("nope")]
    assert (info.name, info.d_model, info.n_heads, info.n_layers, info.vocab_size, info.max_length) == (
        "tiny", 32, 4, 2, 100, 64)
    assert info.limits.max_message_bytes == 64 * 1024 * 1024 and info.limits.max_sequences_per_call > 0
    assert statuses == ["SERVING", "SERVING", "SERVICE_UNKNOWN"]

    def sync_calls() -> tuple[str, str]:
        with SyncEncoderClient(served.target) as c:
            return c.model_info().checksum, c.health("nope")

    assert await asyncio.to_thread(sync_calls) == (info.checksum, "SERVICE_UNKNOWN")


async def test_health_of_a_warming_server_and_of_nothing(start_server, unused_port: int):
    warming = await start_server(wait_ready=False)
    async with EncoderClient(warming.target) as c:
        # Liveness answers at once; readiness may not be SERVING yet (no assumption on timing).
        assert await c.health() == "SERVING"
        assert await c.health("attention.v1.AttentionService") in ("NOT_SERVING", "SERVING")
        await warming.server.ready()
        assert await c.health("attention.v1.AttentionService") == "SERVING"
    async with EncoderClient(f"127.0.0.1:{unused_port}", timeout=5) as c:
        with pytest.raises(Unavailable) as down:
            await c.health()
    assert down.value.code == "UNAVAILABLE"


async def test_encode_stream_matches_responses_by_request_id(served: Running, reference_model):
    sequences = random_ids((4, 9, 16), seed=7)

    async def requests():
        yield StreamRequest([sequences[0]], request_id="a")
        yield StreamRequest([[1, 200]], request_id="bad")
        yield StreamRequest([sequences[1], sequences[2]], options=EncodeOptions(pooling="mean"))

    async with EncoderClient(served.target) as c:
        items = {item.request_id: item async for item in c.encode_stream(requests())}
        from_list = [item async for item in c.encode_stream([StreamRequest([sequences[0]])])]
        # A request the client cannot build ends the stream: what was sent is answered, then it raises.
        before_bad: list[EncodeResult | ClientError] = []
        with pytest.raises(InvalidArgument, match="flat list"):
            async for item in c.encode_stream([StreamRequest([[1, 2]]), StreamRequest([1, 2, 3])]):  # type: ignore[list-item]
                before_bad.append(item)
    assert set(items) == {"a", "bad", "2"}  # an empty id is replaced by the request's index
    bad = items["bad"]
    assert isinstance(bad, InvalidArgument) and bad.field == "sequences[0].token_ids[1]"
    a, two = items["a"], items["2"]
    assert isinstance(a, EncodeResult) and isinstance(two, EncodeResult)
    np.testing.assert_allclose(a.hidden[0], reference_model(sequences[0])[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(two.pooled[1], reference_model(sequences[2])[0].mean(0), atol=1e-5, rtol=0)
    assert len(from_list) == 1 and isinstance(from_list[0], EncodeResult)
    assert [type(item) for item in before_bad] == [EncodeResult]


@pytest.mark.parametrize("as_list", [True, False])
async def test_several_targets_are_balanced_round_robin(start_server, as_list: bool):
    a, b = await start_server(), await start_server()
    target = [a.target, b.target] if as_list else f"{a.target},{b.target}"
    async with EncoderClient(target) as c:
        assert c.target == f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"
        # A subchannel still connecting is skipped by round_robin, so allow a bounded number of calls
        # (pick_first would send all 200 to one server).
        calls = 0
        while calls < 200 and not (a.sample("attention_sequences_total") and b.sample("attention_sequences_total")):
            await c.encode([[1, 2, 3]], request_id=str(calls))
            calls += 1
        for _ in range(10):  # once both are connected, calls alternate
            await c.encode([[1, 2, 3]])
    counts = [a.sample("attention_sequences_total"), b.sample("attention_sequences_total")]
    assert sum(counts) == calls + 10
    assert min(counts) >= 5, counts


def test_targets_and_channel_options():
    assert resolve_target("127.0.0.1:5001") == "127.0.0.1:5001"
    assert resolve_target("dns:///encoder.internal:50051") == "dns:///encoder.internal:50051"
    assert resolve_target(["127.0.0.1:5001", " 10.0.0.2:5002"]) == "ipv4:127.0.0.1:5001,10.0.0.2:5002"
    assert resolve_target("[::1]:5001,[::1]:5002") == "ipv6:[::1]:5001,[::1]:5002"
    assert resolve_target("localhost:5001,127.0.0.1:5002").startswith(("ipv4:", "ipv6:"))
    for bad in ("", "127.0.0.1:1,[::1]:2", "127.0.0.1:1,dns:///x:2", "127.0.0.1,127.0.0.2:1"):
        with pytest.raises(ValueError):
            resolve_target(bad)
    options = dict(channel_options())
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] == 64 << 20
    assert (options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"]) == (30_000, 10_000)
    assert options["grpc.keepalive_permit_without_calls"] == 1
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": "attention.v1.AttentionService"}]
    assert set(method["retryPolicy"]["retryableStatusCodes"]) == {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED"}
    assert "methodConfig" not in json.loads(service_config(None))
    assert dict(channel_options(extra=[("grpc.keepalive_time_ms", 60_000)]))["grpc.keepalive_time_ms"] == 60_000


def test_fill_tensor_writes_in_place_what_to_tensor_builds():
    # The server fills response fields in place (service/doors/attention_v1.py); a field filled twice holds
    # the second array only.
    from proto.attention.v1 import attention_pb2 as pb
    from proto.attention.v1.codec import fill_tensor, from_tensor, to_tensor

    rng = np.random.default_rng(0)
    cases = [(rng.random((5, 3), dtype=np.float32), None), (rng.random(4, dtype=np.float32), pb.DTYPE_BFLOAT16),
             (np.arange(6), None), (rng.random((2, 2), dtype=np.float32), pb.DTYPE_FLOAT16)]
    for array, dtype in cases:
        message = pb.SequenceOutput()
        fill_tensor(message.hidden, np.zeros((7, 7, 7), np.float32))
        fill_tensor(message.hidden, array, dtype)
        assert message.hidden == to_tensor(array, dtype)
        assert from_tensor(message.hidden).shape == array.shape


def test_every_error_class_is_mapped_and_every_code_translates():
    """The httpx pattern: the exception tree and the code table agree."""
    mapped = set(ERROR_OF.values()) | {ServerError}
    assert set(ClientError.__subclasses__()) == mapped
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        error = error_for(code.name, "x")
        assert type(error) is ERROR_OF.get(code.name, ServerError)
        assert error.code == code.name and str(error) == f"{code.name}: x"
    assert set(client.__all__) >= {cls.__name__ for cls in mapped}


def test_importable_without_torch():
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import client, client.client, client.cli, client.load, client.health\n"
        "from proto.attention.v1 import codec\n"
        "import numpy as np\n"
        "c = client.SyncEncoderClient('127.0.0.1:1'); c.close()\n"
        "client.cli.build_parser().parse_args(['encode', '--ids', '1', '2'])\n"
        "assert codec.from_tensor(codec.to_tensor(np.arange(3))).tolist() == [0, 1, 2]\n"
        "assert not any(m == 'model' or m.startswith(('model.', 'service')) for m in sys.modules), 'server code'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.fixture
def unused_port():
    """A port with nothing listening on it (bound, never listened, held for the test)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def silent_target():
    """A TCP listener that never accepts: connections hang in the HTTP/2 handshake."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"127.0.0.1:{s.getsockname()[1]}"
