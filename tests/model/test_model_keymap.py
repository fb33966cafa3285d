"""The key-map mechanism of model/convert.py: each op rebuilds our parameters exactly, JSON and TOML maps
read the same, and every kind of problem is named."""

import json
from pathlib import Path

import pytest
import torch

from model.config import EncoderConfig
from model.convert import OPS, ConversionError, KeyMap, builtin_names, convert, resolve
from model.encoder import Encoder
from tests.support.model_helpers import tiny

CFG = tiny(positional="learned", final_norm=True)

# A source that stores our weights in every way an op undoes: q/k/v apart, transposed, a shared head
# matrix, a factored projection, no biases where ours are zero, LayerNorm weights absent where ours are 1.
PARAMS = {
    "tok_emb.weight": {"op": "add", "src": [{"op": "copy", "src": "emb", "times": 0.5},
                                            {"op": "row0", "src": "emb_type"}]},
    "pos_emb": {"op": "reshape", "src": "pos"},
    "blocks.{i}.attn.qkv.weight": {"op": "concat", "src": [
        {"op": "block_diag", "src": "{p}{i}.q_head"}, {"op": "transpose", "src": "{p}{i}.k_in_out"},
        "{p}{i}.v"]},
    "blocks.{i}.attn.qkv.bias": {"op": "zeros"},
    "blocks.{i}.attn.proj.weight": {"op": "fold", "src": ["{p}{i}.o_up", "{p}{i}.o_down"]},
    "blocks.{i}.attn.proj.bias": {"op": "block_diag", "src": "{p}{i}.o_bias_head"},
    "blocks.{i}.ff.fc1.weight": "{p}{i}.fc1.weight",
    "blocks.{i}.ff.fc1.bias": "{p}{i}.fc1.bias",
    "blocks.{i}.ff.fc2.weight": "{p}{i}.fc2.weight",
    "blocks.{i}.ff.fc2.bias": "{p}{i}.fc2.bias",
    "blocks.{i}.ln1.weight": {"op": "ones"},
    "blocks.{i}.ln1.bias": "{p}{i}.ln1.bias",
    "blocks.{i}.ln2.weight": "{p}{i}.ln2.weight",
    "blocks.{i}.ln2.bias": "{p}{i}.ln2.bias",
    "ln_f.weight": "norm.weight",
    "ln_f.bias": "norm.bias",
}
MAP = {"format": 1, "description": "every op", "vars": {"p": "layers."}, "params": PARAMS,
       "ignore": ["buffer.unused"]}


