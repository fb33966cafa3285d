"""The batch-choice policy (service/window.py `choose_batch`) under closed-loop load, simulated: no
model, no threads, no noise, so two policies compare exactly where the shared CPU cannot.

    python -m bench.policy_sim [--concurrency 4 16 64 128] [--rate 60 90 105] [--lengths 16 256]

Closed loop: each of `concurrency` callers keeps one sequence queued or running; a new one (length
uniform in `lengths`) arrives the moment its previous one finishes. Open loop (`--rate`): sequences
arrive at random (Poisson) at that many per second, whatever the queue holds. When the model frees, the real
`choose_batch` picks the next batch from the queue; the batch then takes cost_ms(B, T), a model of
the reference encoder's fp32 forward on the 2-core CPU fitted to bench/RESULTS.md (16 x 128 in
about 110 ms, 1 x 128 in about 8 ms, 1 x 512 in about 37 ms) plus the service's own time per batch
between forwards (choosing, handing results to the event loop: about 5 ms, measured under load).
Compared: the policy as it is (work and cost weighted by age) and the same with every item given
the oldest's age (work per cost alone, the policy before). The ceiling is length-sorted batches of
the whole mix, as in bench/service_bench.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import numpy as np

from service.batcher import BatchLimits
from service.window import choose_batch

Policy = Callable[[list[int], list[float], BatchLimits], list[int]]


def cost_ms(batch: int, length: int) -> float:
    """One batch of `batch` sequences padded to `length` tokens: fixed + per token + attention."""
    return 6.5 + 0.052 * batch * length + 0.00004 * batch * length * length


def age_weighted(lengths: list[int], ages: list[float], limits: BatchLimits) -> list[int]:
    return choose_batch(lengths, ages, limits)


def unweighted(lengths: list[int], ages: list[float], limits: BatchLimits) -> list[int]:
    return choose_batch(lengths, [ages[0]] * len(ages), limits)  # equal weights; the age bound still holds


def simulate(policy: Policy, limits: BatchLimits, *, lengths: tuple[int, int], batches: int,
             concurrency: int = 0, rate: float = 0.0, seed: int = 0) -> dict[str, float]:
    """Closed loop with `concurrency` callers, or open loop at `rate` sequences/s."""
    rng = np.random.default_rng(seed)
    queue: list[tuple[float, int]] = []  # (enqueued at, length), admission order

    def arrive(at: float) -> None:
        queue.append((at, int(rng.integers(lengths[0], lengths[1] + 1))))

    for _ in range(concurrency):
        arrive(0.0)
    now, skip = 0.0, batches // 10  # the first tenth warms the queue up
    next_arrival = 0.0
    latencies: list[float] = []
    measured_from = sequences = real = padded = 0.0
    for i in range(batches):
        while rate and (next_arrival <= now or not queue):  # open loop: everything that arrived by now
            now = max(now, next_arrival)
            arrive(next_arrival)
            next_arrival += rng.exponential(1 / rate)
        picked = policy([n for _, n in queue], [now - at for at, _ in queue], limits)
        batch = [queue[j] for j in picked]
        for j in sorted(picked, reverse=True):
            del queue[j]
        longest = max(n for _, n in batch)
        now += cost_ms(len(batch), longest) / 1e3
        if i == skip:
            measured_from = now
        for at, n in batch:
            if i > skip:
                latencies.append(now - at)
                sequences, real, padded = sequences + 1, real + n, padded + longest
            if concurrency:
                arrive(now)
    p50, p99 = np.percentile(np.asarray(latencies) * 1e3, [50, 99])
    return {"seq_s": sequences / (now - measured_from), "padding": padded / real, "p50_ms": float(p50),
            "p99_ms": float(p99)}


def ceiling(lengths: tuple[int, int], max_batch_size: int, count: int = 4096, seed: int = 1) -> float:
    """Sequences/s of length-sorted batches of the whole mix, at the best of a few token budgets."""
    mix = sorted(int(n) for n in np.random.default_rng(seed).integers(lengths[0], lengths[1] + 1, count))
    best = 0.0
    for budget in (2048, 4096, 8192, 16384):
        total, current = 0.0, []
        for n in mix:
            if current and ((len(current) + 1) * n > budget or len(current) == max_batch_size):
                total += cost_ms(len(current), current[-1])
                current = []
            current.append(n)
        total += cost_ms(len(current), current[-1])
        best = max(best, count / total * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.policy_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[4, 16, 64, 128], help="closed-loop callers")
    parser.add_argument("--rate", type=float, nargs="*", default=[60, 90, 105], help="open-loop sequences/s")
    parser.add_argument("--lengths", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--batches", type=int, default=2000, help="batches simulated per row (bounded: <= 100000)")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="the CPU default token budget")
    args = parser.parse_args(argv)
    if not 1 <= args.batches <= 100_000:
        parser.error("--batches must be in 1..100000")
    limits = BatchLimits(max_batch_tokens=args.max_batch_tokens, max_batch_size=64)
    lengths = (args.lengths[0], args.lengths[1])
    roof = ceiling(lengths, limits.max_batch_size)
    print(f"lengths {lengths[0]}..{lengths[1]}, budget {limits.max_batch_tokens} tokens; "
          f"length-sorted ceiling {roof:.1f} seq/s (cost model)\n")
    print("| policy | load | seq/s | of ceiling | padding | p50 ms | p99 ms | p99/p50 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    loads = [("closed", float(c), f"{c} callers") for c in args.concurrency]
    loads += [("open", r, f"{r:g} seq/s arriving") for r in args.rate]
    for kind, value, label in loads:
        load = {"concurrency": int(value)} if kind == "closed" else {"rate": value}
        for name, policy in (("work per cost (before)", unweighted), ("age-weighted (now)", age_weighted)):
            r = simulate(policy, limits, lengths=lengths, batches=args.batches, **load)
            print(f"| {name} | {label} | {r['seq_s']:.1f} | {r['seq_s'] / roof:.2f} | {r['padding']:.2f} | "
                  f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['p99_ms'] / r['p50_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
