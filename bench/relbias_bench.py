"""What a relative position bias costs on CPU, in process: SDPA with the boolean padding mask (how a model
without a bias runs) against SDPA with a float mask (bias + mask, how model.encoder runs one), for one
attention call, and whole REFERENCE encoders with relative_bias none / shared / per_layer.

    python -m bench.relbias_bench [--rounds 7] [--threads 1 2]

Alternating passes over the same padded batches (lengths down to half the padded length), median of rounds;
bounded: threads x shapes x rounds passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from model.bundle import script
from model.config import REFERENCE
from model.encoder import Encoder

SHAPES = ((8, 128), (4, 512))  # (B, T)


def _time(fn, passes: int = 3) -> float:  # noqa: ANN001
    fn()
    start = time.perf_counter()
    for _ in range(passes):
        fn()
    return (time.perf_counter() - start) / passes * 1e3


def _attention(B: int, T: int, rounds: int) -> tuple[float, float]:
    nh, hs = REFERENCE.n_heads, REFERENCE.d_head
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, nh, T, hs, generator=g) for _ in range(3))
    lengths = torch.linspace(T, T // 2, B).long()
    mask = (torch.arange(T)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)
    bias = torch.randn(nh, T, T, generator=g)
    low = torch.finfo(torch.float32).min

    def boolean() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def floating() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].masked_fill(~mask, low))  # (B, nh, T, T)

    b, f = [], []
    with torch.inference_mode():
        for _ in range(rounds):
            b.append(_time(boolean))
            f.append(_time(floating))
    return statistics.median(b), statistics.median(f)


def _encoders(B: int, T: int, rounds: int) -> dict[str, float]:
    models = {r: script(Encoder(dataclasses.replace(REFERENCE, relative_bias=r)).init_weights(0).eval())
              for r in ("none", "shared", "per_layer")}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, REFERENCE.vocab_size, (B, T), generator=g)
    lengths = torch.linspace(T, T // 2, B).long()
    times: dict[str, list[float]] = {r: [] for r in models}
    with torch.inference_mode():
        for _ in range(rounds):
            for r, m in models.items():
                times[r].append(_time(lambda m=m: m(ids, None, lengths, False, [])))
    return {r: statistics.median(t) for r, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relbias_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    print("| threads | B x T | SDPA bool mask ms | SDPA float mask ms | ratio | encoder none ms | shared ms | "
          "per_layer ms | shared / none |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for B, T in SHAPES:
            b, f = _attention(B, T, args.rounds)
            e = _encoders(B, T, args.rounds)
            print(f"| {threads} | {B} x {T} | {b:.2f} | {f:.2f} | {f / b:.2f} | {e['none']:.1f} | {e['shared']:.1f} | "
                  f"{e['per_layer']:.1f} | {e['shared'] / e['none']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
