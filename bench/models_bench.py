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
setup: the servers' CPU (user + system, all threads and processes, /proc) over the slice, in cores, and the other
setup's servers' (idle meanwhile: near zero, or they would disturb it).
The lone call: `Encode` of one 3-15-word text, and `Rerank` of one query x `--passages`, at concurrency 1 with
the other model idle: on A (the other model loaded and idle) and on B's one-model server of that model, one call
on each in turn (A B B A ...: this machine's load moves between seconds, and only calls side by side compare),
until each has had `--lone-calls` or `--lone-seconds` have passed; p50 per setup.

Per round, fresh servers of both setups (A's and B's, started in the round's order); the mixed slice on each,
A then B in even rounds and B then A in odd ones, the other setup's servers idle; then the lone calls of each
model. Reported: medians over rounds per model and setup, the ratio A / B per round and its median, and whether
each of issue 41's targets held (A's throughput at least B's for each model; A's p99 no worse; the lone call's
p50 unchanged, within +-LONE_BAND).
Bounded: rounds x (2 x (`--seconds` + the calls in flight) + 2 x `--lone-seconds` + one call per setup) plus the
start-ups.

    python -m bench.models_bench [--rounds 3] [--seconds 30] [--lone-seconds 20] [--size real|tiny] [--b-flag F ...]
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
from bench.late_bench import (
    BERT_TOKENS,
    PREFIXES,
    SIZES,
    _bert_config,
    convert_all,
    tokenizer_json,
    write_cross_encoder,
)
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
    return convert_all(directory, size, {"embed": write_embedder, "rerank": write_cross_encoder})


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
    server_cpu_s: float  # the measured setup's servers, all processes and threads
    idle_cpu_s: float  # the other setup's servers, idle meanwhile
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


CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]


async def call(stub: Any, model: str, request: Any) -> None:
    rpc = stub.Encode if model == "embed" else stub.Rerank
    check(model, request, await rpc(request, timeout=CALL_TIMEOUT_S))


def cpu_of(pids: Sequence[int]) -> float:
    return sum(cpu_s(p)[0] for p in pids)


async def run_slice(targets: dict[str, Target], pools: dict[str, list[Any]], concurrency: dict[str, int], *,
                    pids: Sequence[int], idle: Sequence[int], seconds: float, calls: int) -> Slice:
    """Every model in `concurrency` at once, closed loop, one channel per model, until one has started `calls`
    calls or `seconds` have passed; only calls finished by then count. `pids`: the servers measured, `idle`:
    the ones that should be idle meanwhile (their CPU is reported, to show they are)."""
    channels = {m: grpc.aio.insecure_channel(targets[m].address, options=CHANNEL_OPTIONS) for m in concurrency}
    try:
        stubs = {m: _stubs.AttentionServiceStub(channels[m]) for m in concurrency}
        await asyncio.gather(*(call(stubs[m], m, pools[m][i % len(pools[m])]) for m, c in concurrency.items()
                               for i in range(c)))
        results = {m: Calls() for m in concurrency}
        issued = dict.fromkeys(concurrency, 0)
        cpu_before, idle_before, client_before = cpu_of(pids), cpu_of(idle), time.process_time()
        started = time.perf_counter()
        deadline = started + seconds
        stop: list[float] = []  # when the window closed

        async def caller(model: str) -> None:
            pool = pools[model]
            while not stop:
                if issued[model] >= calls or time.perf_counter() >= deadline:
                    stop.append(time.perf_counter())
                    return
                request = pool[issued[model] % len(pool)]
                issued[model] += 1
                t0 = time.perf_counter()
                await call(stubs[model], model, request)
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
        cpu, idle_cpu = cpu_of(pids) - cpu_before, cpu_of(idle) - idle_before
        client = time.process_time() - client_before
        window = stop[0] - started
        await asyncio.gather(*tasks)
    finally:
        for channel in channels.values():
            await channel.close()
    return Slice(window, results, cpu, idle_cpu, client, os.getloadavg()[0])


