"""Encoder capabilities of other families (rotary positions, RMSNorm, LayerNorm without bias, gated
feed-forwards, gelu_tanh / silu, projections without biases), each as an EncoderConfig field: exported as a
TorchScript bundle and checked against an eager reference written here from the definitions, on both attention
paths with the weights returned; and with every capability off, the reference model's graph unchanged."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.bundle import BundleError, load_bundle, save_bundle
from model.config import REFERENCE, TINY, EncoderConfig
from model.encoder import Encoder
from tests.support.model_helpers import randomized_encoder as _randomized
from tests.support.model_helpers import reference_act as _act
from tests.support.model_helpers import reference_norm as _norm

ROTARY_SWIGLU_RMS = dataclasses.replace(
    TINY, n_layers=3, positional="rotary", rotary_base=500.0, norm="rms", norm_first=True, final_norm=True,
    ffn_gated=True, activation="silu", linear_bias=False, layer_norm_eps=1e-6)
CONFIGS = {
    "rotary+swiglu+rms": ROTARY_SWIGLU_RMS,
    "partial-rotary+geglu+ln-no-bias": dataclasses.replace(
        TINY, positional="rotary", rotary_fraction=0.5, norm_bias=False, ffn_gated=True, activation="gelu",
        embedding_norm=True),
    "gelu_tanh+no-linear-bias": dataclasses.replace(TINY, positional="learned", activation="gelu_tanh",
                                                    linear_bias=False, norm_first=True),
}
LENGTHS = [13, 4, 1, 9, 13]


def _rope(x: torch.Tensor, c: EncoderConfig) -> torch.Tensor:
    """x (H, T, hs): dims (i, i + r/2) of the first r rotated by angle t * base^(-2i/r), in fp64."""
    r, T = c.rotary_dims, x.size(1)
    i = torch.arange(r // 2, dtype=torch.float64)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * c.rotary_base ** (-2.0 * i / r)  # (T, r/2)
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., : r // 2].double(), x[..., r // 2: r].double()
    rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., r:]), dim=-1)


def reference_forward(sd: dict[str, torch.Tensor], c: EncoderConfig,
                      ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence (no padding) written out from the definitions: hidden (T, C), weights (L, H, T, T)."""
    T, H, hs = len(ids), c.n_heads, c.d_head
    x = sd["tok_emb.weight"][torch.tensor(ids)]
    if c.positional == "learned":
        x = x + sd["pos_emb"][c.position_offset: c.position_offset + T]
    if c.embedding_norm:
        x = _norm(x, sd, "ln_emb", c)

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, sd[name + ".weight"], sd.get(name + ".bias"))

    weights = []
    for i in range(c.n_layers):
        p = f"blocks.{i}."

        def attention(h: torch.Tensor, p: str = p) -> torch.Tensor:
            q, k, v = (t.view(T, H, hs).transpose(0, 1) for t in lin(h, p + "attn.qkv").split(c.d_model, dim=-1))
            if c.positional == "rotary":
                q, k = _rope(q, c), _rope(k, c)
            w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hs), dim=-1)
            weights.append(w)
            return lin((w @ v).transpose(0, 1).reshape(T, c.d_model), p + "attn.proj")

        def ff(h: torch.Tensor, p: str = p) -> torch.Tensor:
            u = lin(h, p + "ff.fc1")
            u = _act(u[:, : c.d_ff], c.activation) * u[:, c.d_ff:] if c.ffn_gated else _act(u, c.activation)
            return lin(u, p + "ff.fc2")

        if c.norm_first:
            x = x + attention(_norm(x, sd, p + "ln1", c))
            x = x + ff(_norm(x, sd, p + "ln2", c))
        else:
            x = _norm(x + attention(x), sd, p + "ln1", c)
            x = _norm(x + ff(x), sd, p + "ln2", c)
    if c.final_norm:
        x = _norm(x, sd, "ln_f", c)
    return x, torch.stack(weights)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_capabilities_match_their_definition(tmp_path: Path, name: str) -> None:
    config = CONFIGS[name]
    encoder = _randomized(config, seed=7)
    sd = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    save_bundle(encoder, tmp_path / "b", name=name, version="1", source="test")
    module = load_bundle(tmp_path / "b").module
    g = torch.Generator().manual_seed(3)
    for lengths in (LENGTHS, [8, 8]):
        ids = torch.randint(0, config.vocab_size, (len(lengths), max(lengths)), generator=g)
        n = torch.tensor(lengths)
        with torch.inference_mode():
            sdpa, none = module(ids, None, n, False, [])
            explicit, weights = module(ids, None, n, False, list(range(config.n_layers)))
        assert none is None and weights is not None
        for b, t in enumerate(lengths):
            want_h, want_w = reference_forward(sd, config, ids[b, :t].tolist())
            torch.testing.assert_close(sdpa[b, :t], want_h, rtol=0, atol=1e-5)
            torch.testing.assert_close(explicit[b, :t], want_h, rtol=0, atol=1e-5)
            torch.testing.assert_close(weights[b, :, :, :t, :t], want_w, rtol=0, atol=1e-6)
            assert not bool(weights[b, :, :, :t, t:].any())
    if config.positional == "rotary":  # rotary is position-dependent: a shuffled sequence must differ
        ids = torch.tensor([[5, 6, 7, 8]])
        with torch.inference_mode():
            a, _ = module(ids, None, torch.tensor([4]), False, [])
            b2, _ = module(ids.flip(1), None, torch.tensor([4]), False, [])
        assert float((a[0, 0] - b2[0, 3]).abs().max()) > 1e-3


