"""Choices made from a measurement at warm-up, on the machine the service runs on: the precision
(`precision=auto` on CPU), the CPU worker split (`model_workers=0`) and the batch token budget
(`max_batch_tokens=0`).

Neither can come from a table: bf16 is ~4x fp32 on a CPU with avx512_bf16 and 4-5x slower on an
AVX2-only one, and the batch where throughput stops growing differs between machines and models. So
the runner times the loaded model, here is how the times become a choice. The timing loops are
interleaved (every candidate once per round) and bounded in rounds and seconds (`timed_rounds`).

A reduced precision is served only if, on the same batch, it agrees with fp32 within the bounds the
tests hold (`PRECISION_BOUNDS`) and is at least `MIN_SPEEDUP` times as fast: an accuracy cost is
not taken for a gain within the noise. Its speed is the median over the rounds of its time over
fp32's in the same round (`round_ratios`), not its fastest call against fp32's: other work on the
machine that lands on some rounds moves those rounds' ratios, and the median is the rounds it
spared. (The fastest call of each was distorted both ways on a busy machine: bf16 was timed at
0.11-0.90x fp32 in 7 of 21 loaded starts, 1.5-3.0x in the others, bench/RESULTS.md.)

The worker split and the budget are measured together, as the service runs under load: for each
candidate split (1 worker with every thread, and the default, 2 workers with half each), every
worker runs the same batch at once; a split's throughput is the tokens of all its workers over the
wall time. The split served is the default unless another one's best throughput beats the default's
by `WORKERS_GAIN`; the budget is then chosen on the served split's curve (`choose_batch_tokens`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from model.bundle import RELATIVE_ERROR_BOUND


@dataclass(frozen=True)
class Bound:
    """How close a reduced precision must stay to fp32 on the warm-up batch."""

    min_cosine: float  # of each sequence's mean-pooled vector
    max_hidden_error: float  # max |h - h32| / max |h32| over the real tokens


# Hidden states: RELATIVE_ERROR_BOUND (model/bundle.py, held by tests/model/test_model_numerics.py);
# pooled cosine: tests/model/test_model_hf.py's BOUNDS for MiniLM against its fp32 references.
PRECISION_BOUNDS: dict[str, Bound] = {
    "bf16": Bound(min_cosine=0.9995, max_hidden_error=RELATIVE_ERROR_BOUND["bfloat16"]),
    "fp16": Bound(min_cosine=0.99999, max_hidden_error=RELATIVE_ERROR_BOUND["float16"]),
}
K = TypeVar("K")  # what timed_rounds' runs are named by

MIN_SPEEDUP = 1.1  # a reduced precision must beat fp32 by this factor to be served
BATCH_GAIN = 1.1  # a larger batch must raise throughput by this factor to be worth its latency
WORKERS_GAIN = 1.1  # a worker split other than the default must beat its best throughput by this factor


@dataclass(frozen=True)
class Agreement:
    """A reduced precision's output against fp32's on one batch."""

    min_cosine: float
    hidden_error: float
    finite: bool

    def within(self, bound: Bound) -> bool:
        return self.finite and self.min_cosine >= bound.min_cosine and self.hidden_error <= bound.max_hidden_error


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    reason: str
    forward_ms: dict[str, float]  # measured per precision on the warm-up batch; empty when not measured


@dataclass(frozen=True)
class BatchChoice:
    max_batch_tokens: int
    reason: str
    curve: dict[int, float]  # batch tokens -> tokens/s; empty when not measured


@dataclass(frozen=True)
class WorkersChoice:
    workers: int
    reason: str
    curves: dict[int, dict[int, float]]  # workers -> batch tokens -> tokens/s (all side by side); empty: not measured


def agreement(got: torch.Tensor, want: torch.Tensor, lengths: torch.Tensor) -> Agreement:
    """got, want: (B, T, D) hidden states (any dtype); lengths (B,): real tokens per row."""
    got, want = got.float(), want.float()
    real = torch.arange(want.shape[1])[None, :] < lengths[:, None]  # (B, T)
    finite = bool(torch.isfinite(got[real]).all())
    error = float((got[real] - want[real]).abs().max() / want[real].abs().max()) if finite else float("inf")
    mask = real[:, :, None].to(want.dtype)  # (B, T, 1)
    pooled = [(x * mask).sum(dim=1) / lengths[:, None].to(want.dtype) for x in (got, want)]  # (B, D) each
    cosine = float(F.cosine_similarity(pooled[0], pooled[1], dim=-1).min()) if finite else float("-inf")
    return Agreement(cosine, error, finite)


def timed_rounds(runs: Mapping[K, Callable[[], object]], *, rounds: int = 5, budget_s: float = 2.0,
                 min_rounds: int = 2) -> dict[K, list[float]]:
    """Seconds of each run's call in each round: `rounds` interleaved rounds (each run once per round,
    the order alternating), fewer once `budget_s` is spent (never fewer than `min_rounds`). Every list
    has one entry per round, in order, so the i-th entries of two runs were timed side by side."""
    times: dict[K, list[float]] = {name: [] for name in runs}
    names = list(runs)
    started = time.perf_counter()
    for i in range(rounds):
        if i >= min_rounds and time.perf_counter() - started > budget_s:
            break
        for name in names if i % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def fastest_times(runs: Mapping[K, Callable[[], object]], *, rounds: int = 5, budget_s: float = 2.0,
                  min_rounds: int = 2) -> dict[K, float]:
    """Seconds of each run's fastest call in `timed_rounds`: the one least disturbed by other work."""
    return {name: min(seconds) for name, seconds in
            timed_rounds(runs, rounds=rounds, budget_s=budget_s, min_rounds=min_rounds).items()}


