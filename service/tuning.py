"""Choices made from a measurement at warm-up, on the machine the service runs on: the precision
(`precision=auto` on CPU), the CPU worker split (`model_workers=0`) and the batch token budget
(`max_batch_tokens=0`).

Neither can come from a table: bf16 is ~4x fp32 on a CPU with avx512_bf16 and 4-5x slower on an
AVX2-only one, and the batch where throughput stops growing differs between machines and models. So
the runner times the loaded model, here is how the times become a choice. The timing loops are
interleaved (every candidate once per round) and bounded in rounds and seconds (`timed_rounds`).

A reduced precision is served only if it is at least `MIN_SPEEDUP` times as fast as fp32 (an accuracy
cost is not taken for a gain within the noise) and, on inputs like callers' (service/calibration.py: the
tokenizer on built-in texts, or ids drawn across the vocabulary and lengths), every output the bundle
serves stays within `PRECISION_BOUNDS` of fp32's (`fidelity`: pooled vectors, hidden states per token,
head scores and their order, sparse weights, token vectors); docs/performance.md gives each bound's
reason. The gate runs only for a precision fast enough to be chosen. Its speed is the median over the
rounds of its time over fp32's in the same round (`round_ratios`), not its fastest call against
fp32's: other work on the machine that lands on some rounds moves those rounds' ratios, and the median
is the rounds it spared. (The fastest call of each was distorted both ways on a busy machine: bf16 was
timed at 0.11-0.90x fp32 in 7 of 21 loaded starts, 1.5-3.0x in the others, bench/RESULTS.md.)

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F

from model.bundle import RELATIVE_ERROR_BOUND
from service.calibration import BatchOutputs


@dataclass(frozen=True)
class Bound:
    """How close a reduced precision's outputs must stay to fp32's on the calibration inputs."""

    min_cosine: float  # each row's pooled vectors (mean, first token) and its sparse vector
    max_hidden_error: float  # per row: max |h - h32| / max |h32| over its real tokens
    min_token_cosine: float  # each real token's hidden state and its late-interaction vector
    max_score_error: float  # classify/rerank scores: max |s - s32| / max |s32| over the calibration inputs
    rank_tie: float  # scores keep fp32's order, but for two that fp32 puts within rank_tie x max |s32|


# docs/performance.md ("Accuracy gate") says why each: pooled cosine, tests/model/test_model_hf.py's bound for
# MiniLM against sentence-transformers' fp32; hidden error, RELATIVE_ERROR_BOUND (model/bundle.py, the export's
# bound, held by tests/model/test_model_numerics.py); a token's cosine, twice pooled's distance from 1 (one token
# averages no rounding away); head scores, the hidden error's bound (heads run in fp32 on those hidden states).
PRECISION_BOUNDS: dict[str, Bound] = {
    "bf16": Bound(min_cosine=0.9995, max_hidden_error=RELATIVE_ERROR_BOUND["bfloat16"], min_token_cosine=0.999,
                  max_score_error=RELATIVE_ERROR_BOUND["bfloat16"], rank_tie=0.01),
    "fp16": Bound(min_cosine=0.99999, max_hidden_error=RELATIVE_ERROR_BOUND["float16"], min_token_cosine=0.99998,
                  max_score_error=RELATIVE_ERROR_BOUND["float16"], rank_tie=0.002),
}
K = TypeVar("K")  # what timed_rounds' runs are named by

MIN_SPEEDUP = 1.1  # a reduced precision must beat fp32 by this factor to be served
BATCH_GAIN = 1.1  # a larger batch must raise throughput by this factor to be worth its latency
WORKERS_GAIN = 1.1  # a worker split other than the default must beat its best throughput by this factor


@dataclass(frozen=True)
class Fidelity:
    """A reduced precision's outputs against fp32's on the calibration inputs: the worst of each measure over
    every output the bundle serves. None: an output this bundle does not serve."""

    finite: bool = True
    pooled_cosine: float = 1.0
    token_cosine: float = 1.0
    hidden_error: float = 0.0
    score_error: float | None = None
    rank_swaps: int | None = None  # pairs of scores ordered unlike fp32's, beyond the bound's tie
    sparse_cosine: float | None = None
    vector_cosine: float | None = None

    def failures(self, bound: Bound) -> list[str]:
        """Each measure beyond `bound`, with its value and the bound; [] when within."""
        if not self.finite:
            return ["non-finite output"]
        checks = [("pooled cosine", self.pooled_cosine, ">=", bound.min_cosine),
                  ("token cosine", self.token_cosine, ">=", bound.min_token_cosine),
                  ("hidden error", self.hidden_error, "<=", bound.max_hidden_error),
                  ("score error", self.score_error, "<=", bound.max_score_error),
                  ("rank swaps", self.rank_swaps, "<=", 0),
                  ("sparse cosine", self.sparse_cosine, ">=", bound.min_cosine),
                  ("vector cosine", self.vector_cosine, ">=", bound.min_token_cosine)]
        return [f"{name} {_fmt(value)} vs {op} {limit}" for name, value, op, limit in checks if value is not None
                and not (value >= limit if op == ">=" else value <= limit)]

    def within(self, bound: Bound) -> bool:
        return not self.failures(bound)

    def measures(self) -> dict[str, float]:
        """The measures taken, by name (ModelSpec.precision_fidelity, ModelInfo): 1.0/0.0 for finite."""
        values = {"finite": float(self.finite), "pooled_cosine": self.pooled_cosine,
                  "token_cosine": self.token_cosine, "hidden_error": self.hidden_error,
                  "score_error": self.score_error, "rank_swaps": self.rank_swaps,
                  "sparse_cosine": self.sparse_cosine, "vector_cosine": self.vector_cosine}
        return {name: round(float(value), 7) for name, value in values.items() if value is not None}

    def describe(self) -> str:
        """The measures taken, for the log and the reason: "pooled cosine 0.999858, ..., rank swaps 0"."""
        return ", ".join(f"{name.replace('_', ' ')} {_fmt(getattr(self, name))}" for name in self.measures()
                         if name != "finite")


def _fmt(value: float) -> str:
    """Cosines with six decimals (they differ from 1 in the fourth), counts as integers, errors to 4 digits."""
    if isinstance(value, int) or float(value).is_integer() and value > 1:
        return str(int(value))
    return f"{value:.6f}" if 0.9 < value <= 1.0 else f"{value:.4g}"


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    reason: str
    forward_ms: dict[str, float]  # measured per precision on the warm-up batch; empty when not measured
    # The served precision's outputs against fp32's on the calibration inputs (Fidelity.measures); empty for
    # fp32 and when not measured.
    fidelity: dict[str, float] = field(default_factory=dict)


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


def fidelity(got: Iterable[BatchOutputs], want: Iterable[BatchOutputs], groups: Sequence[int],
             bound: Bound) -> Fidelity:
    """A precision's calibration outputs (`got`, service/calibration.py bundle_outputs) against fp32's (`want`,
    the same batches in the same order). Hidden states, pooled vectors and token vectors are compared on the
    single inputs; scores on whatever the head ran on; `groups`: per pair, its query (pairs' scores are ranked
    within a query; rows' scores across rows, or across labels within a row when there are several)."""
    finite, pooled, token, hidden = True, 1.0, 1.0, 0.0
    sparse: float | None = None
    vector: float | None = None
    scores: dict[tuple[str, bool], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for g, w in zip(got, want, strict=True):
        assert g.index == w.index, "calibration batches out of step. This is a bug."
        pairs = g.pairs
        real = torch.arange(w.hidden.shape[1])[None, :] < w.lengths[:, None]  # (B, T)
        finite = finite and bool(torch.isfinite(g.hidden[real]).all()) and all(
            bool(torch.isfinite(x).all()) for x in g.heads.values())
        if not finite:
            return Fidelity(finite=False)
        for name, out in g.heads.items():
            if name in ("classify", "rerank"):
                table = scores.setdefault((name, pairs), {})
                table.update({i: (out[row], w.heads[name][row]) for row, i in enumerate(g.index)})
            elif name == "sparse":
                sparse = min(1.0 if sparse is None else sparse, _min_cosine(out, w.heads[name]))
            elif name == "colbert":
                vector = min(1.0 if vector is None else vector, _min_cosine(out[real], w.heads[name][real]))
        if pairs:
            continue
        token = min(token, _min_cosine(g.hidden[real], w.hidden[real]))
        mask = real[:, :, None]
        diff = torch.where(mask, (g.hidden - w.hidden).abs(), 0.0).amax(dim=(1, 2))
        largest = torch.where(mask, w.hidden.abs(), 0.0).amax(dim=(1, 2)).clamp_min(1e-30)  # (B,)
        hidden = max(hidden, float((diff / largest).max()))
        means = [torch.where(mask, x, 0.0).sum(dim=1) / w.lengths[:, None] for x in (g.hidden, w.hidden)]
        pooled = min(pooled, _min_cosine(*means), _min_cosine(g.hidden[:, 0], w.hidden[:, 0]))
    score_error: float | None = None
    swaps: int | None = None
    for (_, of_pairs), table in scores.items():
        order = sorted(table)
        s = torch.stack([table[i][0] for i in order])  # (N, labels)
        s32 = torch.stack([table[i][1] for i in order])
        scale = float(s32.abs().max().clamp_min(1e-30))
        score_error = max(score_error or 0.0, float((s - s32).abs().max()) / scale)
        tie = bound.rank_tie * scale
        found: int
        if of_pairs:  # a reranker: each query's passages
            ranked = [[k for k, i in enumerate(order) if groups[i] == q] for q in sorted(set(groups))]
            found = sum(_swaps(s[r, 0], s32[r, 0], tie) for r in ranked)
        elif s.shape[1] > 1:  # a classifier: its labels' order, row by row
            found = sum(_swaps(s[row], s32[row], tie) for row in range(s.shape[0]))
        else:
            found = _swaps(s[:, 0], s32[:, 0], tie)
        swaps = (swaps or 0) + found
    return Fidelity(True, pooled, token, hidden, score_error, swaps, sparse, vector)


def _min_cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    """The least cosine between matching rows of got and want (N, D); 1.0 for none. Two zero vectors agree."""
    if got.shape[0] == 0:
        return 1.0
    cos = F.cosine_similarity(got, want, dim=-1)
    both_zero = (got.abs().amax(dim=-1) == 0) & (want.abs().amax(dim=-1) == 0)
    return float(torch.where(both_zero, 1.0, cos).min())


def _swaps(got: torch.Tensor, want: torch.Tensor, tie: float) -> int:
    """Pairs (i, j) that `want` orders with a gap over `tie` and `got` orders otherwise (or ties)."""
    gap = want[:, None] - want[None, :]  # (n, n)
    return int(((gap > tie) & (got[:, None] - got[None, :] <= 0)).sum())


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


def speedups(ratios: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Per reduced precision, fp32's speed over its: fp32's time over the median of its rounds' ratios."""
    return {name: 1 / statistics.median(values) for name, values in ratios.items()}


def choose_precision(ratios: Mapping[str, Sequence[float]], fidelities: Mapping[str, Fidelity], measured: str,
                     forward_ms: Mapping[str, float], bounds: Mapping[str, Bound] = PRECISION_BOUNDS,
                     calibrated: str = "the calibration inputs") -> PrecisionChoice:
    """The fastest precision that beats fp32 by MIN_SPEEDUP and stays within `bounds` of it; else fp32.
    ratios: per reduced precision that ran, its forward's seconds over fp32's, one per round (`round_ratios`;
    a single one for a precision not timed beyond its first calls); its speed is fp32's over the median.
    fidelities: per reduced precision the gate ran on (one fast enough to be chosen; one without a fidelity
    is not served); measured: what was timed, calibrated: what the gate ran, for the reason; forward_ms: per
    precision (fp32 included), reported as measured."""
    speeds = speedups(ratios)
    notes, passing = [], []
    for name, speedup in speeds.items():
        values, bound, fid = ratios[name], bounds[name], fidelities.get(name)
        over = (f"the median of {len(values)} rounds' ratios, {1 / max(values):.2f}-{1 / min(values):.2f}x"
                if len(values) > 1 else "its second call against fp32's, not timed further")
        if speedup < MIN_SPEEDUP:
            notes.append(f"{name} not chosen: {speedup:.2f}x fp32's speed ({over}; needs {MIN_SPEEDUP}x)")
        elif fid is None:
            notes.append(f"{name} refused: {speedup:.2f}x fp32's speed but not checked against fp32")
        elif not fid.within(bound):
            notes.append(f"{name} refused: differs from fp32 beyond the bound on {calibrated} "
                         f"({'; '.join(fid.failures(bound))}); {speedup:.2f}x fp32's speed")
        else:
            passing.append(name)
            notes.append(f"{name} {speedup:.2f}x fp32's speed ({over}); on {calibrated}: {fid.describe()}")
    chosen = max(passing, key=lambda name: speeds[name]) if passing else "fp32"
    ms = {name: round(value, 3) for name, value in forward_ms.items()}
    timings = ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items())
    reason = f"measured at warm-up on {measured} (median forward: {timings}): {'; '.join(notes)}"
    measures = fidelities[chosen].measures() if chosen != "fp32" else {}
    return PrecisionChoice(chosen, reason, ms, measures)


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
