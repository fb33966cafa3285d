"""`python -m client rerank`, `classify` and `encode --sparse` against real servers on 127.0.0.1:0 serving tiny
random-init Hugging Face heads: what they print equals the library's answers; usage errors exit 2 before any call,
server refusals exit 1 naming the flag."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import EncoderClient
from client.cli import main
from tests.support.head_helpers import BERT_LABELS, sparse_bundle

QUERY = "the cat"
PASSAGES = ["a cat .", "the the the c", "b", "cats a cats"]


@pytest.fixture
def classifier(bert_classifier: tuple[Path, Path, Any]) -> Path:
    return bert_classifier[0]  # tests/conftest.py


@pytest.fixture
def reranker(bert_reranker: tuple[Path, Path, Any]) -> Path:
    return bert_reranker[0]  # tests/conftest.py


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The command in a thread: the in-process server runs on this test's event loop."""
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_rerank_prints_the_librarys_ranking(start_server: Any, reranker: Path, capsys: Any,
                                                  tmp_path: Path) -> None:
    served = await start_server(bundle=reranker)
    async with EncoderClient(served.target) as c:
        want = await c.rerank(QUERY, PASSAGES, return_text=True)
    (tmp_path / "texts.txt").write_text("\n".join(PASSAGES[2:]) + "\n\n", encoding="utf-8")
    args = ["--target", served.target, "rerank", "--query", QUERY, "--text", PASSAGES[0], "--text", PASSAGES[1],
            "--file", str(tmp_path / "texts.txt")]
    code, out, _ = await run_cli(capsys, *args, "--json")
    assert code == 0, out
    assert [(r["index"], r["score"], r["text"]) for r in json.loads(out)] == [(r.index, r.score, r.text) for r in want]
    code, out, _ = await run_cli(capsys, *args, "--top-n", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["rank", "index", "score", "text"] and len(lines) == 3
    for rank, (line, r) in enumerate(zip(lines[1:], want, strict=False)):
        assert line.split()[:3] == [str(rank), str(r.index), f"{r.score:.6f}"] and line.endswith(r.text or "")
    code, _, err = await run_cli(capsys, *args, "--top-n", "0")
    assert code == 1 and err.startswith("error: INVALID_ARGUMENT: ") and "--top-n" in err and "top_n" not in err, err
    code, _, err = await run_cli(capsys, "--target", served.target, "rerank", "--query", QUERY)
    assert code == 2 and "--text" in err, err


async def test_classify_prints_the_librarys_scores(start_server: Any, classifier: Path, capsys: Any) -> None:
    served = await start_server(bundle=classifier)
    async with EncoderClient(served.target) as c:
        texts = await c.classify(PASSAGES[:2])
        pairs = await c.classify([(QUERY, p) for p in PASSAGES[:2]], raw_scores=True)
    base = ["--target", served.target, "classify"]
    code, out, _ = await run_cli(capsys, *base, "--text", PASSAGES[0], "--text", PASSAGES[1], "--json")
    assert code == 0, out
    assert [(r["scores"], r["label"]) for r in json.loads(out)] == [(r.scores, r.label) for r in texts]
    code, out, _ = await run_cli(capsys, *base, "--pair", QUERY, PASSAGES[0], "--pair", QUERY, PASSAGES[1],
                                 "--raw-scores")
    assert code == 0, out
    lines = out.splitlines()
    for i, r in enumerate(pairs):
        assert lines[2 * i] == f"input {i}: {r.label}"
        assert lines[2 * i + 1].split() == [w for label in BERT_LABELS for w in (label, f"{r.scores[label]:.6f}")]
    code, _, err = await run_cli(capsys, *base, "--text", "a", "--pair", "a", "b")
    assert code == 2 and "not both" in err, err
    code, _, err = await run_cli(capsys, *base, "--text", "the cat " * 20)
    assert code == 1 and "INVALID_ARGUMENT" in err and "--truncate" in err, err


async def test_encode_sparse_and_a_model_without_the_head(start_server: Any, tiny_text_bundle: Path,
                                                          tmp_path_factory: pytest.TempPathFactory, capsys: Any,
                                                          tmp_path: Path) -> None:
    served = await start_server(bundle=sparse_bundle(tmp_path_factory)[0])
    async with EncoderClient(served.target) as c:
        want = await c.encode(["the cat"], sparse=True, return_hidden=False, pooling="none")
    base = ["--target", served.target, "encode", "--text", "the cat", "--no-hidden", "--pooling", "none"]
    code, out, _ = await run_cli(capsys, *base, "--sparse")
    assert code == 0, out
    assert f"  sparse    {len(want.sparse[0])} entries" in out
    top = int(want.sparse[0].indices[np.argmax(want.sparse[0].values)])
    assert f"[{top}:{want.sparse[0].values.max():.4f}, " in out  # the largest entry first
    code, out, _ = await run_cli(capsys, *base, "--sparse-top-k", "2", "--out", str(tmp_path / "s.npz"))
    assert code == 0, out
    saved = np.load(tmp_path / "s.npz")
    assert saved["sparse_indices"].tolist() == sorted(want.sparse[0].indices[np.argsort(-want.sparse[0].values)[:2]])
    code, out, _ = await run_cli(capsys, *base, "--sparse", "--out", str(tmp_path / "s.json"))
    assert code == 0, out
    entry = json.loads((tmp_path / "s.json").read_text())["outputs"][0]["sparse"]
    assert entry == {"indices": want.sparse[0].indices.tolist(), "values": want.sparse[0].values.tolist()}
    plain = await start_server(bundle=tiny_text_bundle)
    code, _, err = await run_cli(capsys, "--target", plain.target, "encode", "--text", "a", "--sparse")
    assert code == 1 and "INVALID_ARGUMENT" in err and "--sparse" in err and "output.sparse" not in err, err
    code, _, err = await run_cli(capsys, "--target", plain.target, "rerank", "--query", "a", "--text", "b")
    assert code == 1 and "'rerank'" in err, err
    code, out, _ = await run_cli(capsys, "--target", plain.target, "info")
    assert code == 0 and "tasks" in out and "labels" not in out, out