def _source(config: EncoderConfig) -> tuple[dict[str, torch.Tensor], Encoder]:
    """A random source state_dict and the Encoder it must convert to, built side by side."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    C, hs, nh, L, F = config.d_model, config.d_head, config.n_heads, config.max_length, config.d_ff
    src: dict[str, torch.Tensor] = {"emb": r(config.vocab_size, C), "pos": r(1, L, C), "norm.weight": r(C),
                                    "norm.bias": r(C), "buffer.unused": r(3), "emb_type": r(2, C)}
    want = Encoder(config)
    sd = want.state_dict()
    sd["tok_emb.weight"], sd["pos_emb"] = src["emb"] * 0.5 + src["emb_type"][0], src["pos"][0]
    sd["ln_f.weight"], sd["ln_f.bias"] = src["norm.weight"], src["norm.bias"]
    for i in range(config.n_layers):
        p, b = f"layers.{i}.", f"blocks.{i}."
        q_head, k, v = r(hs, hs), r(C, C), r(C, C)
        up, down, o_bias = r(C, 2 * C), r(2 * C, C), r(hs)
        src.update({p + "q_head": q_head, p + "k_in_out": k.t().contiguous(), p + "v": v, p + "o_up": up,
                    p + "o_down": down, p + "o_bias_head": o_bias})
        sd[b + "attn.qkv.weight"] = torch.cat([torch.block_diag(*[q_head] * nh), k, v])
        sd[b + "attn.qkv.bias"] = torch.zeros(3 * C)
        sd[b + "attn.proj.weight"], sd[b + "attn.proj.bias"] = up @ down, o_bias.repeat(nh)
        for name, shape in (("fc1.weight", (F, C)), ("fc1.bias", (F,)), ("fc2.weight", (C, F)), ("fc2.bias", (C,))):
            src[p + name] = sd[b + "ff." + name] = r(*shape)
        sd[b + "ln1.weight"] = torch.ones(C)
        for name in ("ln1.bias", "ln2.weight", "ln2.bias"):
            src[p + name] = sd[b + name] = r(C)
    want.load_state_dict(sd)
    return src, want


def _toml(data: dict) -> str:
    """The same map written as TOML (params as an inline table per key)."""
    lines = [f"format = {data['format']}", f"description = {json.dumps(data['description'])}",
             f"ignore = {json.dumps(data['ignore'])}", "[vars]", 'p = "layers."', "[params]"]
    lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in data["params"].items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: object) -> str:
    if isinstance(v, str | float):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    assert isinstance(v, dict)
    return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_every_op_rebuilds_our_parameters_exactly(suffix: str, tmp_path: Path) -> None:
    assert {"copy", "reshape", "transpose", "concat", "block_diag", "fold", "add", "row0", "zeros", "ones"} == set(OPS)
    path = tmp_path / f"map{suffix}"
    path.write_text(json.dumps(MAP) if suffix == ".json" else _toml(MAP))
    src, want = _source(CFG)
    got = convert(src, CFG, KeyMap.load(path))
    for key, value in want.state_dict().items():
        assert torch.equal(got.state_dict()[key], value), key


def test_unused_keys_are_refused_unless_ignored_or_unchecked() -> None:
    src, _ = _source(CFG)
    src["head.weight"] = torch.zeros(2)
    with pytest.raises(ConversionError, match=r"unexpected keys \(1\): \['head.weight'\]"):
        convert(src, CFG, KeyMap.from_dict(MAP))
    convert(src, CFG, KeyMap.from_dict({**MAP, "checked": ["layers.", "emb"]}))  # head is outside: ignored
    with pytest.raises(ConversionError, match=r"unexpected keys \(1\): \['head.weight'\]"):
        convert(src, CFG, KeyMap.from_dict({**MAP, "checked": ["layers."]}), strict=True)


def test_ops_that_do_not_apply_are_named() -> None:
    src, _ = _source(CFG)
    src["layers.1.q_head"] = torch.zeros(8, 4)  # not (d_head, d_head)
    src["layers.0.k_in_out"] = torch.zeros(32)  # not 2-D
    src["layers.0.o_down"] = torch.zeros(3, 32)  # o_up is (32, 64)
    src["pos"] = torch.zeros(64, 31)
    with pytest.raises(ConversionError) as info:
        convert(src, CFG, KeyMap.from_dict(MAP))
    message = str(info.value)
    assert "mis-shaped or mis-typed (4)" in message
    assert ("blocks.1.attn.qkv.weight <- concat(block_diag(layers.1.q_head), transpose(layers.1.k_in_out), "
            "layers.1.v): block_diag needs a shared per-head (8, 8) matrix or (8,) bias") in message
    assert "got shape (8, 4)" in message and "transpose needs a 2-D tensor, got shape (32,)" in message
    assert "fold multiplies matrices, got shapes [(32, 64), (3, 32)]" in message
    assert "pos_emb <- reshape(pos): reshape of (64, 31) to (64, 32): the element counts differ" in message


def test_a_wrong_result_shape_is_named_with_the_op() -> None:
    src, _ = _source(CFG)
    src["layers.0.v"] = torch.zeros(16, 32)
    src["layers.1.fc1.weight"] = torch.zeros(48, 32)
    with pytest.raises(ConversionError) as info:
        convert(src, CFG, KeyMap.from_dict(MAP))
    message = str(info.value)
    assert ("blocks.0.attn.qkv.weight <- concat(block_diag(layers.0.q_head), transpose(layers.0.k_in_out), "
            "layers.0.v): expected shape (96, 32), got (80, 32)") in message
    assert "layers.1.fc1.weight: expected shape (64, 32), got (48, 32)" in message


def test_config_the_source_cannot_express_and_uncovered_parameters() -> None:
    keymap = KeyMap.from_dict({**MAP, "requires": {"norm_first": False, "activation": ["relu"]}})
    params = {k: v for k, v in PARAMS.items() if not k.startswith("ln_f")}
    with pytest.raises(ConversionError) as info:
        resolve(KeyMap.from_dict({**MAP, "params": params, "requires": keymap.requires}),
                tiny(positional="learned", final_norm=True, norm_first=True, activation="gelu"))
    message = str(info.value)
    assert ("config field norm_first=True: the source layout of key map <key map> cannot express it "
            "(it has norm_first=False)") in message
    assert "config field activation='gelu'" in message and "(it has activation='relu')" in message
    assert "our parameter ln_f.weight (from final_norm=True) is not covered by key map <key map>" in message
    assert "ln_f.bias (from final_norm=True)" in message


def test_vars_unset_unknown_and_overridden() -> None:
    src, want = _source(CFG)
    renamed = {k.replace("layers.", "body."): v for k, v in src.items()}
    got = convert(renamed, CFG, KeyMap.from_dict(MAP).with_vars(p="body."))
    assert torch.equal(got.blocks[1].attn.proj.weight, want.blocks[1].attn.proj.weight)
    with pytest.raises(ConversionError, match=r"has no vars \['q'\]; its vars are \['p'\]"):
        KeyMap.from_dict(MAP).with_vars(q="x")
    with pytest.raises(ConversionError, match=r"blocks.0.ff.fc1.weight: the key map var 'p' is not set"):
        resolve(KeyMap.from_dict(MAP).with_vars(p=None), CFG)
    with pytest.raises(ConversionError, match=r"tok_emb.weight: unknown key map var \{e\}"):
        resolve(KeyMap.from_dict({**MAP, "params": {**PARAMS, "tok_emb.weight": "{e}weight"}}), CFG)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format": 2}, "format must be 1, got 2"),
        ({"params": {"tok_emb.weight": {"op": "permute", "src": "x"}}}, r"op 'permute' is not one of \['copy'"),
        ({"params": {"tok_emb.weight": {"op": "concat", "src": "x"}}}, "concat needs a list of at least two"),
        ({"params": {"tok_emb.weight": {"op": "zeros", "src": "x"}}}, "zeros takes no src"),
        ({"params": {"tok_emb.weight": {"op": "copy", "src": "x", "dim": 1}}}, r"unknown spec fields \['dim'\]"),
        ({"params": {"tok_emb.weight": {"op": "copy", "src": "x", "times": "2"}}}, "times must be a finite number"),
        ({"requires": {"n_layer": 2}}, r"requires names unknown EncoderConfig fields \['n_layer'\]"),
        ({"map": {}}, r"unknown fields \['map'\]"),
        ({"vars": ["p"]}, "vars must map names to strings"),
        ({"checked": "layers."}, "checked must be a list of strings"),
    ],
)
def test_malformed_key_maps_are_refused_at_load(change: dict, match: str) -> None:
    with pytest.raises(ConversionError, match=match):
        KeyMap.from_dict({**MAP, **change})


def test_builtin_maps_load_and_are_package_data() -> None:
    assert {"stock", "article_mha", "article_einsum"} <= set(builtin_names())
    for name in builtin_names():
        assert KeyMap.builtin(name).name == name
    with pytest.raises(ConversionError, match="no built-in key map 'bert'"):
        KeyMap.builtin("bert")
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'model = ["keymaps/*.json", "keymaps/*.toml"]' in pyproject


def test_the_stock_layout_has_no_relative_bias_and_the_standard_scale() -> None:
    from model.convert import convert_state_dict
    from tests.support.model_helpers import StockEncoder

    config = tiny(positional="none")
    state = StockEncoder(config).state_dict()
    with pytest.raises(ConversionError, match=r"config field relative_bias='shared': the source layout of key map "
                                              r"stock cannot express it \(it has relative_bias='none'\)"):
        convert_state_dict(state, tiny(positional="none", relative_bias="shared"))
    with pytest.raises(ConversionError, match=r"config field attention_scale=0\.125 \(scale 0\.125\): the source "
                                              r"layout of key map stock scales by 1/sqrt\(d_head\) = 0\.353553"):
        convert_state_dict(state, tiny(positional="none", attention_scale=0.125))
    convert_state_dict(state, tiny(positional="none", attention_scale=1 / 8 ** 0.5))  # the same scale, explicit
