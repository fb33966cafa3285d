"""Several models in one process against one process per model (issue 41): an embedder and a reranker under a
mixed load, served (A) by one `python -m service --model embed=... --model rerank=...` and (B) by two one-model
processes on the same cores.

Two random-init models of one encoder shape, built here, seeded (speed does not depend on the weights), with
bench/late_bench.py's WordPiece tokenizer over bench/text_bench.py's words:
  embed   a sentence-transformers folder: BertModel, mean pooling, normalised (all-MiniLM-L6-v2's layout);
  rerank  a BertForSequenceClassification with one label (a cross-encoder, as the ms-marco MiniLM-L6 one).
The encoder (`--size real`): BERT, 6 layers, hidden 384, 12 heads, intermediate 1536 (MiniLM-L6's shape, both);
`--size tiny` is the smoke test's. `convert-hf`'s code makes the bundles. Every server is
tests/support/server_process.py's (pinned: fp32, the CPU's 1024-token batch budget without warm-up, the default
model workers) on 127.0.0.1.
Threads: every process, A and each of B's two, gets what a lone process gets on this machine, the service's
defaults (one intra-op thread per usable core, two model workers on two or more threads), unless `--threads`
sets them for all. So each of B's processes is configured exactly as it would be deployed alone, as TEI's "one
process per model" advice leaves it: B is not cut down to a share of the cores, which a deployment cannot know
in advance, and A gets no more threads than one of B's. `--b-flag` adds flags to B's two servers only (e.g.
`--b-flag=--torch-threads=1 --b-flag=--model-workers=1`: each of B's processes one core's worth).

The load (attention.v1, closed loop, one channel per model): `--embed-concurrency` (8) callers of `Encode`, each
call 1-4 texts of 3-15 words (the pooled vector back, no hidden states), and `--rerank-concurrency` (2) callers
of `Rerank`, each call an 8-word query and `--passages` (16) passages of 20-60 words, both at once. Calls cycle
through seeded pools (64 embed calls, 8 rerank calls). A slice warms up with one call per caller, then runs until
one model has started `--calls` calls or `--seconds` have passed; calls that finish after that are not counted
(they ran with the other model's callers gone). Per model: calls/s, texts/s, p50 and p99 at the client; per
setup: the servers' CPU (user + system, all threads and processes, /proc) over the slice, in cores.
The lone call: `Encode` of one 3-15-word text, and `Rerank` of one query x `--passages`, at concurrency 1 with
the other model idle, p50 over `--lone-calls` calls (at most `--lone-seconds`): on A (the other model loaded and
idle) and on B's one-model server of that model.

Per round, fresh servers: setup A, then B (the order alternating between rounds: A B, B A, A B, ...), each
running the mixed slice then the two lone slices, the other setup's servers stopped. Reported: medians over
rounds per model and setup, the ratio A / B per round and its median, and whether each of issue 41's targets
held (A's throughput at least B's for each model; A's p99 no worse; the lone call's p50 unchanged, within
+-LONE_BAND).
Bounded: rounds x 2 x (`--seconds` + 2 x `--lone-seconds` + the calls in flight) plus the start-ups.

    python -m bench.models_bench [--rounds 3] [--seconds 20] [--size real|tiny] [--b-flag F ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.ab import cpu_s
from bench.late_bench import BERT_TOKENS, PREFIXES, SIZES, _bert_config, tokenizer_json, write_cross_encoder
from bench.rerank import cpu_flags
from bench.text_bench import WORDS
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from tests.support.server_process import ServerProcess

MODELS = ("embed", "rerank")
SETUPS = {"A": "one process, both models", "B": "two one-model processes"}
EMBED_WORDS, EMBED_TEXTS = (3, 15), (1, 4)  # words per text, texts per Encode call (both included)
PASSAGE_WORDS, QUERY_WORDS = (20, 60), 8
EMBED_POOL, RERANK_POOL = 64, 8  # distinct calls a slice cycles through
LONE_BAND = 0.10  # a lone call's p50 counts as unchanged when A / B is within 1 +- this
CALL_TIMEOUT_S = 600.0
_stubs: Any = attention_pb2_grpc  # generated without types


def write_embedder(folder: Path, size: str, seed: int = 0) -> Path:
    """A sentence-transformers folder of a BertModel (no pooler), mean pooling, normalised, at `size`."""
    import torch
    import transformers

    data = tokenizer_json()
    vocab = len(json.loads(data)["model"]["vocab"]) + len(PREFIXES)
    torch.manual_seed(seed)
    model: Any = transformers.BertModel(_bert_config(size, vocab, architectures=["BertModel"]),
                                        add_pooling_layer=False)
    model.eval()
    model.save_pretrained(str(folder))
    (folder / "tokenizer.json").write_bytes(data)
    (folder / "tokenizer_config.json").write_text(json.dumps(BERT_TOKENS))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": SIZES[size]["hidden"], "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return folder


def build(directory: Path, size: str) -> dict[str, Path]:
    """Both bundles, converted by this tree's `convert-hf` code under directory."""
    from model.hf_folder import convert_hf_folder

    bundles = {}
    for name, write in (("embed", write_embedder), ("rerank", write_cross_encoder)):
        src = write(directory / f"{name}-hf", size)
        bundles[name] = directory / name
        convert_hf_folder(src, bundles[name], name=f"bench-{name}")
    return bundles


