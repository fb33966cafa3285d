"""A head task's answer from its logits, door-neutral (numpy only), as Text Embeddings Inference computes it:

  classify (TEI /predict)  per label: softmax over the labels; sigmoid for multi_label_classification and for
                           a one-label head; the logits themselves with raw_scores
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
