"""ALiBi positions (EncoderConfig.positional="alibi": head h's scores get -slope_h * |i - j|, jina-bert-v2 /
MosaicBERT style, symmetric as an encoder has them) and jina-bert-v2's layout through `convert-hf`.

transformers has no ALiBi encoder in-tree, so the references are: the slopes against transformers' own ALiBi
code (Bloom's build_alibi_tensor) and the paper's definition written here; the encoder against a plain-torch
reference written here in fp64 (softmax(QK^T * scale + bias + mask) V per layer, padding, causal and local
masks), on both attention paths with the weights returned, through TorchScript bundles; and a jina-bert-v2
folder (config.json + safetensors under jina's key names, mapped to the reference by hand here) converted with
`convert-hf`, served on 127.0.0.1:0, long inputs chunked."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model.__main__ import main
from model.bundle import BundleError, file_sha256, load_bundle, module_config_facts, read_manifest, save_bundle
from model.config import TINY, EncoderConfig
from model.encoder import alibi_slopes
from model.hf import HFConversionError, convert_hf
from tests.support.model_helpers import randomized_encoder as _randomized
from tests.support.model_helpers import reference_act as _act
from tests.support.model_helpers import reference_norm as _norm

CONFIGS = {
    # jina-bert-v2's shape: post-LN, embedding LayerNorm, GeGLU; a power-of-two head count.
    "post-ln-geglu-4-heads": dataclasses.replace(TINY, positional="alibi", activation="gelu", embedding_norm=True,
                                                 ffn_gated=True),
    # Six heads: the non-power-of-two rule (jina-embeddings-v2-base has 12).
    "pre-ln-6-heads": EncoderConfig(d_model=48, n_heads=6, n_layers=2, d_ff=40, vocab_size=100, max_length=64,
                                    positional="alibi", norm_first=True, final_norm=True, activation="gelu"),
    # With other capabilities: local layers between global ones, RMSNorm, SwiGLU, no biases; three heads.
    "local-rms-swiglu-3-heads": EncoderConfig(
        d_model=36, n_heads=3, n_layers=3, d_ff=40, vocab_size=100, max_length=64, positional="alibi",
        norm_first=True, final_norm=True, norm="rms", ffn_gated=True, activation="silu", linear_bias=False,
        local_radius=3, global_every=2),
}
LENGTHS = [13, 4, 1, 9, 13]  # mixed, one batch: packed, padded keys masked
SAME = [8, 8]  # no padding


def slopes_by_the_paper(n: int) -> list[float]:
    """Press et al.: 2^(-8k/n), k = 1..n, for n a power of two; otherwise the closest power of two p's slopes,
    then 2p's for odd k (1, 3, ...) until there are n."""
    if n & (n - 1) == 0:
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    p = 1 << (n.bit_length() - 1)
    return slopes_by_the_paper(p) + [2.0 ** (-8.0 * k / (2 * p)) for k in range(1, 2 * (n - p), 2)]


def test_slopes_are_the_papers_and_transformers() -> None:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    for n in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 32, 40, 64):
        ours = alibi_slopes(n)
        assert len(ours) == n
        want = slopes_by_the_paper(n)
        assert all(math.isclose(a, b, rel_tol=1e-14) for a, b in zip(ours, want, strict=True)), (n, ours, want)
        # Bloom's tensor for keys at positions 0, 1 is (n, 1, 2): slope * position; column 1 is the slope.
        bloom = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), n, torch.float32)[:, 0, 1]
        # Bloom raises an fp32 base to integer powers (the k-th slope carries k roundings of the base): the
        # same bits up to 8 heads (powers of two, exact), within 5.1e-7 relative beyond (measured).
        ours32 = torch.tensor(ours, dtype=torch.float32)
        if n <= 8:
            assert torch.equal(ours32, bloom), (n, ours32, bloom)
        torch.testing.assert_close(ours32, bloom, rtol=1e-6, atol=0)
    assert alibi_slopes(8) == [2.0 ** -k for k in range(1, 9)]  # the paper's example
    assert alibi_slopes(12)[:8] == alibi_slopes(8)  # 12 heads: 8's slopes, then 16's 1st, 3rd, 5th, 7th
    assert all(math.isclose(a, 2.0 ** (-k / 2), rel_tol=1e-14)
               for a, k in zip(alibi_slopes(12)[8:], (1, 3, 5, 7), strict=True))


