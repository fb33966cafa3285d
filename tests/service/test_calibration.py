"""The precision gate's inputs (service/calibration.py): the built-in texts through a bundle's own tokenizer, ids
drawn across the vocabulary for an id bundle, and the outputs a bundle gives them as the runner computes them."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch

from model.bundle import load_bundle
from service.calibration import (
    BATCH_TOKENS,
    PAIRS_PER_QUERY,
    TEXTS_FILE,
    bundle_outputs,
    calibration_for,
    id_calibration,
    load_texts,
    text_calibration,
)


def test_the_texts_are_package_data_varied_in_length_and_script():
    queries, passages, answers = load_texts()
    assert TEXTS_FILE.is_file() and TEXTS_FILE.parent.name == "data"  # shipped with the package, read locally
    assert len(queries) == len(answers) >= 10 and len(passages) >= 40
    words = sorted(len(p.split()) for p in passages)
    assert words[0] == 1 and words[-1] >= 80  # one word to a paragraph
    scripts = {unicodedata.name(c).split()[0] for p in passages for c in p if c.isalpha() and ord(c) > 0x24F}
    assert {"CJK", "CYRILLIC", "ARABIC", "GREEK", "HANGUL", "DEVANAGARI"} <= scripts, scripts


def test_a_text_bundle_is_calibrated_with_its_own_tokenizer_up_to_its_limit(tiny_text_bundle: Path):
    bundle = load_bundle(tiny_text_bundle)
    assert bundle.tokenizer is not None
    cal = calibration_for(bundle)
    queries, passages, _ = load_texts()
    limit = bundle.tokenizer.settings.max_tokens  # 8
    want = [e.ids for e in bundle.tokenizer.encode([*queries, *passages], truncate=True)]
    assert all(np.array_equal(got, w) for got, w in zip(cal.rows, want, strict=False))
    assert max(map(len, cal.rows)) == limit and min(map(len, cal.rows)) >= 2  # [CLS] ... [SEP], cut at the limit
    assert cal.pairs == [] and cal.source == f"{len(cal.rows)} texts through the tokenizer (3-{limit} tokens)"


def test_joined_passages_reach_the_limit_and_a_quarter_of_it(minilm_bundle: Path):
    """all-MiniLM-L6-v2 cuts at 256 tokens; its longest single text is shorter, so rows of 256 are joined
    passages, [CLS] first and [SEP] last as a cut text has them."""
    bundle = load_bundle(minilm_bundle)
    assert bundle.tokenizer is not None
    cal = text_calibration(bundle.tokenizer, bundle.manifest.config.max_length)
    queries, passages, _ = load_texts()
    singles = cal.rows[: len(queries) + len(passages)]
    joined = cal.rows[len(singles):]
    assert [len(r) for r in joined] == [256] and max(map(len, singles)) < 256
    assert joined[0][0] == 101 and joined[0][-1] == 102


def test_a_reranker_is_calibrated_with_each_query_against_its_answer_and_other_passages(
        bert_reranker: tuple[Path, Path, object]):
    bundle = load_bundle(bert_reranker[0])
    assert "rerank" in bundle.heads and bundle.tokenizer is not None
    cal = calibration_for(bundle)
    queries, passages, answers = load_texts()
    assert len(cal.pairs) == len(cal.groups) == PAIRS_PER_QUERY * len(queries)
    assert cal.groups == [q for q in range(len(queries)) for _ in range(PAIRS_PER_QUERY)]
    first = bundle.tokenizer.encode_pairs([(queries[0], passages[answers[0]])], truncate=True)[0]
    ids, types = cal.pairs[0]
    assert np.array_equal(ids, first.ids) and first.type_ids is not None and np.array_equal(types, first.type_ids)
    assert all(t.max() == 1 for _, t in cal.pairs)  # every pair has a second text of token type 1


def test_an_id_bundle_gets_seeded_ids_across_the_vocabulary_and_lengths():
    cal = id_calibration(1000, 100)
    again = id_calibration(1000, 100)
    assert all(np.array_equal(a, b) for a, b in zip(cal.rows, again.rows, strict=True))  # seeded
    lengths = sorted({len(r) for r in cal.rows})
    assert lengths == [1, 2, 4, 8, 16, 32, 64, 100]
    ids = np.concatenate(cal.rows)
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 900  # below the top tenth (sentinel ids)
    assert ids.max() > 800  # across the vocabulary
    zipf = np.concatenate(cal.rows[1:-1:2])  # per length: a uniform row, then a Zipf row; low ids most often
    assert (zipf < 10).mean() > 0.3 > (np.concatenate(cal.rows[0:-1:2]) < 10).mean()
    assert any(len(set(r.tolist())) == 1 and len(r) == 64 for r in cal.rows)  # one id repeated


def test_the_outputs_are_the_runners_per_batch_with_every_head(bert_reranker: tuple[Path, Path, object]):
    """Single texts get every head but rerank; the pairs get rerank alone; batches stay within BATCH_TOKENS and
    cover every input once; a single text's hidden states are its forward alone (padding changes nothing)."""
    bundle = load_bundle(bert_reranker[0])
    cal = calibration_for(bundle)
    batches = list(bundle_outputs(bundle, cal))
    singles, pairs = [b for b in batches if not b.pairs], [b for b in batches if b.pairs]
    assert sorted(i for b in singles for i in b.index) == list(range(len(cal.rows)))
    assert sorted(i for b in pairs for i in b.index) == list(range(len(cal.pairs)))
    assert {name for b in singles for name in b.heads} == {"classify"}
    assert all(b.heads.keys() == {"rerank"} and b.heads["rerank"].shape == (len(b.index), 1) for b in pairs)
    assert all(b.hidden.shape[0] * b.hidden.shape[1] <= BATCH_TOKENS for b in batches)
    b = singles[-1]
    row = cal.rows[b.index[0]]
    with torch.inference_mode():
        alone = bundle.module(torch.from_numpy(row)[None], None, torch.tensor([len(row)]), False, [])[0]
    torch.testing.assert_close(b.hidden[0, : len(row)], alone[0].float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab_size", [10, 30522])
def test_small_vocabularies_and_lengths_are_drawn_too(vocab_size: int):
    cal = id_calibration(vocab_size, 1)
    assert {len(r) for r in cal.rows} == {1} and max(int(r.max()) for r in cal.rows) < vocab_size - vocab_size // 10
