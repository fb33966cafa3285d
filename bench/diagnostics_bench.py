"""What one attention-health sample costs next to the forward it re-measures, in process.

    python -m bench.diagnostics_bench [--rounds 15] [--threads 0]

For the batch shapes the CPU service forms from mixed lengths under its 1024-token budget, the median
time of the bundle's `forward` (fast path, no weights) and of its `diagnostics` (every layer explicit)
on the same padded batch, interleaved round by round so this shared machine's drift falls on both. The
expected throughput cost of sampling a fraction f of batches is f x diagnostics / forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model.bundle import load_bundle
from model.default import ensure_default_bundle
from service.config import ServiceConfig

SHAPES = ((4, 256), (8, 128), (16, 64), (32, 32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    module = load_bundle(ensure_default_bundle(ServiceConfig().bundle_cache_dir)).module
    sample = ServiceConfig().diagnostics_sample
    print(f"threads {torch.get_num_threads()}, rounds {args.rounds}, default diagnostics_sample {sample}")
    print("| B x T | forward ms | diagnostics ms | ratio | expected cost at the default |")
    print("|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for B, T in SHAPES:
        ids = torch.randint(0, 1000, (B, T), generator=g)
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        lengths[0] = T
        fwd: list[float] = []
        diag: list[float] = []
        with torch.inference_mode():
            for _ in range(2):  # warm both graphs
                module(ids, None, lengths, False, [])
                module.diagnostics(ids, None, lengths, False)
            for _ in range(args.rounds):
                t = time.perf_counter()
                module(ids, None, lengths, False, [])
                fwd.append(time.perf_counter() - t)
                t = time.perf_counter()
                module.diagnostics(ids, None, lengths, False)
                diag.append(time.perf_counter() - t)
        f, d = statistics.median(fwd) * 1e3, statistics.median(diag) * 1e3
        print(f"| {B} x {T} | {f:.1f} | {d:.1f} | {d / f:.2f} | {100 * sample * d / f:.1f}% |")


if __name__ == "__main__":
    main()
