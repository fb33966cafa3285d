"""Task heads (model/heads.py, model/hf_heads.py) against Hugging Face's *ForSequenceClassification (pinned
transformers, tiny random-init models saved with save_pretrained, converted with `convert-hf`): the bundle's
encoder plus its scripted head give the HF logits within 1e-5, single texts and pairs (BERT's token types 0/1
through the head's type delta; XLM-R's <s> q </s></s> p </s>), on the tokenizer's own pair encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.bundle import BundleError, load_bundle, read_manifest
from model.heads import pair_embeddings
from model.hf_folder import convert_hf_folder
from tests.support.head_helpers import BERT_LABELS, hf_logits, hf_tokenizer, write_bert_classifier, write_xlmr_reranker

QUERIES = ["the cat", "a b c", "cats", "the cat a b c the cat . a"]
PASSAGES = ["a cat .", "the the the c", "b", "cats a cats"]
X_QUERIES = ["hello world", "the cat", "über 東京", "a b c the cats is"]
X_PASSAGES = ["the cats", "hello", "a, b. c", "world is the cat"]


def _ours(bundle_dir: Path, tokenizer: object, first: list[str], second: list[str] | None, task: str) -> torch.Tensor:
    """Our logits: the bundle's encoder, then its head, on the same tokenizer encoding (padded)."""
    loaded = load_bundle(bundle_dir)
    head = loaded.heads[task]
    enc = tokenizer(first, second, padding=True, return_tensors="pt")  # type: ignore[operator]
    ids, lengths = enc["input_ids"], enc["attention_mask"].sum(1)
    with torch.inference_mode():
        if head.type_delta.numel():
            assert loaded.token_embeddings is not None
            types = enc["token_type_ids"]
            hidden, _ = loaded.module(None, pair_embeddings(loaded.token_embeddings, head.type_delta, ids, types),
                                      lengths, False, [])
        else:
            hidden, _ = loaded.module(ids, None, lengths, False, [])
        return head(hidden.float(), lengths)


def test_bert_classifier_matches_hf(tmp_path: Path) -> None:
    src, model = write_bert_classifier(tmp_path / "bert-cls")
    out = tmp_path / "bundle"
    manifest = convert_hf_folder(src, out)
    assert manifest.tasks is not None and set(manifest.tasks) == {"embed", "classify"}
    assert manifest.tasks["classify"]["labels"] == BERT_LABELS
    assert manifest.tasks["classify"]["problem_type"] == "single_label_classification"
    assert (out / "heads" / "classify.pt").is_file()
    tok = hf_tokenizer(src, "[PAD]")
    for second in (None, PASSAGES):
        want = hf_logits(model, tok, QUERIES, second)
        got = _ours(out, tok, QUERIES, second, "classify")
        assert want.shape == got.shape == (4, 3)
        assert float((got - want).abs().max()) <= 1e-5, (got, want)
        assert float(want.std()) > 0.1  # not trivially equal: the logits differ between inputs and labels
    # The token types matter: a pair fed with types all 0 gives other logits.
    enc = tok(QUERIES, PASSAGES, padding=True, return_tensors="pt")
    assert int(enc["token_type_ids"].sum()) > 0
    with torch.inference_mode():
        wrong = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    assert float((wrong - hf_logits(model, tok, QUERIES, PASSAGES)).abs().max()) > 1e-3


