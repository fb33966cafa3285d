"""A head task's answer from its logits, door-neutral (numpy only), as Text Embeddings Inference computes it:

  classify (TEI /predict)  per label: softmax over the labels; sigmoid for multi_label_classification and for
                           a one-label head; the logits themselves with raw_scores
  sparse   (TEI /embed_sparse) a SPLADE vector's entries above the threshold, the top_k largest (0: all),
                           indices ascending
  rerank   (TEI /rerank)   per text: sigmoid(logit) (raw_scores: the logit), ranked by score, highest first,
                           ties in the texts' order; the first top_n

The logits are each sequence's `Output.scores` (service/runner.py runs the head of model/heads.py).

Late interaction, from each sequence's `Output.vectors` (unit token vectors: the query encoded as a query,
each text as a document, model/text.py encode(mode=...)) and, for BGE-M3, its pooled dense vector and its
sparse weights (`Output.scores` of the "sparse" head, a [vocab] vector):
  maxsim        ColBERT's late interaction: per query vector, its best dot product with the document's
                vectors, summed over the query vectors (ColBERT, PyLate: reduce "sum") or averaged (BGE-M3's
                colbert_score: reduce "mean", ModelSpec.colbert_reduce)
  lexical       BGE-M3's lexical matching score: the sum over the token ids both have of the product of their
                weights (FlagEmbedding's compute_lexical_matching_score)
  m3_scores     BGE-M3's compute_score: dense (dot of the normalised vectors), sparse, colbert and the weighted
                sums "sparse+dense" (w_dense, w_sparse) and "colbert+sparse+dense" (w_dense, w_sparse,
                w_colbert), each divided by its weights' sum (default weights 1, 1, 1)
Scores are computed in float64 and returned as Python floats; `ranked` orders them as for a cross-encoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def label_scores(logits: np.ndarray, problem_type: str, raw: bool) -> np.ndarray:
    """float32 [n_labels] scores of one sequence's logits (module docstring)."""
    x = np.asarray(logits, dtype=np.float64)
    if raw:
        return x.astype(np.float32)
    if problem_type == "multi_label_classification" or x.shape[-1] == 1:
        return np.asarray(1.0 / (1.0 + np.exp(-x)), dtype=np.float32)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return np.asarray(e / e.sum(axis=-1, keepdims=True), dtype=np.float32)


def rerank_scores(logits: Sequence[np.ndarray], raw: bool) -> list[float]:
    """One score per text: its one logit, through a sigmoid unless `raw`."""
    x = np.asarray([float(np.asarray(row).reshape(-1)[0]) for row in logits], dtype=np.float64)
    out = x if raw else 1.0 / (1.0 + np.exp(-x))
    return [float(v) for v in np.asarray(out, dtype=np.float32)]


def ranked(scores: Sequence[float], top_n: int) -> list[int]:
    """Indices of the `top_n` highest scores, highest first; equal scores keep the texts' order."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]


def sparse_entries(weights: np.ndarray, top_k: int, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """(indices int32, values float32) of a dense [vocab] SPLADE vector: entries > threshold, the top_k largest
    of them when top_k > 0 (ties: the lower index), indices ascending."""
    w = np.asarray(weights, dtype=np.float32)
    index = np.flatnonzero(w > threshold)
    if top_k and len(index) > top_k:
        order = np.lexsort((index, -w[index]))[:top_k]  # by value descending, then index ascending
        index = np.sort(index[order])
    return index.astype(np.int32), w[index]


M3_MODES = ("dense", "sparse", "colbert", "sparse+dense", "colbert+sparse+dense")  # BGE-M3 compute_score's keys


def maxsim(query: np.ndarray, document: np.ndarray, reduce: str = "sum") -> float:
    """ColBERT's MaxSim of a query's token vectors [q, dim] against a document's [d, dim] (module docstring).
    ValueError for a side without vectors or vectors of other widths (the published layouts always give the
    first token, the marker or the last token a vector)."""
    q, d = np.asarray(query, dtype=np.float64), np.asarray(document, dtype=np.float64)
    if q.ndim != 2 or d.ndim != 2 or q.shape[1] != d.shape[1]:
        raise ValueError(f"maxsim needs [q, dim] and [d, dim] vectors, got {list(q.shape)} and {list(d.shape)}")
    if not len(q) or not len(d):
        raise ValueError(f"maxsim of {len(q)} query and {len(d)} document vectors: both need at least one")
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce must be sum or mean, got {reduce!r}")
    best = (q @ d.T).max(axis=1)  # (q,): each query vector's best document vector
    return float(best.sum() if reduce == "sum" else best.mean())


def maxsim_scores(query: np.ndarray, documents: Sequence[np.ndarray], reduce: str = "sum") -> list[float]:
    """maxsim of one query against each document, in the documents' order."""
    return [maxsim(query, d, reduce) for d in documents]


def lexical(query: np.ndarray, document: np.ndarray) -> float:
    """BGE-M3's lexical matching score of two [vocab] sparse weight vectors (their dot product: only the ids
    both have count)."""
    a, b = np.asarray(query, dtype=np.float64).reshape(-1), np.asarray(document, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"lexical needs two [vocab] vectors of one size, got {list(a.shape)} and {list(b.shape)}")
    return float(a @ b)


def m3_scores(query: tuple[np.ndarray, np.ndarray, np.ndarray], document: tuple[np.ndarray, np.ndarray, np.ndarray],
              weights: Sequence[float] = (1.0, 1.0, 1.0)) -> dict[str, float]:
    """BGE-M3's compute_score for one (query, document) pair, each (dense [dim], sparse [vocab], colbert
    [n, dim]): the five scores of M3_MODES, weights (w_dense, w_sparse, w_colbert) as FlagEmbedding's
    weights_for_different_modes. ValueError for weights that are not three finite numbers >= 0 with the sums
    it divides by above 0."""
    w = [float(x) for x in weights]
    if len(w) != 3 or not all(np.isfinite(x) and x >= 0 for x in w) or w[0] + w[1] <= 0:
        raise ValueError(f"weights must be three finite numbers >= 0 (dense, sparse, colbert), dense + sparse > 0; "
                         f"got {list(weights)}")
    dense = float(np.asarray(query[0], np.float64) @ np.asarray(document[0], np.float64))
    sparse = lexical(query[1], document[1])
    colbert = maxsim(query[2], document[2], "mean")
    return {"dense": dense, "sparse": sparse, "colbert": colbert,
            "sparse+dense": (w[1] * sparse + w[0] * dense) / (w[1] + w[0]),
            "colbert+sparse+dense": (w[2] * colbert + w[1] * sparse + w[0] * dense) / sum(w)}


def late_scores(outputs: Sequence[Any], scoring: str, weights: Sequence[float], reduce: str) -> list[float]:
    """A late-interaction rerank's scores, one per text: `outputs` are the texts' (encoded as documents) and,
    last, the query's (service/plan.py `plan_late_rerank`), each with its token vectors (and for BGE-M3's other
    modes its dense and sparse vectors); `scoring` "" is MaxSim with the model's `reduce`, else one of M3_MODES."""
    *documents, query = outputs
    if not scoring:
        return maxsim_scores(query.vectors, [d.vectors for d in documents], reduce)
    q = (query.pooled, query.scores, query.vectors)
    if scoring == "colbert":  # BGE-M3's colbert score alone: MaxSim averaged over the query's vectors
        return [maxsim(query.vectors, d.vectors, "mean") for d in documents]
    return [m3_scores(q, (d.pooled, d.scores, d.vectors), weights)[scoring] for d in documents]
