"""Hugging Face BERT-family checkpoints -> EncoderConfig, key map and text settings (`convert-hf`).

Reads a local model folder (never a hub): `config.json`, `model.safetensors` (or `pytorch_model.bin`,
loaded with weights_only=True), `tokenizer.json`, and the sentence-transformers files when present
(`modules.json`, the Pooling module's `config.json`, `sentence_bert_config.json`,
`config_sentence_transformers.json`, `tokenizer_config.json`). What our encoder cannot reproduce
exactly is refused with a message naming the file and key; never a silently different model.

BERT as our encoder (post-LN, exact GELU, learned positions, `embedding_norm`), through the key map
model/keymaps/hf_bert.json (model/convert.py's mechanism, as every import):
  word_embeddings + token_type_embeddings[0] -> tok_emb   (a single text's token types are all 0)
  position_embeddings                        -> pos_emb
  embeddings.LayerNorm                       -> ln_emb
  attention.self.{query|key|value}           -> attn.qkv  (rows q|k|v)
  attention.output.dense / .LayerNorm        -> attn.proj / ln1
  intermediate.dense / output.dense          -> ff.fc1 / ff.fc2
  output.LayerNorm                           -> ln2
The pooler and the position_ids buffer are not part of the encoder (ignored); keys outside the base
model's prefix (a task head under `cls.`, `classifier.`) are ignored, as `convert` ignores them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from model.config import EncoderConfig
from model.convert import ConversionError, KeyMap, convert
from model.encoder import Encoder
from model.text import TOKENIZER_FILE, TextError, TextSettings, load_tokenizer_json, sha256_bytes, special_ids


class HFConversionError(ValueError):
    """The Hugging Face folder cannot be converted exactly; the message names the file and key."""


# What cannot be reproduced, by model_type, said plainly (RoBERTa-style offset positions would need
# position ids that skip padding_idx + 1 rows and a pad id that is never a real token in the text).
_REFUSED_TYPES = {
    "roberta": "RoBERTa (position ids offset by padding_idx + 1) is not supported yet",
    "xlm-roberta": "XLM-RoBERTa (position ids offset by padding_idx + 1) is not supported yet",
    "camembert": "CamemBERT (RoBERTa positions) is not supported yet",
    "distilbert": "DistilBERT (other key names, no token types) is not supported yet",
    "nomic_bert": "NomicBERT (rotary positions, SwiGLU) cannot be reproduced",
    "new": "the 'new' architecture (rotary positions) cannot be reproduced",
}
_ACTIVATIONS = {"gelu": "gelu", "relu": "relu"}  # HF's "gelu" is the exact erf GELU, as ours
_ST_MODULES = {
    "sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
}

BERT_KEYMAP = "hf_bert"  # model/keymaps/hf_bert.json: the mapping, as data for model/convert.py
_ANCHOR = "embeddings.word_embeddings.weight"


def _read_json(path: Path, *, required: bool = True) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise HFConversionError(f"{path} not found") from None
        return None
    except (OSError, ValueError) as e:  # UnicodeDecodeError, JSONDecodeError, an int of over 4300 digits
        raise HFConversionError(f"{path} is not readable JSON: {e}") from None
    except RecursionError:
        raise HFConversionError(f"{path} is not readable JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise HFConversionError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(model_dir: str | Path) -> EncoderConfig:
    """config.json -> EncoderConfig, refusing by name what our encoder cannot compute exactly."""
    path = Path(model_dir) / "config.json"
    hf = _read_json(path)
    assert hf is not None

    def refuse(key: str, why: str) -> HFConversionError:
        return HFConversionError(f"{path}: {key}={hf.get(key)!r}: {why}")

    model_type = hf.get("model_type")
    if model_type in _REFUSED_TYPES:
        raise refuse("model_type", _REFUSED_TYPES[model_type])
    if model_type != "bert":
        raise refuse("model_type", "only 'bert' is supported")
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise refuse("hidden_act", f"only {sorted(_ACTIVATIONS)} can be reproduced exactly "
                     "(gelu_new and gelu_pytorch_tanh are the tanh approximation)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise refuse("position_embedding_type", "only absolute (learned) positions are supported; "
                     "relative_key / relative_key_query add a relative position term to the scores")
    for key in ("is_decoder", "add_cross_attention"):
        if hf.get(key):
            raise refuse(key, "a decoder or cross-attention is not an encoder")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                "max_position_embeddings"):
        if not isinstance(hf.get(key), int):
            raise refuse(key, "must be an int")
    type_vocab = hf.get("type_vocab_size", 2)
    if not isinstance(type_vocab, int) or type_vocab < 1:
        raise refuse("type_vocab_size", "must be an int >= 1 (row 0 is folded into the word embeddings)")
    try:
        return EncoderConfig(
            d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"], n_layers=hf["num_hidden_layers"],
            d_ff=hf["intermediate_size"], vocab_size=hf["vocab_size"], max_length=hf["max_position_embeddings"],
            positional="learned", norm_first=False, activation=_ACTIVATIONS[act],
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12), final_norm=False, embedding_norm=True,
        )
    except ValueError as e:
        raise HFConversionError(f"{path}: {e}") from None


def load_hf_weights(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The checkpoint's tensors: model.safetensors, else pytorch_model.bin (weights_only)."""
    model_dir = Path(model_dir)
    path = model_dir / "model.safetensors"
    if path.is_file():
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path))), path
        except Exception as e:  # safetensors raises SafetensorError (or OSError) for a bad file
            raise HFConversionError(f"{path} is not a readable safetensors file: {e}") from None
    path = model_dir / "pytorch_model.bin"
    if path.is_file():
        from model.convert import load_state_dict_file

        try:
            return load_state_dict_file(path), path
        except ConversionError as e:
            raise HFConversionError(str(e)) from None
    raise HFConversionError(f"{model_dir}: neither model.safetensors nor pytorch_model.bin found "
                            "(sharded checkpoints are not supported)")


