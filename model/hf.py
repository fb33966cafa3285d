"""Hugging Face checkpoints -> EncoderConfig, key map and text settings (`convert-hf`).

config.json's `model_type` picks the family (FAMILIES): how its config reads as an EncoderConfig, the key map
in model/keymaps/ its weights go through, and the prefixes its base model may sit under. Each is checked
against the transformers model itself (tests/model/test_model_families.py):
  bert         hf_bert        post-LN, learned positions, token type 0 folded into the word table
  roberta,     hf_roberta     BERT's layout; positions from row pad_token_id + 1 on (position_offset), as
  xlm-roberta                 Hugging Face numbers a sequence with no pad id inside (a pad id typed inside a
                              text is numbered otherwise by Hugging Face)
  mpnet        hf_mpnet       RoBERTa's positions plus relative_bias="bucketed" (T5-style, shared by layers)
  distilbert   hf_distilbert  BERT without token types, other names
  modernbert   hf_modernbert  pre-LN, rotary (global / local bases), GeGLU, norms without bias, local
                              sliding-window layers between every global_attn_every_n_layers-th
  bert with    hf_jina_bert   jina-bert-v2 (jina-embeddings-v2): BERT's layout with ALiBi (positional="alibi")
  position_embedding_type     in place of the position table and a GLU feed-forward (feed_forward_type geglu
  "alibi"                     or reglu; its up-projection has no bias)
XLM-R's SentencePiece/Unigram tokenizer.json runs through the same `tokenizers` text path as BERT's WordPiece.

Reads a local model folder (never a hub): `config.json`, `model.safetensors` (or `pytorch_model.bin`,
loaded with weights_only=True), `tokenizer.json`, and the sentence-transformers files when present
(`modules.json`, the Pooling module's `config.json`, `sentence_bert_config.json`,
`config_sentence_transformers.json`, `tokenizer_config.json`). What our encoder cannot reproduce
exactly is refused with a message naming the file and key; never a silently different model. A folder
without `tokenizer.json` converts to an ids-only bundle (no text settings); `ids_only_note` is the line
the command line and the service say about it.

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

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.config import EncoderConfig
from model.convert import ConversionError, KeyMap, convert
from model.encoder import Encoder
from model.text import TOKENIZER_FILE, TextError, TextSettings, load_tokenizer_json, sha256_bytes, special_ids


class HFConversionError(ValueError):
    """The Hugging Face folder cannot be converted exactly; the message names the file and key."""


# What cannot be reproduced (or is not converted yet), by model_type, said plainly.
_REFUSED_TYPES = {
    "camembert": "CamemBERT (RoBERTa positions) is not supported yet",
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
    family = family_of(hf, path)
    try:
        return family.read(hf, _refuser(hf, path))
    except ValueError as e:
        if isinstance(e, HFConversionError):
            raise
        raise HFConversionError(f"{path}: {e}") from None


def _refuser(hf: Mapping[str, Any], path: Path) -> Callable[[str, str], HFConversionError]:
    def refuse(key: str, why: str) -> HFConversionError:
        return HFConversionError(f"{path}: {key}={hf.get(key)!r}: {why}")

    return refuse


def _bert_like(hf: Mapping[str, Any], refuse: Callable[[str, str], HFConversionError],
               position_offset: int = 0) -> EncoderConfig:
    """BERT's layout (and RoBERTa's, whose positions start at position_offset)."""
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise refuse("hidden_act", f"only {sorted(_ACTIVATIONS)} can be reproduced exactly "
                     "(gelu_new and gelu_pytorch_tanh are the tanh approximation)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise refuse("position_embedding_type", "only absolute (learned) positions are supported (and alibi "
                     "for model_type bert: jina-bert-v2); relative_key / relative_key_query add a relative "
                     "position term to the scores")
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
    max_length = hf["max_position_embeddings"] - position_offset
    if max_length < 1:
        raise refuse("max_position_embeddings", f"leaves no position past the offset {position_offset} "
                     "(pad_token_id + 1)")
    return EncoderConfig(
        d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"], n_layers=hf["num_hidden_layers"],
        d_ff=hf["intermediate_size"], vocab_size=hf["vocab_size"], max_length=max_length,
        positional="learned", norm_first=False, activation=_ACTIVATIONS[act],
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12), final_norm=False, embedding_norm=True,
        position_offset=position_offset,
    )


def _pad_offset(hf: Mapping[str, Any], refuse: Callable[[str, str], HFConversionError]) -> int:
    """RoBERTa's position numbering: a sequence without padding ids reads rows pad_token_id + 1, + 2, ..."""
    pad = hf.get("pad_token_id")
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise refuse("pad_token_id", "must be an int >= 0 (positions start at pad_token_id + 1)")
    return pad + 1