def _words(rng: np.random.Generator, span: tuple[int, int]) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(span[0], span[1] + 1))))


def embed_request(texts: list[str], model: str) -> pb.EncodeRequest:
    return pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts], truncate=True, model=model,
                            output=pb.OutputOptions(return_hidden=False, pooling=pb.POOLING_MODEL))


def requests(model: str, served: str, passages: int, *, lone: bool, seed: int = 0) -> list[Any]:
    """The pool of calls of `model` ("embed" or "rerank") a slice cycles through, naming `served` ("" = the
    server's default model). Lone embed calls carry one text; the mixed load's 1-4."""
    rng = np.random.default_rng(seed)
    if model == "embed":
        counts = (1, 1) if lone else EMBED_TEXTS
        return [embed_request([_words(rng, EMBED_WORDS) for _ in range(int(rng.integers(counts[0], counts[1] + 1)))],
                              served) for _ in range(EMBED_POOL)]
    return [pb.RerankRequest(query=_words(rng, (QUERY_WORDS, QUERY_WORDS)), truncate=True, model=served,
                             texts=[_words(rng, PASSAGE_WORDS) for _ in range(passages)])
            for _ in range(RERANK_POOL)]


def texts_of(request: Any) -> int:
    return len(request.sequences) if isinstance(request, pb.EncodeRequest) else len(request.texts)


@dataclass
class Calls:
    """One model's calls in one slice: those that finished inside the measured window."""
    latencies_s: list[float] = field(default_factory=list)
    texts: int = 0

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.latencies_s) * 1e3, q)) if self.latencies_s else float("nan")


@dataclass
class Slice:
    seconds: float
    calls: dict[str, Calls]
    server_cpu_s: float
    client_cpu_s: float
    load: float  # the 1-minute load average at the slice's end

    def rate(self, model: str) -> float:
        return len(self.calls[model].latencies_s) / self.seconds

    def text_rate(self, model: str) -> float:
        return self.calls[model].texts / self.seconds


@dataclass
class Target:
    """Where one model's calls go: the server's address and the name the calls carry."""
    address: str
    served: str


def check(model: str, request: Any, response: Any) -> None:
    """The answer is the call's: a pooled vector per text, or a score per passage."""
    if model == "embed":
        got = [tuple(o.pooled.shape) for o in response.outputs]
        if len(got) != len(request.sequences) or any(len(s) != 1 or s[0] < 1 for s in got):
            raise RuntimeError(f"embed: pooled shapes {got} for {len(request.sequences)} texts")
    elif len(response.results) != len(request.texts):
        raise RuntimeError(f"rerank: {len(response.results)} scores for {len(request.texts)} texts")


