"""Tiny random-init Hugging Face *ForSequenceClassification models (pinned transformers), saved with
save_pretrained beside a tokenizer made with `tokenizers`, as references for the task heads (model/heads.py):
a BERT classifier (3 labels, token types 0/1 for pairs) and an XLM-R reranker (one label)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.family_helpers import UNIGRAM_VOCAB, randomize_, save_hf, unigram_tokenizer_json
from tests.support.hf_helpers import TINY_VOCAB, tiny_tokenizer_json

BERT_LABELS = ["neg", "neutral", "pos"]


def bert_classifier(seed: int = 3, num_labels: int = 3, **overrides: Any) -> Any:
    import transformers

    config = transformers.BertConfig(
        vocab_size=len(TINY_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, type_vocab_size=2, pad_token_id=0,
        num_labels=num_labels, hidden_act="gelu",
        **({"id2label": dict(enumerate(BERT_LABELS)), "label2id": {v: i for i, v in enumerate(BERT_LABELS)}}
           if num_labels == 3 else {}), **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config).eval()
    randomize_(model, seed)
    return model


def xlmr_reranker(seed: int = 5, **overrides: Any) -> Any:
    import transformers

    config = transformers.XLMRobertaConfig(
        vocab_size=len(UNIGRAM_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        type_vocab_size=1, layer_norm_eps=1e-5, hidden_act="gelu", num_labels=1, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.XLMRobertaForSequenceClassification(config).eval()
    randomize_(model, seed)
    return model


def write_bert_classifier(directory: Path, **kwargs: Any) -> tuple[Path, Any]:
    model = bert_classifier(**kwargs)
    return save_hf(model, directory, tiny_tokenizer_json()), model


def write_xlmr_reranker(directory: Path, **kwargs: Any) -> tuple[Path, Any]:
    model = xlmr_reranker(**kwargs)
    return save_hf(model, directory, unigram_tokenizer_json()), model


def hf_tokenizer(directory: Path, pad_token: str) -> Any:
    """transformers' fast tokenizer over the folder's tokenizer.json: `tok(q, p)` pairs as HF does."""
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), pad_token=pad_token,
                                                model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def hf_logits(model: Any, tokenizer: Any, first: list[str], second: list[str] | None = None, *,
              max_length: int | None = None) -> torch.Tensor:
    """The HF model's logits (B, n_labels) on the tokenizer's (pair) encoding, padded, eager."""
    enc = tokenizer(first, second, padding=True, truncation=max_length is not None, max_length=max_length,
                    return_tensors="pt")
    with torch.inference_mode():
        return model(**{k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}).logits


def head_bundle(tmp_path_factory: Any, kind: str) -> tuple[Path, Path, Any]:
    """(bundle, HF folder, HF model) of a tiny head model converted with `convert-hf`: kind is
    bert-classifier (3 labels), bert-reranker (1 label, token types) or xlmr-reranker."""
    from model.hf_folder import convert_hf_folder

    root = tmp_path_factory.mktemp(kind)
    if kind == "xlmr-reranker":
        src, model = write_xlmr_reranker(root / "hf")
    else:
        src, model = write_bert_classifier(root / "hf", num_labels=3 if kind == "bert-classifier" else 1)
    convert_hf_folder(src, root / "bundle", name=kind)
    return root / "bundle", src, model


def masked_lm(kind: str, seed: int = 7) -> Any:
    """A tiny random-init BertForMaskedLM or XLMRobertaForMaskedLM (decoder tied to the word embeddings)."""
    import transformers

    if kind == "bert":
        config: Any = transformers.BertConfig(
            vocab_size=len(TINY_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32, type_vocab_size=2, pad_token_id=0, hidden_act="gelu")
        cls: Any = transformers.BertForMaskedLM
    else:
        config = transformers.XLMRobertaConfig(
            vocab_size=len(UNIGRAM_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            type_vocab_size=1, layer_norm_eps=1e-5, hidden_act="gelu")
        cls = transformers.XLMRobertaForMaskedLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize_(model, seed)
    model.tie_weights()
    return model


def write_masked_lm(directory: Path, kind: str) -> tuple[Path, Any]:
    model = masked_lm(kind)
    return save_hf(model, directory, tiny_tokenizer_json() if kind == "bert" else unigram_tokenizer_json()), model


def hf_splade(model: Any, tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """SPLADE as defined: max over tokens of log(1 + relu(MLM logits)), masked by attention. (B, vocab)"""
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    return (torch.log1p(torch.relu(logits)) * enc["attention_mask"][:, :, None]).amax(dim=1)


def sparse_bundle(tmp_path_factory: Any, kind: str = "bert") -> tuple[Path, Path, Any]:
    """(bundle, HF folder, HF model) of a tiny masked-LM converted with `convert-hf` (tasks embed, sparse)."""
    from model.hf_folder import convert_hf_folder

    root = tmp_path_factory.mktemp(f"{kind}-mlm")
    src, model = write_masked_lm(root / "hf", kind)
    convert_hf_folder(src, root / "bundle", name=f"{kind}-splade")
    return root / "bundle", src, model
