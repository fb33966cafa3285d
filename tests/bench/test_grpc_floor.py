"""bench/grpc_floor.py stays runnable: a bounded run prints a row per server and wait."""

import pytest

from bench import grpc_floor


def test_a_bounded_run_prints_a_row_per_server_and_wait(capsys: pytest.CaptureFixture[str]) -> None:
    assert grpc_floor.main(["--rounds", "2", "--calls", "20", "--wait-ms", "0", "2"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| aio |", "| sync |"))]
    assert [(r[0].strip(), float(r[1])) for r in rows] == [("aio", 0), ("sync", 0), ("aio", 2), ("sync", 2)]
    for row in rows:
        assert len(row[3].split(",")) == 2  # one p50 per round
        assert float(row[2]) > 0  # a round trip above the wait: it never comes back sooner
    assert float(rows[2][4]) >= 0 and float(rows[0][4]) == 0  # the sleep overshoot, none without a wait


def test_the_handlers_wait_is_not_counted() -> None:
    # With a 20 ms wait the p50 above the wait is what gRPC adds, far below the wait itself.
    assert 0 < grpc_floor.measure("aio", 20.0, calls=10) < 20.0


@pytest.mark.parametrize("kind", grpc_floor.AIO_KINDS)
def test_every_aio_floor_answers_a_unary_call_with_its_bytes(kind: str) -> None:
    # The client-streaming kinds (aio-anext, aio-read) serve the same unary call: the caller sees no difference.
    import grpc

    path = "/attention.v1.AttentionService/Encode"
    server = grpc_floor.FloorServer(kind, {path: b"answer"})
    try:
        with grpc.insecure_channel(server.target) as channel:
            call = channel.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            assert [call(b"request", timeout=10) for _ in range(3)] == [b"answer"] * 3
    finally:
        server.stop()
