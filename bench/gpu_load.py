"""The service phase of bench/gpu_check.py: what the service chooses at warm-up on this device with its defaults
(precision, batch budget, from ModelInfo), then `python -m service` under closed-loop load from several spawned
load-generator processes (one Python process may not keep up with a GPU), their reports merged; the tables."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections import Counter
from pathlib import Path
from queue import Empty
from typing import Any

from bench.gpu_model import MAX_BATCH_SIZE, PRESETS, ceiling, cell, fmt, preset_bundle
from tests.support.server_process import ServerProcess

SERVER_STATS = ("queue_ms", "compute_ms", "batch_size", "padded_length", "padding_ratio")


def _load_worker(queue: Any, barrier: Any, kwargs: dict[str, Any]) -> None:
    """One load-generator process: closed-loop callers on their own event loop, started with the others."""
    from client.load import run_load

    try:
        barrier.wait(timeout=60)
    except Exception:  # noqa: BLE001 - a broken barrier: start anyway, the merge reports what was measured
        pass
    try:
        queue.put(asyncio.run(run_load(**kwargs)).to_dict(samples=True))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        queue.put({"error": f"{type(e).__name__}: {e}"})


def drive(target: str, concurrency: int, procs: int, length: int, output: str, args: argparse.Namespace,
          connections: int = 1, **load: Any) -> dict[str, Any]:
    """Closed-loop load from `procs` processes sharing `concurrency` callers; their reports merged. `load`:
    more run_load arguments, or ones that replace these (texts=..., pooling="model")."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
    shares = [s for s in (concurrency // procs + (i < concurrency % procs) for i in range(procs)) if s]
    queue, barrier = ctx.Queue(), ctx.Barrier(len(shares))
    workers = [ctx.Process(target=_load_worker, daemon=True, args=(queue, barrier, dict(
        target=target, concurrency=share, duration_s=args.duration, warmup_s=args.warmup, lengths=(length, length),
        seed=1000 * i + length, pooling="mean" if output == "pooled" else "none", return_hidden=output != "pooled",
        connections=connections,
    ) | load)) for i, share in enumerate(shares)]
    for w in workers:
        w.start()
    parts: list[dict[str, Any]] = []
    try:
        end = time.monotonic() + args.warmup + args.duration + 60
        while len(parts) < len(workers):
            try:
                parts.append(queue.get(timeout=1.0))
            except Empty:
                if time.monotonic() > end or not any(w.is_alive() for w in workers):
                    raise RuntimeError(f"{len(workers) - len(parts)} load process(es) sent no report") from None
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.terminate()
    failed = [p["error"] for p in parts if "error" in p]
    if failed:
        raise RuntimeError(failed[0])
    return merge(parts)


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the processes' ones: rates added, latency percentiles over all samples, the
    server's per-batch statistics weighted by each process's completed calls."""
    import numpy as np

    samples = np.concatenate([np.asarray(p["samples_ms"], dtype=float) for p in parts])
    errors: Counter[str] = Counter()
    for p in parts:
        errors.update(p["errors"])

    def mean(key: str) -> float | None:
        pairs = [(p["server"][key], p["ok"]) for p in parts if p["ok"] and p["server"][key] is not None]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else None

    latency = np.percentile(samples, [50, 90, 99]).tolist() if samples.size else None
    return {"ok": sum(p["ok"] for p in parts), "errors": dict(errors),
            "sequences_per_s": sum(p["sequences_per_s"] for p in parts),
            "tokens_per_s": sum(p["tokens_per_s"] for p in parts),
            "latency_ms": None if latency is None else dict(zip(("p50", "p90", "p99"), latency, strict=True)),
            "server": {k: mean(k) for k in SERVER_STATS},
            "loadgen_cpu": sum(p["client_cpu"] for p in parts), "loadgen_cpu_max": max(p["client_cpu"] for p in parts)}


CHOICES = ("precision", "precision_reason", "precision_forward_ms", "batch_budget", "backend")  # of ModelInfo


def warmup_choices(bundle: Path, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Start the service on `bundle` with its defaults (`precision auto`, the budget measured at warm-up) and
    return what it chose and why, as its ModelInfo says (the fields of CHOICES that it has)."""
    import grpc
    from google.protobuf import json_format

    from proto.attention.v1 import attention_pb2 as pb
    from proto.attention.v1 import attention_pb2_grpc as pb_grpc

    server = ServerProcess(bundle, "--device", args.device, "--max-batch-size", str(MAX_BATCH_SIZE), "--log-level",
                           "warning", pinned=False, timeout=max(10.0, min(240.0, deadline - time.monotonic() - 10)))
    try:
        with grpc.insecure_channel(server.target) as channel:
            info = pb_grpc.AttentionServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    finally:
        server.stop()
    fields = json_format.MessageToDict(info, preserving_proto_field_name=True)
    return {name: fields[name] for name in CHOICES if name in fields}


def choices_lines(choices: dict[str, Any]) -> list[str]:
    if not choices:
        return []
    budget = choices.get("batch_budget", {})
    curve = ", ".join(f"{k}: {float(v):.0f}" for k, v in sorted(budget.get("tokens_per_second", {}).items(),
                                                                key=lambda kv: int(kv[0])))
    return ["", "Chosen at warm-up by the service's defaults (`--precision auto`, budget measured; ModelInfo):", "",
            f"- precision {choices.get('precision', '?')}: {choices.get('precision_reason', '')}",
            f"- max_batch_tokens {budget.get('max_batch_tokens', '?')}: {budget.get('reason', '')}"
            + (f" (tokens/s by batch tokens: {curve})" if curve else "")]


def phase_service(args: argparse.Namespace, deadline: float, record: dict[str, Any], model: dict[str, Any]
                  ) -> dict[str, Any]:
    bundle, lengths = preset_bundle(args.preset), PRESETS[args.preset][1]
    try:  # first: a short start-up, and the measured choices are part of what the phase reports
        record["choices"] = warmup_choices(bundle, args, deadline)
        print("\n".join(choices_lines(record["choices"])), flush=True)
    except Exception as e:  # noqa: BLE001 - recorded; the load runs still run
        record["choices"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    flags = ["--device", args.device, "--precision", args.precision, "--max-batch-size", str(MAX_BATCH_SIZE),
             "--max-batch-tokens", str(args.max_batch_tokens)]
    record["server_flags"] = flags
    runs: list[dict[str, Any]] = record.setdefault("runs", [])
    started = time.monotonic()
    server = ServerProcess(bundle, *flags, "--log-level", "warning", pinned=False, directory=args.out,
                           timeout=min(240.0, deadline - started - 10))
    print(f"  server {server.target} ready in {time.monotonic() - started:.0f} s", flush=True)
    P = args.loadgen_procs
    # The target runs (concurrency 64, all load processes) first, so a short budget still measures them.
    plan = [(64, P, "pooled"), (64, 1, "pooled"), (64, P, "hidden")] + ([] if args.quick else
                                                                        [(16, P, "pooled"), (256, P, "pooled")])
    plan = list(dict.fromkeys(plan))  # with one load process, (64, 1) is (64, P)
    try:
        for c, procs, output in plan:
            for T in lengths:
                runs.append(_measure(server, model, args, deadline, T, c, procs, output))
        # Edge processes (docs/edge-processes.md): one process against N in front of the same model,
        # several connections per load process so that the kernel spreads them over the edges.
        if args.edge_processes:
            for c in (64, 256):
                runs.append(_measure(server, model, args, deadline, lengths[0], c, P, "pooled", edges=0))
    finally:
        server.stop()
    if args.edge_processes and time.monotonic() + 60 < deadline:
        server = ServerProcess(bundle, *flags, "--edge-processes", str(args.edge_processes), "--log-level",
                               "warning", pinned=False, directory=args.out / "edges",
                               timeout=min(240.0, deadline - time.monotonic()))
        try:
            for c in (64, 256):
                runs.append(_measure(server, model, args, deadline, lengths[0], c, P, "pooled",
                                     edges=args.edge_processes))
        finally:
            server.stop()
    measured = [r for r in runs if "sequences_per_s" in r]
    return {"status": "ok" if measured and all(not r["errors"] for r in measured) else "fail"}


EDGE_CONNECTIONS = 8  # per load process, in the edge-process comparison


def _measure(server: ServerProcess, model: dict[str, Any], args: argparse.Namespace, deadline: float, T: int,
             c: int, procs: int, output: str, edges: int | None = None) -> dict[str, Any]:
    """One load run; `edges` set: a run of the edge-process comparison (0: the one-process side)."""
    run: dict[str, Any] = {"length": T, "concurrency": c, "procs": procs, "output": output}
    if edges is not None:
        run["edges"] = edges
    if time.monotonic() + args.warmup + args.duration + 5 > deadline:
        return {**run, "skipped": "out of time"}
    try:
        run.update(drive(server.target, c, procs, T, output, args,
                         connections=EDGE_CONNECTIONS if edges is not None else 1))
        roof = ceiling(model, T)
        if roof is not None:
            run.update(ceiling_seq_s=roof["seq_s"], ratio=run["sequences_per_s"] / roof["seq_s"])
        print(f"  {_run_line(run)}", flush=True)
    except Exception as e:  # noqa: BLE001 - one failed run does not end the phase
        run["error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"  T={T} c={c} x{procs} {output}: {run['error']}", flush=True)
    return run


def _output(r: dict[str, Any]) -> str:
    if "edges" not in r:
        return str(r["output"])
    return f"{r['output']}, {r['edges'] or 'no'} edge procs, {EDGE_CONNECTIONS} conns/proc"


def _run_line(r: dict[str, Any]) -> str:
    lat = r.get("latency_ms") or {"p50": float("nan"), "p99": float("nan")}
    ratio = f"{r['ratio']:.2f} of ceiling" if "ratio" in r else "no ceiling"
    return (f"T={r['length']} c={r['concurrency']} x{r['procs']} {_output(r)}: {r['sequences_per_s']:.1f} seq/s "
            f"({ratio}), p50 {lat['p50']:.1f} p99 {lat['p99']:.1f} ms, batch {r['server']['batch_size'] or 0:.1f}, "
            f"loadgen {r['loadgen_cpu']:.2f} CPU s/s (max {r['loadgen_cpu_max']:.2f}/proc), errors {r['errors'] or 0}")


def service_table(service: dict[str, Any]) -> list[str]:
    choices = service.get("choices", {})
    intro = choices_lines(choices) if "error" not in choices else ["", f"Warm-up choices: {choices['error']}"]
    if not service.get("runs"):
        return intro
    lines = [*intro, "", f"Service under load (`python -m service {' '.join(service['server_flags'])}`):", "",
             "| length | conc. | procs | output | seq/s | of ceiling | p50 ms | p99 ms | queue ms | compute ms | "
             "batch | loadgen CPU s/s (max/proc) | errors |", "|" + "---|" * 13]
    for r in service["runs"]:
        head = f"| {r['length']} | {r['concurrency']} | {r['procs']} | {_output(r)} | "
        if "sequences_per_s" not in r:
            lines.append(head + f"{cell(r.get('skipped') or r.get('error'))} |" + " |" * 8)
            continue
        lat, srv = r["latency_ms"] or {}, r["server"]
        lines.append(head + f"{r['sequences_per_s']:.1f} | {fmt(r.get('ratio'), '.2f')} | {fmt(lat.get('p50'))} | "
                     f"{fmt(lat.get('p99'))} | {fmt(srv['queue_ms'])} | {fmt(srv['compute_ms'])} | "
                     f"{fmt(srv['batch_size'])} | {r['loadgen_cpu']:.2f} ({r['loadgen_cpu_max']:.2f}) | "
                     f"{sum(r['errors'].values())} |")
    return lines
