"""`make gpu-check`: the GPU checks of the performance issue in one bounded, non-interactive run.

    make gpu-check [GPU_PYTHON=python3] [GPU_CHECK_ARGS=--quick]    # = $(GPU_PYTHON) -m bench.gpu_check
    python3 -m bench.gpu_check [--quick] [--out DIR] [--budget-s 450] [--minilm DIR]   # a python with CUDA torch

Four phases inside --budget-s (450 s by default: about 8 minutes with start-up), each with its own
deadline; a phase that fails or runs out of time is recorded, and the next one still runs:
  tests    `pytest -m gpu tests/gpu/test_gpu.py`: fp16/bf16 vs fp32, SDPA backends vs the explicit path, flash on
           unpadded batches, NaN recovery and out-of-memory splits through the service on CUDA. (The rest of
           the suite pins device cpu in tests/conftest.py: it means the same here and is not rerun.)
  model    (bench/gpu_model.py) the LARGE preset (d_model 1024, 16 heads, 12 layers, d_ff 4096, vocab 8192,
           max_length 512; seed 0, no download) in bf16 at lengths 128 and 512 over batch sizes, timed with
           CUDA events: lengths on the host (no row padded: SDPA without a mask, flash-eligible) and on the
           device (the masked path); against a bf16 F.linear matmul timed the same way; and the service's
           batch path (service.runner.Runner.execute: collate, copy in, forward, copy out, pool).
  service  (bench/gpu_load.py) first what the service chooses at warm-up with its defaults (precision auto, the
           batch budget measured on the device: ModelInfo's precision, precision_reason, batch_budget), then
           `python -m service` on that bundle (cuda, bf16) under closed-loop load
           (client.load.run_load) from several spawned load-generator processes (their CPU seconds per
           second are reported), lengths fixed at 128 and 512, mean-pooled outputs, at concurrency 64
           (1 process and all), 16 and 256, and 64 returning hidden states. It ends 20% of the budget before
           the end when the minilm phase will run.
  minilm   (bench/gpu_minilm.py) all-MiniLM-L6-v2 from the fp16 copy in --minilm (.whl/minilm-fp16, written by
           `make gpu-minilm`), converted on the spot to an fp32 bundle: exactness against the committed
           sentence-transformers references (tests/data) in fp32 (min cosine >= 0.99999), fp16 and bf16 on the
           device; texts through the service at concurrency 64, 16, 1 against the in-process ceiling; 16-token
           calls/s at 64 and 256 callers. Without the folder it is not run (results.json "not_run"; not a failure).
The summary table is printed last; results.json, results.md, pytest_gpu.log and server.log go to --out ($OUT
when set, else bench/out/gpu). Targets, reported and not enforced: at length 512 the model reaches 40% of the
matmul rate, and the service at concurrency 64 reaches 0.8 of the model's ceiling within its batch limits.
Exit status: 0 every phase ran, 1 a phase or a CUDA test failed, 2 no CUDA, 3 a dependency is missing.

On the project's H200 machines (python3 3.12 with CUDA torch 2.11, hypothesis, numpy, tqdm; no network):
`make gpu-wheels` here downloads into .whl/ (ignored by git) the wheels it lacks, pinned as requirements*.txt
(20 MB), and writes .whl/minilm-fp16 (38 MB; `make gpu-minilm` alone rewrites it): .whl and the tracked tree
came to 59.5 MiB of the 64 MiB a device call carries (2026-12-01; gpu-minilm fails when they do not fit).
Then one device call, carry [".whl"], timeout_s 540 (one run fits in the 15 minutes with the machine's
start; no rerun does, so a retry is `--quick`, 240 s):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 && python3 -m bench.gpu_check
Elsewhere, online: the dependencies are requirements.txt without torch, and pytest-asyncio, pytest-timeout
and hypothesis. Nothing is installed by this script; what is missing is named (exit 3). pytest runs with the
project's plugins only (PYTEST_DISABLE_PLUGIN_AUTOLOAD), whatever else the image holds.
CPU smoke test (tests/bench/test_gpu_check.py): --device cpu --quick --preset tiny (and the minilm phase on CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from bench.gpu_load import phase_service, service_table
from bench.gpu_minilm import FOLDER, minilm_table, phase_minilm, summary_rows
from bench.gpu_model import PRESETS, ceiling, cell, fmt, model_table, phase_model

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("grpc", "grpc_health", "grpc_reflection", "grpc_status", "google.protobuf", "google.rpc",
            "prometheus_client", "numpy", "tqdm", "pytest", "pytest_asyncio", "pytest_timeout", "hypothesis",
            "tritonclient.grpc",  # the KServe v2 front door's stubs (service/doors/kserve/)
            "tokenizers", "safetensors")  # text bundles; convert-hf (the minilm phase)
MINILM_SHARE = 0.2  # of the budget, kept for the minilm phase when its folder is there
# The project's pytest plugins and no others (a GPU image may hold xdist, cov, benchmark ...).
PYTEST = ("-q", "-p", "no:cacheprovider", "-p", "pytest_asyncio.plugin", "-p", "pytest_timeout",
          "-p", "_hypothesis_pytestplugin")
MODEL_TARGET, SERVICE_TARGET = 0.40, 0.80


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def environment(device: str) -> dict[str, Any]:
    """Print and return what this runs on; exits 3 when torch itself is missing."""
    if not _importable("torch"):
        print(f"error: {sys.executable} has no torch; use GPU_PYTHON=<a python with CUDA torch>", file=sys.stderr)
        sys.exit(3)
    import torch

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": sys.executable,
        "python_version": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count(), "device": device,
        "command": " ".join(["python", "-m", "bench.gpu_check", *sys.argv[1:]]),
    }
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")
    for key, value in info.items():
        print(f"{key}: {value}", flush=True)
    return info


# -- phase: tests ---------------------------------------------------------------------------------

COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
PROGRESS = re.compile(r"^[.FEsxX]+(\s+\[\s*\d+%\])?\s*$")
CHARS = {".": "passed", "F": "failed", "E": "error", "s": "skipped", "x": "xfailed", "X": "xpassed"}


def run_pytest(pytest_args: list[str], timeout: float, log: Path, device: str) -> dict[str, Any]:
    """pytest in a subprocess, in its own process group (killed whole on timeout); the counts come from
    its summary line, or from the progress characters when it was cut off. On --device cpu it sees no GPU."""
    cmd = [sys.executable, "-m", "pytest", *PYTEST, *pytest_args]
    print(f"  $ {' '.join(cmd[1:])}  (timeout {timeout:.0f} s)", flush=True)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        output, timed_out = proc.communicate(timeout=max(timeout, 1.0))[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, timed_out = proc.communicate()[0], True
    except BaseException:  # SIGTERM: take pytest and what it started along
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    log.write_text(output)
    lines = output.splitlines()
    summary = next((line for line in reversed(lines) if COUNT.search(line) and " in " in line), "")
    counts: Counter[str] = Counter()
    if summary and not timed_out:
        for n, what in COUNT.findall(summary):
            counts["error" if what.startswith("error") else what] += int(n)
    else:
        for line in lines:
            if PROGRESS.match(line):
                counts.update(CHARS[c] for c in line.split()[0])
    result = {"args": pytest_args, "rc": proc.returncode, "timed_out": timed_out, "counts": dict(counts),
              "seconds": round(time.monotonic() - started, 1), "log": log.name, "tail": lines[-15:]}
    print(f"  -> {_counts(result)}", flush=True)
    return result


def _counts(run: dict[str, Any]) -> str:
    text = ", ".join(f"{n} {what}" for what, n in sorted(run["counts"].items())) or "no tests counted"
    return text + (f" (cut off at {run['seconds']:.0f} s)" if run["timed_out"] else "")


def phase_tests(args: argparse.Namespace, deadline: float, record: dict[str, Any]) -> dict[str, Any]:
    runs = record.setdefault("runs", {})
    gpu = runs["gpu"] = run_pytest(["-m", "gpu", "tests/gpu/test_gpu.py"], min(130.0, deadline - time.monotonic()),
                                   args.out / "pytest_gpu.log", args.device)
    ok = gpu["rc"] == 0 and not gpu["timed_out"] and not gpu["counts"].get("failed") and not gpu["counts"].get("error")
    if args.device == "cuda" and not gpu["counts"].get("passed"):
        ok = False  # on a GPU, all skipped means the tests did not see CUDA
    return {"status": "ok" if ok else "fail", "runs": runs}


# -- report ---------------------------------------------------------------------------------------

def summary_table(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    phases = results["phases"]
    tests, model, service = (phases.get(k, {}) for k in ("tests", "model", "service"))
    rows = []

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    if "gpu" in tests.get("runs", {}):
        rows.append(("CUDA tests (tests/gpu/test_gpu.py)", _counts(tests["runs"]["gpu"]), "all pass",
                     verdict(tests["status"] == "ok")))
    if "matmul_tflops" in model:
        rows.append((f"{args.precision} matmul (F.linear)", f"{model['matmul_tflops']:.4g} TFLOP/s", "", ""))
    lengths = PRESETS[args.preset][1]
    for T in lengths:
        best, last = ceiling(model, T, within_service=False), T == lengths[-1]
        masked = "" if best is None or best["masked_ms"] is None else f"; masked {best['masked_ms']:.2f} ms"
        rows.append((f"model T={T}", "not measured" if best is None else
                     f"{best['seq_s']:.1f} seq/s (batch {best['batch']}, {best['ms']:.2f} ms{masked}), "
                     f"{best['of_matmul']:.0%} of matmul",
                     f">= {MODEL_TARGET:.0%} of matmul" if last else "info",
                     verdict(None if best is None else best["of_matmul"] >= MODEL_TARGET) if last else "-"))
    for T in lengths:
        last = T == lengths[-1]
        run = next((r for r in service.get("runs", []) if r["length"] == T and r["concurrency"] == 64
                    and r["procs"] == args.loadgen_procs and r["output"] == "pooled" and "sequences_per_s" in r), None)
        ratio = None if run is None else run.get("ratio")
        result = "not measured" if run is None else (
            f"{run['sequences_per_s']:.1f} seq/s" + (f" = {ratio:.2f} of {run['ceiling_seq_s']:.1f}" if ratio else
                                                     " (no ceiling)") +
            f"; p99 {fmt((run['latency_ms'] or {}).get('p99'))} ms; loadgen {run['loadgen_cpu']:.1f} CPU s/s")
        rows.append((f"service T={T}, c64, {args.loadgen_procs} load procs", result,
                     f">= {SERVICE_TARGET} of ceiling" if last else "info",
                     verdict(None if ratio is None else ratio >= SERVICE_TARGET) if last else "-"))
    edge_runs = {(r["edges"], r["concurrency"]): r for r in service.get("runs", [])
                 if "edges" in r and "sequences_per_s" in r}
    for c in (64, 256):  # docs/edge-processes.md: N edge processes against one process
        one, many = edge_runs.get((0, c)), edge_runs.get((args.edge_processes, c))
        if one is not None and many is not None:
            rows.append((f"service T={lengths[0]}, c{c}, {args.edge_processes} edge procs",
                         f"{many['sequences_per_s']:.1f} seq/s = {many['sequences_per_s'] / one['sequences_per_s']:.2f}"
                         f"x one process ({one['sequences_per_s']:.1f})", "info", "-"))
    rows += summary_rows(phases.get("minilm", {}), results.get("not_run", {}).get("minilm"))
    rows.append(("phases", ", ".join(f"{k} {v['status']} {v.get('seconds', 0):.0f} s" for k, v in phases.items()),
                 "all ok", verdict(all(v["status"] == "ok" for v in phases.values()))))
    rows += [(f"{k} phase", cell(v["error"]), "", "") for k, v in phases.items() if v.get("error")]
    return ["| check | result | target | verdict |", "|---|---|---|---|",
            *(f"| {' | '.join(row)} |" for row in rows)]


def detail_tables(results: dict[str, Any]) -> list[str]:
    phases = results["phases"]
    return model_table(phases.get("model", {})) + service_table(phases.get("service", {})) + minilm_table(
        phases.get("minilm", {}))



def write_results(results: dict[str, Any], args: argparse.Namespace) -> str:
    meta = results["meta"]
    head = [f"# GPU check, {meta['date']}", "",
            f"{meta.get('device_name', 'no CUDA device')}; torch {meta['torch']} (CUDA {meta['torch_cuda']}); "
            f"python {meta['python_version']}; {meta['cpu_count']} CPUs; `{meta['command']}`; preset {args.preset}"]
    text = "\n".join(head + detail_tables(results) + ["", *summary_table(results, args)]) + "\n"
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return text


# -- main -----------------------------------------------------------------------------------------

def run_phase(results: dict[str, Any], args: argparse.Namespace, name: str, deadline: float, fn: Any) -> dict[str, Any]:
    """fn(deadline, record) fills `record` as it goes, so a phase cut short (an error, SIGTERM) keeps what it
    measured; the results are written after every phase."""
    started = time.monotonic()
    record: dict[str, Any] = {"status": "running"}
    results["phases"][name] = record
    print(f"== {name} (up to {deadline - started:.0f} s)", flush=True)
    try:
        if deadline - started < 10:
            record.update(status="skipped", error="no time left in the budget")
        else:
            record.update(fn(deadline, record))
    except Exception as e:  # noqa: BLE001 - recorded; the next phase still runs
        traceback.print_exc()
        record.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
    except BaseException:
        record["status"] = "interrupted"
        raise
    finally:
        record["seconds"] = round(time.monotonic() - started, 1)
        write_results(results, args)
    return record


def parse_args(argv: list[str]) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=doc.split("\n\n")[0],
                                     epilog=doc.split("\n\n", 2)[2], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else
                        ROOT / "bench" / "out" / "gpu", help="results directory (default: $OUT, else bench/out/gpu)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: for the smoke test")
    parser.add_argument("--quick", action="store_true", help="shorter windows and runs, fewer concurrencies")
    parser.add_argument("--budget-s", type=float, default=None, help="the whole run (default 450, quick 240)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="the server's (16384 cuda, 2048 cpu)")
    parser.add_argument("--loadgen-procs", type=int, default=max(1, min(5, (os.cpu_count() or 1) // 3)),
                        help="load-generator processes (default: a third of the cores, at most 5)")
    parser.add_argument("--duration", type=float, default=None, help="measured seconds per load run (5, quick 2)")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up seconds per load run (2, quick 1)")
    parser.add_argument("--minilm", type=Path, default=FOLDER, help="the fp16 copy of all-MiniLM-L6-v2 (`make "
                        f"gpu-minilm`); the phase is skipped when it is missing [default {FOLDER.relative_to(ROOT)}]")
    parser.add_argument("--edge-processes", type=int, default=None,
                        help="also measure the service with this many edge processes against one process, at c64 "
                             "and c256 (default 8 on cuda, 0 = skip; the cpu smoke test skips it)")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="large", help=argparse.SUPPRESS)  # tiny: tests
    args = parser.parse_args(argv)
    args.budget_s = args.budget_s or (240.0 if args.quick else 450.0)
    if args.edge_processes is None:
        args.edge_processes = 8 if args.device == "cuda" else 0
    args.max_batch_tokens = args.max_batch_tokens or (16384 if args.device == "cuda" else 2048)
    args.duration = args.duration or (2.0 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    meta = environment(args.device)
    if args.device == "cuda" and not meta["cuda_available"]:
        print(f"error: CUDA is not available to {sys.executable} (torch {meta['torch']}). Run with "
              "GPU_PYTHON=<a python with CUDA torch>, or --device cpu for the CPU smoke test.", file=sys.stderr)
        return 2
    missing = [m for m in REQUIRED if not _importable(m)]
    if missing:
        print(f"error: {sys.executable} lacks {missing}; `python -m bench.gpu_check --help` says how to add "
              "them (requirements.txt minus torch, and the test plugins)", file=sys.stderr)
        return 3
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the server, write the results
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": meta, "phases": {}}
    start = time.monotonic()
    end = start + args.budget_s
    try:  # each phase ends by its deadline; it also leaves most of the later phases' shares to them
        run_phase(results, args, "tests", min(start + 0.38 * args.budget_s, end - 0.5 * args.budget_s),
                  lambda d, r: phase_tests(args, d, r))
        model = run_phase(results, args, "model", min(time.monotonic() + 0.22 * args.budget_s,
                                                      end - 0.32 * args.budget_s), lambda d, r: phase_model(args, d, r))
        minilm = (args.minilm / "fp16.json").is_file()
        run_phase(results, args, "service", end - (MINILM_SHARE * args.budget_s if minilm else 5),
                  lambda d, r: phase_service(args, d, r, model))
        if minilm:
            run_phase(results, args, "minilm", end - 5, lambda d, r: phase_minilm(args, d, r))
        else:  # not a phase that failed: nothing to run it on
            results["not_run"] = {"minilm": f"no {args.minilm / 'fp16.json'} (make gpu-minilm writes it)"}
    finally:  # also on SIGTERM
        write_results(results, args)
        print("\n".join([*detail_tables(results), "", *summary_table(results, args)]))
        print(f"results: {args.out / 'results.json'}, {args.out / 'results.md'} ({time.monotonic() - start:.0f} s)",
              flush=True)
    return 0 if all(p["status"] == "ok" for p in results["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
