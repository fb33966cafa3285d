"""A head task's answer from its logits, door-neutral (numpy only), as Text Embeddings Inference computes it:

  classify (TEI /predict)  per label: softmax over the labels; sigmoid for multi_label_classification and for
                           a one-label head; the logits themselves with raw_scores
  sparse   (TEI /embed_sparse) a SPLADE vector's entries above the threshold, the top_k largest (0: all),
                           indices ascending
  rerank   (TEI /rerank)   per text: sigmoid(logit) (raw_scores: the logit), ranked by score, highest first,
                           ties in the texts' order; the first top_n

The logits are each sequence's `Output.scores` (service/runner.py runs the head of model/heads.py).
"""

from __future__ import annotations

from collections.abc import Sequence

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
