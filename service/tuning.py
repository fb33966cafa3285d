"""Choices made from a measurement at warm-up, on the machine the service runs on: the precision
(`precision=auto` on CPU) and the batch token budget (`max_batch_tokens=0`).

Neither can come from a table: bf16 is ~4x fp32 on a CPU with avx512_bf16 and 4-5x slower on an
AVX2-only one, and the batch where throughput stops growing differs between machines and models. So
the runner times the loaded model, here is how the times become a choice. The timing loops are
interleaved (every candidate once per round) and bounded in rounds and seconds; each candidate's time
is its fastest round, the one least disturbed by the machine's other work.

A reduced precision is served only if, on the same batch, it agrees with fp32 within the bounds the
tests hold (`PRECISION_BOUNDS`) and is at least `MIN_SPEEDUP` times as fast: an accuracy cost is
not taken for a gain within the noise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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
MIN_SPEEDUP = 1.1  # a reduced precision must beat fp32 by this factor to be served
BATCH_GAIN = 1.1  # a larger batch must raise throughput by this factor to be worth its latency


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


def fastest_times(runs: Mapping[str, Callable[[], object]], *, rounds: int = 5, budget_s: float = 2.0,
                  min_rounds: int = 2) -> dict[str, float]:
    """Seconds of each run's fastest call: `rounds` interleaved rounds (each run once per round, the
    order alternating), fewer once `budget_s` is spent (never fewer than `min_rounds`)."""
    best = dict.fromkeys(runs, float("inf"))
    names = list(runs)
    started = time.perf_counter()
    for i in range(rounds):
        if i >= min_rounds and time.perf_counter() - started > budget_s:
            break
        for name in names if i % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def choose_precision(seconds: Mapping[str, float], agreements: Mapping[str, Agreement], shape: str,
                     bounds: Mapping[str, Bound] = PRECISION_BOUNDS) -> PrecisionChoice:
    """The fastest precision that agrees with fp32 within `bounds` and beats it by MIN_SPEEDUP; else fp32.
    seconds: per precision (fp32 included); agreements: per reduced precision; shape: for the reason."""
    fp32 = seconds["fp32"]
    ms = {name: round(s * 1e3, 3) for name, s in seconds.items()}
    notes, passing = [], []
    for name, agree in agreements.items():
        speedup = fp32 / seconds[name]
        bound = bounds[name]
        if not agree.within(bound):
            notes.append(f"{name} refused: differs from fp32 beyond the bound (pooled cosine {agree.min_cosine:.6f}"
                         f" vs >= {bound.min_cosine}, hidden error {agree.hidden_error:.4g} vs <= "
                         f"{bound.max_hidden_error})")
        elif speedup < MIN_SPEEDUP:
            notes.append(f"{name} not chosen: {speedup:.2f}x fp32's speed (needs {MIN_SPEEDUP}x)")
        else:
            passing.append(name)
            notes.append(f"{name} {speedup:.2f}x fp32's speed, pooled cosine {agree.min_cosine:.6f}, hidden error "
                         f"{agree.hidden_error:.4g}")
    chosen = min(passing, key=lambda name: seconds[name]) if passing else "fp32"
    timings = ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items())
    reason = f"measured at warm-up on {shape} ({timings}): {'; '.join(notes)}"
    return PrecisionChoice(chosen, reason, ms)


def choose_batch_tokens(curve: Mapping[int, float], gain: float = BATCH_GAIN) -> int:
    """The smallest measured budget whose throughput is within `gain` of the best measured: past it, a
    larger batch buys less than that factor for its extra latency. curve maps batch tokens to tokens/s.
    Against the best, not the next size: one point slowed by the machine's other work does not stop it."""
    best = max(curve.values())
    return min(tokens for tokens, rate in curve.items() if rate * gain >= best)


def batch_reason(curve: Mapping[int, float], chosen: int, seq_len: int, threads: int) -> str:
    points = ", ".join(f"{tokens}: {rate:.0f}" for tokens, rate in sorted(curve.items()))
    return (f"measured at warm-up, rows of {seq_len}+ tokens on {threads} thread(s), tokens/s by batch tokens "
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
