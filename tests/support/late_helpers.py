"""Late-interaction test material: tiny random-init models in each published layout, built here (no hub, no
download), and the plain-torch references of their token vectors.

  write_pylate    a PyLate ColBERT folder as PyLate 1.6 saves one (modules.json: Transformer, then
                  pylate.models.Dense.Dense in 1_Dense; "[Q] " / "[D] " added tokens; config_sentence_transformers.json)
  write_stanford  a stanford-futuredata ColBERT checkpoint (architectures HF_ColBERT, `bert.` + `linear.weight`,
                  [unused0] / [unused1], artifact.metadata)
  write_bge_m3    a BGE-M3 folder (XLM-R encoder, colbert_linear.pt and sparse_linear.pt beside it, the
                  sentence-transformers files BAAI/bge-m3 ships)
The weights are seeded (family_helpers.randomize_), so bench/late_reference.py builds the same folders in a
throwaway venv with the authors' packages and tests/data/late_reference.* hold their outputs; `weights_digest`
ties those outputs to these weights.
"""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.family_helpers import UNIGRAM_VOCAB, randomize_, save_hf, unigram_tokenizer_json
from tests.support.hf_helpers import TINY_VOCAB

DATA = Path(__file__).resolve().parents[1] / "data"
# BERT's tiny vocabulary, plus punctuation (the skip list), two words and ColBERT's markers.
LATE_VOCAB = TINY_VOCAB + [",", "!", "?", "dog", "runs", "[unused0]", "[unused1]"]
PYLATE_PREFIXES = ["[Q] ", "[D] "]  # added tokens, as PyLate adds them
QUERIES = ["the cat", "a dog runs", "cats, a b c!", "the the the cat a b c dog runs ."]
DOCUMENTS = ["a cat .", "the dog runs, the cat runs!", "b", "cats a cats ? the . dog runs a b c the cat a"]
M3_QUERIES = ["hello world", "the cat", "über 東京", "a b c the cats is"]
M3_DOCUMENTS = ["the cats", "hello, world.", "a, b. c", "world is the cat the cat is hello"]


