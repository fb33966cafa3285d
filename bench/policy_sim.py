"""The batch-choice policy (service/batching/choice.py `choose_batch`) under closed-loop load, simulated: no
model, no threads, no noise, so two policies compare exactly where the shared CPU cannot.

    python -m bench.policy_sim [--concurrency 4 16 64 128] [--rate 60 90 105] [--lengths 16 256]
                              [--workers 2] [--max-batch-tokens 1024]

Closed loop: each of `concurrency` callers keeps one sequence queued or running; a new one (length
uniform in `lengths`) arrives the moment its previous one finishes. Open loop (`--rate`): sequences
arrive at random (Poisson) at that many per second, whatever the queue holds.

The model threads are the batcher's (service/batching/batcher.py, "Workers"): whenever one is free it takes
the real `choose_batch`'s pick from the queue; a batch that starts with nothing else running and
leaves nothing queued runs wide on the lead (both cores), every other one narrow (one core) beside
the others, and nothing starts beside a wide one. A batch takes `cost_ms`, a model of the reference
encoder's fp32 forward on the 2-core CPU fitted to bench/RESULTS.md (wide: 1 x 128 in about 8 ms,
8 x 128 in about 61 ms; narrow 8 x 128 in about 103 ms) plus the service's own time per batch
(choosing, handing results to the event loop: about 5 ms under load). A batch whose padding is at
least 1/16 of its real tokens runs packed (model/encoder.py): its position-wise work is on the real
tokens, and only attention and the gathers see the padded grid.

Compared: the policy as it is, and the same with every item given the oldest's age (work per cost
alone, the policy before the age weighting). (Pricing padding at packing's fraction of a token was
tried and changed nothing; bench/RESULTS.md.) The ceiling is length-sorted
batches of the whole mix, as in bench/service_bench.py, run the faster of wide or two narrow.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from model.encoder import PACK_MIN_PADDING
from service.batching import BatchLimits
from service.batching.choice import choose_batch

Policy = Callable[[list[int], list[float], BatchLimits], list[int]]

SERVICE_MS = 6.5  # per batch: the forward's fixed cost and the service's own work between batches
TOKEN_MS = 0.052  # per token of position-wise work (projections, feed-forward, LayerNorm), wide
ATTENTION_MS = 0.00004  # per query x key position, wide
GATHER_MS = 0.004  # per padded-grid position of a packed batch: the gathers into and out of attention
NARROW = 1.7  # a batch's compute on one core against both (in process, 8 x 128: 103 against 61 ms)


def cost_ms(lengths: list[int], wide: bool = True) -> float:
    """One batch of sequences of `lengths`, padded to the longest, on both cores or (narrow) on one."""
    batch, padded, real = len(lengths), max(lengths), sum(lengths)
    grid = batch * padded
    packed = grid - real >= PACK_MIN_PADDING * real
    compute = TOKEN_MS * (real if packed else grid) + ATTENTION_MS * grid * padded + (GATHER_MS * grid if packed else 0)
    return SERVICE_MS + compute * (1.0 if wide else NARROW)


def age_weighted(lengths: list[int], ages: list[float], limits: BatchLimits) -> list[int]:
    return choose_batch(lengths, ages, limits)


def unweighted(lengths: list[int], ages: list[float], limits: BatchLimits) -> list[int]:
    return choose_batch(lengths, [ages[0]] * len(ages), limits)  # equal weights; the age bound still holds


@dataclass
class _Running:
    until: float
    batch: list[tuple[float, int]]
    wide: bool


def simulate(policy: Policy, limits: BatchLimits, *, lengths: tuple[int, int], batches: int,
             concurrency: int = 0, rate: float = 0.0, workers: int = 2, seed: int = 0) -> dict[str, float]:
    """Closed loop with `concurrency` callers, or open loop at `rate` sequences/s; `batches` in all."""
    rng = np.random.default_rng(seed)
    queue: list[tuple[float, int]] = []  # (enqueued at, length), admission order
    running: dict[int, _Running] = {}  # worker -> its batch

    def arrive(at: float) -> None:
        queue.append((at, int(rng.integers(lengths[0], lengths[1] + 1))))

    def start(now: float) -> None:
        """Free workers take batches, lead first, as the batcher's `_next_batch` lets them."""
        for worker in range(workers):
            if worker in running or not queue or any(r.wide for r in running.values()):
                continue
            picked = policy([n for _, n in queue], [now - at for at, _ in queue], limits)
            alone = not running and len(picked) == len(queue)
            if alone and worker > 0:
                continue  # the lead's, to run wide
            batch = [queue[j] for j in picked]
            for j in sorted(picked, reverse=True):
                del queue[j]
            wide = alone or workers == 1
            running[worker] = _Running(now + cost_ms([n for _, n in batch], wide) / 1e3, batch, wide)

    for _ in range(concurrency):
        arrive(0.0)
    now, skip, done = 0.0, batches // 10, 0  # the first tenth warms the queue up
    next_arrival = 0.0
    latencies: list[float] = []
    measured_from = sequences = real = padded = 0.0
    start(now)
    while done < batches:
        finish = min((r.until for r in running.values()), default=np.inf)
        if rate and next_arrival < finish:  # open loop: the next arrival comes first
            now = next_arrival
            arrive(now)
            next_arrival += rng.exponential(1 / rate)
            start(now)
            continue
        worker = min(running, key=lambda w: running[w].until)
        finished = running.pop(worker)
        now, done = finished.until, done + 1
        if done == skip:
            measured_from = now
        longest = max(n for _, n in finished.batch)
        for at, n in finished.batch:
            if done > skip:
                latencies.append(now - at)
                sequences, real, padded = sequences + 1, real + n, padded + longest
            if concurrency:
                arrive(now)
        start(now)
    p50, p99 = np.percentile(np.asarray(latencies) * 1e3, [50, 99])
    return {"seq_s": sequences / (now - measured_from), "padding": padded / real, "p50_ms": float(p50),
            "p99_ms": float(p99)}