def _read_bert(hf: Mapping[str, Any], refuse: Callable[[str, str], HFConversionError]) -> EncoderConfig:
    return _bert_like(hf, refuse)


def _read_roberta(hf: Mapping[str, Any], refuse: Callable[[str, str], HFConversionError]) -> EncoderConfig:
    return _bert_like(hf, refuse, _pad_offset(hf, refuse))


def _read_mpnet(hf: Mapping[str, Any], refuse: Callable[[str, str], HFConversionError]) -> EncoderConfig:
    # MPNetEmbeddings numbers positions from its padding_idx, fixed at 1 whatever pad_token_id says; and its
    # relative_position_bucket is called with 32 buckets and max_distance 128 whatever the table's size.
    if hf.get("relative_attention_num_buckets", 32) != 32:
        raise refuse("relative_attention_num_buckets", "MPNetModel buckets relative positions into 32 whatever "
                     "this says; only 32 is reproduced")
    config = _bert_like(hf, refuse, position_offset=2)
    return dataclasses.replace(config, relative_bias="bucketed", relative_buckets=32, relative_max_distance=128)


def _read_distilbert(hf: Mapping[str, Any], refuse: Callable[[str, str], HFConversionError]) -> EncoderConfig:
    # DistilBERT's names for BERT's fields; its LayerNorms' eps is fixed at 1e-12 in the model code.
    names = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
             "hidden_dim": "intermediate_size", "activation": "hidden_act"}
    renamed = {**hf, **{bert: hf[ours] for ours, bert in names.items() if ours in hf}}

    def refuse_named(key: str, why: str) -> HFConversionError:
        source = next((d for d, b in names.items() if b == key), key)
        return refuse(source, why)

    return dataclasses.replace(_bert_like(renamed, refuse_named), layer_norm_eps=1e-12)


_GLU_ACTIVATIONS = {"geglu": "gelu", "reglu": "relu"}  # jina-bert-v2's feed_forward_type: nn.GELU(), nn.ReLU()


def _read_jina_bert(hf: Mapping[str, Any], refuse: Callable[[str, str], HFConversionError]) -> EncoderConfig:
    """jina-bert-v2 (jina-embeddings-v2-*, MosaicBERT's layout): BERT's, with ALiBi in place of the position table
    and a GLU feed-forward (act(first half) * second half) whose activation feed_forward_type names."""
    kind = hf.get("feed_forward_type", "original")
    if kind not in _GLU_ACTIVATIONS:
        raise refuse("feed_forward_type", f"with ALiBi only jina-bert-v2's GLU feed-forwards "
                     f"{sorted(_GLU_ACTIVATIONS)} are converted")
    # hidden_act does not reach the GLU (feed_forward_type picks its activation); the rest is BERT's.
    config = _bert_like({**hf, "position_embedding_type": "absolute", "hidden_act": "gelu"}, refuse)
    return dataclasses.replace(config, positional="alibi", ffn_gated=True, activation=_GLU_ACTIVATIONS[kind])


_MODERNBERT_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu",
                           "relu": "relu"}