async def run_slice(targets: dict[str, Target], pools: dict[str, list[Any]], concurrency: dict[str, int], *,
                    pids: Sequence[int], seconds: float, calls: int) -> Slice:
    """Every model in `concurrency` at once, closed loop, until one has started `calls` calls or `seconds`
    have passed; only calls finished by then count."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
    channels = {m: grpc.aio.insecure_channel(targets[m].address, options=options) for m in concurrency}
    try:
        stubs = {m: _stubs.AttentionServiceStub(channels[m]) for m in concurrency}

        async def call(model: str, request: Any) -> None:
            rpc = stubs[model].Encode if model == "embed" else stubs[model].Rerank
            check(model, request, await rpc(request, timeout=CALL_TIMEOUT_S))

        await asyncio.gather(*(call(m, pools[m][i % len(pools[m])]) for m, c in concurrency.items()
                               for i in range(c)))
        results = {m: Calls() for m in concurrency}
        issued = dict.fromkeys(concurrency, 0)
        cpu_before, client_before = sum(cpu_s(p)[0] for p in pids), time.process_time()
        started = time.perf_counter()
        deadline = started + seconds
        stop: list[float] = []  # when the window closed (the first caller to see it over records it)

        async def caller(model: str) -> None:
            pool = pools[model]
            while not stop:
                if issued[model] >= calls or time.perf_counter() >= deadline:
                    stop.append(time.perf_counter())
                    return
                request = pool[issued[model] % len(pool)]
                issued[model] += 1
                t0 = time.perf_counter()
                await call(model, request)
                t1 = time.perf_counter()
                if not stop and t1 < deadline:  # finished inside the window
                    results[model].latencies_s.append(t1 - t0)
                    results[model].texts += texts_of(request)

        tasks = [asyncio.ensure_future(caller(m)) for m, c in concurrency.items() for _ in range(c)]
        # The window closes at the deadline or when a caller reaches `calls`; the CPU counters are read then,
        # not after the calls in flight drain.
        while not stop and time.perf_counter() < deadline:
            await asyncio.sleep(min(0.01, deadline - time.perf_counter()))
        if not stop:
            stop.append(time.perf_counter())
        cpu, client = sum(cpu_s(p)[0] for p in pids) - cpu_before, time.process_time() - client_before
        window = stop[0] - started
        await asyncio.gather(*tasks)
    finally:
        for channel in channels.values():
            await channel.close()
    return Slice(window, results, cpu, client, os.getloadavg()[0])


def start(*models: tuple[str, Path], flags: Sequence[str]) -> ServerProcess:
    """A server of `models`: one bundle in the one-model form (`--model PATH`), or several as NAME=PATH."""
    if len(models) == 1:
        return ServerProcess(models[0][1], "--log-level", "warning", *flags, timeout=600)
    (first, path), *rest = models
    more = [arg for name, p in rest for arg in ("--model", f"{name}={p}")]
    return ServerProcess(Path(f"{first}={path}"), *more, "--log-level", "warning", *flags, timeout=600)


def served(server: ServerProcess) -> str:
    """What the server says it serves (ListModels): name, tasks, shape, precision, threads' batch budget."""
    with grpc.insecure_channel(server.target) as channel:
        models = _stubs.AttentionServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=60).models
    return "; ".join(f"{m.name}: tasks {','.join(m.tasks)}, {m.n_layers} layers x {m.d_model}, {m.precision}, "
                     f"max_batch_tokens {m.batch_budget.max_batch_tokens}" for m in models)


@dataclass
class Round:
    mixed: Slice
    lone: dict[str, Slice]


