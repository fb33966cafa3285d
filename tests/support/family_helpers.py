"""Hugging Face model families as references: tiny random-init transformers models (RobertaModel,
XLMRobertaModel, ...) saved with save_pretrained, a tiny SentencePiece-style Unigram tokenizer, and the
comparison of a bundle's hidden states and attention weights with the HF model's own (eager attention).

transformers is a pinned test dependency (requirements-dev.txt); nothing here downloads: HF_HUB_OFFLINE=1 is
set before transformers is first imported, and every model is built from a config in the test."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / huggingface_hub read it (at import)
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# XLM-R's special tokens and ids (fairseq's order), then the pieces; "▁" marks a word start (SentencePiece).
UNIGRAM_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
UNIGRAM_PIECES = ["▁", "▁the", "▁cat", "s", "▁a", "▁b", "▁c", "at", "▁über", "▁東", "京", ",", ".", "▁hello",
                  "▁world", "▁wor", "ld", "▁he", "llo", "e", "o", "l", "h", "w", "r", "d", "t", "c", "a", "b", "▁is"]
UNIGRAM_VOCAB = UNIGRAM_SPECIALS + UNIGRAM_PIECES + ["<mask>"]


def unigram_tokenizer_json() -> bytes:
    """An XLM-R style tokenizer.json (Unigram model, Metaspace, <s> $A </s>), built with `tokenizers`."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram

    scores = [(t, 0.0) for t in UNIGRAM_SPECIALS]
    scores += [(p, -1.0 - 0.25 * len(p) if p.startswith("▁") else -3.0 - 0.5 * len(p)) for p in UNIGRAM_PIECES]
    scores.append(("<mask>", 0.0))
    tok = Tokenizer(Unigram(scores, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Nmt(), normalizers.NFKC(),
                                           normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.add_special_tokens(UNIGRAM_SPECIALS + ["<mask>"])
    return tok.to_str().encode("utf-8")


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's init (std 0.02, LayerNorms (1, 0): nearly uniform attention) by seeded values large enough
    that every term matters: weights std 0.2 (embeddings 0.5), norm weights 1 +- 0.1, biases std 0.1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed" in name.lower() or "relative_attention_bias" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.2 * noise)


def save_hf(model: Any, directory: Path, tokenizer: bytes | None = None,
            tokenizer_config: dict[str, Any] | None = None) -> Path:
    """save_pretrained (safetensors) plus, optionally, tokenizer.json and tokenizer_config.json."""
    model.save_pretrained(str(directory))
    if tokenizer is not None:
        (directory / "tokenizer.json").write_bytes(tokenizer)
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def mixed_batch(lengths: list[int], vocab: int, pad: int, bos: int, eos: int, seed: int,
                avoid: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) padded with `pad`, lengths (B,)): <bos> random content <eos>, content ids never a special."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(vocab) if i not in {pad, bos, eos, *avoid}])
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad, dtype=torch.int64)
    for b, n in enumerate(lengths):
        ids[b, n - 1], ids[b, 0] = eos, bos  # a row of one token is <bos> alone
        ids[b, 1:n - 1] = allowed[torch.randint(0, len(allowed), (max(n - 2, 0),), generator=g)]
    return ids, torch.tensor(lengths)


def hf_forward(model: Any, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF model's last_hidden_state (B, T, C) and attentions stacked (B, L, nh, T, T), eager, padded batch."""
    mask = (torch.arange(ids.size(1))[None, :] < lengths[:, None]).long()
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    return out.last_hidden_state, torch.stack(out.attentions, dim=1)


def ours_forward(module: Any, ids: torch.Tensor, lengths: torch.Tensor,
                 layers: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.inference_mode():
        hidden, weights = module(ids, None, lengths, False, layers)
    return hidden, weights


def assert_matches_hf(module: Any, model: Any, ids: torch.Tensor, lengths: torch.Tensor, *,
                      hidden_atol: float = 1e-5, attention_atol: float = 1e-6) -> dict[str, float]:
    """Both attention paths of `module` (SDPA: no weights asked; explicit: all layers' weights) against the HF
    model on the real rows of a padded batch. Returns the worst differences (for the report)."""
    want_h, want_w = hf_forward(model, ids, lengths)
    n_layers = want_w.size(1)
    worst = {"hidden_sdpa": 0.0, "hidden_explicit": 0.0, "attention": 0.0}
    got_sdpa, none = ours_forward(module, ids, lengths, [])
    assert none is None
    got_h, got_w = ours_forward(module, ids, lengths, list(range(n_layers)))
    assert got_w is not None and got_w.shape == want_w.shape, (None if got_w is None else got_w.shape, want_w.shape)
    for b, n in enumerate(lengths.tolist()):
        for key, got in (("hidden_sdpa", got_sdpa), ("hidden_explicit", got_h)):
            err = float((got[b, :n] - want_h[b, :n]).abs().max())
            worst[key] = max(worst[key], err)
        err = float((got_w[b, :, :, :n, :n] - want_w[b, :, :, :n, :n]).abs().max())
        worst["attention"] = max(worst["attention"], err)
        assert not bool(got_w[b, :, :, :n, n:].any())  # padded keys: exactly 0
    assert worst["hidden_sdpa"] <= hidden_atol and worst["hidden_explicit"] <= hidden_atol, worst
    assert worst["attention"] <= attention_atol, worst
    # The weights are not trivially equal: far from uniform, so an error in positions or scale would show.
    assert float(want_w.amax()) > 0.5, float(want_w.amax())
    return worst


def numpy_rows(x: torch.Tensor, n: int) -> np.ndarray:
    return x[:n].float().numpy()