def round_ratios(times: Mapping[K, Sequence[float]], base: K) -> dict[K, list[float]]:
    """Each run's seconds over `base`'s in the same round, round by round (`base` itself left out);
    times: as `timed_rounds` returns."""
    return {name: [s / b for s, b in zip(seconds, times[base], strict=True)]
            for name, seconds in times.items() if name != base}


def choose_precision(ratios: Mapping[str, Sequence[float]], agreements: Mapping[str, Agreement], measured: str,
                     forward_ms: Mapping[str, float], bounds: Mapping[str, Bound] = PRECISION_BOUNDS
                     ) -> PrecisionChoice:
    """The fastest precision that agrees with fp32 within `bounds` and beats it by MIN_SPEEDUP; else fp32.
    ratios: per reduced precision that ran, its forward's seconds over fp32's, one per round (`round_ratios`;
    a single one for a precision not timed beyond its first calls); its speed is fp32's over the median.
    agreements: per reduced precision that ran; measured: what was timed, for the reason; forward_ms: per
    precision (fp32 included), reported as measured."""
    speedups = {name: 1 / statistics.median(values) for name, values in ratios.items()}
    notes, passing = [], []
    for name, agree in agreements.items():
        speedup, values = speedups[name], ratios[name]
        bound = bounds[name]
        over = (f"the median of {len(values)} rounds' ratios, {1 / max(values):.2f}-{1 / min(values):.2f}x"
                if len(values) > 1 else "its second call against fp32's, not timed further")
        if not agree.within(bound):
            notes.append(f"{name} refused: differs from fp32 beyond the bound (pooled cosine {agree.min_cosine:.6f}"
                         f" vs >= {bound.min_cosine}, hidden error {agree.hidden_error:.4g} vs <= "
                         f"{bound.max_hidden_error})")
        elif speedup < MIN_SPEEDUP:
            notes.append(f"{name} not chosen: {speedup:.2f}x fp32's speed ({over}; needs {MIN_SPEEDUP}x)")
        else:
            passing.append(name)
            notes.append(f"{name} {speedup:.2f}x fp32's speed ({over}), pooled cosine {agree.min_cosine:.6f}, "
                         f"hidden error {agree.hidden_error:.4g}")
    chosen = max(passing, key=lambda name: speedups[name]) if passing else "fp32"
    ms = {name: round(value, 3) for name, value in forward_ms.items()}
    timings = ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items())
    reason = f"measured at warm-up on {measured} (median forward: {timings}): {'; '.join(notes)}"
    return PrecisionChoice(chosen, reason, ms)