def run_setup(setup: str, bundles: dict[str, Path], args: argparse.Namespace, flags: list[str],
              round_: int) -> Round:
    """Fresh servers of `setup`, the mixed slice, the two lone slices, the servers stopped."""
    servers: list[ServerProcess] = []
    try:
        if setup == "A":
            servers.append(start(*bundles.items(), flags=flags))
            targets = {m: Target(servers[0].target, m) for m in MODELS}
        else:
            for m in MODELS:
                servers.append(start((m, bundles[m]), flags=[*flags, *args.b_flag]))
            targets = {m: Target(s.target, "") for m, s in zip(MODELS, servers, strict=True)}
        for s in servers:
            print(f"round {round_} {setup} server pid {s.pid}: {served(s)}", flush=True)
        pids = [s.pid for s in servers]
        pools = {m: requests(m, targets[m].served, args.passages, lone=False) for m in MODELS}
        concurrency = {"embed": args.embed_concurrency, "rerank": args.rerank_concurrency}
        mixed = asyncio.run(run_slice(targets, pools, concurrency, pids=pids, seconds=args.seconds,
                                      calls=args.calls))
        for m in MODELS:
            c = mixed.calls[m]
            print(f"round {round_} {setup} mixed {m}: {mixed.rate(m):.2f} calls/s, {mixed.text_rate(m):.1f} texts/s, "
                  f"{len(c.latencies_s)} calls in {mixed.seconds:.3f} s, p50 {c.percentile(50):.1f} ms, p99 "
                  f"{c.percentile(99):.1f} ms", flush=True)
        print(f"round {round_} {setup} mixed server CPU {mixed.server_cpu_s / mixed.seconds:.2f} cores, client CPU "
              f"{mixed.client_cpu_s / mixed.seconds:.2f} cores, load average {mixed.load:.2f}", flush=True)
        lone = {}
        for m in MODELS:
            pool = requests(m, targets[m].served, args.passages, lone=True, seed=1)
            owner = [servers[0].pid] if setup == "A" else [servers[MODELS.index(m)].pid]
            lone[m] = asyncio.run(run_slice(targets, {m: pool}, {m: 1}, pids=owner, seconds=args.lone_seconds,
                                            calls=args.lone_calls))
            c = lone[m].calls[m]
            print(f"round {round_} {setup} lone {m}: {len(c.latencies_s)} calls in {lone[m].seconds:.3f} s, p50 "
                  f"{c.percentile(50):.2f} ms, p99 {c.percentile(99):.2f} ms, load average {lone[m].load:.2f}",
                  flush=True)
        return Round(mixed, lone)
    finally:
        for s in servers:
            s.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.models_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds of the mixed slice, at most")
    parser.add_argument("--calls", type=int, default=5000, help="mixed slice: calls of one model, at most")
    parser.add_argument("--lone-seconds", type=float, default=8.0, help="measured seconds of a lone slice, at most")
    parser.add_argument("--lone-calls", type=int, default=100, help="calls of a lone slice, at most")
    parser.add_argument("--embed-concurrency", type=int, default=8)
    parser.add_argument("--rerank-concurrency", type=int, default=2)
    parser.add_argument("--passages", type=int, default=16, help="texts per Rerank call")
    parser.add_argument("--size", choices=sorted(SIZES), default="real",
                        help="the encoder: real (6 x 384, MiniLM-L6's shape) or tiny (the smoke test's)")
    parser.add_argument("--threads", type=int, default=0, help="every server's torch threads (0: the service's "
                                                                "default, one per core)")
    parser.add_argument("--server-flag", action="append", default=[], help="a flag for every server (repeat)")
    parser.add_argument("--b-flag", action="append", default=[], help="a flag for setup B's servers (repeat)")
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 20 and 0 < args.seconds <= 300 and 0 < args.lone_seconds <= 300
            and 1 <= args.calls <= 100_000 and 1 <= args.lone_calls <= 10_000 and 1 <= args.passages <= 64
            and 1 <= args.embed_concurrency <= 64 and 1 <= args.rerank_concurrency <= 64):
        parser.error("--rounds 1..20, --seconds and --lone-seconds (0, 300], --calls 1..100000, --lone-calls "
                     "1..10000, --passages 1..64, --embed-concurrency and --rerank-concurrency 1..64")
    flags = [*(["--torch-threads", str(args.threads)] if args.threads else []), *args.server_flag]
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; cpu {cpu_flags()}; cores {os.cpu_count()}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rounds: dict[str, list[Round]] = {s: [] for s in SETUPS}
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        bundles = build(Path(tmp), args.size)
        print(f"models built: {args.size} encoder {SIZES[args.size]}; embed c{args.embed_concurrency} "
              f"({EMBED_TEXTS[0]}-{EMBED_TEXTS[1]} texts of {EMBED_WORDS[0]}-{EMBED_WORDS[1]} words), rerank "
              f"c{args.rerank_concurrency} (1 query x {args.passages} passages of {PASSAGE_WORDS[0]}-"
              f"{PASSAGE_WORDS[1]} words)", flush=True)
        for round_ in range(args.rounds):
            for setup in (SETUPS if round_ % 2 == 0 else reversed(SETUPS)):
                rounds[setup].append(run_setup(setup, bundles, args, flags, round_))
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(rounds)
    return 0


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _per_round(values: Sequence[float]) -> str:
    return f"{' '.join(f'{x:.3f}' for x in values)} (median {_median(values):.3f})"


