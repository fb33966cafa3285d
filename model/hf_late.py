"""Late-interaction folders (`convert-hf`): ColBERT's projection (and BGE-M3's sparse weights) as heads of the
bundle (model/heads.py), and how their queries and documents are tokenized (model/text.py MultiVectorSettings).

Three published layouts, told apart by their files (`layout_of`), each read as its authors' code reads it:
  pylate    a sentence-transformers folder whose modules.json is a Transformer then Dense modules (no Pooling),
            as PyLate saves a ColBERT model: each Dense's config.json (in/out features, bias, activation
            identity or tanh) and weights (linear.weight, linear.bias); config_sentence_transformers.json's
            query_prefix / document_prefix ("[Q] " / "[D] ", tokens of tokenizer.json, inserted after [CLS]),
            query_length (32), document_length (180), do_query_expansion (true: queries padded to
            query_length with [MASK]), attend_to_expansion_tokens (false), skiplist_words (string.punctuation,
            as ids through the tokenizer's vocabulary, a word it lacks meaning its unknown token's id, as
            transformers' convert_tokens_to_ids does). MaxSim summed over query tokens.
  stanford  stanford-futuredata ColBERT (config.json architectures HF_ColBERT): the encoder under `bert.` and
            `linear` (no bias) in the same state dict; artifact.metadata (optional; ColBERT's defaults for what
            it leaves out) gives query_token_id / doc_token_id ([unused0] / [unused1]), query_maxlen (32),
            doc_maxlen (220), dim, mask_punctuation (true: the first id of each punctuation symbol, as
            ColBERT's skiplist), attend_to_mask_tokens (false); similarity must be cosine and interaction
            colbert. Documents also drop the pad id (ColBERT's mask). MaxSim summed.
  bge-m3    BAAI/bge-m3: an encoder folder with colbert_linear.pt (Linear d -> dim, bias) and sparse_linear.pt
            (Linear d -> 1, bias) beside it, as FlagEmbedding's M3 loads them: dense = [CLS] normalised; sparse =
            relu(sparse_linear(h)) per token, max per token id, the cls/eos/pad/unk ids excluded; colbert =
            colbert_linear(h) of every token but the first, normalised. MaxSim averaged over query tokens
            (FlagEmbedding's colbert_score). Queries and documents are encoded alike.
A piece missing (a Dense's weights, `linear.weight`, one of BGE-M3's two files, a prefix that is not a token)
is refused by name: the references would run with new, untrained weights there.
"""

from __future__ import annotations

import dataclasses
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.config import EncoderConfig
from model.convert import ConversionError, load_state_dict_file
from model.heads import ColbertHead, LexicalHead
from model.hf_heads import SPARSE_FILE
from model.text import MultiVectorSettings, TextError, TextSettings, load_tokenizer_json

COLBERT_FILE = "heads/colbert.pt"
LAYOUTS = ("pylate", "stanford", "bge-m3")
DENSE_MODULES = ("pylate.models.Dense.Dense", "pylate.models.Dense", "sentence_transformers.models.Dense")
_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
# PyLate's ColBERT defaults (pylate/models/colbert.py) and ColBERT's (colbert/infra/config/settings.py).
_PYLATE = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 32, "document_length": 180,
           "attend_to_expansion_tokens": False, "skiplist_words": list(string.punctuation),
           "do_query_expansion": True}
_STANFORD = {"query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": 32, "doc_maxlen": 220,
             "mask_punctuation": True, "attend_to_mask_tokens": False, "similarity": "cosine",
             "interaction": "colbert"}
M3_FILES = ("colbert_linear.pt", "sparse_linear.pt")


class LateConversionError(ValueError):
    """A late-interaction folder that cannot be converted exactly; the message names the file and key."""


@dataclass(frozen=True)
class LateModel:
    """What a late-interaction folder adds to its bundle: manifest tasks, head file -> module, text settings."""

    layout: str
    tasks: dict[str, dict[str, Any]]
    heads: dict[str, nn.Module]
    settings: TextSettings


def _json(path: Path, required: bool = True) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise LateConversionError(f"{path} not found") from None
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise LateConversionError(f"{path} is not readable JSON: {e}") from None


def _modules(model_dir: Path) -> list[Any]:
    data = _json(model_dir / "modules.json", required=False)
    return data if isinstance(data, list) else []


def _kind(module: Any) -> str:
    return str(module.get("type", "")) if isinstance(module, dict) else ""


