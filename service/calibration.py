"""The precision gate's inputs and the outputs a bundle gives them (service/tuning.py judges them).

`precision=auto` serves a reduced precision only if it answers what callers send as fp32 does. Callers
send text, or ids that came from text, so the gate runs inputs like theirs, never only random ids
(random ids missed a model that bf16 breaks on text, tests/service/test_tuning.py):
- a text bundle: its own tokenizer on the built-in texts (data/calibration.json: short to long, many
  domains, several languages and scripts, code, numbers, markup, typos, emoji), each text alone, plus
  passages joined into rows of the tokenizer's limit and a quarter of it; a bundle with a rerank head
  also gets each query paired with its answer and with seven other passages (token types as the plan
  sends them);
- an id bundle: ids drawn across the vocabulary (uniform, and Zipf-distributed as text's tokens are,
  low ids most often) at lengths from 1 to max_length, and one id repeated; seeded. Ids stay below
  the top tenth of the vocabulary, where test models keep their sentinel ids (model/faults.py).
`bundle_outputs` runs them through a loaded bundle (on CPU, where `auto` measures) as the runner does: one
forward per batch of similar lengths, each head the bundle serves applied in fp32 to that batch's hidden states.
Imports torch; loads nothing over the network (the texts are package data).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.bundle import LoadedBundle
from model.heads import pair_embeddings
from model.text import TextTokenizer

TEXTS_FILE = Path(__file__).resolve().parent / "data" / "calibration.json"
PAIRS_PER_QUERY = 8  # its answer and seven other passages
BATCH_TOKENS = 4096  # padded tokens per calibration forward: rows sorted by length, so little is padding


@dataclass(frozen=True)
class Calibration:
    """What the gate runs. rows: token ids [T] each, single inputs; pairs: (ids [T], token types [T]) each,
    for a rerank head; groups: per pair, the query it belongs to (scores are ranked within a query)."""

    rows: list[np.ndarray]
    pairs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    source: str = ""  # what the rows are, for the reason: "64 texts of the tokenizer's (3-256 tokens)"

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows) + sum(len(ids) for ids, _ in self.pairs)


@functools.cache
def load_texts() -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    """(queries, passages, answers): answers[i] is the index of the passage that answers queries[i]."""
    data = json.loads(TEXTS_FILE.read_text(encoding="utf-8"))
    queries, passages, answers = tuple(data["queries"]), tuple(data["passages"]), tuple(data["answers"])
    assert len(answers) == len(queries) and all(0 <= a < len(passages) for a in answers), \
        f"{TEXTS_FILE}: answers must give one passage index per query. This is a bug."
    return queries, passages, answers


def calibration_for(bundle: LoadedBundle) -> Calibration:
    """The gate's inputs for `bundle`: its tokenizer's on the texts, or drawn ids for an id bundle."""
    cfg = bundle.manifest.config
    if bundle.tokenizer is None:
        return id_calibration(cfg.vocab_size, cfg.max_length)
    return text_calibration(bundle.tokenizer, cfg.max_length, pairs="rerank" in bundle.heads)


def text_calibration(tokenizer: TextTokenizer, max_length: int, *, pairs: bool = False) -> Calibration:
    """The built-in texts through `tokenizer`, each alone (cut at its limit, as a call with truncate is), and
    passages joined to rows of the limit and of a quarter of it (where longer than every single text);
    with `pairs`, (query, passage) pairs as a rerank call tokenizes them."""
    queries, passages, answers = load_texts()
    limit = min(tokenizer.settings.max_tokens, max_length)
    rows = [e.ids for e in tokenizer.encode([*queries, *passages], truncate=True)]  # max_tokens <= max_length
    longest = max(len(r) for r in rows)
    whole = tokenizer.encode([" ".join(passages)], truncate=False)[0].ids
    while 2 < len(whole) < limit:  # the passages again (between the first and last token) until it reaches the limit
        whole = np.concatenate([whole[:-1], whole[1:]])
    for length in sorted({limit, limit // 4}, reverse=True):
        if longest < length <= len(whole):
            rows.append(np.concatenate([whole[: length - 1], whole[-1:]]))  # the final special token kept
    cal = Calibration(rows, source=f"{len(rows)} texts through the tokenizer ({min(map(len, rows))}-"
                                   f"{max(map(len, rows))} tokens)")
    if not pairs:
        return cal
    texts, groups = [], []
    for q, (query, answer) in enumerate(zip(queries, answers, strict=True)):
        for k in range(PAIRS_PER_QUERY):
            texts.append((query, passages[(answer + 6 * k) % len(passages)]))
            groups.append(q)
    encoded = tokenizer.encode_pairs(texts, truncate=True)
    pair_rows = [(e.ids, e.type_ids if e.type_ids is not None else np.zeros_like(e.ids)) for e in encoded]
    return Calibration(cal.rows, pair_rows, groups, f"{cal.source} and {len(pair_rows)} query-passage pairs")


def id_calibration(vocab_size: int, max_length: int, seed: int = 0) -> Calibration:
    """Seeded ids at lengths 1, 2, 4, ... and max_length: per length a uniform draw across the vocabulary and a
    Zipf draw (low ids most often); and one id repeated. All below the top tenth of the vocabulary."""
    rng = np.random.default_rng(seed)
    high = max(1, vocab_size - vocab_size // 10)
    lengths = sorted({*(2**i for i in range(max_length.bit_length()) if 2**i <= max_length), max_length})
    rows = []
    for n in lengths:
        rows.append(rng.integers(0, high, n))
        rows.append((rng.zipf(1.2, n) - 1) % high)  # the tail wrapped round, not piled on one id
    rows.append(np.full(min(64, max_length), int(rng.integers(0, high))))
    rows = [r.astype(np.int64) for r in rows]
    return Calibration(rows, source=f"{len(rows)} rows of ids drawn across the vocabulary (1-{max_length} tokens)")


@dataclass(frozen=True)
class BatchOutputs:
    """One calibration forward's outputs, fp32. index: the inputs' positions in Calibration.rows (or .pairs);
    lengths (B,); hidden (B, T, D); heads: per head the bundle serves, its output (classify, rerank: (B, labels);
    sparse: (B, vocab); colbert: (B, T, dim))."""

    index: list[int]
    lengths: torch.Tensor
    hidden: torch.Tensor
    heads: dict[str, torch.Tensor]
    pairs: bool = False  # the inputs are Calibration.pairs (their hidden states are not served: scores only)


def bundle_outputs(bundle: LoadedBundle, cal: Calibration) -> Iterator[BatchOutputs]:
    """The calibration's rows, then its pairs, in batches of similar length, through `bundle` as the runner runs
    them (service/runner.py _enqueue): rows get every head but rerank (rerank too when there are no pairs); pairs
    get the rerank head alone, fed as the word table plus the type delta when the bundle has one (pair_types)."""
    singles = [name for name in bundle.heads if name != "rerank" or not cal.pairs]
    for index, ids, _, lengths in _batches([(r, None) for r in cal.rows]):
        yield _forward(bundle, index, ids, None, lengths, singles)
    for index, ids, types, lengths in _batches(cal.pairs):
        yield dataclasses.replace(_forward(bundle, index, ids, types, lengths, ["rerank"]), pairs=True)


def _batches(inputs: Sequence[tuple[np.ndarray, np.ndarray | None]]
             ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """(index, ids (B, T), types (B, T) or None, lengths (B,)) per batch: inputs sorted by length, cut where the
    padded batch would pass BATCH_TOKENS."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i][0]))
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(inputs[order[end]][0]) <= BATCH_TOKENS:
            end += 1
        index = order[start:end]
        T = len(inputs[index[-1]][0])
        ids = torch.zeros((len(index), T), dtype=torch.int64)
        types = torch.zeros((len(index), T), dtype=torch.int64) if inputs[index[0]][1] is not None else None
        for row, i in enumerate(index):
            r, t = inputs[i]
            ids[row, : len(r)] = torch.from_numpy(np.asarray(r, dtype=np.int64))
            if types is not None and t is not None:
                types[row, : len(t)] = torch.from_numpy(np.asarray(t, dtype=np.int64))
        yield index, ids, types, torch.tensor([len(inputs[i][0]) for i in index])
        start = end


def _forward(bundle: LoadedBundle, index: list[int], ids: torch.Tensor, types: torch.Tensor | None,
             lengths: torch.Tensor, heads: Sequence[str]) -> BatchOutputs:
    module: Any = bundle.module
    with torch.inference_mode():
        if types is not None and bundle.token_embeddings is not None:  # pairs, as the runner feeds them
            emb = pair_embeddings(bundle.token_embeddings, bundle.heads["rerank"].type_delta, ids, types)
            hidden = module(None, emb, lengths, False, [])[0].float()
        else:
            hidden = module(ids, None, lengths, False, [])[0].float()
        outs = {name: _head(bundle.heads[name], hidden, lengths, ids).float() for name in heads}
    return BatchOutputs(index, lengths, hidden, outs)


def _head(head: Any, hidden: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = head(hidden, lengths, ids) if getattr(head, "takes_ids", False) else head(hidden, lengths)
    return out
