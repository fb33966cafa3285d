"""Reranking 1 query x 64 passages: a ColBERT model (MaxSim, both sides encoded per call) against a cross-encoder
of the same encoder size, through real servers (issue 43).

Two random-init models of one encoder shape, built here, seeded (speed does not depend on the weights):
  colbert        a PyLate ColBERT folder (modules.json: the BERT, then one Dense 384 -> 128, no bias, identity;
                 "[Q] " / "[D] " markers; query_length 32 with [MASK] expansion, document_length 180, the
                 punctuation skip list), as PyLate saves one;
  cross-encoder  a BertForSequenceClassification with one label.
The encoder (`--size real`): BERT, 6 layers, hidden 384, 12 heads, intermediate 1536, 512 positions (MiniLM-L6's
shape, which answerai-colbert-small and the ms-marco MiniLM-L6 cross-encoder share); one WordPiece tokenizer over
bench/text_bench.py's words serves both. `convert-hf`'s code makes the bundles; each is served by its own
`python -m service` (tests/support/server_process.py, pinned: fp32, the CPU's 1024-token batch budget without
warm-up, the default workers) on 127.0.0.1.

The load: attention.v1 `Rerank(query, 64 texts)`, one call at a time per caller, at concurrency 1 and 4 (closed
loop, one channel), each call one of 8 seeded requests in turn (an 8-word query, passages of 100-150 words drawn
from the same words: 105-160 tokens, specials aside). A slice warms up with one call per caller, then runs until
`--calls` calls have started or `--seconds` have passed, and waits for those in flight. The ColBERT server encodes
the 64 passages as documents and the query as a query (65 sequences) and scores by MaxSim; the cross-encoder's
server runs 64 (query, passage) pairs.
What the two compute differs, and the output says how: a pair is query + passage tokens in one sequence, a
ColBERT document is the passage alone (cut at 180 tokens) and the query one more 32-token sequence; each model's
real and padded tokens per call are reported (padded: the server's attention_batch_tokens, size x padded length
summed over its batches). And a ColBERT deployment would usually precompute the documents' vectors, leaving one
32-token query per call; here both sides are encoded per call, as the issue asks.

Per round, both servers start fresh (`--keep-servers`: one each for the run), and each concurrency runs a slice
on each model, the order alternating between rounds (bench/ab.py: two processes of the same code differ by up to
6% for their lifetime, and this machine drifts between minutes). Per model and concurrency: passages/s (texts
scored a second), calls/s, p50 and p99 per call at the client, the server's CPU a call (/proc, user + system, all
threads, warm-up calls excluded), real and padded tokens a call; medians over rounds, and the ratio ColBERT /
cross-encoder per round and its median (passages/s, p50, and the server's CPU a call: on this loaded machine
the steadier of the three).
Bounded: rounds x concurrencies x 2 x (`--seconds` + the calls in flight) plus the start-ups.

    python -m bench.late_bench [--rounds 2] [--concurrency 1 4] [--seconds 30] [--calls 200] [--keep-servers]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.ab import cpu_s
from bench.rerank import cpu_flags
from bench.text_bench import WORDS
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from tests.support.server_process import ServerProcess

MODELS = ("colbert", "cross-encoder")
SIZES: dict[str, dict[str, int]] = {  # the encoder of both models; dim is ColBERT's projection
    "real": {"layers": 6, "hidden": 384, "heads": 12, "intermediate": 1536, "positions": 512, "dim": 128},
    "tiny": {"layers": 2, "hidden": 32, "heads": 4, "intermediate": 64, "positions": 256, "dim": 16},
}
QUERY_LENGTH, DOCUMENT_LENGTH = 32, 180  # PyLate's defaults
PREFIXES = ["[Q] ", "[D] "]  # PyLate's markers: added tokens of the tokenizer (both models have them)
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_TOKENS = {"tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
               "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"}
REQUESTS = 8  # distinct requests a slice cycles through
QUERY_WORDS = 8
CALL_TIMEOUT_S = 600.0
_stubs: Any = attention_pb2_grpc  # generated without types


def tokenizer_json() -> bytes:
    """BERT WordPiece over bench/text_bench.py's words and punctuation, with PyLate's markers as added tokens."""
    from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    words = sorted({w.lower() for w in WORDS} | set(string.punctuation))
    tok = Tokenizer(WordPiece({w: i for i, w in enumerate(SPECIALS + words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(p, normalized=True, special=False) for p in PREFIXES])
    return tok.to_str().encode()


def _bert_config(size: str, vocab: int, **extra: Any) -> Any:
    import transformers

    s = SIZES[size]
    return transformers.BertConfig(vocab_size=vocab, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                                   num_attention_heads=s["heads"], intermediate_size=s["intermediate"],
                                   max_position_embeddings=s["positions"], type_vocab_size=2, pad_token_id=0, **extra)


def _save(model: Any, folder: Path, tokenizer: bytes) -> None:
    model.save_pretrained(str(folder))
    (folder / "tokenizer.json").write_bytes(tokenizer)
    (folder / "tokenizer_config.json").write_text(json.dumps(BERT_TOKENS))


def write_colbert(folder: Path, size: str, seed: int = 0) -> Path:
    """A PyLate ColBERT folder as PyLate 1.6 saves one (tests/support/late_helpers.py's layout), at `size`."""
    import torch
    import transformers
    from safetensors.torch import save_file

    data = tokenizer_json()
    vocab = len(json.loads(data)["model"]["vocab"]) + len(PREFIXES)
    torch.manual_seed(seed)
    model: Any = transformers.BertModel(_bert_config(size, vocab, architectures=["BertModel"]),
                                        add_pooling_layer=False)
    model.eval()
    _save(model, folder, data)
    hidden, dim = SIZES[size]["hidden"], SIZES[size]["dim"]
    dense = folder / "1_Dense"
    dense.mkdir()
    weight = torch.randn(dim, hidden, generator=torch.Generator().manual_seed(seed + 1)) / hidden ** 0.5
    save_file({"linear.weight": weight}, str(dense / "model.safetensors"))
    (dense / "config.json").write_text(json.dumps({
        "in_features": hidden, "out_features": dim, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": DOCUMENT_LENGTH - 1,
                                                                  "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({
        "model_type": "ColBERT", "prompts": {"query": "", "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "MaxSim", "query_prefix": PREFIXES[0], "document_prefix": PREFIXES[1],
        "query_length": QUERY_LENGTH, "document_length": DOCUMENT_LENGTH, "attend_to_expansion_tokens": False,
        "skiplist_words": list(string.punctuation), "do_query_expansion": True}))
    return folder


def write_cross_encoder(folder: Path, size: str, seed: int = 0) -> Path:
    """A one-label BertForSequenceClassification of the same encoder and tokenizer."""
    import torch
    import transformers

    data = tokenizer_json()
    vocab = len(json.loads(data)["model"]["vocab"]) + len(PREFIXES)
    torch.manual_seed(seed)
    model: Any = transformers.BertForSequenceClassification(_bert_config(size, vocab, num_labels=1))
    model.eval()
    _save(model, folder, data)
    return folder


def build(directory: Path, size: str) -> dict[str, Path]:
    """Both bundles, converted by this tree's `convert-hf` code under directory."""
    return convert_all(directory, size, {"colbert": write_colbert, "cross-encoder": write_cross_encoder})


def convert_all(directory: Path, size: str, writers: dict[str, Callable[[Path, str], Path]]) -> dict[str, Path]:
    """Each writer's Hugging Face folder, converted by this tree's `convert-hf` code, by name under directory."""
    from model.hf_folder import convert_hf_folder

    bundles = {}
    for name, write in writers.items():
        src = write(directory / f"{name}-hf", size)
        bundles[name] = directory / name
        convert_hf_folder(src, bundles[name], name=f"bench-{name}")
    return bundles


def requests(passages: int, words: tuple[int, int], seed: int = 0) -> list[pb.RerankRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(REQUESTS):
        query = " ".join(rng.choice(WORDS, QUERY_WORDS))
        texts = [" ".join(rng.choice(WORDS, int(rng.integers(words[0], words[1] + 1)))) for _ in range(passages)]
        out.append(pb.RerankRequest(query=query, texts=texts, truncate=True))
    return out


@dataclass
class Slice:
    calls: int
    seconds: float
    latencies_s: list[float]
    cpu_ms_per_call: float
    real_tokens: float  # per call: the sequences' own tokens (a ColBERT query counted at its 32)
    padded_tokens: float  # per call: the server's batches, size x padded length
    precision: str

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.latencies_s) * 1e3, q))


