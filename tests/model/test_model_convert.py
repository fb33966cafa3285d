"""Converting a stock nn.Embedding + nn.TransformerEncoder: the bundle computes what the stock model
computes (fp32, atol 1e-5, real positions), and a state_dict that does not fit says exactly why."""

import json
from pathlib import Path

import pytest
import torch

from model.__main__ import main
from model.bundle import load_bundle, read_manifest
from model.config import EncoderConfig
from model.convert import ConversionError, convert_state_dict, key_mapping, load_state_dict_file
from model.encoder import sinusoidal_table
from tests.support.model_helpers import StockEncoder, batch, tiny

ATOL = 1e-5
LENGTHS = [[12], [12, 7, 1], [5, 12, 3, 9]]


def _stock(config: EncoderConfig, final_norm: bool = False, seed: int = 0) -> StockEncoder:
    torch.manual_seed(seed)
    stock = StockEncoder(config, final_norm=final_norm).eval()
    with torch.no_grad():  # LayerNorm defaults are (1, 0): perturb them so a norm1/norm2 swap shows
        for name, p in stock.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return stock


@pytest.mark.parametrize(
    ("config", "final_norm"),
    [
        (tiny(positional="none"), False),
        (tiny(positional="none", norm_first=True, activation="gelu"), False),
        (tiny(positional="none", norm_first=True, activation="gelu", final_norm=True, layer_norm_eps=1e-6), True),
    ],
    ids=["post-ln-relu", "pre-ln-gelu", "pre-ln-gelu-final-norm"],
)
def test_exported_bundle_equals_stock_model(config: EncoderConfig, final_norm: bool, tmp_path: Path) -> None:
    stock = _stock(config, final_norm)
    encoder = convert_state_dict(stock.state_dict(), config)
    with torch.no_grad():
        for lengths in LENGTHS:
            ids, lengths_t = batch(config, lengths, seed=len(lengths))
            for causal in (False, True):
                want = stock(ids, lengths_t, causal)
                got, _ = encoder(ids, None, lengths_t, causal, [])
                for b, n in enumerate(lengths):
                    torch.testing.assert_close(got[b, :n], want[b, :n], atol=ATOL, rtol=0)
    # ... and through the bundle, the service's path.
    from model.bundle import save_bundle

    save_bundle(encoder, tmp_path / "b", name="stock", version="1", source="test")
    loaded = load_bundle(tmp_path / "b").module
    ids, lengths_t = batch(config, [12, 7, 1], seed=1)
    with torch.inference_mode():
        want = stock(ids, lengths_t)
        got, weights = loaded(ids, None, lengths_t, False, [0])
    for b, n in enumerate([12, 7, 1]):
        torch.testing.assert_close(got[b, :n], want[b, :n], atol=ATOL, rtol=0)
    assert weights is not None and weights.shape == (3, 1, config.n_heads, 12, 12)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_positions_are_added_to_the_embeddings(positional: str) -> None:
    """Equal to the stock encoder run on embedding(ids) + table[:T]; learned tables come from position_key."""
    config = tiny(positional=positional, norm_first=True)
    stock = _stock(config)
    table = torch.randn(config.max_length, config.d_model) if positional == "learned" else sinusoidal_table(
        config.max_length, config.d_model)
    state = {**stock.state_dict(), "pos.weight": table}
    encoder = convert_state_dict(state, config, position_key="pos.weight" if positional == "learned" else None)
    ids, lengths = batch(config, [config.max_length, 20, 3], seed=4)
    pad = torch.arange(config.max_length)[None, :] >= lengths[:, None]
    with torch.no_grad():
        want = stock.encoder(stock.embedding(ids) + table, src_key_padding_mask=pad)
        got, _ = encoder(ids, None, lengths, False, [])
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(got[b, :n], want[b, :n], atol=ATOL, rtol=0)
    if positional == "learned":
        with pytest.raises(ConversionError, match="positional='learned' needs position_key"):
            convert_state_dict(state, config)


