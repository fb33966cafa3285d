"""`python -m client` and `python -m client.health` end to end against `python -m service` in a
subprocess (SIGTERM at the end must exit 0)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client.cli import main
from tests.support.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def service(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_bundle, "--max-batch-tokens", "2048", "--drain-grace-s", "2", "--log-level", "warning",
                           directory=tmp_path_factory.mktemp("service"), timeout=60)
    assert server.ports["pid"] == server.pid
    try:
        yield server
        assert server.terminate() == 0, server.output()[-2000:]
    finally:
        server.kill()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_module(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture
def unused_port() -> Iterator[int]:
    with socket.socket() as s:  # bound but not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_encode_prints_shapes_and_a_preview(service: ServerProcess, reference_model, capsys):
    code, out, _ = run_cli(capsys, "--target", service.target, "encode", "--ids", "5", "6", "7", "--ids", "8", "9",
                           "--pooling", "mean", "--attention", "--layers", "-1", "--heads", "mean")
    assert code == 0, out
    hidden = reference_model(np.array([5, 6, 7]))[0]
    preview = ", ".join(f"{v:.4f}" for v in hidden.reshape(-1)[:4])
    assert f"hidden    [3, 32]          [{preview}, ...]" in out
    assert "pooled    [32]" in out and "attention [1, 1, 3, 3]" in out and "attention [1, 1, 2, 2]" in out
    assert "model tiny v1 on cpu (fp32)" in out


def test_encode_writes_npy_npz_and_json(service: ServerProcess, reference_model, capsys, tmp_path: Path):
    a, b = np.array([1, 2, 3, 4]), np.array([10, 20])
    flags = ["encode", "--target", service.target, "--ids", *map(str, a)]
    assert run_cli(capsys, *flags, "--out", str(tmp_path / "one.npy"))[0] == 0
    np.testing.assert_allclose(np.load(tmp_path / "one.npy"), reference_model(a)[0], atol=1e-5, rtol=0)

    flags += ["--ids", *map(str, b)]
    assert run_cli(capsys, *flags, "--pooling", "cls", "--out", str(tmp_path / "many.npz"))[0] == 0
    with np.load(tmp_path / "many.npz") as z:
        assert sorted(z.files) == ["hidden_0", "hidden_1", "pooled"]
        np.testing.assert_allclose(z["hidden_1"], reference_model(b)[0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(z["pooled"], [reference_model(a)[0][0], reference_model(b)[0][0]], atol=1e-5,
                                   rtol=0)

    assert run_cli(capsys, *flags, "--request-id", "r1", "--out", str(tmp_path / "many.json"))[0] == 0
    data = json.loads((tmp_path / "many.json").read_text())
    assert data["request_id"] == "r1" and data["metadata"]["model_name"] == "tiny"
    assert [o["nonfinite"] for o in data["outputs"]] == [False, False]
    np.testing.assert_allclose(data["outputs"][1]["hidden"], reference_model(b)[0], atol=1e-5, rtol=0)

    # Two arrays do not fit one .npy: a usage error, nothing written.
    code, _, err = run_cli(capsys, *flags, "--out", str(tmp_path / "two.npy"))
    assert code == 2 and "npz" in err and not (tmp_path / "two.npy").exists()


def test_encode_reads_json_npy_and_npz_files(service: ServerProcess, reference_model, capsys, tmp_path: Path):
    seqs = [[3, 1, 4, 1, 5], [9, 2, 6]]
    (tmp_path / "in.json").write_text(json.dumps(seqs))
    np.save(tmp_path / "in.npy", np.array(seqs[0]))
    np.savez(tmp_path / "in.npz", a=np.array(seqs[0]), b=np.array(seqs[1]))
    for name, expected in (("in.json", seqs), ("in.npy", seqs[:1]), ("in.npz", seqs)):
        out = tmp_path / f"{name}.json"
        assert run_cli(capsys, "--target", service.target, "encode", "--file", str(tmp_path / name),
                       "--out", str(out))[0] == 0
        outputs = json.loads(out.read_text())["outputs"]
        assert len(outputs) == len(expected), name
        for ids, output in zip(expected, outputs, strict=True):
            np.testing.assert_allclose(output["hidden"], reference_model(np.array(ids))[0], atol=1e-5, rtol=0)


def test_encode_errors_exit_nonzero_and_name_the_field(service: ServerProcess, capsys, tmp_path: Path):
    code, _, err = run_cli(capsys, "--target", service.target, "encode", "--ids", "1", "2", "1000")
    assert code == 1 and "INVALID_ARGUMENT" in err and "sequences[0].token_ids[2]" in err
    assert run_cli(capsys, "--target", service.target, "encode")[0] == 2  # no input
    assert run_cli(capsys, "--target", service.target, "encode", "--file", str(tmp_path / "missing.json"))[0] == 2


def test_info(service: ServerProcess, capsys):
    code, out, _ = run_cli(capsys, "info", "--target", service.target)
    assert code == 0
    fields = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert (fields["name"], fields["d_model"], fields["n_layers"], fields["vocab_size"]) == ("tiny", "32", "2", "100")
    assert fields["limits.max_message_bytes"] == str(64 << 20)
    # The test server pins precision (tests/support/server_process.py PINNED) and sets the budget itself.
    assert (fields["precision_reason"], fields["batch.max_batch_tokens"], fields["batch.reason"]) == (
        "configured", "2048", "configured")
    assert (fields["batch.model_workers"], fields["batch.workers_reason"]) == ("2", "configured")
    code, out, _ = run_cli(capsys, "info", "--target", service.target, "--json")
    assert code == 0 and json.loads(out)["limits"]["max_attention_bytes"] > 0


def test_health_probe_exit_codes(service: ServerProcess, unused_port: int):
    ok = run_module("client.health", "--target", service.target)
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING")
    live = run_module("client", "--target", service.target, "health", "--service", "")
    assert (live.returncode, live.stdout.strip()) == (0, "SERVING")
    unknown = run_module("client.health", "--target", service.target, "--service", "nope")
    assert (unknown.returncode, unknown.stdout.strip()) == (1, "SERVICE_UNKNOWN")
    down = run_module("client.health", "--target", f"127.0.0.1:{unused_port}", "--timeout", "5")
    assert down.returncode == 1 and down.stdout.startswith("UNAVAILABLE")
    assert len(down.stdout.strip().splitlines()) == 1


def test_plot_writes_a_png_heatmap(service: ServerProcess, capsys, tmp_path: Path):
    import matplotlib.image

    out = tmp_path / "attention.png"
    code, stdout, _ = run_cli(capsys, "--target", service.target, "plot", "--ids", "5", "17", "42", "8", "99", "3",
                              "--layer", "-1", "--head", "2", "--out", str(out))
    assert code == 0 and "layer 1, head 2" in stdout
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(out)
    assert image.shape[0] >= 300 and image.shape[1] >= 300
    assert image[..., :3].std() > 0.05  # not a blank canvas

    mean = tmp_path / "mean.png"
    long_ids = [str(i) for i in range(60)]
    assert run_cli(capsys, "--target", service.target, "plot", "--ids", *long_ids, "--out", str(mean))[0] == 0
    assert mean.read_bytes()[:8] == PNG_SIGNATURE
    assert run_cli(capsys, "--target", service.target, "plot", "--ids", "1", "--head", "9", "--out", str(mean))[0] == 2


def test_bench_writes_a_json_report(service: ServerProcess, capsys, tmp_path: Path):
    before = service.sample("attention_sequences_total")
    report_path = tmp_path / "bench.json"
    code, out, _ = run_cli(capsys, "--target", service.target, "bench", "--requests", "50", "--concurrency", "4",
                           "--lengths", "8:32", "--seed", "1", "--no-progress", "--json", str(report_path))
    assert code == 0
    assert "Latency (ms):" in out and "p99" in out and "Errors by code: none" in out
    report = json.loads(report_path.read_text())
    assert {"requests", "ok", "errors", "sequences_per_s", "tokens_per_s", "latency_ms", "server", "client_cpu",
            "concurrency", "duration_s"} <= set(report)
    assert report["errors"] == {} and report["requests"] == report["ok"] == report["sequences"] == 50
    assert 50 * 8 <= report["tokens"] <= 50 * 32
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    server = report["server"]
    assert server["batch_size"] >= 1 and server["padded_length"] >= 8 and server["padding_ratio"] >= 1
    assert server["compute_ms"] > 0 and report["client_cpu_s"] >= 0
    assert report["lengths"] == [8, 32] and report["concurrency"] == 4
    assert service.sample("attention_sequences_total") - before == 50  # no warm-up asked: every call was measured


def test_bench_over_encode_stream(service: ServerProcess, capsys, tmp_path: Path):
    before = service.sample("attention_sequences_total")
    report_path = tmp_path / "bench.json"
    code, out, _ = run_cli(capsys, "--target", service.target, "bench", "--stream", "--requests", "60",
                           "--concurrency", "8", "--connections", "2", "--lengths", "8:32", "--no-progress",
                           "--json", str(report_path))
    assert code == 0, out
    assert "over EncodeStream" in out and "Errors by code: none" in out
    report = json.loads(report_path.read_text())
    assert report["stream"] is True and report["errors"] == {} and report["ok"] == report["sequences"] == 60
    assert report["server"]["batch_size"] >= 1 and report["latency_ms"]["p50"] > 0
    assert service.sample("attention_sequences_total") - before == 60


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bench_counts_refused_requests_by_code(service: ServerProcess, stream: bool):
    # Nothing to return (no hidden states, no pooling, no attention): every request is INVALID_ARGUMENT,
    # an RPC status on Encode, a per-request error on EncodeStream; the stream itself lives on.
    from client.load import run_load

    report = asyncio.run(run_load(service.target, concurrency=3, max_requests=12, duration_s=None,
                                  return_hidden=False, pooling="none", stream=stream))
    assert report.errors == {"INVALID_ARGUMENT": 12} and report.ok == 0 and report.requests == 12


def test_bench_refuses_unbounded_or_oversized_runs(service: ServerProcess, capsys):
    assert run_cli(capsys, "--target", service.target, "bench", "--duration", "601")[0] == 2
    assert run_cli(capsys, "--target", service.target, "bench", "--requests", "0")[0] == 2
    assert run_cli(capsys, "--target", service.target, "bench", "--requests", "5", "--lengths", "9:3")[0] == 2


def test_plot_entropy_per_layer_and_head_matches_the_models_own_diagnostics(service: ServerProcess, tiny_bundle,
                                                                            capsys, tmp_path: Path):
    import matplotlib.image
    import torch

    from model.bundle import load_bundle

    ids = [5, 17, 42, 8, 99, 3, 61]
    out = tmp_path / "entropy.png"
    code, stdout, _ = run_cli(capsys, "--target", service.target, "plot", "--ids", *map(str, ids), "--entropy",
                              "--out", str(out))
    assert code == 0 and out.read_bytes()[:8] == PNG_SIGNATURE
    rows = [line.split(":")[1].split() for line in stdout.splitlines() if line.startswith("entropy layer")]
    per_head = np.array(rows, dtype=np.float64)  # [L, H], from the returned weights, in the client
    assert per_head.shape == (2, 4) and ((per_head > 0) & (per_head < 1)).all()
    # The model's own explicit-path measure averages the same rows over heads.
    with torch.inference_mode():
        stats = load_bundle(tiny_bundle).module.diagnostics(torch.tensor([ids]), None, torch.tensor([len(ids)]), False)
    np.testing.assert_allclose(per_head.mean(axis=1), stats[0, :, 1].numpy(), atol=2e-3)  # printed to 3 digits
    image = matplotlib.image.imread(out)
    assert image.shape[1] > image.shape[0]  # the entropy panel beside the heatmap


def test_entropy_per_head_extremes():
    from client.entropy import entropy_per_head

    T = 5
    uniform = np.full((1, 2, T, T), 1.0 / T)
    one_hot = np.broadcast_to(np.eye(T), (1, 2, T, T))
    np.testing.assert_allclose(entropy_per_head(uniform), 1.0)
    np.testing.assert_allclose(entropy_per_head(one_hot), 0.0)
    causal_uniform = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    np.testing.assert_allclose(entropy_per_head(causal_uniform[None, None], causal=True), 1.0)
    assert np.isnan(entropy_per_head(np.ones((1, 1, 1, 1)))).all()