def real_tokens(model: str, response: pb.RerankResponse) -> int:
    """Tokens the call's sequences hold: a pair's, or a ColBERT document's plus its query's (always padded to
    QUERY_LENGTH with [MASK], which the model computes)."""
    return int(sum(r.token_count for r in response.results)) + (QUERY_LENGTH if model == "colbert" else 0)


async def run_slice(server: ServerProcess, model: str, load: list[pb.RerankRequest], *, concurrency: int,
                    seconds: float, calls: int) -> Slice:
    async with grpc.aio.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                                 ("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = _stubs.AttentionServiceStub(ch)
        warm = await asyncio.gather(*(stub.Rerank(load[i % len(load)], timeout=CALL_TIMEOUT_S)
                                      for i in range(concurrency)))
        padded_before = server.sample("attention_batch_tokens_sum")
        cpu_before = cpu_s(server.pid)[0]
        started = time.perf_counter()
        deadline, latencies, real = started + seconds, [], []
        issued = 0

        async def caller() -> None:
            nonlocal issued
            while issued < calls and time.perf_counter() < deadline:
                request = load[issued % len(load)]
                issued += 1
                t0 = time.perf_counter()
                response = await stub.Rerank(request, timeout=CALL_TIMEOUT_S)
                latencies.append(time.perf_counter() - t0)
                if len(response.results) != len(request.texts):
                    raise RuntimeError(f"{model}: {len(response.results)} scores for {len(request.texts)} texts")
                real.append(real_tokens(model, response))

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu = cpu_s(server.pid)[0] - cpu_before
        padded = server.sample("attention_batch_tokens_sum") - padded_before
    n = len(latencies)
    return Slice(n, elapsed, latencies, 1e3 * cpu / n, float(np.mean(real)), padded / n, warm[0].metadata.precision)


def start(bundle: Path, flags: Sequence[str]) -> ServerProcess:
    return ServerProcess(bundle, "--log-level", "warning", *flags, timeout=300)


def served(server: ServerProcess) -> str:
    """What the server says it serves (ModelInfo): a ColBERT model has token vectors and no labels, a
    cross-encoder one label."""
    with grpc.insecure_channel(server.target) as channel:
        info = _stubs.AttentionServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
    return (f"{info.name}: tasks {','.join(info.tasks)}, vector_dim {info.vector_dim}, labels {len(info.labels)}, "
            f"{info.n_layers} layers x {info.d_model}, {info.backend}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.late_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per slice, at most")
    parser.add_argument("--calls", type=int, default=200, help="measured calls per slice, at most")
    parser.add_argument("--passages", type=int, default=64, help="texts per Rerank call")
    parser.add_argument("--words", type=int, nargs=2, default=[100, 150], metavar=("MIN", "MAX"),
                        help="words per passage, both included")
    parser.add_argument("--size", choices=sorted(SIZES), default="real",
                        help="the encoder: real (6 x 384, MiniLM-L6's shape) or tiny (the smoke test's)")
    parser.add_argument("--threads", type=int, default=0, help="the servers' torch threads (0: the service's "
                                                                "default, one per core)")
    parser.add_argument("--server-flag", action="append", default=[], help="a flag for both servers (repeat)")
    parser.add_argument("--keep-servers", action="store_true",
                        help="one server per model for all rounds rather than a fresh pair each round")
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 20 and 0 < args.seconds <= 300 and 1 <= args.calls <= 10_000
            and all(1 <= c <= 64 for c in args.concurrency) and 1 <= args.passages <= 64
            and 1 <= args.words[0] <= args.words[1] <= 400):
        parser.error("--rounds 1..20, --seconds (0, 300], --calls 1..10000, --concurrency 1..64, --passages 1..64, "
                     "--words 1 <= MIN <= MAX <= 400")
    flags = [*(["--torch-threads", str(args.threads)] if args.threads else []), *args.server_flag]
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; cpu {cpu_flags()}; cores {os.cpu_count()}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    load = requests(args.passages, tuple(args.words))
    rows: dict[tuple[str, int], list[Slice]] = {(m, c): [] for m in MODELS for c in args.concurrency}
    with tempfile.TemporaryDirectory(prefix="bench-late-") as tmp:
        bundles = build(Path(tmp), args.size)
        print(f"models built: {args.size} encoder {SIZES[args.size]}; {args.passages} passages of "
              f"{args.words[0]}-{args.words[1]} words, {QUERY_WORDS}-word queries", flush=True)
        servers: dict[str, ServerProcess] = {}
        try:
            for round_ in range(args.rounds):
                order = MODELS if round_ % 2 == 0 else MODELS[::-1]
                for model in order:
                    if model not in servers:
                        servers[model] = start(bundles[model], flags)
                        print(f"round {round_} {model} started: {served(servers[model])}", flush=True)
                for c, model in ((c, m) for c in args.concurrency for m in order):
                    s = asyncio.run(run_slice(servers[model], model, load, concurrency=c, seconds=args.seconds,
                                              calls=args.calls))
                    rows[model, c].append(s)
                    print(f"round {round_} c{c} {model}: {args.passages * s.calls_per_s:.1f} passages/s, "
                          f"{s.calls} calls in {s.seconds:.3f} s, p50 {s.percentile(50):.1f} ms, p99 "
                          f"{s.percentile(99):.1f} ms, server CPU {s.cpu_ms_per_call:.1f} ms/call, tokens/call real "
                          f"{s.real_tokens:.0f} padded {s.padded_tokens:.0f}, {s.precision}, load average "
                          f"{os.getloadavg()[0]:.2f}", flush=True)
                if not args.keep_servers:
                    for server in servers.values():
                        server.stop()
                    servers = {}
        finally:
            for server in servers.values():
                server.stop()
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(rows, args.concurrency, args.passages)
    return 0