def reference(sd32: dict[str, torch.Tensor], c: EncoderConfig, ids: torch.Tensor, lengths: torch.Tensor,
              causal: bool, alibi: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch, in fp64, from the definitions: hidden (B, T, C), weights (B, L, H, T, T) (alibi=False:
    the same model without its position term, to show that the term counts)."""
    sd = {k: v.double() for k, v in sd32.items()}
    B, T = ids.shape
    H, hs = c.n_heads, c.d_head
    x = sd["tok_emb.weight"][ids]  # (B, T, C); no position table
    if c.embedding_norm:
        x = _norm(x, sd, "ln_emb", c)
    pos = torch.arange(T)
    distance = (pos[None, :] - pos[:, None]).abs().double()  # (T, T): |i - j|
    bias = -torch.tensor(slopes_by_the_paper(H), dtype=torch.float64)[:, None, None] * distance  # (H, T, T)
    bias = bias if alibi else torch.zeros_like(bias)
    allowed = (pos[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T): real keys
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])

    def lin(h: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(h, sd[name + ".weight"], sd.get(name + ".bias"))

    weights = []
    for i in range(c.n_layers):
        p = f"blocks.{i}."
        keys = allowed & (distance <= c.local_radius) if c.is_local(i) else allowed

        def attention(h: torch.Tensor, p: str = p, keys: torch.Tensor = keys) -> torch.Tensor:
            q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in lin(h, p + "attn.qkv").split(c.d_model, -1))
            scores = (q @ k.transpose(-1, -2) * c.scale + bias).masked_fill(~keys, -math.inf)
            # A padded query far from every real key (a local layer) has none: NaN, kept out of the values.
            w = torch.where(keys, torch.softmax(scores, dim=-1), 0.0)
            weights.append(w)
            return lin((w @ v).transpose(1, 2).reshape(B, T, c.d_model), p + "attn.proj")

        def ff(h: torch.Tensor, p: str = p) -> torch.Tensor:
            u = lin(h, p + "ff.fc1")
            u = _act(u[..., : c.d_ff], c.activation) * u[..., c.d_ff:] if c.ffn_gated else _act(u, c.activation)
            return lin(u, p + "ff.fc2")

        if c.norm_first:
            x = x + attention(_norm(x, sd, p + "ln1", c) if i or c.first_attn_norm else x)
            x = x + ff(_norm(x, sd, p + "ln2", c))
        else:
            x = _norm(x + attention(x), sd, p + "ln1", c)
            x = _norm(x + ff(x), sd, p + "ln2", c)
    if c.final_norm:
        x = _norm(x, sd, "ln_f", c)
    return x, torch.stack(weights, dim=1)


def _batch(config: EncoderConfig, lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = torch.tensor(lengths)
    ids = torch.randint(1, config.vocab_size, (len(lengths), max(lengths)), generator=g)
    return ids.masked_fill(torch.arange(max(lengths))[None, :] >= n[:, None], 0), n


def assert_matches_reference(module: Any, sd: dict[str, torch.Tensor], config: EncoderConfig, ids: torch.Tensor,
                             lengths: torch.Tensor, causal: bool) -> None:
    """Both attention paths of `module` (SDPA: no weights asked; explicit: every layer's) on the real rows."""
    want_h, want_w = reference(sd, config, ids, lengths, causal)
    with torch.inference_mode():
        sdpa, none = module(ids, None, lengths, causal, [])
        explicit, weights = module(ids, None, lengths, causal, list(range(config.n_layers)))
    assert none is None and weights is not None and weights.dtype == torch.float32
    for b, t in enumerate(lengths.tolist()):
        torch.testing.assert_close(sdpa[b, :t].double(), want_h[b, :t], rtol=0, atol=1e-5)
        torch.testing.assert_close(explicit[b, :t].double(), want_h[b, :t], rtol=0, atol=1e-5)
        torch.testing.assert_close(sdpa[b, :t], explicit[b, :t], rtol=0, atol=5e-6)  # the paths agree
        torch.testing.assert_close(weights[b, :, :, :t, :t].double(), want_w[b, :, :, :t, :t], rtol=0, atol=1e-6)
        assert not bool(weights[b, :, :, :t, t:].any())  # padded keys: exactly 0
    # The position term counts: without it the weights are far from these.
    assert float((reference(sd, config, ids, lengths, causal, alibi=False)[1] - want_w).abs().amax()) > 0.05


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_alibi_matches_the_reference_through_a_bundle(tmp_path: Path, name: str) -> None:
    config = CONFIGS[name]
    encoder = _randomized(config, seed=7)
    sd = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    manifest = save_bundle(encoder, tmp_path / "b", name=name, version="1", source="test")
    assert manifest.config.positional == "alibi" and "pos_emb" not in sd  # no table: the bias is derived
    loaded = load_bundle(tmp_path / "b")  # TorchScript saved and loaded, checked against its manifest
    assert module_config_facts(torch.jit.load(str(tmp_path / "b" / "model.pt")))["positional"] == "alibi"
    for seed, (lengths, causal) in enumerate(((LENGTHS, False), (LENGTHS, True), (SAME, False), (SAME, True))):
        ids, n = _batch(config, lengths, seed)
        assert_matches_reference(loaded.module, sd, config, ids, n, causal)


def test_alibi_is_batch_invariant_and_symmetric() -> None:
    config = CONFIGS["pre-ln-6-heads"]
    module = torch.jit.script(_randomized(config, seed=3))
    ids, n = _batch(config, LENGTHS, seed=5)
    with torch.inference_mode():
        for layers in ([], [0, 1]):
            batched, _ = module(ids, None, n, False, layers)
            for b, t in enumerate(LENGTHS):  # each row alone, no padding: the same as in the padded batch
                alone, _ = module(ids[b:b + 1, :t], None, n[b:b + 1], False, layers)
                torch.testing.assert_close(batched[b, :t], alone[0], rtol=0, atol=2e-6)
        # |i - j| is symmetric: the reversed sequence gives the reversed states; a swap of two tokens does not.
        row = ids[:1, :13]
        forward, _ = module(row, None, torch.tensor([13]), False, [])
        backward, _ = module(row.flip(1), None, torch.tensor([13]), False, [])
        torch.testing.assert_close(backward[0].flip(0), forward[0], rtol=0, atol=2e-6)
        swapped = row.clone()
        swapped[0, [2, 9]] = swapped[0, [9, 2]]
        moved, _ = module(swapped, None, torch.tensor([13]), False, [])
        assert float((moved[0, 0] - forward[0, 0]).abs().max()) > 1e-3  # positions matter


def test_alibi_config_and_bundle_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"positional='alibi' with relative_bias='bucketed'"):
        dataclasses.replace(TINY, positional="alibi", relative_bias="bucketed")
    with pytest.raises(ValueError, match="needs a position table"):
        dataclasses.replace(TINY, positional="alibi", position_offset=2)
    config = CONFIGS["pre-ln-6-heads"]
    assert EncoderConfig.from_json(config.to_json()) == config
    save_bundle(_randomized(config, 1), tmp_path / "b", name="a", version="1", source="test")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    # A manifest that says another position scheme is refused by name.
    for positional in ("none", "sinusoidal"):
        edited = {**manifest, "config": {**manifest["config"], "positional": positional}}
        (tmp_path / "b" / "manifest.json").write_text(json.dumps(edited))
        with pytest.raises(BundleError, match="config.positional is 'alibi' in the module|config.positional"):
            load_bundle(tmp_path / "b")
    # The slopes are derived (outside weights_sha256): a module with other slopes is refused even with a
    # manifest that checksums its file.
    module = torch.jit.load(str(tmp_path / "b" / "model.pt"))
    module.alibi_slopes = [s * 2 for s in alibi_slopes(6)]
    torch.jit.save(module, str(tmp_path / "b" / "model.pt"))
    manifest["sha256"] = file_sha256(tmp_path / "b" / "model.pt")
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="ALiBi slopes"):
        load_bundle(tmp_path / "b")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alibi_reduced_precision_is_bounded(dtype: torch.dtype) -> None:
    """Within the bounds every model is held to (model.bundle.RELATIVE_ERROR_BOUND): the slopes stay fp32
    (a list, not a buffer the cast reaches), the explicit scores fp32; SDPA's float mask is in the dtype."""
    from model.bundle import RELATIVE_ERROR_BOUND
    from tests.support.model_helpers import max_errors

    bound = RELATIVE_ERROR_BOUND["bfloat16" if dtype == torch.bfloat16 else "float16"]
    for name in ("post-ln-geglu-4-heads", "pre-ln-6-heads"):
        for causal in (False, True):
            hidden, weights = max_errors(CONFIGS[name], dtype, [64, 40, 1, 17], causal)
            assert hidden <= bound and weights <= bound, (name, causal, hidden, weights)