def report(rounds: dict[str, list[Round]]) -> None:
    """Medians over rounds per model and setup; A / B per round and its median; the targets."""
    print("| model | setup | calls/s | texts/s | p50 ms | p99 ms | lone call p50 ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for m in MODELS:
        for setup, name in SETUPS.items():
            rs = rounds[setup]
            print(f"| {m} | {setup}: {name} | {_median([r.mixed.rate(m) for r in rs]):.2f} "
                  f"| {_median([r.mixed.text_rate(m) for r in rs]):.1f} "
                  f"| {_median([r.mixed.calls[m].percentile(50) for r in rs]):.1f} "
                  f"| {_median([r.mixed.calls[m].percentile(99) for r in rs]):.1f} "
                  f"| {_median([r.lone[m].calls[m].percentile(50) for r in rs]):.2f} |")
    for setup, name in SETUPS.items():
        rs = rounds[setup]
        print(f"{setup} ({name}) mixed: server CPU {_median([r.mixed.server_cpu_s / r.mixed.seconds for r in rs]):.2f} "
              f"cores, client CPU {_median([r.mixed.client_cpu_s / r.mixed.seconds for r in rs]):.2f} cores (medians)")
    pairs = list(zip(rounds["A"], rounds["B"], strict=True))
    verdicts = []
    for m in MODELS:
        rate = [_ratio(a.mixed.rate(m), b.mixed.rate(m)) for a, b in pairs]
        p99 = [_ratio(a.mixed.calls[m].percentile(99), b.mixed.calls[m].percentile(99)) for a, b in pairs]
        lone = [_ratio(a.lone[m].calls[m].percentile(50), b.lone[m].calls[m].percentile(50)) for a, b in pairs]
        print(f"A / B {m}: calls/s per round {_per_round(rate)}; p99 per round {_per_round(p99)}; lone p50 per round "
              f"{_per_round(lone)}")
        verdicts += [
            (f"{m} throughput A >= B", _median(rate) >= 1.0, f"median A / B {_median(rate):.3f}"),
            (f"{m} p99 A <= B", _median(p99) <= 1.0, f"median A / B {_median(p99):.3f}"),
            (f"{m} lone p50 unchanged (A / B within 1 +- {LONE_BAND:.2f})", abs(_median(lone) - 1) <= LONE_BAND,
             f"median A / B {_median(lone):.3f}")]
    server = [_ratio(a.mixed.server_cpu_s / a.mixed.seconds, b.mixed.server_cpu_s / b.mixed.seconds) for a, b in pairs]
    print(f"A / B server CPU (cores) per round {_per_round(server)}")
    for what, held, why in verdicts:
        print(f"target {what}: {'met' if held else 'NOT met'} ({why})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