def ceiling(lengths: tuple[int, int], max_batch_size: int, workers: int = 2, count: int = 4096,
            seed: int = 1) -> float:
    """Sequences/s of length-sorted batches of the whole mix, at the best of a few token budgets, run
    wide one at a time or narrow `workers` at a time, whichever is faster."""
    mix = sorted(int(n) for n in np.random.default_rng(seed).integers(lengths[0], lengths[1] + 1, count))
    best = 0.0
    for budget in (1024, 2048, 4096, 8192):
        groups: list[list[int]] = [[]]
        for n in mix:
            if groups[-1] and ((len(groups[-1]) + 1) * n > budget or len(groups[-1]) == max_batch_size):
                groups.append([])
            groups[-1].append(n)
        wide = sum(cost_ms(g) for g in groups)
        narrow = sum(cost_ms(g, wide=False) for g in groups) / workers
        best = max(best, count / min(wide, narrow) * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.policy_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[4, 16, 64, 128], help="closed-loop callers")
    parser.add_argument("--rate", type=float, nargs="*", default=[60, 90, 105], help="open-loop sequences/s")
    parser.add_argument("--lengths", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--batches", type=int, default=2000, help="batches simulated per row (bounded: <= 100000)")
    parser.add_argument("--workers", type=int, default=2, help="model workers (the CPU default)")
    parser.add_argument("--max-batch-tokens", type=int, default=1024, help="the CPU default token budget")
    args = parser.parse_args(argv)
    if not 1 <= args.batches <= 100_000:
        parser.error("--batches must be in 1..100000")
    if not 1 <= args.workers <= 8:
        parser.error("--workers must be in 1..8")
    limits = BatchLimits(max_batch_tokens=args.max_batch_tokens, max_batch_size=64)
    lengths = (args.lengths[0], args.lengths[1])
    roof = ceiling(lengths, limits.max_batch_size, args.workers)
    print(f"lengths {lengths[0]}..{lengths[1]}, budget {limits.max_batch_tokens} tokens, {args.workers} worker(s); "
          f"length-sorted ceiling {roof:.1f} seq/s (cost model)\n")
    print("| policy | load | seq/s | of ceiling | padding | p50 ms | p99 ms | p99/p50 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    loads = [("closed", float(c), f"{c} callers") for c in args.concurrency]
    loads += [("open", r, f"{r:g} seq/s arriving") for r in args.rate]
    policies = (("work per cost, unweighted", unweighted), ("age-weighted (now)", age_weighted))
    for kind, value, label in loads:
        load = {"concurrency": int(value)} if kind == "closed" else {"rate": value}
        for name, policy in policies:
            r = simulate(policy, limits, lengths=lengths, batches=args.batches, workers=args.workers, **load)
            print(f"| {name} | {label} | {r['seq_s']:.1f} | {r['seq_s'] / roof:.2f} | {r['padding']:.2f} | "
                  f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['p99_ms'] / r['p50_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