def report(rows: dict[tuple[str, int], list[Slice]], concurrency: Sequence[int], passages: int) -> None:
    """Medians over rounds per model and concurrency, then ColBERT / cross-encoder per round and its median."""
    print("| model | c | passages/s | calls/s | p50 ms | p99 ms | server CPU ms/call | tokens/call real / padded |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for c in concurrency:
        for model in MODELS:
            s = rows[model, c]
            med = {k: statistics.median(v) for k, v in {
                "rate": [passages * x.calls_per_s for x in s], "calls": [x.calls_per_s for x in s],
                "p50": [x.percentile(50) for x in s], "p99": [x.percentile(99) for x in s],
                "cpu": [x.cpu_ms_per_call for x in s], "real": [x.real_tokens for x in s],
                "padded": [x.padded_tokens for x in s]}.items()}
            print(f"| {model} | {c} | {med['rate']:.1f} | {med['calls']:.2f} | {med['p50']:.0f} | {med['p99']:.0f} "
                  f"| {med['cpu']:.0f} | {med['real']:.0f} / {med['padded']:.0f} |")
    for c in concurrency:
        pairs = list(zip(rows["colbert", c], rows["cross-encoder", c], strict=True))
        ratios = {"passages/s": [a.calls_per_s / b.calls_per_s for a, b in pairs],
                  "p50": [a.percentile(50) / b.percentile(50) for a, b in pairs],
                  "server CPU/call": [a.cpu_ms_per_call / b.cpu_ms_per_call for a, b in pairs]}
        print(f"colbert / cross-encoder c{c}: " + "; ".join(
            f"{name} per round {' '.join(f'{x:.3f}' for x in values)}, median {statistics.median(values):.3f}"
            for name, values in ratios.items()))
    print("note: both sides are encoded per call here, as issue 43 asks; a ColBERT deployment would usually "
          "precompute the documents' vectors, leaving one 32-token query a call.")
    print("note: a cross-encoder sequence is query + passage (one per pair); ColBERT's are the 64 passages alone, "
          "cut at 180 tokens, plus one query padded to 32 with [MASK]: the real / padded tokens above.")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