def late_tokenizer_json(added: list[str]) -> bytes:
    """A BERT WordPiece tokenizer.json over LATE_VOCAB, with `added` as PyLate's added (non-special) tokens."""
    from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    tok = Tokenizer(WordPiece({w: i for i, w in enumerate(LATE_VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.add_tokens([AddedToken(a, normalized=True, special=False) for a in added])
    return tok.to_str().encode()


BERT_TOKENS = {"tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
               "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"}
M3_TOKENS = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>",
             "sep_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}


def tiny_bert(vocab_size: int, seed: int, max_positions: int = 32) -> Any:
    import transformers

    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=max_positions, type_vocab_size=2,
                                     pad_token_id=0, hidden_act="gelu", architectures=["BertModel"])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    randomize_(model, seed)
    return model


def _linear(out: int, inp: int, seed: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=g) * 0.3
    return weight, (torch.randn(out, generator=g) * 0.1 if bias else None)


def write_pylate(directory: Path, *, seed: int = 11, query_length: int = 10, document_length: int = 12,
                 attend: bool = False, expansion: bool = True, dense: tuple[tuple[int, bool, str], ...] = (
                     (24, True, "tanh"), (16, False, "identity"))) -> Path:
    """A PyLate ColBERT folder: a tiny BERT, then Dense modules (out_features, bias, activation) in order."""
    from safetensors.torch import save_file

    model = tiny_bert(len(LATE_VOCAB) + len(PYLATE_PREFIXES), seed)
    save_hf(model, directory, late_tokenizer_json(PYLATE_PREFIXES), BERT_TOKENS)
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    width = 32
    for i, (out, bias, activation) in enumerate(dense, start=1):
        folder = directory / f"{i}_Dense"
        folder.mkdir()
        weight, b = _linear(out, width, seed + i, bias)
        save_file({"linear.weight": weight, **({"linear.bias": b} if b is not None else {})},
                  str(folder / "model.safetensors"))
        act = {"identity": "torch.nn.modules.linear.Identity", "tanh": "torch.nn.modules.activation.Tanh"}[activation]
        (folder / "config.json").write_text(json.dumps({"in_features": width, "out_features": out, "bias": bias,
                                                        "activation_function": act, "use_residual": False}))
        modules.append({"idx": i, "name": str(i), "path": f"{i}_Dense", "type": "pylate.models.Dense.Dense"})
        width = out
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    (directory / "config_sentence_transformers.json").write_text(json.dumps({
        "model_type": "ColBERT", "prompts": {"query": "", "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "MaxSim", "query_prefix": "[Q] ", "document_prefix": "[D] ",
        "query_length": query_length, "document_length": document_length, "attend_to_expansion_tokens": attend,
        "skiplist_words": list(string.punctuation), "do_query_expansion": expansion}))
    return directory


def write_stanford(directory: Path, *, seed: int = 13, dim: int = 16, metadata: dict[str, Any] | None = None) -> Path:
    """A stanford-futuredata ColBERT checkpoint (HF_ColBERT): BERT under `bert.`, `linear` (no bias) beside it."""
    from safetensors.torch import save_file

    model = tiny_bert(len(LATE_VOCAB), seed)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["architectures"] = ["HF_ColBERT"]
    (directory / "config.json").write_text(json.dumps(config))
    state = {f"bert.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    state["linear.weight"] = _linear(dim, 32, seed + 1, False)[0]
    save_file(state, str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_bytes(late_tokenizer_json([]))
    (directory / "tokenizer_config.json").write_text(json.dumps(BERT_TOKENS))
    meta = {"query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": 10, "doc_maxlen": 12,
            "dim": dim, "mask_punctuation": True, "attend_to_mask_tokens": False, "similarity": "cosine",
            "interaction": "colbert", **(metadata or {})}
    (directory / "artifact.metadata").write_text(json.dumps(meta))
    return directory


def tiny_xlmr(seed: int) -> Any:
    import transformers

    config = transformers.XLMRobertaConfig(
        vocab_size=len(UNIGRAM_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
        layer_norm_eps=1e-5, hidden_act="gelu", architectures=["XLMRobertaModel"])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.XLMRobertaModel(config, add_pooling_layer=False).eval()
    randomize_(model, seed)
    return model


def write_bge_m3(directory: Path, *, seed: int = 17, dim: int = 32) -> Path:
    """A BGE-M3 folder: the XLM-R encoder, colbert_linear.pt (32 -> dim, bias) and sparse_linear.pt (32 -> 1)."""
    model = tiny_xlmr(seed)
    save_hf(model, directory, unigram_tokenizer_json(), M3_TOKENS)
    for name, out, offset in (("colbert_linear.pt", dim, 1), ("sparse_linear.pt", 1, 2)):
        weight, bias = _linear(out, 32, seed + offset, True)
        assert bias is not None
        if name == "sparse_linear.pt":
            bias = bias + 1.5  # most tokens get a weight above 0 (relu), some do not
        torch.save({"weight": weight, "bias": bias}, directory / name)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 38, "do_lower_case": False}))
    return directory


def weights_digest(directory: Path) -> str:
    """sha256 over every tensor the folder holds (file, name, shape, float32 bytes), whatever the file format:
    the committed references were computed from weights with this digest."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.suffix in (".safetensors", ".pt")):
        tensors = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
        for name in sorted(tensors):
            t = tensors[name].detach().float().contiguous()
            digest.update(f"{path.relative_to(directory).as_posix()}|{name}|{tuple(t.shape)}|".encode())
            digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def hf_tokenizer(directory: Path) -> Any:
    """transformers' fast tokenizer over the folder's tokenizer.json and tokenizer_config.json."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(directory))


def colbert_reference(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor | None, str]], tokenizer: Any,
                      texts: list[str], *, marker: int, length: int, query: bool, expansion: bool, attend: bool,
                      skip: set[int], pad_id: int) -> list[np.ndarray]:
    """Plain torch, as PyLate's ColBERT.tokenize/encode and stanford ColBERT's tensorize/query/doc compute token
    vectors: cut at length - 1, the marker after [CLS], a query padded to `length` with [MASK] (attended only if
    `attend`), the transformers model, the projection chain, L2 normalisation; a query keeps every vector, a
    document drops padding and the `skip` ids."""
    out = []
    for text in texts:  # one at a time: no padding but a query's expansion
        enc = tokenizer([text], truncation=True, max_length=length - 1, return_tensors="pt",
                        padding="max_length" if query and expansion else False)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        ids = torch.cat([ids[:, :1], torch.full((1, 1), marker), ids[:, 1:]], dim=1)
        mask = torch.cat([mask[:, :1], torch.ones(1, 1, dtype=mask.dtype), mask[:, 1:]], dim=1)
        if query and expansion:
            ids = torch.where(ids == pad_id, torch.tensor(tokenizer.mask_token_id), ids)
            if attend:
                mask = torch.ones_like(mask)
        with torch.inference_mode():
            x = model(input_ids=ids, attention_mask=mask).last_hidden_state
            for weight, bias, activation in layers:
                x = torch.nn.functional.linear(x, weight, bias)
                x = torch.tanh(x) if activation == "tanh" else x
            x = torch.nn.functional.normalize(x, p=2, dim=-1)[0]
        keep = torch.ones(ids.shape[1], dtype=torch.bool) if query else (mask[0].bool() & torch.tensor(
            [int(i) not in skip for i in ids[0]]))
        out.append(x[keep].numpy())
    return out


def m3_reference(model: Any, colbert: dict[str, torch.Tensor], sparse: dict[str, torch.Tensor], tokenizer: Any,
                 texts: list[str], excluded: set[int]) -> list[tuple[np.ndarray, dict[int, float], np.ndarray]]:
    """Plain torch, as FlagEmbedding's M3Embedder.encode computes BGE-M3's outputs, per text: (dense [CLS]
    normalised, {token id: max weight > 0, the excluded ids left out}, colbert vectors of tokens 1.. normalised)."""
    out = []
    for text in texts:
        enc = tokenizer([text], truncation=True, max_length=38, return_tensors="pt")
        with torch.inference_mode():
            h = model(**enc).last_hidden_state[0]  # (T, C)
            dense = torch.nn.functional.normalize(h[0], dim=-1)
            weights = torch.relu(torch.nn.functional.linear(h, sparse["weight"], sparse["bias"]))[:, 0]
            vecs = torch.nn.functional.normalize(torch.nn.functional.linear(h[1:], colbert["weight"], colbert["bias"]),
                                                 dim=-1)
        lexical: dict[int, float] = {}
        for w, i in zip(weights.tolist(), enc["input_ids"][0].tolist(), strict=True):
            if i not in excluded and w > 0 and w > lexical.get(i, 0.0):
                lexical[i] = w
        out.append((dense.numpy(), lexical, vecs.numpy()))
    return out
