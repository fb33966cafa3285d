"""Writes tests/data/late_reference.{json,npz}: the authors' own packages run on the tiny late-interaction folders
of tests/support/late_helpers.py (seeded weights; `weights_digest` recorded so the tests know they compare the
same weights). Not part of the suite, and none of these packages is a dependency of the project: run it in a
throwaway venv that has them (the shared venv's torch on its path), from the repository root:

  python -m venv /tmp/lateref && echo "$PWD/.venv/lib/python3.11/site-packages" \
      > /tmp/lateref/lib/python3.11/site-packages/shared.pth
  /tmp/lateref/bin/pip install --no-deps pylate==1.6.0 sentence-transformers==5.3.0 transformers==5.3.0 \
      tokenizers==0.22.2 huggingface-hub==1.3.0 flagembedding==1.4.2 (and the pure-Python packages they import)
  /tmp/lateref/bin/python -m tests.support.late_reference

  pylate      PyLate's ColBERT on the PyLate folder (attend_to_expansion_tokens false and true) and on the stanford
              ColBERT checkpoint (PyLate reads HF_ColBERT, linear and artifact.metadata); encode(is_query=True /
              False) and pylate.scores.colbert_scores per (query, document)
  bge-m3      FlagEmbedding's BGEM3FlagModel: encode(return_dense, return_sparse, return_colbert_vecs) and
              compute_score per pair (one pair a call: a batch pads shorter passages' ColBERT vectors with
              zeros, which its max then sees), weights [0.4, 0.2, 0.4]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tests.support import late_helpers as L

M3_WEIGHTS = [0.4, 0.2, 0.4]


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("pylate", "sentence-transformers", "transformers", "tokenizers", "torch",
                                       "FlagEmbedding")}


def _colbert(folder: Path, name: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    import torch
    from pylate import models, scores

    model = models.ColBERT(str(folder), device="cpu")
    q = model.encode(L.QUERIES, is_query=True, batch_size=3)
    d = model.encode(L.DOCUMENTS, is_query=False, batch_size=3)
    for i, v in enumerate(q):
        arrays[f"{name}_query_{i}"] = np.asarray(v, np.float32)
    for i, v in enumerate(d):
        arrays[f"{name}_document_{i}"] = np.asarray(v, np.float32)
    maxsim = [[float(scores.colbert_scores(torch.from_numpy(qv)[None], torch.from_numpy(dv)[None])[0, 0])
               for dv in d] for qv in q]
    query_ids = [model.tokenize([t], is_query=True)["input_ids"][0].tolist() for t in L.QUERIES]
    document_ids = [model.tokenize([t], is_query=False)["input_ids"][0].tolist() for t in L.DOCUMENTS]
    return {"digest": L.weights_digest(folder), "maxsim": maxsim, "query_ids": query_ids, "document_ids": document_ids,
            "skiplist": sorted(set(model.skiplist)), "attend_to_expansion_tokens": model.attend_to_expansion_tokens}


def _m3(folder: Path, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    from FlagEmbedding import BGEM3FlagModel

    model = BGEM3FlagModel(str(folder), use_fp16=False, devices="cpu")
    out: dict[str, Any] = {"digest": L.weights_digest(folder)}
    for side, texts in (("query", L.M3_QUERIES), ("document", L.M3_DOCUMENTS)):
        enc = model.encode(texts, batch_size=3, max_length=38, return_dense=True, return_sparse=True,
                           return_colbert_vecs=True)
        arrays[f"m3_{side}_dense"] = np.asarray(enc["dense_vecs"], np.float32)
        for i, v in enumerate(enc["colbert_vecs"]):
            arrays[f"m3_{side}_colbert_{i}"] = np.asarray(v, np.float32)
        out[f"{side}_lexical"] = [{k: float(v) for k, v in w.items()} for w in enc["lexical_weights"]]
        out[f"{side}_ids"] = [model.tokenizer(t, truncation=True, max_length=38)["input_ids"] for t in texts]
    out["lexical_scores"] = [[float(model.compute_lexical_matching_score(q, d)) for d in out["document_lexical"]]
                             for q in out["query_lexical"]]
    out["weights"] = M3_WEIGHTS
    out["compute_score"] = [
        [{k: float(v[0]) for k, v in model.compute_score([(q, d)], batch_size=1, max_query_length=38,
                                                      max_passage_length=38,
                                                      weights_for_different_modes=M3_WEIGHTS).items()}
         for d in L.M3_DOCUMENTS] for q in L.M3_QUERIES]
    return out


def main() -> int:
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"made_by": "python -m tests.support.late_reference (its docstring)",
                            "versions": _versions(), "queries": L.QUERIES, "documents": L.DOCUMENTS,
                            "m3_queries": L.M3_QUERIES, "m3_documents": L.M3_DOCUMENTS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        meta["pylate"] = _colbert(L.write_pylate(root / "pylate"), "pylate", arrays)
        meta["pylate_attend"] = _colbert(L.write_pylate(root / "pylate-attend", attend=True), "pylate_attend", arrays)
        meta["stanford"] = _colbert(L.write_stanford(root / "stanford"), "stanford", arrays)
        meta["bge_m3"] = _m3(L.write_bge_m3(root / "m3"), arrays)
    L.DATA.mkdir(exist_ok=True)
    (L.DATA / "late_reference.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    np.savez_compressed(L.DATA / "late_reference.npz", **arrays)
    print(f"wrote {L.DATA / 'late_reference.json'} and .npz ({len(arrays)} arrays)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