def test_xlmr_reranker_matches_hf(tmp_path: Path) -> None:
    src, model = write_xlmr_reranker(tmp_path / "xlmr-rerank")
    out = tmp_path / "bundle"
    manifest = convert_hf_folder(src, out)
    assert manifest.tasks is not None and set(manifest.tasks) == {"embed", "classify", "rerank"}
    assert manifest.tasks["rerank"]["labels"] == ["LABEL_0"]
    tok = hf_tokenizer(src, "<pad>")
    enc = tok(X_QUERIES[:1], X_PASSAGES[:1])
    assert enc["input_ids"][0].count(2) == 3  # <s> q </s></s> p </s>
    want = hf_logits(model, tok, X_QUERIES, X_PASSAGES)
    got = _ours(out, tok, X_QUERIES, X_PASSAGES, "rerank")
    assert want.shape == got.shape == (4, 1)
    assert float((got - want).abs().max()) <= 1e-5, (got, want)
    assert float(want.std()) > 0.05
    assert load_bundle(out).token_embeddings is None  # one token type: pairs ride as token ids


def test_base_model_bundle_has_no_tasks(tmp_path: Path) -> None:
    """A folder whose architectures is a base model converts as before: no tasks key, embed only."""
    src, _ = write_bert_classifier(tmp_path / "bert")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (src / "config.json").write_text(json.dumps(config))
    manifest = convert_hf_folder(src, tmp_path / "bundle")
    assert manifest.tasks is None and manifest.task_names == ("embed",)
    assert "tasks" not in json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert load_bundle(tmp_path / "bundle").heads == {}


def test_head_file_checksum_and_manifest_checks(tmp_path: Path) -> None:
    src, _ = write_bert_classifier(tmp_path / "bert-cls")
    out = tmp_path / "bundle"
    convert_hf_folder(src, out)
    data = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**data, "tasks": {**data["tasks"], "translate": {}}}))
    with pytest.raises(BundleError, match=r"tasks.translate: unknown task"):
        read_manifest(out)
    bad = {**data["tasks"], "rerank": data["tasks"]["classify"]}  # three labels
    (out / "manifest.json").write_text(json.dumps({**data, "tasks": bad}))
    with pytest.raises(BundleError, match=r"tasks.rerank.labels: a reranker has one label"):
        read_manifest(out)
    (out / "manifest.json").write_text(json.dumps(data))
    head = out / "heads" / "classify.pt"
    head.write_bytes(head.read_bytes() + b"x")
    with pytest.raises(BundleError, match=r"classify.pt failed its checksum"):
        load_bundle(out)


@pytest.mark.parametrize(("kind", "pad", "texts"), [("bert", "[PAD]", QUERIES), ("xlmr", "<pad>", X_QUERIES)])
def test_splade_head_matches_the_masked_lm(tmp_path: Path, kind: str, pad: str, texts: list[str]) -> None:
    """SparseHead = max over real tokens of log(1 + relu(MLM logits)), the decoder tied to the word table."""
    from tests.support.head_helpers import hf_splade, write_masked_lm

    src, model = write_masked_lm(tmp_path / "mlm", kind)
    out = tmp_path / "bundle"
    manifest = convert_hf_folder(src, out)
    assert manifest.tasks is not None and set(manifest.tasks) == {"embed", "sparse"}
    tok = hf_tokenizer(src, pad)
    want = hf_splade(model, tok, texts)
    loaded = load_bundle(out)
    enc = tok(texts, padding=True, return_tensors="pt")
    lengths = enc["attention_mask"].sum(1)
    with torch.inference_mode():
        hidden, _ = loaded.module(enc["input_ids"], None, lengths, False, [])
        got = loaded.heads["sparse"](hidden.float(), lengths)
    assert got.shape == want.shape == (len(texts), model.config.vocab_size)
    assert float((got - want).abs().max()) <= 1e-5
    assert 0 < int((want > 0).sum()) < want.numel()  # sparse, and not trivially empty
    # Rows a few at a time (a small chunk: one row per pass) give the same vectors.
    from model.heads import SparseHead

    eager = SparseHead(32, model.config.vocab_size, "gelu", model.config.layer_norm_eps)
    eager.load_state_dict(loaded.heads["sparse"].state_dict())
    eager.chunk = 1
    with torch.inference_mode():
        assert float((eager(hidden.float(), lengths) - got).abs().max()) <= 1e-6
