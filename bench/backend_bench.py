"""In-process ceiling of the compiled backend (AOTInductor, model.pt2) against the TorchScript module (model.pt).

    python -m bench.backend_bench [--bundle DIR] [--threads 2] [--rounds 7] [--max-batch-size 64] [--device cpu]

Without --bundle it builds the default bundle (model/default.py, REFERENCE, seed 0) in a temporary directory and
compiles its model.pt2 (python -m model compile-aoti); a --bundle without manifest.aoti is compiled in place.
Cases: B = 1, 4, 8 rows of T = 128 tokens (no padding) and a mixed set (32 sequences of 16..256 tokens, seeded,
sorted by length, in batches of 8: padded). Each round times every case once on each backend, the order
alternating between rounds (A then B, then B then A); a case's time is the median over rounds. fp32, the
serving call (ids in, no attention weights, every layer). Prints a markdown table and the B/A ratios.
--device cuda (not run yet: no GPU here) compiles a CUDA model.pt2 on the spot (a --bundle must not hold a CPU one)
and times each case to a torch.cuda.synchronize().
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from model.aoti import compile_aoti
from model.bundle import load_bundle, load_compiled, read_manifest
from model.default import build_default_bundle

Batch = tuple[torch.Tensor, torch.Tensor]


def cases(vocab: int, max_length: int) -> dict[str, list[Batch]]:
    rng = np.random.default_rng(0)
    out: dict[str, list[Batch]] = {}
    t = min(128, max_length)
    for b in (1, 4, 8):
        out[f"B={b} T={t}"] = [(torch.from_numpy(rng.integers(0, vocab, (b, t))), torch.full((b,), t))]
    lengths = sorted(int(x) for x in rng.integers(min(16, max_length), min(256, max_length) + 1, 32))
    mixed = []
    for i in range(0, 32, 8):
        rows = lengths[i:i + 8]
        ids = torch.from_numpy(rng.integers(0, vocab, (len(rows), max(rows))))
        mixed.append((ids, torch.tensor(rows)))
    out[f"mixed {min(16, max_length)}..{min(256, max_length)} (32 seqs, batches of 8)"] = mixed
    return out


def run(bundle: Path, threads: int, rounds: int, device: str = "cpu") -> list[tuple[str, float, float]]:
    torch.set_num_threads(threads)
    scripted = load_bundle(bundle, device=device).module
    compiled = load_compiled(bundle, read_manifest(bundle), device=device, reference=scripted)
    cfg = read_manifest(bundle).config

    def ts(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = scripted(ids, None, lengths, False, [])[0]
        return out

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    backends: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"torchscript": ts,
                                                                                 "aoti": compiled}
    table = {case: [(ids.to(device), lengths) for ids, lengths in batches]  # lengths stay on the host
             for case, batches in cases(max(1, cfg.vocab_size - cfg.vocab_size // 10), cfg.max_length).items()}
    times: dict[tuple[str, str], list[float]] = {(c, b): [] for c in table for b in backends}
    for _ in range(2):  # warm: TorchScript profiles and specialises on its first calls
        for batches in table.values():
            for fn in backends.values():
                for ids, lengths in batches:
                    fn(ids, lengths)
    for r in range(rounds):
        order = list(backends) if r % 2 == 0 else list(reversed(backends))
        for case, batches in table.items():
            for name in order:
                fn = backends[name]
                started = time.perf_counter()
                for ids, lengths in batches:
                    fn(ids, lengths)
                sync()
                times[(case, name)].append(time.perf_counter() - started)
    return [(case, statistics.median(times[(case, "torchscript")]) * 1e3,
             statistics.median(times[(case, "aoti")]) * 1e3) for case in table]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backend_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=None, help="bundle directory (default: build the default one)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: 7)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="compile for batches up to this (default: 64)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device (default: cpu)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle
        if bundle is None:
            bundle = Path(tmp) / "default"
            build_default_bundle(bundle)
        if read_manifest(bundle).aoti is None:
            started = time.perf_counter()
            compile_aoti(bundle, max_batch_size=args.max_batch_size, device=args.device)
            print(f"compiled {bundle}/model.pt2 in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        rows = run(bundle, args.threads, args.rounds, args.device)
    print(f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}, {args.threads} thread(s), "
          f"{args.rounds} rounds, {args.device}, torch {torch.__version__}")
    print("| case | TorchScript ms | AOTI ms | AOTI / TorchScript |")
    print("|---|---:|---:|---:|")
    for case, a, b in rows:
        print(f"| {case} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
