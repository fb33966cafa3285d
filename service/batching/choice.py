"""The batch-choice policy: which items of one key's queue to batch next, by age-weighted windows of
similar lengths. Pure policy (numpy only), apart from the batcher's queue and thread mechanics.

`choose_batch` takes the oldest items (about `pool_batches` batches' worth), sorts them by length
and picks the window of similar lengths with the best age-weighted work per cost:

    score = sum(w_i * length_i) / (sum(w_i) * padded length + batch_overhead_tokens)
    w_i   = ((age_i + AGE_SLACK_S) / (age of the oldest in the pool + AGE_SLACK_S)) ** AGE_POWER + FRESH_WEIGHT

With all weights 1 this is plain work per cost (real tokens / (padded tokens + overhead)),
which keeps the padding low but lets an item whose length fits no good window wait until it is the
oldest of all, which stretches the tail (bench/RESULTS.md). Weighting each item's work and
its padded cost alike makes a window of old items worth more than an equally efficient one of
newcomers, while a newcomer of about the padded length still adds to any window (it adds as much
work as cost), so batches do not shrink. `python -m bench.policy_sim` compares the two under load.
`max_age_ms` stays the hard bound: once the oldest item has waited that long, the window must
contain it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

# Steep, so the oldest few items decide which window runs; the weight of a newcomer is FRESH_WEIGHT:
# above zero, so its work and cost still count, and small next to the oldest's 1 + FRESH_WEIGHT.
# Chosen with bench/policy_sim.py (RESULTS.md): the tail shrinks most for the throughput it costs.
AGE_POWER = 6
FRESH_WEIGHT = 0.01
# Ages are compared as (age + AGE_SLACK_S): differences of a few milliseconds (the order a burst of
# calls happened to arrive in) should not decide which of two equally good windows runs.
AGE_SLACK_S = 0.01
# Up to this many (end, size) cells, `choose_batch` and `choose_window` run in plain Python: numpy's
# per-call cost (some 30 array operations, 70-250 us here, on the model thread with the GIL held)
# outweighs a few dozen cells (bench/RESULTS.md, issue 22). The same float operations in the same
# order: the same choice (tests/service/test_batcher.py holds the two equal; a numpy that vectorises pow could
# differ from libm's in the last bit of a weight, and so on an exact tie).
PYTHON_CELLS = 64


class WindowLimits(Protocol):
    """What the policy reads of service.batching.types.BatchLimits."""

    @property
    def max_batch_tokens(self) -> int: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def batch_overhead_tokens(self) -> int: ...
    @property
    def pool_batches(self) -> int: ...
    @property
    def max_age_ms(self) -> float: ...
    @property
    def max_wait_ms(self) -> float: ...


def choose_batch(lengths: Sequence[int], ages: Sequence[float], limits: WindowLimits) -> list[int]:
    """Given one key's queue in admission order (`lengths`, `ages` in seconds, oldest first), the
    indices of the items to batch next, shortest first. Only the first `pool_size(limits)` items
    are looked at: callers may pass just those."""
    if len(lengths) == 1:  # the common case at low load: skip numpy
        return [0]
    pool = lengths[: pool_size(limits)]
    n = len(pool)
    if n <= limits.max_batch_size and min(pool) == max(pool) and n * pool[0] <= limits.max_batch_tokens:
        # All of one length and all fit: every window pads alike, so the score grows with the window's
        # weight and the whole pool wins (with max_wait_ms too: none is full). What the search returns.
        return list(range(n))
    if n * min(limits.max_batch_size, n) <= PYTHON_CELLS:
        return _choose_batch_python([int(x) for x in pool], [float(a) for a in ages[:n]], limits)
    length = np.asarray(pool, dtype=np.int64)
    # The pool: the oldest items up to pool_batches batches' worth of tokens (at least one item).
    # Items further back wait their turn, which bounds everyone's wait while leaving enough choice
    # to group similar lengths.
    budget = limits.pool_batches * limits.max_batch_tokens
    n = min(len(length), int(np.searchsorted(np.cumsum(length), budget)) + 1)
    length = length[:n]
    if limits.max_wait_ms > 0 and n <= limits.max_batch_size and n * int(length.max()) <= limits.max_batch_tokens:
        # max_wait_ms holds a batch open to grow it (larger batches bought with latency): what it
        # gathered runs whole. Without it, the scores below may leave a newcomer for the next batch.
        return [int(i) for i in np.argsort(length, kind="stable")]
    age = np.asarray(ages[:n], dtype=np.float64)
    order = np.argsort(length, kind="stable")
    weight = ((age + AGE_SLACK_S) / (age[0] + AGE_SLACK_S)) ** AGE_POWER + FRESH_WEIGHT
    anchor = int(np.flatnonzero(order == 0)[0]) if age[0] >= limits.max_age_ms / 1e3 else None
    lo, hi = choose_window(length[order], limits, anchor, weight[order])
    return [int(i) for i in order[lo : hi + 1]]


def pool_size(limits: WindowLimits) -> int:
    """The most items `choose_batch` looks at."""
    return limits.pool_batches * limits.max_batch_size


def choose_window(lengths: Sequence[int] | np.ndarray, limits: WindowLimits, anchor: int | None,
                  weights: Sequence[float] | np.ndarray | None = None) -> tuple[int, int]:
    """Given lengths sorted ascending, the [lo, hi] window to batch (inclusive).

    Every window within the size and token limits (all padded to lengths[hi]) is scored by
    sum(w * length) / (sum(w) * lengths[hi] + batch_overhead_tokens), all weights 1 without `weights`
    (real tokens / (padded tokens + overhead)); the best wins, ties going to more weighted work. With
    `anchor`, only windows that contain it are considered. Vectorised: n x max_batch_size cells.
    """
    n = len(lengths)
    if n * min(limits.max_batch_size, n) <= PYTHON_CELLS:
        return _choose_window_python([int(x) for x in lengths], limits, anchor,
                                     [1.0] * n if weights is None else [float(w) for w in weights])
    length = np.asarray(lengths, dtype=np.int64)
    weight = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    work_prefix = np.concatenate(([0], np.cumsum(length * weight)))
    weight_prefix = np.concatenate(([0], np.cumsum(weight)))
    hi = np.arange(n)[:, None]  # (n, 1)
    size = np.arange(1, min(limits.max_batch_size, n) + 1)[None, :]  # (1, k)
    lo = hi - size + 1  # (n, k)
    valid = (lo >= 0) & (size * length[:, None] <= limits.max_batch_tokens)
    if anchor is not None:
        valid &= (lo <= anchor) & (hi >= anchor)
    start = np.clip(lo, 0, None)
    work = work_prefix[hi + 1] - work_prefix[start]  # (n, k)
    grid = (weight_prefix[hi + 1] - weight_prefix[start]) * length[:, None]  # weighted padded tokens
    cost = grid + limits.batch_overhead_tokens
    score = np.where(valid, work / cost + work * 1e-12, -1.0)
    best = int(np.argmax(score))
    if score.flat[best] < 0:  # nothing fits the budget (one item longer than it): run one alone
        one = 0 if anchor is None else anchor
        return one, one
    h, k = divmod(best, score.shape[1])
    return h - k, h


def _choose_batch_python(length: list[int], age: list[float], limits: WindowLimits) -> list[int]:
    """`choose_batch` for a small pool, in plain Python, step for step."""
    budget = limits.pool_batches * limits.max_batch_tokens
    n, total = len(length), 0
    for i, x in enumerate(length):  # np.searchsorted(np.cumsum(length), budget) + 1
        total += x
        if total >= budget:
            n = min(n, i + 1)
            break
    length, age = length[:n], age[:n]
    order = sorted(range(n), key=length.__getitem__)  # stable, as argsort(kind="stable")
    if limits.max_wait_ms > 0 and n <= limits.max_batch_size and n * max(length) <= limits.max_batch_tokens:
        return order
    weight = [((a + AGE_SLACK_S) / (age[0] + AGE_SLACK_S)) ** AGE_POWER + FRESH_WEIGHT for a in age]
    anchor = order.index(0) if age[0] >= limits.max_age_ms / 1e3 else None
    lo, hi = _choose_window_python([length[i] for i in order], limits, anchor, [weight[i] for i in order])
    return order[lo : hi + 1]


def _choose_window_python(length: list[int], limits: WindowLimits, anchor: int | None,
                          weight: list[float]) -> tuple[int, int]:
    """`choose_window` cell by cell: the same scores from the same float operations, and the first
    best cell in the same (end, size) order as numpy's argmax."""
    n = len(length)
    work_prefix, weight_prefix = [0.0], [0.0]
    for x, w in zip(length, weight, strict=True):
        work_prefix.append(work_prefix[-1] + x * w)
        weight_prefix.append(weight_prefix[-1] + w)
    best, best_score = (0, 0), -2.0
    for hi in range(n):
        for size in range(1, min(limits.max_batch_size, n) + 1):
            lo = hi - size + 1
            score = -1.0
            if lo >= 0 and size * length[hi] <= limits.max_batch_tokens and (
                    anchor is None or lo <= anchor <= hi):
                work = work_prefix[hi + 1] - work_prefix[lo]
                cost = (weight_prefix[hi + 1] - weight_prefix[lo]) * length[hi] + limits.batch_overhead_tokens
                score = work / cost + work * 1e-12
            if score > best_score:
                best, best_score = (hi, size - 1), score
    if best_score < 0:  # nothing fits the budget (one item longer than it): run one alone
        one = 0 if anchor is None else anchor
        return one, one
    h, k = best
    return h - k, h