def _read_modernbert(hf: Mapping[str, Any], refuse: Callable[[str, str], HFConversionError]) -> EncoderConfig:
    """ModernBERT: rotary (global and local bases), GeGLU, local sliding-window layers between global ones."""
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                "max_position_embeddings", "local_attention"):
        if isinstance(hf.get(key), bool) or not isinstance(hf.get(key), int):
            raise refuse(key, "must be an int")
    act = hf.get("hidden_activation", "gelu")
    if act not in _MODERNBERT_ACTIVATIONS:
        raise refuse("hidden_activation", f"only {sorted(_MODERNBERT_ACTIVATIONS)} can be reproduced exactly")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise refuse("head_dim", "only hidden_size / num_attention_heads is supported")
    if hf.get("is_causal") or hf.get("causal_mask"):
        raise refuse("is_causal" if hf.get("is_causal") else "causal_mask", "a decoder is not an encoder")
    n = hf["num_hidden_layers"]
    every = hf.get("global_attn_every_n_layers", 3)
    types = hf.get("layer_types")
    if types is not None:  # transformers 5 writes the pattern out; it must be global every n-th layer
        if not isinstance(types, list) or len(types) != n or types[0] != "full_attention":
            raise refuse("layer_types", "must list num_hidden_layers layers, the first 'full_attention'")
        fulls = [i for i, t in enumerate(types) if t == "full_attention"]
        every = fulls[1] if len(fulls) > 1 else n
        if types != ["full_attention" if i % every == 0 else "sliding_attention" for i in range(n)]:
            raise refuse("layer_types", "only global attention every n-th layer (from 0), local between, is "
                         "supported")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise refuse("global_attn_every_n_layers", "must be an int >= 1")
    rope = hf.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict) or not all(isinstance(rope.get(k), dict) for k in (
                "full_attention", "sliding_attention")):
            raise refuse("rope_parameters", "must hold full_attention and sliding_attention settings")
        for kind in ("full_attention", "sliding_attention"):
            if rope[kind].get("rope_type", "default") != "default" or rope[kind].get("partial_rotary_factor", 1.0) != 1:
                raise refuse("rope_parameters", f"{kind}: only the default rope_type over the whole head is "
                             "supported")
        global_base, local_base = rope["full_attention"].get("rope_theta"), rope["sliding_attention"].get("rope_theta")
    else:  # the files before transformers 5
        if hf.get("rope_scaling"):
            raise refuse("rope_scaling", "scaled rotary positions are not supported")
        global_base, local_base = hf.get("global_rope_theta", 160000.0), hf.get("local_rope_theta", 10000.0)
    if local_base is None:
        local_base = global_base
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    return EncoderConfig(
        d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"], n_layers=n, d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], max_length=hf["max_position_embeddings"], positional="rotary",
        rotary_base=global_base, local_rotary_base=local_base, norm_first=True, first_attn_norm=False,
        activation=_MODERNBERT_ACTIVATIONS[act], layer_norm_eps=hf.get("norm_eps", 1e-5),
        norm_bias=bool(hf.get("norm_bias", False)), embedding_norm=True, final_norm=True, ffn_gated=True,
        # One flag for every projection: a checkpoint with biases in only some has zeros in the others.
        linear_bias=bool(attention_bias or mlp_bias),
        local_radius=hf["local_attention"] // 2 if every > 1 else 0, global_every=every,
    )


@dataclass(frozen=True)
class Family:
    """One model_type: how its config.json reads as an EncoderConfig, the key map of its weights, and the
    prefixes its base model may sit under (a *For* task checkpoint's)."""

    model_type: str
    read: Callable[[Mapping[str, Any], Callable[[str, str], HFConversionError]], EncoderConfig]
    keymap: str
    prefixes: tuple[str, ...]
    anchor: str = _ANCHOR  # a key every checkpoint of the family has (found under one of the prefixes)


FAMILIES = {f.model_type: f for f in (
    Family("bert", _read_bert, BERT_KEYMAP, ("", "bert.")),
    Family("roberta", _read_roberta, "hf_roberta", ("", "roberta.")),
    Family("xlm-roberta", _read_roberta, "hf_roberta", ("", "roberta.")),
    Family("mpnet", _read_mpnet, "hf_mpnet", ("", "mpnet.")),
    Family("distilbert", _read_distilbert, "hf_distilbert", ("", "distilbert.")),
    Family("modernbert", _read_modernbert, "hf_modernbert", ("", "model."), "embeddings.tok_embeddings.weight"),
)}


