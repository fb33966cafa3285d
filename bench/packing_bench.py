"""What packing (model.encoder: position-wise layers on the real tokens only) gives, in process: the
REFERENCE encoder scripted twice, packed as the service runs it and with packing off, run in alternating
passes over the same padded batches, so this machine's drift (+-30% between minutes) falls on both alike.

    python -m bench.packing_bench [--rounds 8] [--threads 1 2] [--batches 20] [--pools 256 50 12 7]

Batches of 7 sequences with lengths 16..256, each taken from a sorted window of `pool` random lengths:
a pool of 256 pads about as little as the sorted ceiling, 50 about as much as the service at 64
callers, 7 is arrival order. Prints, per thread count and pool, the padding and the per-pass speed
ratio packed / unpacked (median over rounds). Bounded: threads x pools x rounds x 2 passes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from model.bundle import script
from model.config import REFERENCE, EncoderConfig
from model.encoder import Encoder

POOLS = (256, 50, 12, 7)
BATCH = 7


def scripted(config: EncoderConfig, pack: bool) -> torch.jit.ScriptModule:
    encoder = Encoder(config).init_weights(0).eval()
    if not pack:
        encoder.pack_min_padding = float("inf")  # a Final: scripted in as a constant
    return script(encoder)


def batches(config: EncoderConfig, pool: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = random.Random(seed)
    low, high = 16, min(256, config.max_length)
    out = []
    for _ in range(count):
        lengths = sorted(rng.randint(low, high) for _ in range(pool))
        start = rng.randrange(0, pool - BATCH + 1)
        chosen = lengths[start:start + BATCH]
        ids = torch.randint(0, config.vocab_size, (BATCH, max(chosen)), generator=torch.Generator().manual_seed(seed))
        out.append((ids, torch.tensor(chosen)))
    return out


def compare(modules: dict[str, torch.jit.ScriptModule], work: list[tuple[torch.Tensor, torch.Tensor]],
            rounds: int) -> list[float]:
    """Per round, time(unpacked) / time(packed) over one pass each, the order alternating."""
    ratios = []
    with torch.inference_mode():
        for module in modules.values():
            for ids, lengths in work[:3]:
                module(ids, None, lengths, False, [])
        for r in range(rounds):
            took = {}
            for name in (("packed", "unpacked") if r % 2 == 0 else ("unpacked", "packed")):
                started = time.perf_counter()
                for ids, lengths in work:
                    modules[name](ids, None, lengths, False, [])
                took[name] = time.perf_counter() - started
            ratios.append(took["unpacked"] / took["packed"])
    return ratios


def main(argv: list[str] | None = None, config: EncoderConfig = REFERENCE) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.packing_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=20, help="batches per pass")
    parser.add_argument("--pools", type=int, nargs="+", default=list(POOLS))
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 50 and 1 <= args.batches <= 200 and all(p >= BATCH for p in args.pools)):
        parser.error(f"--rounds in 1..50, --batches in 1..200, --pools at least {BATCH}")
    modules = {"packed": scripted(config, True), "unpacked": scripted(config, False)}
    print("| threads | pool | padding (padded / real tokens) | packed / unpacked speed, median | rounds |")
    print("|---:|---:|---:|---:|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for pool in args.pools:
            work = batches(config, pool, args.batches, seed=pool)
            padding = sum(ids.numel() for ids, _ in work) / sum(int(lengths.sum()) for _, lengths in work)
            ratios = compare(modules, work, args.rounds)
            print(f"| {threads} | {pool} | {padding:.3f} | {statistics.median(ratios):.3f} | "
                  f"{' '.join(f'{x:.2f}' for x in ratios)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