def convert_bert(state_dict: Mapping[str, torch.Tensor], config: EncoderConfig, source: str) -> Encoder:
    """Build an fp32 Encoder(config) from a BERT state_dict through the hf_bert key map; every problem names
    `source` and the key. A BertFor* checkpoint's base model is under 'bert.'; its head is left out."""
    prefixes = [p for p in ("", "bert.") if p + _ANCHOR in state_dict]
    if not prefixes:
        raise HFConversionError(f"{source}: no key {_ANCHOR!r} (nor 'bert.{_ANCHOR}'): not a BERT checkpoint")
    keymap = KeyMap.builtin(BERT_KEYMAP).with_vars(p=prefixes[0])
    try:
        return convert(state_dict, config, keymap)
    except ConversionError as e:
        raise HFConversionError(f"{source}: {e}") from None


def _pooling(model_dir: Path, modules: list[Any], modules_path: Path) -> tuple[str, bool]:
    """(pooling, normalize) from modules.json and the Pooling module's config."""
    pooling, normalize = None, False
    for i, module in enumerate(modules):
        kind = module.get("type") if isinstance(module, dict) else None
        if kind not in _ST_MODULES:
            raise HFConversionError(f"{modules_path}: module {i} type {kind!r} is not supported "
                                    f"(only {sorted(_ST_MODULES)})")
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            path = model_dir / str(module.get("path", "")) / "config.json"
            cfg = _read_json(path)
            assert cfg is not None
            if cfg.get("include_prompt", True) is not True:
                raise HFConversionError(f"{path}: include_prompt={cfg['include_prompt']!r}: pooling that "
                                        "leaves the prompt out is not supported")
            if isinstance(cfg.get("pooling_mode"), str):
                modes = [cfg["pooling_mode"]]
            else:
                modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
                         for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
            if modes not in (["mean"], ["cls"]):
                raise HFConversionError(f"{path}: pooling modes {modes}: only exactly one of mean or cls "
                                        "(pooling_mode_mean_tokens, pooling_mode_cls_token) is supported")
            pooling = modes[0]
    if pooling is None:
        raise HFConversionError(f"{modules_path}: no sentence_transformers.models.Pooling module")
    return pooling, normalize