def test_capability_fields_are_checked_and_stated() -> None:
    for bad, named in [({"norm": "batch"}, "norm must be one of"), ({"activation": "swish"}, "activation"),
                       ({"rotary_fraction": 0.0}, "rotary_fraction"), ({"rotary_base": float("inf")}, "rotary_base"),
                       ({"positional": "rotary", "rotary_fraction": 0.1}, "rotary dims"),
                       ({"ffn_gated": 1}, "ffn_gated must be a bool"), ({"linear_bias": "no"}, "linear_bias"),
                       ({"positional": "rotary", "position_offset": 2}, "needs a position table")]:
        with pytest.raises(ValueError, match=named):
            EncoderConfig(**{**TINY.to_dict(), **bad})
    c = ROTARY_SWIGLU_RMS
    assert EncoderConfig.from_json(c.to_json()) == c and c.rotary_dims == c.d_head
    sd = Encoder(c).state_dict()
    assert tuple(sd["blocks.0.ff.fc1.weight"].shape) == (2 * c.d_ff, c.d_model)
    assert not any(k.endswith("bias") for k in sd) and "pos_emb" not in sd  # rotary tables are derived


def test_a_bundle_whose_config_contradicts_its_capabilities_is_refused(tmp_path: Path) -> None:
    import json

    save_bundle(_randomized(ROTARY_SWIGLU_RMS, 1), tmp_path / "b", name="r", version="1", source="test")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    for change, named in [({"rotary_base": 10000.0}, "config.rotary_base"), ({"activation": "gelu"}, "activation"),
                          ({"norm": "layer"}, "config.norm"), ({"ffn_gated": False}, "ffn_gated")]:
        edited = {**manifest, "config": {**manifest["config"], **change}}
        (tmp_path / "b" / "manifest.json").write_text(json.dumps(edited))
        with pytest.raises(BundleError, match=named):
            load_bundle(tmp_path / "b")


def _ops(config: EncoderConfig, attn_layers: list[int]) -> set[str]:
    """Every aten op in the frozen, inlined forward graph, nested blocks (if / loop bodies) included."""
    import re

    module = torch.jit.freeze(torch.jit.script(Encoder(config).init_weights(0).eval()))
    graph = module.graph
    torch._C._jit_pass_inline(graph)
    return set(re.findall(r"aten::\w+", str(graph)))


def test_every_capability_off_leaves_the_reference_graph_free_of_them() -> None:
    """With the defaults, the frozen graph has none of the capabilities' operations (no per-call work)."""
    ops = _ops(REFERENCE, [])
    assert not ops & {"aten::cos", "aten::sin", "aten::rsqrt", "aten::silu", "aten::cat", "aten::neg",
                      "aten::abs", "aten::tensor"}, ops
    rotary = _ops(dataclasses.replace(REFERENCE, positional="rotary", norm="rms"), [])
    assert {"aten::cat", "aten::rsqrt"} <= rotary  # the check can see them when they are on
    assert {"aten::abs", "aten::tensor", "aten::neg"} <= _ops(dataclasses.replace(REFERENCE, positional="alibi"), [])
