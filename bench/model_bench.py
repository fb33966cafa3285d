"""The model's in-process ceiling: sequences/s and achieved GFLOP/s of the REFERENCE bundle, called the way
the service calls it (load_bundle: TorchScript, frozen, inference_mode), fp32 and bf16, on CPU, at
batch 1, 4, 16, 64 x length 32, 128, 512, next to a dense matmul's GFLOP/s measured in the same run.

    python -m bench.model_bench [--quick] [--out bench/out/model_bench.md] [--budget-s S]

FLOPs of one forward, B sequences of T tokens (no padding here), a multiply-add counted as 2:
    per layer  2*B*T*(4*d^2 + 2*d*d_ff)   the QKV (3 d^2) and output (d^2) projections, the two FFN matmuls
             + 4*B*T^2*d                  QK^T and attention x V
    times n_layers; embeddings, LayerNorm, softmax and activations (O(B*T*d)) are left out.
Each shape gets one warm-up call, then calls for at least 0.2 s (--quick) or 1 s; the fastest call
counts (on a shared machine noise only adds time). The matmul reference is a 1024^3 F.linear in the
same dtype, the best of 3 windows before and 3 after that precision's shapes. Bounded: a shape whose
predicted time (from the rate measured so far; shapes run cheapest first) does not fit what is left
of its precision's share of the budget is skipped and marked. The default budget (150 s of
measurement) makes ~2-3 min on 2 cores; --quick (22 s) ~30 s.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.bundle import load_bundle, read_manifest
from model.config import EncoderConfig
from model.default import build_default_bundle

BATCHES = (1, 4, 16, 64)
LENGTHS = (32, 128, 512)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_OUT = Path("bench/out/model_bench.md")


def forward_flops(config: EncoderConfig, batch: int, length: int) -> float:
    d, d_ff = config.d_model, config.d_ff
    per_layer = 2 * batch * length * (4 * d * d + 2 * d * d_ff) + 4 * batch * length * length * d
    return float(config.n_layers * per_layer)


def matmul_gflops(dtype: torch.dtype, seconds: float, n: int = 1024) -> float:
    """Dense n^3 product through F.linear (the op the projections use: on AVX2 CPUs a bf16 torch.mm takes
    a path ~10x slower than bf16 F.linear), best of 3 windows so a noisy neighbour does not set the bar."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    best = 0.0
    with torch.inference_mode():
        F.linear(a, b)  # warm-up
        for _ in range(3):
            calls, started = 0, time.perf_counter()
            while calls < 2 or time.perf_counter() - started < seconds / 3:
                F.linear(a, b)
                calls += 1
            best = max(best, 2 * n**3 * calls / (time.perf_counter() - started) / 1e9)
    return best


@dataclass
class Row:
    precision: str
    length: int
    batch: int
    ms_per_batch: float | None = None
    seq_per_s: float | None = None
    gflops: float | None = None
    of_matmul: float | None = None
    note: str = ""


def measure(module: torch.jit.ScriptModule, config: EncoderConfig, batch: int, length: int,
            min_seconds: float) -> float:
    """Seconds per forward: one warm-up call (TorchScript profiles new shapes), then timed calls for at
    least min_seconds; the fastest call counts, since a busy neighbour only ever adds time."""
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(batch))
    lengths = torch.full((batch,), length, dtype=torch.int64)
    times: list[float] = []
    with torch.inference_mode():
        module(ids, None, lengths, False, [])
        started = time.perf_counter()
        while not times or time.perf_counter() - started < min_seconds:
            t0 = time.perf_counter()
            module(ids, None, lengths, False, [])
            times.append(time.perf_counter() - t0)
    return min(times)


