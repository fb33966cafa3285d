"""Attention entropy from returned attention weights (numpy only): the service's health measure, per head.

The same definition as the service's sampled `attention_entropy_normalized` (model/encoder.py
`attention_stats`), which averages it over heads and queries: a query row's entropy over the keys it may
attend to, divided by log(their number), so 1 = uniform and 0 = one-hot. Rows with fewer than two allowed
keys (a length-1 sequence, a causal first query) have no spread and are left out.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def entropy_per_head(attention: npt.NDArray[np.floating], causal: bool = False) -> npt.NDArray[np.float64]:
    """attention [L, H, T, T] (padding stripped, as returned) -> [L, H]: mean normalised entropy of each
    layer and head over its query rows; NaN when no row has two allowed keys."""
    p = np.asarray(attention, dtype=np.float64)
    T = p.shape[-1]
    allowed = np.arange(1, T + 1) if causal else np.full(T, T)  # keys each query may attend to
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)  # [L, H, T]
        rows = allowed >= 2
        if not rows.any():
            return np.full(p.shape[:2], np.nan)
        normalised = h[..., rows] / np.log(allowed[rows])
    return np.asarray(np.clip(normalised.mean(axis=-1), 0.0, 1.0), dtype=np.float64)