def layout_of(model_dir: str | Path, hf: dict[str, Any]) -> str | None:
    """Which late-interaction layout the folder is in (module docstring), or None for any other folder."""
    model_dir = Path(model_dir)
    if any((model_dir / name).is_file() for name in M3_FILES):
        return "bge-m3"
    if "HF_ColBERT" in (hf.get("architectures") or []):
        return "stanford"
    kinds = [_kind(m) for m in _modules(model_dir)]
    if any(k in DENSE_MODULES for k in kinds) and not any(k.endswith(".Pooling") for k in kinds):
        return "pylate"
    return None


def read_late(model_dir: str | Path, config: EncoderConfig, state_dict: dict[str, torch.Tensor],
              tokenizer: bytes | None, settings: TextSettings | None) -> LateModel | None:
    """The folder's late-interaction heads and settings, or None when it is not in one of LAYOUTS.
    `state_dict`: the folder's weights (stanford's `linear` is in them); tokenizer and settings: convert_hf's."""
    model_dir = Path(model_dir)
    hf = _json(model_dir / "config.json")
    layout = layout_of(model_dir, hf)
    if layout is None:
        return None
    if tokenizer is None or settings is None:
        raise LateConversionError(f"{model_dir}: a {layout} late-interaction folder needs its tokenizer.json (the "
                                  "query and document markers, [MASK] and the skip list are tokens)")
    tok = _Vocabulary(tokenizer, model_dir)
    if layout == "bge-m3":
        return _bge_m3(model_dir, config, tok, settings)
    if layout == "pylate":
        head, multi = _pylate(model_dir, config, tok, settings)
    else:
        head, multi = _stanford(model_dir, config, state_dict, tok)
    # "embed" stays: Encode (hidden states, and the token vectors beside them) is an embed call; a ColBERT
    # model's pooled vector is the encoder's, not a trained sentence embedding.
    tasks = {"embed": {}, "colbert": {"file": COLBERT_FILE, "dim": head.dim, "reduce": "sum"}}
    return LateModel(layout, tasks, {COLBERT_FILE: head}, dataclasses.replace(settings, multi_vector=multi))