def read_text_settings(model_dir: str | Path, config: EncoderConfig) -> tuple[bytes, TextSettings]:
    """tokenizer.json bytes and the text settings sentence-transformers would apply to this folder.

    Without sentence-transformers files: pooling cls (what BERT's own pooler reads), not normalised,
    max_tokens from tokenizer_config.json's model_max_length capped at the positions."""
    model_dir = Path(model_dir)
    tok_path = model_dir / TOKENIZER_FILE
    try:
        data = tok_path.read_bytes()
    except FileNotFoundError:
        raise HFConversionError(f"{tok_path} not found (a vocab.txt-only folder: save it once with a fast "
                                "tokenizer to get tokenizer.json)") from None
    try:
        tokenizer = load_tokenizer_json(data, str(tok_path))
        specials = special_ids(data, str(tok_path))
    except TextError as e:
        raise HFConversionError(str(e)) from None
    # Token types are folded (row 0): a single text must get type 0 throughout.
    types = tokenizer.encode("a").type_ids
    if any(types):
        raise HFConversionError(f"{tok_path}: post_processor gives a single text token types {types}; "
                                "only type 0 is folded into the word embeddings")
    tok_cfg = _read_json(model_dir / "tokenizer_config.json", required=False) or {}
    side = tok_cfg.get("truncation_side", "right")
    st_cfg = _read_json(model_dir / "sentence_bert_config.json", required=False)
    max_tokens = config.max_length
    if st_cfg is not None and st_cfg.get("max_seq_length") is not None:
        max_tokens = st_cfg["max_seq_length"]
        if not isinstance(max_tokens, int) or max_tokens < 2:
            raise HFConversionError(f"{model_dir / 'sentence_bert_config.json'}: max_seq_length={max_tokens!r} "
                                    "must be an int >= 2")
    elif isinstance(tok_cfg.get("model_max_length"), int):
        max_tokens = tok_cfg["model_max_length"]
    max_tokens = min(max_tokens, config.max_length)  # sentence-transformers caps it at the positions too
    if st_cfg is not None and st_cfg.get("do_lower_case"):
        # sentence-transformers adds a Lowercase normaliser; refused unless the tokenizer lowercases already.
        normalizer = json.loads(data).get("normalizer") or {}
        if not (normalizer.get("type") == "BertNormalizer" and normalizer.get("lowercase")):
            raise HFConversionError(f"{model_dir / 'sentence_bert_config.json'}: do_lower_case=true with a "
                                    "tokenizer that does not lowercase is not supported")
    modules_path = model_dir / "modules.json"
    modules = _read_json_list(modules_path)
    pooling, normalize = ("cls", False) if modules is None else _pooling(model_dir, modules, modules_path)
    st = _read_json(model_dir / "config_sentence_transformers.json", required=False) or {}
    prompts = st.get("prompts") or {}
    default_prompt = st.get("default_prompt_name") or ""
    try:
        settings = TextSettings(
            tokenizer_sha256=sha256_bytes(data), max_tokens=max_tokens, truncation_side=side, pooling=pooling,
            normalize=normalize, prompts=prompts, default_prompt_name=default_prompt, special_ids=specials,
        )
    except TextError as e:
        raise HFConversionError(f"{model_dir}: {e}") from None
    return data, settings


def _read_json_list(path: Path) -> list[Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise HFConversionError(f"{path} is not readable JSON: {e}") from None
    except RecursionError:
        raise HFConversionError(f"{path} is not readable JSON: nested too deeply") from None
    if not isinstance(data, list):
        raise HFConversionError(f"{path} must hold a JSON list of modules, got {type(data).__name__}")
    return data


def convert_hf(model_dir: str | Path) -> tuple[Encoder, bytes, TextSettings, str]:
    """(encoder, tokenizer.json bytes, text settings, source) for a local Hugging Face BERT folder."""
    config = read_hf_config(model_dir)
    state_dict, weights_path = load_hf_weights(model_dir)
    encoder = convert_bert(state_dict, config, str(weights_path))
    data, settings = read_text_settings(model_dir, config)
    return encoder, data, settings, f"hf:{Path(model_dir).resolve().name}/{weights_path.name}"
