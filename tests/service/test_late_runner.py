"""Late interaction at the runner (the bundle in process, as the doors will reach it): tiny random-init models in
the three published layouts (tests/support/late_helpers.py), converted by `convert-hf`'s code, tokenized by the
bundle's tokenizer in query / document mode and run by the service's Runner, against

  - the authors' own packages, committed (tests/data/late_reference.*: PyLate 1.6.0 on the PyLate folder and on
    the stanford ColBERT checkpoint, FlagEmbedding 1.4.2 on the BGE-M3 folder; tests/support/late_reference.py
    made them): token ids, ColBERT query and document vectors (query expansion, attended or not, and the skip
    list), MaxSim scores and their ranking, BGE-M3's dense vector, sparse weights (ids and values), ColBERT
    vectors, lexical matching scores and compute_score;
  - the same weights in plain torch (transformers' models, the projection written out in
    tests/support/late_helpers.py), which needs no committed data.
fp32, within 1e-5.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.hf_folder import convert_hf_folder
from model.text import TextTokenizer
from service.jobs import POOL_CLS, Job, Output
from service.runner import Runner
from service.tasks import lexical, m3_scores, maxsim, maxsim_scores, ranked, sparse_entries
from tests.service.test_pipeline import Observed
from tests.support import helpers
from tests.support import late_helpers as L

ATOL = 1e-5


@dataclass
class Served:
    folder: Path
    runner: Runner
    tokenizer: TextTokenizer


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = json.loads((L.DATA / "late_reference.json").read_text(encoding="utf-8"))
    with np.load(L.DATA / "late_reference.npz") as npz:
        return meta, {k: npz[k] for k in npz.files}


def _serve(root: Path, folder: Path) -> Served:
    convert_hf_folder(folder, root / "bundle")
    runner = Runner(helpers.test_config(root / "bundle"), str(root / "bundle"), Observed())
    spec = runner.load()
    assert spec.tokenizer is not None
    return Served(folder, runner, spec.tokenizer)


@pytest.fixture(scope="module")
def pylate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("pylate")
    yield _serve(root, L.write_pylate(root / "hf"))


@pytest.fixture(scope="module")
def stanford(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("stanford")
    yield _serve(root, L.write_stanford(root / "hf"))


@pytest.fixture(scope="module")
def m3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("m3")
    yield _serve(root, L.write_bge_m3(root / "hf"))


def _vectors(served: Served, texts: list[str], mode: str, **job: Any) -> tuple[list[Any], list[Output]]:
    """Encode `texts` in `mode`, run them as one batch; (the Encoded, the Outputs)."""
    encoded = served.tokenizer.encode(texts, truncate=True, mode=mode)
    jobs = [Job(e.ids, None, return_hidden=False, vectors=True, vector_rows=e.vector_rows, attend=e.attend, **job)
            for e in encoded]
    outputs, _ = served.runner.execute(jobs)
    assert all(isinstance(o, Output) for o in outputs), outputs
    return encoded, outputs  # type: ignore[return-value]


def _dense_layers(folder: Path) -> list[tuple[torch.Tensor, torch.Tensor | None, str]]:
    from safetensors.torch import load_file

    layers = []
    for module in json.loads((folder / "modules.json").read_text())[1:]:
        weights = load_file(str(folder / module["path"] / "model.safetensors"))
        act = json.loads((folder / module["path"] / "config.json").read_text())["activation_function"]
        layers.append((weights["linear.weight"], weights.get("linear.bias"), "tanh" if act.endswith("Tanh") else "id"))
    return layers


def _check_colbert(served: Served, name: str, reference: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
    meta, arrays = reference
    ref = meta[name]
    assert L.weights_digest(served.folder) == ref["digest"], "the references were made from other weights"
    q_enc, q_out = _vectors(served, L.QUERIES, "query")
    d_enc, d_out = _vectors(served, L.DOCUMENTS, "document")
    assert [e.ids.tolist() for e in q_enc] == ref["query_ids"]
    assert [e.ids.tolist() for e in d_enc] == ref["document_ids"]
    queries = [o.vectors for o in q_out]
    documents = [o.vectors for o in d_out]
    for i, v in enumerate(queries):
        want = arrays[f"{name}_query_{i}"]
        assert v is not None and v.shape == want.shape and float(np.abs(v - want).max()) <= ATOL, (i, name)
    for i, v in enumerate(documents):
        want = arrays[f"{name}_document_{i}"]
        assert v is not None and v.shape == want.shape and float(np.abs(v - want).max()) <= ATOL, (i, name)
    # The skip list took vectors out: a document has fewer vectors than tokens where it holds punctuation.
    assert any(len(v) < len(e.ids) for v, e in zip(documents, d_enc, strict=True) if v is not None)
    for qi, q in enumerate(queries):
        assert q is not None
        got = maxsim_scores(q, [d for d in documents if d is not None], served.runner.spec.colbert_reduce)  # type: ignore[union-attr]
        assert np.allclose(got, ref["maxsim"][qi], rtol=0, atol=ATOL), (got, ref["maxsim"][qi])
        assert ranked(got, len(got)) == ranked(ref["maxsim"][qi], len(got))


def test_pylate_vectors_and_maxsim_match_pylate(pylate: Served, reference: Any) -> None:
    spec = pylate.runner.spec
    assert spec is not None and spec.vector_dim == 16 and spec.colbert_reduce == "sum" and "colbert" in spec.tasks
    _check_colbert(pylate, "pylate", reference)


def test_pylate_expansion_attended(tmp_path: Path, reference: Any) -> None:
    served = _serve(tmp_path, L.write_pylate(tmp_path / "hf", attend=True))
    enc = served.tokenizer.encode(["the cat"], truncate=True, mode="query")[0]
    assert enc.attend == 0 and len(enc.ids) == 10  # expanded to query_length, every token attended
    _check_colbert(served, "pylate_attend", reference)


def test_stanford_vectors_and_maxsim_match_pylate(stanford: Served, reference: Any) -> None:
    _check_colbert(stanford, "stanford", reference)


def test_colbert_vectors_match_plain_torch(pylate: Served, stanford: Served) -> None:
    """The same weights in transformers' BertModel plus the projection written out: no committed data needed."""
    for served, prefix, seed, layers in (
            (pylate, "", 11, _dense_layers(pylate.folder)),
            (stanford, "bert.", 13, None)):
        multi = served.tokenizer.settings.multi_vector
        assert multi is not None
        model = L.tiny_bert(len(L.LATE_VOCAB) + (2 if not prefix else 0), seed)
        if layers is None:
            from safetensors.torch import load_file

            layers = [(load_file(str(served.folder / "model.safetensors"))["linear.weight"], None, "id")]
        tok = L.hf_tokenizer(served.folder)
        for mode, texts in (("query", L.QUERIES), ("document", L.DOCUMENTS)):
            want = L.colbert_reference(model, layers, tok, texts, marker=multi.marker(mode) or 0,
                                       length=multi.length(mode), query=mode == "query", expansion=True,
                                       attend=multi.attend_expansion, skip=set(multi.skip_ids), pad_id=0)
            _, outputs = _vectors(served, texts, mode)
            for got, w in zip(outputs, want, strict=True):
                assert got.vectors is not None and got.vectors.shape == w.shape
                assert float(np.abs(got.vectors - w).max()) <= ATOL


