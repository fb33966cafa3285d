"""Convert the state_dict of a stock PyTorch encoder (nn.Embedding + nn.TransformerEncoder) to our Encoder.

The stock model is `nn.Embedding(vocab_size, d_model)` plus `nn.TransformerEncoder` of
`nn.TransformerEncoderLayer(d_model, n_heads, d_ff, batch_first=True, norm_first=..., activation=...)`
layers, optionally with a final `norm=nn.LayerNorm(d_model)`. Key mapping, with E = embedding prefix
(default "embedding.") and N = encoder prefix (default "encoder."):

  E + weight                                  -> tok_emb.weight         (vocab_size, d_model)
  N + layers.{i}.self_attn.in_proj_weight     -> blocks.{i}.attn.qkv.weight   (3*d_model, d_model), q|k|v rows
  N + layers.{i}.self_attn.in_proj_bias       -> blocks.{i}.attn.qkv.bias     (3*d_model,)
  N + layers.{i}.self_attn.out_proj.{weight,bias} -> blocks.{i}.attn.proj.{weight,bias}
  N + layers.{i}.linear1.{weight,bias}        -> blocks.{i}.ff.fc1.{weight,bias}  (d_ff, d_model), (d_ff,)
  N + layers.{i}.linear2.{weight,bias}        -> blocks.{i}.ff.fc2.{weight,bias}  (d_model, d_ff), (d_model,)
  N + layers.{i}.norm1.{weight,bias}          -> blocks.{i}.ln1.{weight,bias}
  N + layers.{i}.norm2.{weight,bias}          -> blocks.{i}.ln2.{weight,bias}
  N + norm.{weight,bias}                      -> ln_f.{weight,bias}      (only with config.final_norm)
  position_key                                -> pos_emb                 (only with positional="learned")

A state_dict cannot say how the stock model was built: norm_first, activation, layer_norm_eps and the
positional encoding (the stock pair has none: use positional="none", or "sinusoidal" if the model added
the standard sin/cos table) must be set in the config to match, or outputs silently differ.
Keys under E or N that do not map are errors; keys elsewhere (a task head, say) are ignored unless strict.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from model.config import EncoderConfig
from model.encoder import Encoder

_LAYER_KEYS = {  # ours -> stock, per layer
    "attn.qkv.weight": "self_attn.in_proj_weight",
    "attn.qkv.bias": "self_attn.in_proj_bias",
    "attn.proj.weight": "self_attn.out_proj.weight",
    "attn.proj.bias": "self_attn.out_proj.bias",
    "ff.fc1.weight": "linear1.weight",
    "ff.fc1.bias": "linear1.bias",
    "ff.fc2.weight": "linear2.weight",
    "ff.fc2.bias": "linear2.bias",
    "ln1.weight": "norm1.weight",
    "ln1.bias": "norm1.bias",
    "ln2.weight": "norm2.weight",
    "ln2.bias": "norm2.bias",
}


class ConversionError(ValueError):
    """The state_dict does not match the config; the message lists every offending key."""


def key_mapping(config: EncoderConfig, *, embedding_prefix: str = "embedding.", encoder_prefix: str = "encoder.",
                position_key: str | None = None) -> dict[str, str]:
    """Our state_dict key -> the stock key it comes from, for this config."""
    mapping = {"tok_emb.weight": embedding_prefix + "weight"}
    if config.positional == "learned":
        if not position_key:
            raise ConversionError("positional='learned' needs position_key: the state_dict key of the "
                                  "(max_length, d_model) position table (the stock modules have none)")
        mapping["pos_emb"] = position_key
    for i in range(config.n_layers):
        for ours, stock in _LAYER_KEYS.items():
            mapping[f"blocks.{i}.{ours}"] = f"{encoder_prefix}layers.{i}.{stock}"
    if config.final_norm:
        mapping["ln_f.weight"] = encoder_prefix + "norm.weight"
        mapping["ln_f.bias"] = encoder_prefix + "norm.bias"
    return mapping


def convert_state_dict(state_dict: Mapping[str, object], config: EncoderConfig, *,
                       embedding_prefix: str = "embedding.", encoder_prefix: str = "encoder.",
                       position_key: str | None = None, strict: bool = False) -> Encoder:
    """Build an fp32 Encoder(config) holding the stock weights; ConversionError lists all problems."""
    mapping = key_mapping(config, embedding_prefix=embedding_prefix, encoder_prefix=encoder_prefix,
                          position_key=position_key)
    encoder = Encoder(config)
    expected = encoder.state_dict()
    assert set(mapping) == set(expected), "key_mapping and Encoder disagree. This is a bug."
    wanted = set(mapping.values())

    def ours_to_check(key: str) -> bool:
        return strict or key.startswith((embedding_prefix, encoder_prefix)) or key == position_key

    missing = sorted(k for k in wanted if k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in wanted and ours_to_check(k))
    ignored = sorted(k for k in state_dict if k not in wanted and not ours_to_check(k))
    bad = []
    for ours, stock in mapping.items():
        value = state_dict.get(stock)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            bad.append(f"{stock}: expected a floating-point tensor, got {type(value).__name__}"
                       + (f" {value.dtype}" if isinstance(value, torch.Tensor) else ""))
        elif tuple(value.shape) != tuple(expected[ours].shape):
            bad.append(f"{stock}: expected shape {tuple(expected[ours].shape)}, got {tuple(value.shape)}")
    if missing or unexpected or bad:
        lines = [f"state_dict does not match EncoderConfig({config.to_json()}) with embedding_prefix="
                 f"{embedding_prefix!r}, encoder_prefix={encoder_prefix!r}:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {unexpected}")
        if bad:
            lines.append(f"  mis-shaped or mis-typed ({len(bad)}): {bad}")
        if ignored and missing:
            lines.append(f"  keys outside the prefixes, ignored (wrong prefix?): {ignored[:20]}")
        raise ConversionError("\n".join(lines))
    ours_sd = {ours: state_dict[stock].detach().to(torch.float32).cpu() for ours, stock in mapping.items()}
    encoder.load_state_dict(ours_sd, strict=True)
    return encoder.eval()


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """torch.load a state_dict file safely (weights_only: no arbitrary pickles)."""
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConversionError(f"{path} not found") from None
    except Exception as e:  # torch.load raises UnpicklingError, RuntimeError, ... for a bad file
        raise ConversionError(f"{path} is not a loadable state_dict file: {e}") from e
    if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
        raise ConversionError(f"{path} holds a {type(data).__name__}, not a state_dict (a str -> tensor mapping)")
    return dict(data)
