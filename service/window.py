"""Which batch to form from a length-sorted pool: the window that does the most real work per cost.

Pure policy (numpy only), kept apart from the batcher's queue and thread mechanics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class WindowLimits(Protocol):
    """What the policy reads of service.batcher.BatchLimits."""

    @property
    def max_batch_tokens(self) -> int: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def batch_overhead_tokens(self) -> int: ...


def choose_window(lengths: Sequence[int], limits: WindowLimits, anchor: int | None) -> tuple[int, int]:
    """Given lengths sorted ascending, the [lo, hi] window to batch (inclusive).

    Every window within the size and token limits (all padded to lengths[hi]) is scored by real
    tokens / (padded tokens + batch_overhead_tokens); the best wins, ties going to more real tokens.
    With `anchor`, only windows that contain it are considered. Vectorised: n x max_batch_size cells.
    """
    n = len(lengths)
    length = np.asarray(lengths, dtype=np.int64)
    prefix = np.concatenate(([0], np.cumsum(length)))
    hi = np.arange(n)[:, None]  # (n, 1)
    size = np.arange(1, min(limits.max_batch_size, n) + 1)[None, :]  # (1, k)
    lo = hi - size + 1  # (n, k)
    padded = size * length[:, None]  # (n, k)
    valid = (lo >= 0) & (padded <= limits.max_batch_tokens)
    if anchor is not None:
        valid &= (lo <= anchor) & (hi >= anchor)
    real = prefix[hi + 1] - prefix[np.clip(lo, 0, None)]  # (n, k)
    score = np.where(valid, real / (padded + limits.batch_overhead_tokens) + real * 1e-12, -1.0)
    best = int(np.argmax(score))
    if score.flat[best] < 0:  # nothing fits the budget (one item longer than it): run one alone
        one = 0 if anchor is None else anchor
        return one, one
    h, k = divmod(best, score.shape[1])
    return h - k, h