def choose_batch_tokens(curve: Mapping[int, float], gain: float = BATCH_GAIN) -> int:
    """The smallest measured budget whose throughput is within `gain` of the best measured: past it, a
    larger batch buys less than that factor for its extra latency. curve maps batch tokens to tokens/s.
    Against the best, not the next size: one point slowed by the machine's other work does not stop it."""
    best = max(curve.values())
    return min(tokens for tokens, rate in curve.items() if rate * gain >= best)


def batch_reason(curve: Mapping[int, float], chosen: int, seq_len: int, threads: int, workers: int = 1) -> str:
    points = ", ".join(f"{tokens}: {rate:.0f}" for tokens, rate in sorted(curve.items()))
    return (f"measured at warm-up, rows of {seq_len}+ tokens, {workers} worker(s) side by side on {threads} "
            f"thread(s) each, tokens/s by batch tokens "
            f"({points}): {chosen} is the smallest within {BATCH_GAIN}x of the best")


def batch_shapes(max_length: int, max_batch_size: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(rows, row length) per budget in `sizes`: rows of min(128, max_length) tokens, longer rows where
    max_batch_size rows of those would not reach the budget (up to max_length); budgets that repeat a
    shape are dropped."""
    seq = min(128, max_length)
    shapes: list[tuple[int, int]] = []
    for tokens in sizes:
        rows = max(1, min(max_batch_size, tokens // seq))
        shape = (rows, max(seq, min(max_length, tokens // rows)))
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def measure_splits(run: Callable[[int, int, int], object], splits: Sequence[int],
                   shapes: Sequence[tuple[int, int]], *, rounds: int = 3, budget_s: float = 4.0,
                   min_rounds: int = 2) -> dict[int, dict[int, float]]:
    """Tokens/s of each worker split at each batch shape: `run(workers, rows, seq)` returns once
    `workers` model threads have each run one batch of `rows` x `seq` tokens side by side. First the
    smallest shape on every split twice, outside the budget (TorchScript profiles and optimises on a
    graph's first calls, seconds on a busy machine); then every (split, shape) once, ascending,
    dropping the larger shapes once a call takes longer than a quarter of `budget_s` or half of it is
    spent; then interleaved rounds (fastest_times) in what is left. Returns {workers: {batch tokens:
    tokens/s}}."""
    for _ in range(2):
        for workers in splits:
            run(workers, *shapes[0])
    started = time.perf_counter()
    kept: list[tuple[int, int]] = []
    for rows, seq in shapes:
        slowest = 0.0
        for workers in splits:
            t0 = time.perf_counter()
            run(workers, rows, seq)
            slowest = max(slowest, time.perf_counter() - t0)
        kept.append((rows, seq))
        if slowest > budget_s / 4 or time.perf_counter() - started > budget_s / 2:
            break
    runs = {(workers, rows, seq): functools.partial(run, workers, rows, seq) for workers in splits
            for rows, seq in kept}
    left = max(0.0, budget_s - (time.perf_counter() - started))
    seconds = fastest_times(runs, rounds=rounds, budget_s=left, min_rounds=min_rounds)
    return {workers: {rows * seq: workers * rows * seq / seconds[(workers, rows, seq)] for rows, seq in kept}
            for workers in splits}


def choose_workers(curves: Mapping[int, Mapping[int, float]], default: int, gain: float = WORKERS_GAIN) -> int:
    """The default split unless another one's best tokens/s beats the default's best by `gain` (then the
    fastest such). curves: workers -> batch tokens -> tokens/s, measured side by side."""
    base = max(curves[default].values())
    better = [workers for workers, curve in curves.items() if workers != default and max(curve.values()) >= base * gain]
    return max(better, key=lambda workers: max(curves[workers].values())) if better else default


def workers_reason(curves: Mapping[int, Mapping[int, float]], chosen: int, default: int, threads: int) -> str:
    bests = ", ".join(f"{workers} x {max(1, threads // workers)} thread(s) {max(curve.values()):.0f}"
                      for workers, curve in sorted(curves.items()))
    why = "the default" if chosen == default else f"beats the default ({default}) by {WORKERS_GAIN}x or more"
    if chosen == default and len(curves) > 1:
        why += f", no other split beats it by {WORKERS_GAIN}x"
    return f"measured at warm-up, side by side, best tokens/s by workers ({bests}): {chosen}, {why}"