def test_custom_prefixes_and_ignored_head() -> None:
    config = tiny(positional="none")
    stock = _stock(config)
    renamed = {k.replace("embedding.", "embed.").replace("encoder.", "body.transformer."): v
               for k, v in stock.state_dict().items()}
    renamed["head.weight"] = torch.zeros(3, config.d_model)  # a task head: ignored unless strict
    encoder = convert_state_dict(renamed, config, embedding_prefix="embed.", encoder_prefix="body.transformer.")
    assert torch.equal(encoder.blocks[1].ff.fc2.weight, stock.encoder.layers[1].linear2.weight)
    with pytest.raises(ConversionError, match=r"unexpected keys \(1\): \['head.weight'\]"):
        convert_state_dict(renamed, config, embedding_prefix="embed.", encoder_prefix="body.transformer.",
                           strict=True)


def test_mismatched_state_dict_lists_every_problem() -> None:
    config = tiny(positional="none")
    state = _stock(tiny(positional="none", n_layers=3, d_ff=48), final_norm=True).state_dict()
    del state["encoder.layers.0.norm2.bias"]
    state["encoder.layers.1.self_attn.in_proj_bias"] = torch.zeros(3 * config.d_model, dtype=torch.long)
    with pytest.raises(ConversionError) as info:
        convert_state_dict(state, config)
    message = str(info.value)
    assert "missing keys (1): ['encoder.layers.0.norm2.bias']" in message
    # layer 2 and the final norm are not in a 2-layer config without final_norm
    assert "unexpected keys (14): ['encoder.layers.2." in message and "'encoder.norm.weight'" in message
    for i in (0, 1):
        assert f"encoder.layers.{i}.linear1.weight: expected shape (64, 32), got (48, 32)" in message
        assert f"encoder.layers.{i}.linear2.bias" not in message  # right shape
    assert ("encoder.layers.1.self_attn.in_proj_bias: expected a floating-point tensor, got Tensor torch.int64"
            in message)


def test_wrong_prefix_hints_at_the_real_keys() -> None:
    config = tiny(positional="none")
    with pytest.raises(ConversionError, match=r"(?s)missing keys \(25\).*outside the prefixes, ignored \(wrong "
                                              r"prefix\?\): \['embedding.weight'"):
        convert_state_dict(_stock(config).state_dict(), config, encoder_prefix="transformer.",
                           embedding_prefix="emb.")


def test_key_mapping_documents_the_stock_names() -> None:
    mapping = key_mapping(tiny(final_norm=True))
    assert mapping["blocks.1.attn.qkv.weight"] == "encoder.layers.1.self_attn.in_proj_weight"
    assert mapping["blocks.0.attn.proj.bias"] == "encoder.layers.0.self_attn.out_proj.bias"
    assert mapping["blocks.0.ff.fc1.weight"] == "encoder.layers.0.linear1.weight"
    assert mapping["blocks.1.ln2.weight"] == "encoder.layers.1.norm2.weight"
    assert mapping["ln_f.bias"] == "encoder.norm.bias" and mapping["tok_emb.weight"] == "embedding.weight"


def test_state_dict_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="not found"):
        load_state_dict_file(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(ConversionError, match="not a loadable state_dict file"):
        load_state_dict_file(tmp_path / "junk.pt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ConversionError, match="holds a list, not a state_dict"):
        load_state_dict_file(tmp_path / "list.pt")


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny(positional="none", norm_first=True, activation="gelu")
    stock = _stock(config)
    torch.save(stock.state_dict(), tmp_path / "stock.pt")
    (tmp_path / "config.json").write_text(config.to_json())
    argv = ["convert", "--state-dict", str(tmp_path / "stock.pt"), "--config", str(tmp_path / "config.json"),
            "--out", str(tmp_path / "bundle"), "--name", "stock-tiny", "--version", "7"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    manifest = read_manifest(tmp_path / "bundle")
    assert printed == manifest.to_dict()
    assert (manifest.name, manifest.version, manifest.source) == ("stock-tiny", "7", "state_dict:stock.pt")
    assert manifest.config == config
    # A bad config file and a mismatched state_dict are reported on stderr with exit code 1.
    (tmp_path / "bad.json").write_text(json.dumps({**config.to_dict(), "n_layers": 3}))
    argv[4], argv[6] = str(tmp_path / "bad.json"), str(tmp_path / "bundle2")
    assert main(argv) == 1
    assert "missing keys (12): ['encoder.layers.2." in capsys.readouterr().err
    (tmp_path / "typo.json").write_text(json.dumps({"dmodel": 32}))
    argv[4] = str(tmp_path / "typo.json")
    assert main(argv) == 1
    assert "unknown EncoderConfig keys ['dmodel']" in capsys.readouterr().err
