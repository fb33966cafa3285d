"""bench/gpu_check.py (`make gpu-check`) stays runnable without a GPU: its CPU smoke mode runs every phase
end to end on the TINY preset, and asking for CUDA where there is none exits 2 with a clear message. The
MiniLM phase's pieces run on CPU too: the fp16 copy `make gpu-minilm` writes, its conversion, the exactness
check on MiniLM; the phase itself on a tiny BERT packed the same way; and its absence (not run, not a
failure)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import gpu_minilm
from model.bundle import read_manifest
from tests.support.hf_helpers import MINILM_SHA256, Reference, write_tiny_bert

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "cuda_available: False" in proc.stdout and f"torch: {torch.__version__}" in proc.stdout
    assert "CUDA is not available" in proc.stderr and "--device cpu" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_cpu_smoke_run_reports_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, TMPDIR=str(tmp_path), OUT=str(out))  # $OUT is the default --out
    # A budget that a busy machine cannot use up (the phases end when done: about 2 minutes at load 6 on
    # 2 cores); with 200 s the model phase's share (22%) once ended before its T=64 rows at load 4-9.
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--preset", "tiny",
         "--loadgen-procs", "2", "--duration", "1", "--warmup", "0.5", "--budget-s", "400",
         "--minilm", str(tmp_path / "no-minilm")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=460)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # The summary table comes last (before the line naming the files), after the detail tables.
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("results: ")
    head = lines.index("| check | result | target | verdict |")
    assert all(line.startswith("|") for line in lines[head:-1])
    summary = "\n".join(lines[head:-1])
    for label in ("CUDA tests (tests/gpu/test_gpu.py)", "model T=16", "model T=64", "service T=64, c64, 2 load procs",
                  "phases"):
        assert f"| {label} |" in summary, label
    assert "| phases | tests ok" in summary and "model ok" in summary and "service ok" in summary
    assert f"| all-MiniLM-L6-v2 | not run: no {tmp_path / 'no-minilm' / 'fp16.json'}" in summary
    text = proc.stdout
    assert text.index("Model ceiling") < text.index("Service under load") < text.index("| check | result |")

    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["device"] == "cpu" and results["meta"]["torch"] == torch.__version__
    phases = results["phases"]
    assert {name: p["status"] for name, p in phases.items()} == {"tests": "ok", "model": "ok", "service": "ok"}
    assert results["not_run"] == {"minilm": f"no {tmp_path / 'no-minilm' / 'fp16.json'} (make gpu-minilm writes it)"}
    gpu_tests = phases["tests"]["runs"]["gpu"]
    assert gpu_tests["counts"].get("skipped", 0) > 0 and set(gpu_tests["counts"]) == {"skipped"}  # no CUDA here
    assert "existing" not in phases["tests"]["runs"]  # never the rest of the suite on a CPU
    measured = [r for r in phases["model"]["rows"] if "seq_s" in r]
    assert {r["length"] for r in measured} == {16, 64} and all(r["seq_s"] > 0 for r in measured)
    assert set(phases["model"]["service_path"]) == {"16", "64"}
    choices = phases["service"]["choices"]  # what the defaults chose at warm-up (CPU here: both measured)
    assert choices["precision"] in ("fp32", "bf16", "fp16") and choices["precision_reason"].startswith("measured")
    assert choices["batch_budget"]["reason"].startswith("measured") and choices["batch_budget"]["tokens_per_second"]
    assert f"- precision {choices['precision']}: measured" in text
    assert f"- max_batch_tokens {choices['batch_budget']['max_batch_tokens']}: measured" in text
    runs = phases["service"]["runs"]
    assert {(r["length"], r["concurrency"], r["procs"], r["output"]) for r in runs} == {
        (T, 64, procs, output) for T in (16, 64) for procs, output in ((2, "pooled"), (1, "pooled"), (2, "hidden"))}
    for r in runs:
        assert r["sequences_per_s"] > 0 and r["errors"] == {} and r["ratio"] > 0, r
        assert r["loadgen_cpu"] > 0 and r["latency_ms"]["p99"] >= r["latency_ms"]["p50"] > 0
    assert (out / "results.md").read_text().rstrip().endswith(lines[-2])
    assert {p.name for p in out.iterdir()} == {"results.json", "results.md", "pytest_gpu.log", "server.log"}


def test_the_gpu_wheels_are_the_versions_the_project_pins() -> None:
    """`make gpu-wheels` downloads for the GPU machines exactly the versions requirements*.txt pin (their
    dependencies that gpu-check needs are pinned there too, so a later install cannot drift from them)."""
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    listed = re.search(r"^GPU_WHEELS := (.*)$", makefile, re.M)
    assert listed is not None
    wheels = dict(w.split("==") for w in listed[1].split())
    lines = [line.split("#")[0].strip() for name in ("requirements.txt", "requirements-dev.txt")
             for line in (REPO / name).read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if "==" in line)
    assert {"grpcio", "protobuf", "pytest", "pytest-asyncio", "pytest-timeout"} <= set(wheels)
    for name, pinned in wheels.items():
        assert pins.get(name) == pinned, name
    assert ".whl/" in (REPO / ".gitignore").read_text().splitlines()


@pytest.fixture(scope="module")
def minilm_copy(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-minilm") / "minilm-fp16"
    meta = gpu_minilm.write_fp16_copy(minilm_dir, out)
    assert meta["source_sha256"]["model.safetensors"].startswith("53aa5117") and meta["tensors"] == 104
    return out


def test_the_fp16_copy_is_small_and_unpacks_to_fp16_safetensors(minilm_copy: Path, minilm_dir: Path,
                                                                 tmp_path: Path) -> None:
    from safetensors.torch import load_file

    size = sum(p.stat().st_size for p in minilm_copy.rglob("*") if p.is_file())
    assert size < 40 * 2**20  # fp32 weights alone are 87 MB; fp16 45 MB before the byte shuffle and deflate
    assert {p.relative_to(minilm_copy).as_posix() for p in minilm_copy.rglob("*") if p.is_file()} == {
        *gpu_minilm.FILES, gpu_minilm.PACKED, gpu_minilm.META}
    hf = gpu_minilm.unpack(minilm_copy, tmp_path / "hf")
    got, original = load_file(str(hf / "model.safetensors")), load_file(str(minilm_dir / "model.safetensors"))
    assert got.keys() == original.keys()
    for key, value in original.items():
        if value.is_floating_point():
            assert got[key].dtype == torch.float16 and torch.equal(got[key], value.half()), key
        else:
            assert torch.equal(got[key], value), key  # the int64 position ids stay as they are
    assert (hf / "tokenizer.json").read_bytes() == (minilm_dir / "tokenizer.json").read_bytes()


def test_a_corrupt_copy_or_another_model_is_refused(minilm_copy: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(minilm_copy, bad)
    meta = json.loads((bad / gpu_minilm.META).read_text())
    (bad / gpu_minilm.META).write_text(json.dumps({**meta, "fp16_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="fail their checksum"):
        gpu_minilm.unpack(bad, tmp_path / "hf")
    with pytest.raises(ValueError, match="not the genuine model"):
        gpu_minilm.write_fp16_copy(write_tiny_bert(tmp_path / "tiny"), tmp_path / "out")


@pytest.fixture(scope="module")
def fp16_bundle(minilm_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_minilm.convert(minilm_copy, tmp_path_factory.mktemp("bundles") / "minilm-fp16")


def test_the_copy_converts_to_an_fp32_text_bundle(fp16_bundle: Path, minilm_bundle: Path) -> None:
    got, original = read_manifest(fp16_bundle), read_manifest(minilm_bundle)
    assert got.dtype == "float32" and got.config == original.config and got.text == original.text
    assert got.source == "hf:all-MiniLM-L6-v2/model.safetensors"
    assert got.weights_sha256 != original.weights_sha256  # the weights went through fp16


@pytest.mark.timeout(400)  # MiniLM in fp32, fp16 and bf16 on CPU: past the default 120 s on a busy machine
def test_exactness_on_cpu_against_the_references(fp16_bundle: Path, minilm_reference: Reference) -> None:
    """fp16 weights in an fp32 model keep cosine >= 0.99999 (measured 0.9999991 on CPU); fp16 and bf16 compute
    stay within what tests/model/test_model_hf.py bounds for the original weights."""
    fp32 = gpu_minilm.exactness(fp16_bundle, "cpu", "fp32", minilm_reference)
    assert fp32["texts"] == len(minilm_reference.texts) >= 20
    for forward in ("single", "batch"):
        assert fp32[forward]["min_cosine"] >= gpu_minilm.FP32_MIN_COSINE, fp32
        assert fp32[forward]["max_abs"] < 1e-3 and fp32[forward]["hidden_rel"] < 2e-3, fp32
    half = gpu_minilm.exactness(fp16_bundle, "cpu", "fp16", minilm_reference)
    bf16 = gpu_minilm.exactness(fp16_bundle, "cpu", "bf16", minilm_reference)
    assert half["single"]["min_cosine"] >= 0.99999 and bf16["single"]["min_cosine"] >= 0.9995, (half, bf16)
    assert bf16["single"]["max_abs"] > half["single"]["max_abs"] > 0
    # The check can fail: against references one text out of place, the cosine drops far below the bound
    # (on the first three texts: the forwards of all 25 once more would only cost time).
    three = replace(minilm_reference, texts=minilm_reference.texts[:3], ids=minilm_reference.ids[:3],
                    hidden_rows=minilm_reference.hidden_rows[:3], hidden=minilm_reference.hidden[:3],
                    embeddings=minilm_reference.embeddings[:3])
    shifted = replace(three, embeddings=np.roll(three.embeddings, 1, axis=0))
    assert gpu_minilm.exactness(fp16_bundle, "cpu", "fp32", three)["single"]["min_cosine"] >= 0.99999
    assert gpu_minilm.exactness(fp16_bundle, "cpu", "fp32", shifted)["single"]["min_cosine"] < 0.9


TINY_TEXTS = ["a cat", "the cats .", "a b c", "cat", "the cat a b c .", "b", "c c c c c c"]


def tiny_reference(copy: Path, tmp: Path) -> Reference:
    """What the phase's exactness compares against for a tiny BERT's copy: transformers' BertModel on the
    copy's fp16 weights in fp32, mean-pooled over every token and normalised (as sentence-transformers)."""
    import torch.nn.functional as F
    import transformers
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    hf = gpu_minilm.unpack(copy, tmp / "hf")
    config = transformers.BertConfig(**json.loads((hf / "config.json").read_text()))
    config._attn_implementation = "eager"
    model = transformers.BertModel(config).eval()
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(hf / "model.safetensors")).items()}
    missing, _ = model.load_state_dict(state, strict=False)
    assert not missing, missing
    tokenizer = Tokenizer.from_str((hf / "tokenizer.json").read_text())
    ids = [tokenizer.encode(text).ids for text in TINY_TEXTS]
    with torch.inference_mode():
        hidden = [model(input_ids=torch.tensor([i])).last_hidden_state[0] for i in ids]  # each [T, C]
    embeddings = torch.stack([F.normalize(h.mean(dim=0), dim=0) for h in hidden]).numpy()
    return Reference(TINY_TEXTS, ids, [list(range(len(i))) for i in ids], embeddings, [h.numpy() for h in hidden])