async def run_lone(targets: dict[str, Target], pools: dict[str, list[Any]], model: str, *, first: str,
                   seconds: float, calls: int) -> dict[str, Calls]:
    """`model`'s lone calls, one at a time, alternating between the setups' servers (`targets`: setup ->
    server) call by call, `first` first in each pair then last in the next (A B B A ...), so that the
    machine's drift falls on both alike; until each has had `calls` or `seconds` have passed."""
    order = [first, *(s for s in targets if s != first)]
    channels = {s: grpc.aio.insecure_channel(t.address, options=CHANNEL_OPTIONS) for s, t in targets.items()}
    try:
        stubs = {s: _stubs.AttentionServiceStub(c) for s, c in channels.items()}
        for s in order:  # a warm call on each
            await call(stubs[s], model, pools[s][0])
        results = {s: Calls() for s in targets}
        deadline = time.perf_counter() + seconds
        for i in range(calls):
            for s in (order if i % 2 == 0 else order[::-1]):
                request = pools[s][i % len(pools[s])]
                t0 = time.perf_counter()
                await call(stubs[s], model, request)
                results[s].latencies_s.append(time.perf_counter() - t0)
                results[s].texts += texts_of(request)
            if time.perf_counter() >= deadline:
                break
    finally:
        for channel in channels.values():
            await channel.close()
    return results


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
    mixed: dict[str, Slice]  # setup -> its mixed slice
    lone: dict[str, dict[str, Calls]]  # model -> setup -> its lone calls


def run_round(round_: int, bundles: dict[str, Path], args: argparse.Namespace, flags: list[str]) -> Round:
    """Fresh servers of both setups; each setup's mixed slice, in this round's order, the other's servers idle;
    each model's lone calls alternating between the setups; the servers stopped."""
    order = list(SETUPS) if round_ % 2 == 0 else list(SETUPS)[::-1]
    servers: dict[str, list[ServerProcess]] = {}
    try:
        for setup in order:
            if setup == "A":
                servers[setup] = [start(*bundles.items(), flags=flags)]
            else:
                servers[setup] = [start((m, bundles[m]), flags=[*flags, *args.b_flag]) for m in MODELS]
            for s in servers[setup]:
                print(f"round {round_} {setup} server pid {s.pid}: {served(s)}", flush=True)
        targets = {"A": {m: Target(servers["A"][0].target, m) for m in MODELS},
                   "B": {m: Target(s.target, "") for m, s in zip(MODELS, servers["B"], strict=True)}}
        concurrency = {"embed": args.embed_concurrency, "rerank": args.rerank_concurrency}
        mixed = {}
        for setup in order:
            pools = {m: requests(m, targets[setup][m].served, args.passages, lone=False) for m in MODELS}
            pids = [s.pid for s in servers[setup]]
            idle = [s.pid for other in order if other != setup for s in servers[other]]
            mixed[setup] = x = asyncio.run(run_slice(targets[setup], pools, concurrency, pids=pids, idle=idle,
                                                     seconds=args.seconds, calls=args.calls))
            for m in MODELS:
                c = x.calls[m]
                print(f"round {round_} {setup} mixed {m}: {x.rate(m):.2f} calls/s, {x.text_rate(m):.1f} texts/s, "
                      f"{len(c.latencies_s)} calls in {x.seconds:.3f} s, p50 {c.percentile(50):.1f} ms, p99 "
                      f"{c.percentile(99):.1f} ms", flush=True)
            print(f"round {round_} {setup} mixed server CPU {x.server_cpu_s / x.seconds:.2f} cores, idle servers "
                  f"{x.idle_cpu_s / x.seconds:.3f} cores, client CPU {x.client_cpu_s / x.seconds:.2f} cores, load "
                  f"average {x.load:.2f}", flush=True)
        lone = {}
        for m in MODELS:
            # the same calls on both (same seed), each naming the model as its server serves it
            pools = {s: requests(m, targets[s][m].served, args.passages, lone=True, seed=1) for s in SETUPS}
            lone[m] = asyncio.run(run_lone({s: targets[s][m] for s in SETUPS}, pools, m, first=order[0],
                                           seconds=args.lone_seconds, calls=args.lone_calls))
            for setup in order:
                c = lone[m][setup]
                print(f"round {round_} {setup} lone {m}: {len(c.latencies_s)} calls, p50 {c.percentile(50):.2f} ms, "
                      f"p99 {c.percentile(99):.2f} ms, load average {os.getloadavg()[0]:.2f}", flush=True)
        return Round(mixed, lone)
    finally:
        for group in servers.values():
            for s in group:
                s.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.models_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds of a mixed slice, at most")
    parser.add_argument("--calls", type=int, default=5000, help="mixed slice: calls of one model, at most")
    parser.add_argument("--lone-seconds", type=float, default=20.0,
                        help="lone calls of one model, both setups together: seconds, at most")
    parser.add_argument("--lone-calls", type=int, default=100, help="lone calls of one model per setup, at most")
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
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        bundles = build(Path(tmp), args.size)
        print(f"models built: {args.size} encoder {SIZES[args.size]}; embed c{args.embed_concurrency} "
              f"({EMBED_TEXTS[0]}-{EMBED_TEXTS[1]} texts of {EMBED_WORDS[0]}-{EMBED_WORDS[1]} words), rerank "
              f"c{args.rerank_concurrency} (1 query x {args.passages} passages of {PASSAGE_WORDS[0]}-"
              f"{PASSAGE_WORDS[1]} words)", flush=True)
        for round_ in range(args.rounds):
            rounds.append(run_round(round_, bundles, args, flags))
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(rounds)
    return 0


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _per_round(values: Sequence[float]) -> str:
    return f"{' '.join(f'{x:.3f}' for x in values)} (median {_median(values):.3f})"