# -- jina-bert-v2 through convert-hf ---------------------------------------------------------------------

JINA = {
    "model_type": "bert", "architectures": ["JinaBertForMaskedLM"], "position_embedding_type": "alibi",
    "feed_forward_type": "geglu", "emb_pooler": "mean", "hidden_act": "gelu", "hidden_size": 48,
    "num_attention_heads": 6, "num_hidden_layers": 2, "intermediate_size": 40, "vocab_size": 12,
    "max_position_embeddings": 16, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
    "attention_probs_dropout_prob": 0.0,
}


def jina_state_dict(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under jina-bert-v2's key names (JinaBertModel: mlp.gated_layers without a bias)."""
    g = torch.Generator().manual_seed(seed)
    C, Fd = config["hidden_size"], config["intermediate_size"]

    def r(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    sd = {"embeddings.word_embeddings.weight": r(config["vocab_size"], C, std=0.5),
          "embeddings.token_type_embeddings.weight": r(config["type_vocab_size"], C, std=0.5),
          "embeddings.LayerNorm.weight": 1 + r(C, std=0.1), "embeddings.LayerNorm.bias": r(C, std=0.1),
          "pooler.dense.weight": r(C, C), "pooler.dense.bias": r(C)}
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            sd[p + f"attention.self.{name}.weight"], sd[p + f"attention.self.{name}.bias"] = r(C, C), r(C, std=0.1)
        sd[p + "attention.output.dense.weight"], sd[p + "attention.output.dense.bias"] = r(C, C), r(C, std=0.1)
        sd[p + "attention.output.LayerNorm.weight"] = 1 + r(C, std=0.1)
        sd[p + "attention.output.LayerNorm.bias"] = r(C, std=0.1)
        sd[p + "mlp.gated_layers.weight"] = r(2 * Fd, C)
        sd[p + "mlp.wo.weight"], sd[p + "mlp.wo.bias"] = r(C, Fd), r(C, std=0.1)
        sd[p + "mlp.layernorm.weight"], sd[p + "mlp.layernorm.bias"] = 1 + r(C, std=0.1), r(C, std=0.1)
    return sd


def ours_by_hand(jina: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """jina's tensors under our names, mapped here (not through the key map): q|k|v rows, token type 0 added to
    the words, the GLU's up-projection without a bias."""
    words, types = jina["embeddings.word_embeddings.weight"], jina["embeddings.token_type_embeddings.weight"]
    sd = {"tok_emb.weight": words + types[0],
          "ln_emb.weight": jina["embeddings.LayerNorm.weight"], "ln_emb.bias": jina["embeddings.LayerNorm.bias"]}
    for i in range(layers):
        p, o = f"encoder.layer.{i}.", f"blocks.{i}."
        for part in ("weight", "bias"):
            sd[o + f"attn.qkv.{part}"] = torch.cat([jina[p + f"attention.self.{n}.{part}"]
                                                    for n in ("query", "key", "value")])
            sd[o + f"attn.proj.{part}"] = jina[p + f"attention.output.dense.{part}"]
            sd[o + f"ln1.{part}"] = jina[p + f"attention.output.LayerNorm.{part}"]
            sd[o + f"ff.fc2.{part}"] = jina[p + f"mlp.wo.{part}"]
            sd[o + f"ln2.{part}"] = jina[p + f"mlp.layernorm.{part}"]
        sd[o + "ff.fc1.weight"] = jina[p + "mlp.gated_layers.weight"]
    return sd


def write_jina(directory: Path, config: dict[str, Any] | None = None, seed: int = 0,
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    from safetensors.torch import save_file

    from tests.support.hf_helpers import tiny_tokenizer_json

    config = config or JINA
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state_dict if state_dict is not None else jina_state_dict(config, seed),
              str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_bytes(tiny_tokenizer_json())
    return directory


def test_jina_bert_v2_converts_and_matches_the_reference(tmp_path: Path) -> None:
    src = write_jina(tmp_path / "jina")
    jina = jina_state_dict(JINA, 0)
    assert main(["convert-hf", "--model-dir", str(src), "--out", str(tmp_path / "b")]) == 0
    config = read_manifest(tmp_path / "b").config
    assert (config.positional, config.ffn_gated, config.activation, config.n_heads, config.max_length) == (
        "alibi", True, "gelu", 6, 16)
    loaded = load_bundle(tmp_path / "b")
    assert loaded.tokenizer is not None  # its tokenizer.json: a text bundle
    sd = {**ours_by_hand(jina, 2), **{f"blocks.{i}.ff.fc1.bias": torch.zeros(80) for i in range(2)}}
    for seed, (lengths, causal) in enumerate((([13, 4, 1, 16, 9], False), ([16, 3], True), ([11, 11], False))):
        ids, n = _batch(config, lengths, seed)
        assert_matches_reference(loaded.module, sd, config, ids, n, causal)
    # reglu: the same layout with ReLU; a JinaBertFor* checkpoint's base model under "bert.".
    src = write_jina(tmp_path / "reglu", {**JINA, "feed_forward_type": "reglu"},
                     state_dict={"bert." + k: v for k, v in jina.items()} | {"cls.predictions.bias": torch.zeros(12)})
    encoder, _, _, _ = convert_hf(src)
    assert encoder.config.activation == "relu"
    ids, n = _batch(encoder.config, [13, 4, 1], 9)
    assert_matches_reference(torch.jit.script(encoder), sd, encoder.config, ids, n, False)


def test_jina_refusals_name_the_field(tmp_path: Path) -> None:
    src = write_jina(tmp_path / "j")
    for change, named in (({"feed_forward_type": "original"}, "feed_forward_type='original': with ALiBi only"),
                          ({"model_type": "roberta"}, "position_embedding_type='alibi': only absolute"),
                          ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'")):
        (src / "config.json").write_text(json.dumps({**JINA, **change}))
        with pytest.raises(HFConversionError, match=re.escape(named)):
            convert_hf(src)
    # jina-bert-v2-qk-post-norm (jina-embeddings-v2-base-code) adds norms over q and k: unexpected keys, refused.
    sd = jina_state_dict(JINA, 0)
    sd["encoder.layer.0.attention.self.layer_norm_q.weight"] = torch.ones(48)
    src = write_jina(tmp_path / "code", state_dict=sd)
    with pytest.raises(HFConversionError, match=r"unexpected keys \(1\): \['encoder\.layer\.0\.attention\.self\."
                                                r"layer_norm_q\.weight'\]"):
        convert_hf(src)


async def test_jina_served_positional_attention_and_chunks(start_server: Any, tmp_path: Path) -> None:
    """Over gRPC: ModelInfo says alibi; mixed lengths in one call equal the reference (attention too); a
    sequence longer than the model, chunked, equals its windows run one by one and stitched by hand."""
    from proto.attention.v1 import attention_pb2 as pb
    from proto.attention.v1.codec import from_tensor
    from tests.service.test_chunking import runner_of, stitched_by_hand
    from tests.support.helpers import ids_request

    src = write_jina(tmp_path / "jina", seed=2)
    assert main(["convert-hf", "--model-dir", str(src), "--out", str(tmp_path / "b")]) == 0
    config = read_manifest(tmp_path / "b").config
    sd = {**ours_by_hand(jina_state_dict(JINA, 2), 2), **{f"blocks.{i}.ff.fc1.bias": torch.zeros(80)
                                                          for i in range(2)}}
    served = await start_server(bundle=tmp_path / "b")
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.positional, info.max_length, info.n_heads) == ("alibi", 16, 6)
    ids, n = _batch(config, [13, 4, 1, 16], seed=4)
    rows = [ids[b, :t].numpy() for b, t in enumerate(n.tolist())]
    response = await served.stub.Encode(ids_request(*rows, attention=pb.AttentionOptions(return_attention=True)),
                                        timeout=60)
    want_h, want_w = reference(sd, config, ids, n, False)
    for b, (out, t) in enumerate(zip(response.outputs, n.tolist(), strict=True)):
        np.testing.assert_allclose(np.asarray(from_tensor(out.hidden)), want_h[b, :t].numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(from_tensor(out.attention)), want_w[b, :, :, :t, :t].numpy(),
                                   rtol=0, atol=1e-6)
    long = np.random.default_rng(0).integers(1, 12, 41)
    response = await served.stub.Encode(ids_request(long, long_inputs=pb.LONG_INPUTS_CHUNK, chunk_stride=5),
                                        timeout=60)
    want, windows = stitched_by_hand(runner_of(tmp_path / "b"), long, 16, 5)
    assert windows > 2
    np.testing.assert_allclose(np.asarray(from_tensor(response.outputs[0].hidden)), want, rtol=0, atol=1e-5)
    # Each window is from position 0: its first token's state equals the window encoded alone, not the same
    # token's state inside the whole sequence (ALiBi has no table, so nothing stops a longer T but max_length).
    first, _ = reference(sd, config, torch.from_numpy(long[None, :16]), torch.tensor([16]), False)
    np.testing.assert_allclose(want[:8], first[0, :8].numpy(), rtol=0, atol=1e-5)