def test_expansion_in_a_mixed_batch(pylate: Served) -> None:
    """Queries whose expansion is not attended, batched with documents and a plain embedding job (the batch runs
    unpacked), give the vectors they give alone; the plain job's pooled vector is what it is alone."""
    q = pylate.tokenizer.encode(L.QUERIES, truncate=True, mode="query")
    d = pylate.tokenizer.encode(L.DOCUMENTS, truncate=True, mode="document")
    assert any(0 < e.attend < len(e.ids) for e in q)
    plain = Job(d[3].ids, None, pooling=POOL_CLS, return_hidden=False)
    jobs = [Job(e.ids, None, return_hidden=False, vectors=True, vector_rows=e.vector_rows, attend=e.attend)
            for e in (q[0], d[3], q[1], d[2])] + [plain]
    together, _ = pylate.runner.execute(jobs)
    for job, out in zip(jobs, together, strict=True):
        alone, _ = pylate.runner.execute([job])
        assert isinstance(out, Output) and isinstance(alone[0], Output)
        for a, b in ((out.vectors, alone[0].vectors), (out.pooled, alone[0].pooled)):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert float(np.abs(a - b).max()) <= ATOL


def test_bge_m3_dense_sparse_colbert_from_one_forward(m3: Served, reference: Any) -> None:
    meta, arrays = reference
    ref = meta["bge_m3"]
    spec = m3.runner.spec
    assert spec is not None and spec.sparse_kind == "lexical" and spec.colbert_reduce == "mean"
    assert L.weights_digest(m3.folder) == ref["digest"], "the references were made from other weights"
    sides = {}
    for side, texts in (("query", L.M3_QUERIES), ("document", L.M3_DOCUMENTS)):
        encoded, outputs = _vectors(m3, texts, side, head="sparse", pooling=POOL_CLS, normalize=True)
        assert [e.ids.tolist() for e in encoded] == ref[f"{side}_ids"]
        dense = np.stack([o.pooled for o in outputs])  # type: ignore[misc]
        assert float(np.abs(dense - arrays[f"m3_{side}_dense"]).max()) <= ATOL
        for i, out in enumerate(outputs):
            want = arrays[f"m3_{side}_colbert_{i}"]
            assert out.vectors is not None and out.vectors.shape == want.shape
            assert float(np.abs(out.vectors - want).max()) <= ATOL
            assert out.scores is not None
            index, values = sparse_entries(out.scores, 0, 0.0)
            want_lexical = ref[f"{side}_lexical"][i]
            assert sorted(int(k) for k in want_lexical) == index.tolist()
            assert np.allclose(values, [want_lexical[str(k)] for k in index.tolist()], rtol=0, atol=ATOL)
        sides[side] = [(o.pooled, o.scores, o.vectors) for o in outputs]
    assert any(ref["query_lexical"]) and any(len(w) < len(ids) - 2 for w, ids in zip(
        ref["document_lexical"], ref["document_ids"], strict=True))  # weights kept, and some left out
    for qi, q in enumerate(sides["query"]):
        for di, d in enumerate(sides["document"]):
            assert abs(lexical(q[1], d[1]) - ref["lexical_scores"][qi][di]) <= ATOL
            got = m3_scores(q, d, ref["weights"])  # type: ignore[arg-type]
            for mode, value in ref["compute_score"][qi][di].items():
                assert abs(got[mode] - value) <= ATOL, (qi, di, mode, got[mode], value)
            assert abs(maxsim(q[2], d[2], "mean") - got["colbert"]) <= 1e-12