class _Vocabulary:
    """The folder's tokenizer.json, asked as transformers asks a fast tokenizer (convert_tokens_to_ids)."""

    def __init__(self, data: bytes, model_dir: Path) -> None:
        self.tokenizer = load_tokenizer_json(data, str(model_dir / "tokenizer.json"))
        self.model_dir = model_dir
        self._config = {**(_json(model_dir / "special_tokens_map.json", required=False) or {}),
                        **(_json(model_dir / "tokenizer_config.json", required=False) or {})}

    def special(self, name: str) -> str | None:
        """tokenizer_config.json's (else special_tokens_map.json's) `name` ("mask_token", ...), or None."""
        value = self._config.get(name)
        if isinstance(value, dict):  # an AddedToken, serialised
            value = value.get("content")
        return value if isinstance(value, str) and value else None

    def special_id(self, name: str) -> int | None:
        token = self.special(name)
        return None if token is None else self.tokenizer.token_to_id(token)

    def token_id(self, token: str) -> int | None:
        """convert_tokens_to_ids: the token's id, else the unknown token's (None if there is none)."""
        found = self.tokenizer.token_to_id(token)
        return found if found is not None else self.special_id("unk_token")

    def known(self, token: str, where: str) -> int:
        """token_id, refused when neither the token nor an unknown token is in the vocabulary."""
        found = self.token_id(token)
        if found is None:
            raise LateConversionError(f"{where}={token!r} is not a token of {self.model_dir / 'tokenizer.json'}")
        return int(found)

    def marker(self, token: str, where: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise LateConversionError(f"{where}={token!r} is not a token of {self.model_dir / 'tokenizer.json'}: "
                                      "the reference would add it with a new, untrained embedding")
        return int(found)

    def expansion(self, where: str) -> int:
        """PyLate's and ColBERT's query padding: the mask token ([MASK], <mask>)."""
        found = self.special_id("mask_token")
        if found is None:
            raise LateConversionError(f"{where}: query expansion needs a mask_token (tokenizer_config.json or "
                                      f"special_tokens_map.json in {self.model_dir}) that tokenizer.json knows")
        return int(found)


def _limit_lengths(query: int, document: int, config: EncoderConfig, where: str) -> tuple[int, int]:
    for key, value in (("query_length", query), ("document_length", document)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 3:
            raise LateConversionError(f"{where}: {key}={value!r} must be an int >= 3 (first token, marker, last)")
    if query > config.max_length:  # every query is padded to it: the reference cannot encode one either
        raise LateConversionError(f"{where}: query_length={query} exceeds the model's {config.max_length} positions")
    # A longer document limit: cut at the positions, as no reference can encode a longer one.
    return query, min(document, config.max_length)


def _pylate(model_dir: Path, config: EncoderConfig, tok: _Vocabulary,
            settings: TextSettings) -> tuple[ColbertHead, MultiVectorSettings]:
    modules_path = model_dir / "modules.json"
    modules = _modules(model_dir)
    layers: list[tuple[torch.Tensor, torch.Tensor | None, str]] = []
    width = config.d_model
    for i, module in enumerate(modules):
        kind = _kind(module)
        if i == 0 and kind == "sentence_transformers.models.Transformer":
            continue
        if kind not in DENSE_MODULES:
            raise LateConversionError(f"{modules_path}: module {i} type {kind!r}: a PyLate ColBERT folder is a "
                                      f"Transformer then Dense modules ({', '.join(DENSE_MODULES)})")
        folder = model_dir / str(module.get("path", ""))
        cfg = _json(folder / "config.json")
        if cfg.get("use_residual"):
            raise LateConversionError(f"{folder / 'config.json'}: use_residual=true is not supported")
        activation = _ACTIVATIONS.get(str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")))
        if activation is None:
            raise LateConversionError(f"{folder / 'config.json'}: activation_function="
                                      f"{cfg.get('activation_function')!r}: only {sorted(_ACTIVATIONS)}")
        weights = _dense_weights(folder)
        weight = weights.get("linear.weight")
        if weight is None:
            raise LateConversionError(f"{folder}: no key 'linear.weight' (the Dense projection)")
        bias = weights.get("linear.bias")
        if bool(cfg.get("bias", True)) != (bias is not None):
            raise LateConversionError(f"{folder}: config.json bias={cfg.get('bias')!r} but linear.bias is "
                                      f"{'present' if bias is not None else 'absent'}")
        out = cfg.get("out_features")
        if weight.dim() != 2 or int(weight.shape[1]) != width or cfg.get("in_features") != width or \
                int(weight.shape[0]) != out or (bias is not None and tuple(bias.shape) != (out,)):
            raise LateConversionError(f"{folder}: linear.weight {list(weight.shape)} does not take {width} features "
                                      f"to out_features={out!r}")
        layers.append((weight, bias, activation))
        width = int(out)
    if not layers:
        raise LateConversionError(f"{modules_path}: no Dense module (the ColBERT projection)")
    st_path = model_dir / "config_sentence_transformers.json"
    st = {**_PYLATE, **{k: v for k, v in (_json(st_path, required=False) or {}).items() if v is not None}}
    query, document = _limit_lengths(st["query_length"], st["document_length"], config, str(st_path))
    words = st["skiplist_words"]
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise LateConversionError(f"{st_path}: skiplist_words must list strings, got {words!r}")
    markers = [None if not st[key] else tok.marker(st[key], f"{st_path}: {key}")
               for key in ("query_prefix", "document_prefix")]
    expand = bool(st["do_query_expansion"])
    try:
        multi = MultiVectorSettings(
            query_length=query, document_length=document, query_marker=markers[0], document_marker=markers[1],
            expansion_id=tok.expansion(str(st_path)) if expand else None,
            attend_expansion=expand and bool(st["attend_to_expansion_tokens"]),
            skip_ids=tuple(i for i in (tok.token_id(w) for w in words) if i is not None))
    except TextError as e:
        raise LateConversionError(f"{st_path}: {e}") from None
    return ColbertHead(layers), multi


def _dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / "model.safetensors"
    if path.is_file():
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except Exception as e:  # safetensors raises its own error type (or OSError) for a bad file
            raise LateConversionError(f"{path} is not a readable safetensors file: {e}") from None
    path = folder / "pytorch_model.bin"
    if not path.is_file():
        raise LateConversionError(f"{folder}: neither model.safetensors nor pytorch_model.bin (the Dense weights)")
    try:
        return load_state_dict_file(path)
    except ConversionError as e:
        raise LateConversionError(str(e)) from None


def _stanford(model_dir: Path, config: EncoderConfig, state_dict: dict[str, torch.Tensor],
              tok: _Vocabulary) -> tuple[ColbertHead, MultiVectorSettings]:
    meta_path = model_dir / "artifact.metadata"
    meta = {**_STANFORD, **{k: v for k, v in (_json(meta_path, required=False) or {}).items() if v is not None}}
    for key in ("similarity", "interaction"):
        if meta[key] != _STANFORD[key]:
            raise LateConversionError(f"{meta_path}: {key}={meta[key]!r}: only {_STANFORD[key]!r} is supported")
    weight = state_dict.get("linear.weight")
    if weight is None:
        raise LateConversionError(f"{model_dir}: HF_ColBERT weights without 'linear.weight' (ColBERT's projection)")
    if "linear.bias" in state_dict:
        raise LateConversionError(f"{model_dir}: 'linear.bias': ColBERT's projection has no bias")
    if weight.dim() != 2 or int(weight.shape[1]) != config.d_model:
        raise LateConversionError(f"{model_dir}: linear.weight {list(weight.shape)} does not take {config.d_model} "
                                  "features")
    if "dim" in meta and meta["dim"] != int(weight.shape[0]):
        raise LateConversionError(f"{meta_path}: dim={meta['dim']!r} but linear.weight has {int(weight.shape[0])} rows")
    query, document = _limit_lengths(meta["query_maxlen"], meta["doc_maxlen"], config, str(meta_path))
    # ColBERT's skip list: the first id of each punctuation symbol, and its mask drops the pad id from documents.
    skip = [tok.tokenizer.encode(s, add_special_tokens=False).ids[:1] for s in string.punctuation] if bool(
        meta["mask_punctuation"]) else []
    pad = tok.special_id("pad_token")
    where = f"{meta_path} (or ColBERT's default)"
    try:
        multi = MultiVectorSettings(
            query_length=query, document_length=document,
            query_marker=tok.known(str(meta["query_token_id"]), f"{where}: query_token_id"),
            document_marker=tok.known(str(meta["doc_token_id"]), f"{where}: doc_token_id"),
            expansion_id=tok.expansion(where), attend_expansion=bool(meta["attend_to_mask_tokens"]),
            skip_ids=tuple(i for ids in skip for i in ids) + (() if pad is None else (pad,)))
    except TextError as e:
        raise LateConversionError(f"{where}: {e}") from None
    return ColbertHead([(weight, None, "identity")]), multi


def _bge_m3(model_dir: Path, config: EncoderConfig, tok: _Vocabulary, settings: TextSettings) -> LateModel:
    linear: dict[str, dict[str, torch.Tensor]] = {}
    for name in M3_FILES:
        path = model_dir / name
        if not path.is_file():
            other = next(n for n in M3_FILES if n != name)
            raise LateConversionError(f"{path} not found: BGE-M3's {other} is there, and FlagEmbedding needs both "
                                      "(without them its heads are new, untrained)")
        try:
            linear[name] = load_state_dict_file(path)
        except ConversionError as e:
            raise LateConversionError(str(e)) from None
        for key in ("weight", "bias"):
            if key not in linear[name]:
                raise LateConversionError(f"{path}: no key {key!r} (an nn.Linear's state dict)")
    colbert, sparse = linear["colbert_linear.pt"], linear["sparse_linear.pt"]
    d = config.d_model
    if colbert["weight"].dim() != 2 or int(colbert["weight"].shape[1]) != d or \
            tuple(colbert["bias"].shape) != (int(colbert["weight"].shape[0]),):
        raise LateConversionError(f"{model_dir / 'colbert_linear.pt'}: weight {list(colbert['weight'].shape)}, bias "
                                  f"{list(colbert['bias'].shape)}: not a Linear from {d} features")
    if tuple(sparse["weight"].shape) != (1, d) or tuple(sparse["bias"].shape) != (1,):
        raise LateConversionError(f"{model_dir / 'sparse_linear.pt'}: weight {list(sparse['weight'].shape)}, bias "
                                  f"{list(sparse['bias'].shape)}: not a Linear from {d} features to 1")
    # FlagEmbedding leaves out the cls, eos, pad and unk tokens (those the tokenizer names) from the weights.
    excluded = [i for i in (tok.special_id(n) for n in ("cls_token", "eos_token", "pad_token", "unk_token"))
                if i is not None]
    if not excluded:
        raise LateConversionError(f"{model_dir}: tokenizer_config.json / special_tokens_map.json name none of the "
                                  "cls, eos, pad and unk tokens that BGE-M3's sparse weights leave out")
    head = ColbertHead([(colbert["weight"], colbert["bias"], "identity")])
    lexical = LexicalHead(sparse["weight"], sparse["bias"], config.vocab_size, excluded)
    multi = MultiVectorSettings(query_length=settings.max_tokens, document_length=settings.max_tokens, first_vector=1)
    tasks = {"embed": {}, "sparse": {"file": SPARSE_FILE, "kind": "lexical"},
             "colbert": {"file": COLBERT_FILE, "dim": head.dim, "reduce": "mean"}}
    # The dense vector is FlagEmbedding's: [CLS], normalised (whatever modules.json would pool).
    text = dataclasses.replace(settings, pooling="cls", normalize=True, multi_vector=multi)
    return LateModel("bge-m3", tasks, {COLBERT_FILE: head, SPARSE_FILE: lexical}, text)