@pytest.mark.slow
def test_the_minilm_phase_runs_on_cpu(tmp_path: Path) -> None:
    """The phase end to end (fp16 copy, conversion, exactness in three precisions, the in-process ceiling,
    a real service under text and id load, the tables) on a tiny BERT packed as `make gpu-minilm` packs
    MiniLM, against that model's own references: MiniLM itself costs a minute and a half of CPU here, and
    its pieces are checked on CPU above (its copy, conversion and exactness) and on the GPU by gpu-check."""
    source = write_tiny_bert(tmp_path / "tiny-bert")
    pins = {name: hashlib.sha256((source / name).read_bytes()).hexdigest() for name in MINILM_SHA256}
    copy = tmp_path / "tiny-fp16"
    gpu_minilm.write_fp16_copy(source, copy, pins=pins)
    args = argparse.Namespace(device="cpu", precision="fp32", max_batch_tokens=2048, loadgen_procs=2, duration=1.0,
                              warmup=0.5, quick=True, out=tmp_path / "out", minilm=copy)
    record: dict[str, object] = {}
    record.update(gpu_minilm.phase_minilm(args, time.monotonic() + 240, record, tiny_reference(copy, tmp_path)))
    assert record["status"] == "ok", record
    checks = record["exactness"]
    assert isinstance(checks, list) and [(c["device"], c["precision"]) for c in checks] == [
        ("cpu", "fp32"), ("cpu", "fp16"), ("cpu", "bf16")]
    runs = record["runs"]
    assert isinstance(runs, list)
    assert [(r["kind"], r["concurrency"], r["procs"]) for r in runs] == [
        ("text", 64, 2), ("calls", 64, 2), ("calls", 256, 2), ("text", 16, 2), ("text", 1, 1)]
    for r in runs:
        assert r["sequences_per_s"] > 0 and r["errors"] == {}, r
        assert ("ratio" in r) == (r["kind"] == "text") and r.get("ratio", 1) > 0
    assert (args.out / "minilm" / "server.log").is_file()
    table = "\n".join(gpu_minilm.minilm_table(record))
    assert "| cpu | fp32 | batch |" in table and "| 16 tokens, calls/s | 256 | 2 |" in table
    rows = gpu_minilm.summary_rows(record, None)
    assert ("MiniLM cpu fp32 exactness" in rows[0][0] and rows[0][3] == "PASS"
            and [r[0] for r in rows[3:]] == ["MiniLM text c64", "MiniLM calls c64", "MiniLM calls c256",
                                              "MiniLM text c16", "MiniLM text c1"])