def test_bge_m3_matches_plain_torch(m3: Served) -> None:
    model = L.tiny_xlmr(17)
    colbert = torch.load(m3.folder / "colbert_linear.pt", weights_only=True)
    sparse = torch.load(m3.folder / "sparse_linear.pt", weights_only=True)
    want = L.m3_reference(model, colbert, sparse, L.hf_tokenizer(m3.folder), L.M3_DOCUMENTS, {0, 1, 2, 3})
    _, outputs = _vectors(m3, L.M3_DOCUMENTS, "document", head="sparse", pooling=POOL_CLS, normalize=True)
    for out, (dense, weights, vectors) in zip(outputs, want, strict=True):
        assert out.pooled is not None and float(np.abs(out.pooled - dense).max()) <= ATOL
        assert out.vectors is not None and float(np.abs(out.vectors - vectors).max()) <= ATOL
        assert out.scores is not None
        index, values = sparse_entries(out.scores, 0, 0.0)
        assert index.tolist() == sorted(weights)
        assert np.allclose(values, [weights[i] for i in sorted(weights)], rtol=0, atol=ATOL)


def test_scoring_rules() -> None:
    """maxsim by hand: per query vector its best document vector, summed (or averaged); refusals by name."""
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    d = np.array([[0.5, 0.5], [1.0, 0.0], [0.0, -1.0]])
    assert maxsim(q, d) == pytest.approx(1.0 + 0.5)
    assert maxsim(q, d, "mean") == pytest.approx(0.75)
    with pytest.raises(ValueError, match="both need at least one"):
        maxsim(q, d[:0])
    with pytest.raises(ValueError, match=r"\[q, dim\] and \[d, dim\]"):
        maxsim(q, np.ones((2, 3)))
    a, b = np.zeros(6), np.zeros(6)
    a[[1, 4]], b[[4, 5]] = (0.5, 2.0), (3.0, 1.0)
    assert lexical(a, b) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="weights must be three finite numbers"):
        m3_scores((a, a, q), (b, b, d), (1.0, -1.0, 1.0))
