"""The model phase of bench/gpu_check.py: the preset's in-process ceiling against a dense matmul, and the
service's own batch path; the table that reports them."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

PRESETS = {  # EncoderConfig fields, the lengths measured, the batch sizes tried
    "large": (dict(d_model=1024, n_heads=16, n_layers=12, d_ff=4096, vocab_size=8192, max_length=512),
              (128, 512), (1, 8, 16, 32, 64, 128)),
    "tiny": (dict(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=100, max_length=64), (16, 64), (1, 8, 32)),
}
MAX_BATCH_SIZE = 64  # the server's default, passed explicitly


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def cell(text: Any) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:200]


def time_calls(fn: Any, device: str, min_s: float) -> float:
    """Seconds per call of fn(): 3 warm-up calls (TorchScript profiles on the first, optimizes on the
    second), then 3 windows of about min_s/3, timed with CUDA events on a GPU; the fastest window counts."""
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        for _ in range(3):
            fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        n = max(1, int(min_s / 3 / max(time.perf_counter() - t0, 1e-6)))
        best = float("inf")
        for _ in range(3):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(n):
                    fn()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3 / n)
            else:
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                best = min(best, (time.perf_counter() - t0) / n)
    return best


def matmul_tflops(device: str, dtype: Any, min_s: float) -> float:
    """The dense rate to compare with: F.linear (the projections' op) on n x n, best of the sizes."""
    import torch
    import torch.nn.functional as F

    best = 0.0
    for n in ((4096, 8192) if device == "cuda" else (1024,)):
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
        best = max(best, 2 * n**3 / time_calls(lambda a=a, b=b: F.linear(a, b), device, min_s) / 1e12)
    return best


def preset_bundle(preset: str) -> Path:
    """The preset's bundle from seed 0, built once into a temp-dir cache (a rerun reuses it)."""
    from model.bundle import MANIFEST_FILE, save_bundle
    from model.config import EncoderConfig
    from model.encoder import Encoder

    config = EncoderConfig(**PRESETS[preset][0])
    digest = hashlib.sha256(config.to_json().encode()).hexdigest()[:12]
    final = Path(tempfile.gettempdir()) / "attention-gpu-check" / f"{preset}-{digest}"
    if not (final / MANIFEST_FILE).is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            save_bundle(Encoder(config).init_weights(0), tmp / "b", name=f"attention-{preset}", version="1",
                        source="seed:0")
            os.rename(tmp / "b", final)
        except OSError:
            if not (final / MANIFEST_FILE).is_file():  # else another run finished it first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def phase_model(args: argparse.Namespace, deadline: float, record: dict[str, Any]) -> dict[str, Any]:
    """Fills record: matmul_tflops, rows (one per length and batch) and service_path (one per length)."""
    import numpy as np
    import torch
    from prometheus_client import CollectorRegistry

    from bench.model_bench import forward_flops
    from model.bundle import load_bundle, read_manifest
    from service.config import ServiceConfig
    from service.device import DTYPES
    from service.jobs import POOL_MEAN, Job
    from service.metrics import Metrics
    from service.runner import Runner

    started, cuda = time.monotonic(), args.device == "cuda"
    bundle = preset_bundle(args.preset)
    config, lengths, batches = read_manifest(bundle).config, PRESETS[args.preset][1], PRESETS[args.preset][2]
    print(f"  bundle {bundle} ({time.monotonic() - started:.0f} s)", flush=True)
    dtype, min_s = DTYPES[args.precision], (0.1 if args.quick else 0.3)
    peak = matmul_tflops(args.device, dtype, min_s)
    print(f"  {args.precision} matmul {peak:.4g} TFLOP/s", flush=True)
    record.update(bundle=str(bundle), config=config.to_dict(), precision=args.precision, matmul_tflops=peak)
    rows: list[dict[str, Any]] = record.setdefault("rows", [])
    path: dict[str, Any] = record.setdefault("service_path", {})
    module = load_bundle(bundle, device=args.device, dtype=dtype).module
    rate = 0.3 * peak * 1e12  # first guess of the achieved rate; then the last measured (cheap shapes first)
    for T in lengths:
        for B in batches:
            if B * T > 2 * args.max_batch_tokens:
                continue
            flops = forward_flops(config, B, T)
            row: dict[str, Any] = {"length": T, "batch": B,
                                   "in_service_limits": B <= MAX_BATCH_SIZE and B * T <= args.max_batch_tokens}
            if time.monotonic() + (12 if cuda else 6) * flops / rate + 2 * min_s > deadline - 15:
                rows.append({**row, "skipped": "out of time"})
                continue
            g = torch.Generator().manual_seed(B * T)
            ids = torch.randint(0, config.vocab_size, (B, T), generator=g).to(args.device)
            # No row is padded. Lengths on the host let Encoder.forward see that without a device sync, so
            # SDPA gets no mask (flash on CUDA); on the device they take the masked path.
            host = torch.full((B,), T, dtype=torch.int64, pin_memory=cuda)
            on_device = host.to(args.device)
            try:
                seconds = time_calls(lambda ids=ids, n=host, m=module: m(ids, None, n, False, []), args.device, min_s)
                masked = time_calls(lambda ids=ids, n=on_device, m=module: m(ids, None, n, False, []),
                                    args.device, min_s) if cuda else None
            except RuntimeError as e:  # e.g. out of memory: the other shapes still count
                rows.append({**row, "skipped": f"{type(e).__name__}: {e}"[:200]})
                continue
            rate, masked_ms = flops / seconds, None if masked is None else masked * 1e3
            rows.append({**row, "ms": seconds * 1e3, "masked_ms": masked_ms, "seq_s": B / seconds,
                         "tflops": rate / 1e12, "of_matmul": rate / 1e12 / peak})
            print(f"  T={T} B={B}: {seconds * 1e3:.2f} ms (masked {fmt(masked_ms, '.2f')}), {B / seconds:.1f} seq/s, "
                  f"{rate / 1e12:.4g} TFLOP/s ({rate / 1e12 / peak:.0%} of matmul)", flush=True)
    del module
    if cuda:
        torch.cuda.empty_cache()
    # The service's own per-batch path at its largest batch, mean-pooled as in the load runs.
    runner = Runner(ServiceConfig(device=args.device, precision=args.precision, nonfinite_policy="fail"),
                    str(bundle), Metrics(CollectorRegistry()))
    runner.load()
    for T in lengths:
        B = min(MAX_BATCH_SIZE, args.max_batch_tokens // T)
        if time.monotonic() + 2 > deadline:
            break
        seq = np.random.default_rng(T).integers(0, config.vocab_size, T)
        jobs = [Job(seq, None, pooling=POOL_MEAN, return_hidden=False)] * B
        # Wall time ("cpu" timing): execute() returns once the outputs are back on the host.
        seconds = time_calls(lambda jobs=jobs, r=runner: r.execute(jobs), "cpu", min_s)
        path[str(T)] = {"batch": B, "ms": seconds * 1e3, "seq_s": B / seconds}
        print(f"  service path T={T} B={B}: {seconds * 1e3:.2f} ms, {B / seconds:.1f} seq/s", flush=True)
    del runner
    if cuda:
        torch.cuda.empty_cache()
    return {"status": "ok"}


def ceiling(model: dict[str, Any], T: int, within_service: bool = True) -> dict[str, Any] | None:
    """The fastest measured row at length T (within the server's batch limits unless told otherwise)."""
    rows = [r for r in model.get("rows", []) if r["length"] == T and "seq_s" in r
            and (r["in_service_limits"] or not within_service)]
    return max(rows, key=lambda r: r["seq_s"], default=None)


def model_table(model: dict[str, Any]) -> list[str]:
    if not model.get("rows"):
        return []
    lines = ["", f"Model ceiling ({model['precision']}; dense matmul {model['matmul_tflops']:.4g} TFLOP/s; "
                 "lengths on the host, no padding: SDPA without a mask; masked: lengths on the device):", "",
             "| length | batch | ms/batch | masked ms | seq/s | TFLOP/s | of matmul | within service limits |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in model["rows"]:
        cells = (f"{cell(r['skipped'])} | | | | | |" if "skipped" in r else
                 f"{r['ms']:.2f} | {fmt(r['masked_ms'], '.2f')} | {r['seq_s']:.1f} | {r['tflops']:.4g} | "
                 f"{r['of_matmul']:.0%} | {'yes' if r['in_service_limits'] else 'no'} |")
        lines.append(f"| {r['length']} | {r['batch']} | {cells}")
    for T, p in model.get("service_path", {}).items():
        lines.append(f"- service batch path (Runner.execute, mean-pooled), T={T} B={p['batch']}: "
                     f"{p['ms']:.2f} ms, {p['seq_s']:.1f} seq/s")
    return lines