# model_type bert with position_embedding_type alibi: jina-bert-v2's config (its code is not in transformers).
JINA_BERT = Family("bert", _read_jina_bert, "hf_jina_bert", ("", "bert."))


def family_of(hf: Mapping[str, Any], path: Path) -> Family:
    """The Family of a config.json's model_type, or an HFConversionError naming it."""
    model_type = hf.get("model_type")
    if model_type == "bert" and hf.get("position_embedding_type") == "alibi":
        return JINA_BERT
    if isinstance(model_type, str) and model_type in FAMILIES:
        return FAMILIES[model_type]
    why = _REFUSED_TYPES.get(model_type, f"only {sorted(FAMILIES)} are supported") if isinstance(
        model_type, str) else f"only {sorted(FAMILIES)} are supported"
    raise HFConversionError(f"{path}: model_type={model_type!r}: {why}")


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
    return convert_family(FAMILIES["bert"], state_dict, config, source)


def convert_family(family: Family, state_dict: Mapping[str, torch.Tensor], config: EncoderConfig,
                   source: str) -> Encoder:
    """Build an fp32 Encoder(config) from a checkpoint of `family` through its key map, the base model found
    under one of the family's prefixes; every problem names `source` and the key."""
    prefixes = [p for p in family.prefixes if p + family.anchor in state_dict]
    if not prefixes:
        others = " nor ".join(repr(p + family.anchor) for p in family.prefixes[1:])
        raise HFConversionError(f"{source}: no key {family.anchor!r}{f' (nor {others})' if others else ''}: "
                                f"not a {family.model_type} checkpoint")
    keymap = KeyMap.builtin(family.keymap).with_vars(p=prefixes[0])
    try:
        return convert(state_dict, config, keymap)
    except ConversionError as e:
        raise HFConversionError(f"{source}: {e}") from None


def _pooling(model_dir: Path, modules: list[Any], modules_path: Path) -> tuple[str, bool]:
    """(pooling, normalize) from modules.json and the Pooling module's config. A Transformer then Dense modules
    and no Pooling is a PyLate ColBERT folder (model/hf_late.py reads its Dense modules): cls, not normalised,
    as a folder without modules.json."""
    from model.hf_late import DENSE_MODULES

    kinds = [m.get("type") if isinstance(m, dict) else None for m in modules]
    if any(k in DENSE_MODULES for k in kinds) and not any(isinstance(k, str) and k.endswith(".Pooling")
                                                          for k in kinds):
        return "cls", False
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


def ids_only_note(model_dir: str | Path) -> str:
    """One line for a folder without tokenizer.json: its bundle takes token ids only, and how to give it text."""
    return (f"{Path(model_dir)} has no {TOKENIZER_FILE}: the bundle takes token ids and embeddings only, no text; "
            f"to serve text, save the model's fast tokenizer into the folder (transformers: "
            f"AutoTokenizer.from_pretrained(model).save_pretrained(folder) writes {TOKENIZER_FILE}) and convert again")


def convert_hf(model_dir: str | Path) -> tuple[Encoder, bytes | None, TextSettings | None, str]:
    """(encoder, tokenizer.json bytes, text settings, source) for a local Hugging Face folder of one of FAMILIES
    (config.json's model_type picks the family). A folder without tokenizer.json (weights only, or a
    vocab.txt the `tokenizers` library cannot read as it is) gives no tokenizer and no text settings: an
    ids-only bundle (`ids_only_note` says so)."""
    config = read_hf_config(model_dir)
    hf = _read_json(Path(model_dir) / "config.json")
    assert hf is not None
    family = family_of(hf, Path(model_dir) / "config.json")
    state_dict, weights_path = load_hf_weights(model_dir)
    encoder = convert_family(family, state_dict, config, str(weights_path))
    source = f"hf:{Path(model_dir).resolve().name}/{weights_path.name}"
    if not (Path(model_dir) / TOKENIZER_FILE).is_file():
        return encoder, None, None, source
    data, settings = read_text_settings(model_dir, config)
    return encoder, data, settings, source