def report(rounds: list[Round]) -> None:
    """Medians over rounds per model and setup; A / B per round and its median; the targets."""
    print("| model | setup | calls/s | texts/s | p50 ms | p99 ms | lone call p50 ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for m in MODELS:
        for setup, name in SETUPS.items():
            mixed = [r.mixed[setup] for r in rounds]
            print(f"| {m} | {setup}: {name} | {_median([x.rate(m) for x in mixed]):.2f} "
                  f"| {_median([x.text_rate(m) for x in mixed]):.1f} "
                  f"| {_median([x.calls[m].percentile(50) for x in mixed]):.1f} "
                  f"| {_median([x.calls[m].percentile(99) for x in mixed]):.1f} "
                  f"| {_median([r.lone[m][setup].percentile(50) for r in rounds]):.2f} |")
    for setup, name in SETUPS.items():
        mixed = [r.mixed[setup] for r in rounds]
        print(f"{setup} ({name}) mixed: server CPU {_median([x.server_cpu_s / x.seconds for x in mixed]):.2f} cores, "
              f"client CPU {_median([x.client_cpu_s / x.seconds for x in mixed]):.2f} cores (medians)")
    verdicts = []
    for m in MODELS:
        rate = [_ratio(r.mixed["A"].rate(m), r.mixed["B"].rate(m)) for r in rounds]
        p99 = [_ratio(r.mixed["A"].calls[m].percentile(99), r.mixed["B"].calls[m].percentile(99)) for r in rounds]
        lone = [_ratio(r.lone[m]["A"].percentile(50), r.lone[m]["B"].percentile(50)) for r in rounds]
        print(f"A / B {m}: calls/s per round {_per_round(rate)}; p99 per round {_per_round(p99)}; lone p50 per round "
              f"{_per_round(lone)}")
        verdicts += [
            (f"{m} throughput A >= B", _median(rate) >= 1.0, f"median A / B {_median(rate):.3f}"),
            (f"{m} p99 A <= B", _median(p99) <= 1.0, f"median A / B {_median(p99):.3f}"),
            (f"{m} lone p50 unchanged (A / B within 1 +- {LONE_BAND:.2f})", abs(_median(lone) - 1) <= LONE_BAND,
             f"median A / B {_median(lone):.3f}")]
    server = [_ratio(r.mixed["A"].server_cpu_s / r.mixed["A"].seconds, r.mixed["B"].server_cpu_s / r.mixed["B"].seconds)
              for r in rounds]
    print(f"A / B server CPU (cores) per round {_per_round(server)}")
    for what, held, why in verdicts:
        print(f"target {what}: {'met' if held else 'NOT met'} ({why})")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
