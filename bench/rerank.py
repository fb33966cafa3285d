"""Reranking 1 query x 64 passages in one Rerank call against 64 single-pair Rerank calls (issue 31).

A random-init cross-encoder of MiniLM-L6's shape (BertForSequenceClassification, one label: 384 wide, 6
layers, 12 heads; pinned transformers, seeded), with a WordPiece tokenizer over bench/text_bench.py's word
list, converted with `convert-hf` and served by a real server process (tests/support/server_process.py)
on 127.0.0.1. Passages are seeded draws of 20-80 words (about 25-100 tokens per pair). Per round: the one
call of 64 texts; 64 calls of one text each, one after the other; and the same 64 calls at once (asyncio,
one channel). Each is timed end to end at the client; the median of `--rounds` is reported.
Bounded: `--rounds` rounds (default 5) after one warm-up round.

    python -m bench.rerank [--rounds 5] [--threads 2]
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
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.text_bench import WORDS
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from tests.support.server_process import ServerProcess

PASSAGES = 64


def _tokenizer_json() -> bytes:
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w.lower() for w in WORDS} | set(".,;:!?()-"))
    tok = Tokenizer(WordPiece({w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(specials)
    return tok.to_str().encode()


def build_reranker(directory: Path) -> Path:
    """The cross-encoder as a Hugging Face folder, converted into directory/bundle."""
    import torch
    import transformers

    from model.hf_folder import convert_hf_folder

    data = _tokenizer_json()
    vocab = len(json.loads(data)["model"]["vocab"])
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=1536, max_position_embeddings=512, num_labels=1)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(str(directory / "hf"))
    (directory / "hf" / "tokenizer.json").write_bytes(data)
    convert_hf_folder(directory / "hf", directory / "bundle", name="bench-reranker")
    return directory / "bundle"


def texts(seed: int = 0) -> tuple[str, list[str]]:
    rng = np.random.default_rng(seed)
    query = " ".join(rng.choice(WORDS, 8))
    return query, [" ".join(rng.choice(WORDS, int(rng.integers(20, 81)))) for _ in range(PASSAGES)]


async def measure(target: str, query: str, passages: list[str], rounds: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)

        async def one_call() -> pb.RerankResponse:
            return await stub.Rerank(pb.RerankRequest(query=query, texts=passages, truncate=True), timeout=120)

        async def single(text: str) -> pb.RerankResponse:
            return await stub.Rerank(pb.RerankRequest(query=query, texts=[text], truncate=True), timeout=120)

        async def sequential() -> None:
            for text in passages:
                await single(text)

        async def concurrent() -> None:
            await asyncio.gather(*(single(text) for text in passages))

        times: dict[str, list[float]] = {"one call of 64": [], "64 calls, sequential": [], "64 calls, concurrent": []}
        batch_sizes: list[int] = []
        for r in range(rounds + 1):  # the first round warms up
            for name, run in (("one call of 64", one_call), ("64 calls, sequential", sequential),
                              ("64 calls, concurrent", concurrent)):
                started = time.perf_counter()
                result = await run()
                seconds = time.perf_counter() - started
                if r:
                    times[name].append(seconds)
                if isinstance(result, pb.RerankResponse) and r:
                    batch_sizes.append(result.metadata.batch_size)
    out: dict[str, Any] = {}
    for name, values in times.items():
        median = statistics.median(values)
        out[name] = {"median_ms": round(median * 1e3, 1), "pairs_per_s": round(PASSAGES / median, 1),
                     "min_ms": round(min(values) * 1e3, 1)}
    out["largest batch of the one call"] = max(batch_sizes)
    return out


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in flags if f in ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")]
    return f"{model}; {' '.join(wanted)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rerank", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_flags(),
                              "cores": os.cpu_count(), "command": "python -m bench.rerank " + " ".join(argv or []),
                              "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-rerank-") as tmp:
        bundle = build_reranker(Path(tmp))
        query, passages = texts()
        server = ServerProcess(bundle, "--max-batch-tokens", "8192", "--max-batch-size", "64",
                               "--torch-threads", str(args.threads))
        try:
            report["results"] = asyncio.run(measure(server.target, query, passages, args.rounds))
        finally:
            server.stop()
    report["load_average_after"] = os.getloadavg()
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