def run(quick: bool, budget_s: float, bundle_dir: Path) -> tuple[list[Row], dict[str, float]]:
    config = read_manifest(bundle_dir).config
    min_seconds = 0.2 if quick else 1.0
    deadline = time.perf_counter() + budget_s
    matmul_s = 0.3 if quick else 1.0
    peaks = {name: matmul_gflops(dtype, matmul_s) for name, dtype in DTYPES.items()}
    rows: dict[tuple[str, int, int], Row] = {}
    shapes = sorted(((t, b) for t in LENGTHS for b in BATCHES), key=lambda s: forward_flops(config, s[1], s[0]))
    with tqdm(total=len(DTYPES) * len(shapes), desc="model bench", unit="shape", file=sys.stderr) as bar:
        for i, precision in enumerate(DTYPES):
            module = load_bundle(bundle_dir, dtype=DTYPES[precision]).module
            # First guess of the achieved rate: a fraction of the matmul peak; then the last one measured
            # (shapes run cheapest first, so the last rate is the nearest in size).
            rate = peaks[precision] * 0.3 * 1e9
            now = time.perf_counter()
            precision_deadline = now + (deadline - now) / (len(DTYPES) - i)  # an equal share of what is left
            for length, batch in shapes:
                flops = forward_flops(config, batch, length)
                one = 1.5 * flops / rate  # 1.5: big batches fall out of cache and run slower per FLOP
                predicted = one + max(one, min_seconds)  # the warm-up call, then the timed ones
                left = precision_deadline - time.perf_counter()
                row = rows[precision, length, batch] = Row(precision, length, batch)
                if predicted > left:
                    row.note = f"skipped: ~{predicted:.0f} s predicted, {max(left, 0):.0f} s left"
                else:
                    seconds = measure(module, config, batch, length, min_seconds)
                    rate = flops / seconds
                    row.ms_per_batch = seconds * 1e3
                    row.seq_per_s = batch / seconds
                    row.gflops = rate / 1e9
                bar.update()
            # Measured again after the block: on a shared machine the best of the two is the fairer bar.
            peaks[precision] = max(peaks[precision], matmul_gflops(DTYPES[precision], matmul_s))
    for row in rows.values():
        if row.gflops is not None:
            row.of_matmul = row.gflops / peaks[row.precision]
    return [rows[p, t, b] for p in DTYPES for t in LENGTHS for b in BATCHES], peaks


def table(rows: list[Row]) -> str:
    lines = ["| precision | length | batch | ms/batch | seq/s | GFLOP/s | of matmul |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.ms_per_batch is None:
            lines.append(f"| {r.precision} | {r.length} | {r.batch} | {r.note} | | | |")
        else:
            lines.append(f"| {r.precision} | {r.length} | {r.batch} | {r.ms_per_batch:.1f} | {r.seq_per_s:.1f} | "
                         f"{r.gflops:.1f} | {r.of_matmul:.0%} |")
    return "\n".join(lines)


def report(rows: list[Row], peaks: dict[str, float], config: EncoderConfig, quick: bool, elapsed: float) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    head = [
        "# Model bench: the bundle through load_bundle (TorchScript, frozen), CPU",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- machine: {cpu}, {torch.get_num_threads()} torch threads, SIMD {torch.backends.cpu.get_cpu_capability()}",
        f"- torch {torch.__version__}, python {platform.python_version()}; mode {'quick' if quick else 'full'}, "
        f"{elapsed:.0f} s",
        f"- config: {config.to_json()}",
        "- dense 1024^3 matmul (F.linear, best of 6 windows around the shapes): "
        + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peaks.items()),
        "- FLOPs per forward: n_layers * (2*B*T*(4*d^2 + 2*d*d_ff) + 4*B*T^2*d); no padding",
        "",
    ]
    return "\n".join(head) + table(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 30 s instead of about 3 min")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"markdown report (default: {DEFAULT_OUT})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="measurement budget in seconds (default: 150, or 22 with --quick)")
    parser.add_argument("--bundle", type=Path, default=None,
                        help="an existing bundle directory (default: build the seed-0 default in a temp dir)")
    args = parser.parse_args(argv)
    budget = args.budget_s if args.budget_s is not None else (22.0 if args.quick else 150.0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        bundle_dir = args.bundle
        if bundle_dir is None:
            bundle_dir = Path(tmp) / "reference"
            build_default_bundle(bundle_dir, seed=0)
        rows, peaks = run(args.quick, budget, bundle_dir)
        config = read_manifest(bundle_dir).config
    text = report(rows, peaks, config, args.quick, time.perf_counter() - started)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
