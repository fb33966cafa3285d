"""Client-side errors that say what to do (issue 28 item 4), each as its message and exit code, against
real `python -m service` processes: the tiny id model and the tiny text model.

Exit codes (client/cli.py): 2 a usage error found before any call, 1 the server refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client import EncoderClient, InvalidArgument, StreamRequest, SyncEncoderClient
from client.cli import build_parser, cli_words, main
from client.messages import DTYPE_NAMES
from tests.support.server_process import ServerProcess

FLAGS = ("--max-batch-tokens", "2048", "--drain-grace-s", "2", "--log-level", "warning")
LONG_TEXT = "a b c the cat a b c"  # 8 words + [CLS]/[SEP]: over the tiny text model's 8 tokens


@pytest.fixture(scope="module")
def ids_server(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_bundle, *FLAGS, directory=tmp_path_factory.mktemp("ids"), timeout=60)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def text_server(tiny_text_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_text_bundle, *FLAGS, directory=tmp_path_factory.mktemp("text"), timeout=60)
    try:
        yield server
    finally:
        server.stop()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def encode_calls(server: ServerProcess) -> float:
    return server.sample("grpc_server_started_total", {"grpc_method": "Encode"})


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_encode_out_into_a_missing_folder_is_refused_before_the_call(ids_server: ServerProcess, capsys,
                                                                     tmp_path: Path):
    before = encode_calls(ids_server)
    out = tmp_path / "no-such-folder" / "out.npz"
    code, _, err = run_cli(capsys, "--target", ids_server.target, "encode", "--ids", "1", "2", "--out", str(out))
    line = one_error_line(err)
    assert code == 2 and "does not exist" in line and "mkdir -p" in line
    code, _, err = run_cli(capsys, "--target", ids_server.target, "encode", "--ids", "1", "--out",
                           str(tmp_path / "out.txt"))
    assert code == 2 and ".npy, .npz or .json" in one_error_line(err)
    code, _, err = run_cli(capsys, "--target", ids_server.target, "plot", "--ids", "1", "2", "--out",
                           str(tmp_path / "missing" / "a.png"))
    assert code == 2 and "does not exist" in one_error_line(err)
    assert encode_calls(ids_server) == before, "nothing was sent"


def test_plot_refuses_a_layer_the_model_lacks_also_with_entropy(ids_server: ServerProcess, capsys, tmp_path: Path):
    before = encode_calls(ids_server)
    for extra in (["--entropy"], []):
        code, _, err = run_cli(capsys, "--target", ids_server.target, "plot", "--ids", "1", "2", "3", "--layer", "9",
                               *extra, "--out", str(tmp_path / "p.png"))
        assert code == 2 and "--layer 9 not in [-2, 2): the model has 2 layers" in one_error_line(err)
    assert encode_calls(ids_server) == before and not (tmp_path / "p.png").exists()
    code, out, _ = run_cli(capsys, "--target", ids_server.target, "plot", "--ids", "1", "2", "3", "--layer", "-2",
                           "--entropy", "--out", str(tmp_path / "p.png"))
    assert code == 0 and "layer 0, mean of heads" in out


def test_plot_refuses_over_limit_text_as_encode_does_and_marks_a_cut(text_server: ServerProcess, capsys,
                                                                     tmp_path: Path):
    png = tmp_path / "t.png"
    for command in ("encode", "plot"):
        extra = ["--out", str(png)] if command == "plot" else []
        code, _, err = run_cli(capsys, "--target", text_server.target, command, "--text", LONG_TEXT, *extra)
        line = one_error_line(err)
        assert code == 1 and "over the model's limit of 8" in line, line
        assert "give --truncate to cut it" in line and "set truncate" not in line  # in the CLI's words
    assert not png.exists()
    code, out, _ = run_cli(capsys, "--target", text_server.target, "plot", "--text", LONG_TEXT, "--truncate",
                           "--out", str(png))
    assert code == 0 and "(truncated)" in out and "8 tokens" in out and png.exists()
    code, out, _ = run_cli(capsys, "--target", text_server.target, "plot", "--text", "the cat", "--out", str(png))
    assert code == 0 and "(truncated)" not in out


def test_api_field_names_come_back_as_the_clis_flags(text_server: ServerProcess, capsys):
    code, _, err = run_cli(capsys, "--target", text_server.target, "encode", "--text", "a", "--stride", "3")
    line = one_error_line(err)
    assert code == 1 and "--stride" in line and "chunk_stride" not in line, line
    code, _, err = run_cli(capsys, "--target", text_server.target, "encode", "--text", "a", "--long-inputs", "chunk",
                           "--truncate")
    line = one_error_line(err)
    assert code == 1 and "contradicts --truncate" in line and "--long-inputs" in line, line
    assert "long_inputs" not in line and "truncate = true" not in line
    # The words of the table, one by one (the server's texts as they are today).
    assert cli_words("given, but return_attention is false") == "given, but --attention is not given"
    assert cli_words("normalizes the pooled vector: set output.pooling").endswith(": set --pooling")
    assert cli_words("unknown prompt 'x'") == "unknown prompt 'x'"


def test_float_ids_get_a_hint(ids_server: ServerProcess, capsys, tmp_path: Path):
    with SyncEncoderClient(ids_server.target) as client, pytest.raises(InvalidArgument) as float_ids:
        client.encode([np.array([1.0, 2.0, 3.0])])
    assert "token ids must be integers" in str(float_ids.value) and float_ids.value.field == "sequences[0]"
    path = tmp_path / "floats.json"
    path.write_text(json.dumps([[1.5, 2.0]]))
    code, _, err = run_cli(capsys, "--target", ids_server.target, "encode", "--file", str(path))
    assert code == 1 and "token ids must be integers" in one_error_line(err)


def test_dtype_names_are_the_librarys(ids_server: ServerProcess, capsys):
    assert DTYPE_NAMES == ("float32", "float16", "bfloat16")
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    encode = next(a for a in commands["encode"]._actions if a.dest == "dtype")
    assert tuple(encode.choices) == DTYPE_NAMES
    with pytest.raises(SystemExit) as usage:
        main(["encode", "--ids", "1", "--dtype", "fp16"])
    assert usage.value.code == 2 and "invalid choice: 'fp16'" in capsys.readouterr().err
    with SyncEncoderClient(ids_server.target) as client, pytest.raises(InvalidArgument, match="output_dtype"):
        client.encode([[1, 2]], output_dtype="fp16")  # type: ignore[arg-type]
    with SyncEncoderClient(ids_server.target) as client:
        half = client.encode([[1, 2, 3]], output_dtype="float16", pooling="mean")
        bf16 = client.encode([[1, 2, 3]], output_dtype="bfloat16", attention=True, attention_dtype="float16")
    assert half.hidden[0].dtype == half.pooled[0].dtype == np.float16 and half.hidden[0].flags.writeable
    assert bf16.hidden[0].dtype == np.float32 and bf16.attention[0].dtype == np.float16


async def test_pooling_defaults_follow_the_model_not_the_input(text_server: ServerProcess, ids_server: ServerProcess):
    async with EncoderClient(text_server.target) as client:
        (tokens,) = await client.tokenize(["the cats"])
        by_text = await client.encode(["the cats"])
        by_ids = await client.encode([np.array(tokens.ids)])
        streamed = [item async for item in client.encode_stream([StreamRequest([np.array(tokens.ids)])])]
    np.testing.assert_allclose(by_ids.pooled[0], by_text.pooled[0], atol=1e-6)
    assert np.isclose(np.linalg.norm(by_ids.pooled[0]), 1.0)  # the model's own pooling, normalised
    np.testing.assert_allclose(streamed[0].pooled[0], by_text.pooled[0], atol=1e-6)  # type: ignore[union-attr]
    async with EncoderClient(ids_server.target) as client:
        plain = await client.encode([[1, 2, 3]])
    assert plain.pooled == [] and len(plain.hidden) == 1  # no tokenizer: no pooling unless asked


def test_bench_sends_text_to_a_text_model(text_server: ServerProcess, ids_server: ServerProcess, capsys,
                                          tmp_path: Path):
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat\n\na b c\nthe cats . a b c the cat a\n")
    before = text_server.sample("attention_sequences_total")
    report = tmp_path / "r.json"
    code, out, _ = run_cli(capsys, "--target", text_server.target, "bench", "--text-file", str(texts), "--requests",
                           "12", "--concurrency", "2", "--no-progress", "--json", str(report))
    assert code == 0 and "Errors by code: none" in out, out
    data = json.loads(report.read_text())
    assert data["ok"] == 12 and 12 * 4 <= data["tokens"] <= 12 * 8  # the server's token counts, cut at 8
    assert text_server.sample("attention_sequences_total") - before == 12
    code, out, _ = run_cli(capsys, "--target", text_server.target, "bench", "--generated-text", "--lengths", "2:5",
                           "--requests", "8", "--no-progress")
    assert code == 0 and "calls         8 (8 ok)" in out
    code, _, err = run_cli(capsys, "--target", ids_server.target, "bench", "--generated-text", "--requests", "4",
                           "--no-progress")
    assert code == 2 and "takes no text" in one_error_line(err)
    code, _, err = run_cli(capsys, "--target", ids_server.target, "bench", "--text-file", str(tmp_path / "none.txt"),
                           "--requests", "4")
    assert code == 2 and "none.txt" in one_error_line(err)


def test_bench_against_a_dead_server(capsys, unused_port: int):
    code, _, err = run_cli(capsys, "--target", f"127.0.0.1:{unused_port}", "--timeout", "5", "bench", "--requests",
                           "100", "--no-progress")
    assert code == 1 and "UNAVAILABLE" in one_error_line(err)


def test_bench_backs_off_when_its_server_dies(tiny_bundle: Path, tmp_path: Path):
    """Killed mid-run, the server gets a few calls a second from each caller, not a flood: each failed
    UNAVAILABLE call is followed by a wait of 50 ms doubling to 1 s. In the at most 8 s left of the run
    that is at most 12 calls per caller (without the waits: about 150,000 calls in 9 s)."""
    from client.load import run_load

    server = ServerProcess(tiny_bundle, *FLAGS, directory=tmp_path / "victim", timeout=60)
    concurrency = 4

    async def kill_after_some_calls() -> None:
        while await asyncio.to_thread(server.started) < 20:
            await asyncio.sleep(0.05)
        os.kill(server.pid, signal.SIGKILL)

    async def bench() -> object:
        killer = asyncio.create_task(kill_after_some_calls())
        report = await run_load(server.target, concurrency=concurrency, duration_s=8, lengths=(4, 8), timeout=5)
        await killer
        return report

    try:
        report = asyncio.run(bench())
    finally:
        server.kill()
        server.stop()
    errors = report.errors  # type: ignore[attr-defined]
    assert report.ok >= 20 - concurrency  # type: ignore[attr-defined]
    assert errors.get("UNAVAILABLE", 0) >= concurrency, errors  # every caller met the dead server
    assert sum(errors.values()) <= 12 * concurrency, errors


@pytest.fixture
def unused_port() -> Iterator[int]:
    import socket

    with socket.socket() as s:  # bound but not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
