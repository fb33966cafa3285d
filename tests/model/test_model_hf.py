"""Hugging Face BERT -> bundle: exactness against sentence-transformers / transformers (committed references,
tests/data, from bench/hf_reference.py), text settings, and the converter's refusals (each names file and key)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model.__main__ import main
from model.bundle import BundleError, load_bundle, read_manifest
from model.config import EncoderConfig
from model.encoder import Encoder
from model.hf import HFConversionError, convert_hf, read_hf_config, read_text_settings
from model.text import TextError, TextSettings, TextTokenizer
from tests.support.hf_helpers import TINY_BERT, Reference, tiny_bert_state_dict, write_tiny_bert

# Reduced precision against the fp32 references, all 25 texts, one per forward, CPU (AVX2), measured 2026-12-01:
# normalised embeddings max |e - e_ref|, min cosine; hidden states max |h - h_ref| / max |h_ref|.
#   bf16: 0.0035, 0.99988, 0.0077     fp16: 0.00030, 0.9999984, 0.00093     (fp32: 1.7e-7, 0.9999998, 0)
BOUNDS = {  # dtype: (embedding max abs, min cosine, hidden relative), about 3x the measured
    "bfloat16": (0.01, 0.9995, 0.02),
    "float16": (0.001, 0.99999, 0.003),
}


def _forward(module: torch.jit.ScriptModule, ids: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        hidden, _ = module(torch.from_numpy(ids)[None], None, torch.tensor([len(ids)]), False, [])
    return hidden[0].float()


def _embedding(hidden: torch.Tensor) -> torch.Tensor:
    return F.normalize(hidden.mean(dim=0), dim=0)


def test_token_ids_equal_hf(minilm_bundle: Path, minilm_reference: Reference) -> None:
    tokenizer = load_bundle(minilm_bundle).tokenizer
    assert tokenizer is not None
    encoded = tokenizer.encode(minilm_reference.texts, truncate=True)
    assert len(minilm_reference.texts) >= 20
    for text, got, want in zip(minilm_reference.texts, encoded, minilm_reference.ids, strict=True):
        assert got.ids.tolist() == want, text[:40]
        assert len(got.tokens) == len(want)
    lengths = [e.full_length for e in encoded]
    assert [e.truncated for e in encoded].count(True) == 3  # LONG*12, LONG*30, "a " * 255
    assert lengths[7] == 256 and not encoded[7].truncated and lengths[8] == 257 and len(encoded[8].ids) == 256
    assert encoded[1].ids.tolist() == [101, 102] and encoded[2].ids.tolist() == [101, 102]  # empty, blank
    # Special-token strings typed in the text become special ids, as in HF; other cases do not.
    assert encoded[14].ids.tolist().count(102) == 3 and encoded[15].ids.tolist()[1:3] == [0, 0]
    assert 102 not in encoded[16].ids.tolist()[1:-1] and 0 not in encoded[16].ids.tolist()


def test_untruncated_encoding_reports_the_full_length(minilm_bundle: Path, minilm_reference: Reference) -> None:
    tokenizer = load_bundle(minilm_bundle).tokenizer
    assert tokenizer is not None
    long = tokenizer.encode([minilm_reference.texts[5]], truncate=False)[0]
    assert long.full_length == len(long.ids) > 256 and not long.truncated
    assert long.ids[:256].tolist() != minilm_reference.ids[5]  # the cut keeps [SEP] at the end
    assert long.ids[:255].tolist() == minilm_reference.ids[5][:255]


def test_embeddings_and_hidden_states_match_fp32(minilm_bundle: Path, minilm_reference: Reference) -> None:
    module = load_bundle(minilm_bundle).module
    for i, ids in enumerate(minilm_reference.ids):
        hidden = _forward(module, np.asarray(ids, np.int64))
        rows = hidden[minilm_reference.hidden_rows[i]]
        np.testing.assert_allclose(rows.numpy(), minilm_reference.hidden[i], rtol=0, atol=1e-4)
        emb = _embedding(hidden)
        want = torch.from_numpy(minilm_reference.embeddings[i])
        np.testing.assert_allclose(emb.numpy(), want.numpy(), rtol=0, atol=1e-5)
        assert float(emb @ want) >= 0.99999


@pytest.mark.parametrize("dtype", sorted(BOUNDS))
def test_reduced_precision_bounds(minilm_bundle: Path, minilm_reference: Reference, dtype: str) -> None:
    module = load_bundle(minilm_bundle, dtype=dtype).module
    emb_err, min_cos, hid_err = 0.0, 1.0, 0.0
    for i, ids in enumerate(minilm_reference.ids):
        hidden = _forward(module, np.asarray(ids, np.int64))
        ref = torch.from_numpy(minilm_reference.hidden[i])
        hid_err = max(hid_err, float((hidden[minilm_reference.hidden_rows[i]] - ref).abs().max() / ref.abs().max()))
        emb, want = _embedding(hidden), torch.from_numpy(minilm_reference.embeddings[i])
        emb_err, min_cos = max(emb_err, float((emb - want).abs().max())), min(min_cos, float(emb @ want))
    bound_emb, bound_cos, bound_hid = BOUNDS[dtype]
    assert emb_err <= bound_emb and min_cos >= bound_cos and hid_err <= bound_hid, (emb_err, min_cos, hid_err)


def test_minilm_manifest_carries_the_text_settings(minilm_bundle: Path) -> None:
    manifest = read_manifest(minilm_bundle)
    assert manifest.format_version == 2  # servers before text input accept only 1: they refuse it
    assert manifest.text is not None
    assert (manifest.text.max_tokens, manifest.text.pooling, manifest.text.normalize) == (256, "mean", True)
    assert manifest.text.tokenizer_sha256 == "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
    assert manifest.text.special_ids["[CLS]"] == 101 and manifest.text.special_ids["[PAD]"] == 0
    assert manifest.config.embedding_norm and manifest.config.positional == "learned"
    assert json.loads((minilm_bundle / "manifest.json").read_text())["format_version"] == 2


# -- the tiny synthetic BERT: the converter's mapping and refusals, without the real model ---------------------


def _hf_reference_forward(sd: dict[str, torch.Tensor], config: dict[str, object], ids: list[int]) -> torch.Tensor:
    """BERT written out from its definition (post-LN, exact GELU, token type 0): an independent check."""
    C, H = int(config["hidden_size"]), int(config["num_attention_heads"])  # type: ignore[call-overload]
    eps = float(config["layer_norm_eps"])  # type: ignore[arg-type]
    t = torch.tensor(ids)
    x = sd["embeddings.word_embeddings.weight"][t] + sd["embeddings.position_embeddings.weight"][: len(ids)]
    x = x + sd["embeddings.token_type_embeddings.weight"][0]
    x = F.layer_norm(x, (C,), sd["embeddings.LayerNorm.weight"], sd["embeddings.LayerNorm.bias"], eps)
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"encoder.layer.{i}."

        def lin(x: torch.Tensor, name: str, p: str = p) -> torch.Tensor:
            return F.linear(x, sd[p + name + ".weight"], sd[p + name + ".bias"])

        q, k, v = (lin(x, f"attention.self.{n}").view(len(ids), H, C // H).transpose(0, 1)
                   for n in ("query", "key", "value"))  # (H, T, hs)
        att = torch.softmax(q @ k.transpose(-1, -2) / (C // H) ** 0.5, dim=-1) @ v  # (H, T, hs)
        a = lin(att.transpose(0, 1).reshape(len(ids), C), "attention.output.dense")
        x = F.layer_norm(x + a, (C,), sd[p + "attention.output.LayerNorm.weight"],
                         sd[p + "attention.output.LayerNorm.bias"], eps)
        f = lin(F.gelu(lin(x, "intermediate.dense")), "output.dense")
        x = F.layer_norm(x + f, (C,), sd[p + "output.LayerNorm.weight"], sd[p + "output.LayerNorm.bias"], eps)
    return x


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_tiny_bert_matches_its_definition(tmp_path: Path, prefix: str) -> None:
    sd = tiny_bert_state_dict(TINY_BERT, seed=3, prefix=prefix)
    sd["cls.predictions.bias"] = torch.zeros(12)  # a task head, outside the base model: ignored
    src = write_tiny_bert(tmp_path / "src", state_dict=sd)
    encoder, _, settings, _ = convert_hf(src)
    ids = [2, 8, 9, 10, 11, 3]
    with torch.inference_mode():
        got, _ = encoder(torch.tensor([ids]), None, torch.tensor([len(ids)]), False, [])
    bare = {k.removeprefix(prefix): v for k, v in sd.items()}
    want = _hf_reference_forward(bare, TINY_BERT, ids)
    torch.testing.assert_close(got[0], want, rtol=0, atol=1e-5)
    assert (settings.max_tokens, settings.pooling, settings.normalize) == (8, "mean", True)
    assert settings.prompts == {"query": "a ", "passage": "b "}


def test_convert_hf_cli_writes_a_text_bundle(tiny_text_bundle: Path) -> None:
    loaded = load_bundle(tiny_text_bundle)
    assert loaded.tokenizer is not None and loaded.manifest.name == "tiny-bert"
    encoded = loaded.tokenizer.encode(["the cats", ""], truncate=False, prompt=loaded.tokenizer.prompt("query"))
    assert [e.ids.tolist() for e in encoded] == [[2, 5, 8, 9, 10, 3], [2, 5, 3]]
    assert encoded[0].tokens == ["[CLS]", "a", "the", "cat", "##s", "[SEP]"]


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("file", "change", "named"), [
    ("config.json", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
    ("config.json", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ("config.json", {"model_type": "camembert"}, "model_type='camembert': CamemBERT"),
    ("config.json", {"model_type": "nomic_bert"}, "model_type='nomic_bert'"),
    ("config.json", {"model_type": "gpt2"}, "model_type='gpt2'"),
    ("config.json", {"is_decoder": True}, "is_decoder=True"),
    ("1_Pooling/config.json", {"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True},
     "pooling modes ['max']"),
    ("1_Pooling/config.json", {"include_prompt": False}, "include_prompt=False"),
    ("sentence_bert_config.json", {"max_seq_length": "long"}, "max_seq_length='long'"),
])
def test_refusals_name_file_and_key(tmp_path: Path, file: str, change: dict[str, object], named: str) -> None:
    src = write_tiny_bert(tmp_path / "src")
    _edit_json(src / file, **change)
    with pytest.raises(HFConversionError) as info:
        convert_hf(src)
    assert str(src / file) in str(info.value) and named in str(info.value)


def test_refusals_of_weights_and_modules(tmp_path: Path) -> None:
    sd = tiny_bert_state_dict(TINY_BERT)
    sd["encoder.layer.0.attention.self.relative_bias"] = torch.zeros(3)
    del sd["encoder.layer.1.output.dense.bias"]
    src = write_tiny_bert(tmp_path / "a", state_dict=sd)
    with pytest.raises(HFConversionError) as info:
        convert_hf(src)
    message = str(info.value)
    assert str(src / "model.safetensors") in message and "key map hf_bert" in message
    assert "missing keys (1): ['encoder.layer.1.output.dense.bias']" in message
    assert "unexpected keys (1): ['encoder.layer.0.attention.self.relative_bias']" in message
    src = write_tiny_bert(tmp_path / "b")
    modules = json.loads((src / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (src / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(HFConversionError, match=r"modules\.json: module 2 type 'sentence_transformers\.models\.Dense'"):
        convert_hf(src)
    src = write_tiny_bert(tmp_path / "c")
    (src / "tokenizer.json").unlink()  # no longer refused: an ids-only bundle (tests/model/test_model_hf_ids_only.py)
    assert convert_hf(src)[1:3] == (None, None)
    src = write_tiny_bert(tmp_path / "d")
    sd = tiny_bert_state_dict(TINY_BERT)
    sd["embeddings.position_embeddings.weight"] = sd["embeddings.position_embeddings.weight"][:10]
    write_tiny_bert(src, state_dict=sd)
    with pytest.raises(HFConversionError, match=r"position_embeddings\.weight: expected shape \(16, 32\), "
                                                r"got \(10, 32\)"):
        convert_hf(src)
    (src / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(HFConversionError, match=r"model\.safetensors is not a readable safetensors file"):
        convert_hf(src)


def test_plain_bert_folder_defaults_to_cls_unnormalised(tmp_path: Path) -> None:
    src = write_tiny_bert(tmp_path / "src", sentence_transformers=False)
    config = read_hf_config(src)
    _, settings = read_text_settings(src, config)
    assert (settings.pooling, settings.normalize, settings.max_tokens) == ("cls", False, 16)


def test_corrupt_tokenizer_fails_to_load(tiny_text_bundle: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_text_bundle, bundle)
    with (bundle / "tokenizer.json").open("ab") as f:
        f.write(b" ")
    with pytest.raises(BundleError, match=r"tokenizer\.json failed its checksum"):
        load_bundle(bundle)
    (bundle / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match=r"tokenizer\.json not found"):
        load_bundle(bundle)


def test_cli_reports_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_tiny_bert(tmp_path / "src")
    _edit_json(src / "config.json", hidden_act="silu")
    assert main(["convert-hf", "--model-dir", str(src), "--out", str(tmp_path / "out")]) == 1
    assert "hidden_act='silu'" in capsys.readouterr().err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_text_settings_are_checked() -> None:
    ok = {"tokenizer_sha256": "0" * 64, "max_tokens": 8}
    assert TextSettings.from_dict(ok).to_dict()["pooling"] == "mean"
    for bad, named in [({"max_tokens": 1}, "max_tokens"), ({"pooling": "max"}, "pooling"),
                       ({"truncation_side": "middle"}, "truncation_side"), ({"nope": 1}, "nope"),
                       ({"default_prompt_name": "q"}, "default_prompt_name")]:
        with pytest.raises(TextError, match=named):
            TextSettings.from_dict({**ok, **bad})
    with pytest.raises(TextError, match="failed its checksum"):
        TextTokenizer(b"{}", TextSettings.from_dict(ok))


def test_embedding_norm_is_off_by_default() -> None:
    assert EncoderConfig().embedding_norm is False
    plain = Encoder(EncoderConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, vocab_size=10, max_length=4))
    assert not any(k.startswith("ln_emb") for k in plain.state_dict())
    normed = EncoderConfig.from_json(EncoderConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, vocab_size=10,
                                                   max_length=4, embedding_norm=True).to_json())
    assert {"ln_emb.weight", "ln_emb.bias"} <= set(Encoder(normed).state_dict())
    with pytest.raises(ValueError, match="embedding_norm must be a bool"):
        EncoderConfig(embedding_norm=1)  # type: ignore[arg-type]


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path: Path) -> None:
    sd = tiny_bert_state_dict(TINY_BERT, seed=5)
    src = write_tiny_bert(tmp_path / "src", state_dict=sd)
    (src / "model.safetensors").unlink()
    torch.save(sd, src / "pytorch_model.bin")
    encoder, _, _, source = convert_hf(src)
    assert source.endswith("/pytorch_model.bin")
    torch.testing.assert_close(encoder.state_dict()["pos_emb"], sd["embeddings.position_embeddings.weight"])
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04junk")
    with pytest.raises(HFConversionError, match=r"pytorch_model\.bin is not a loadable state_dict file"):
        convert_hf(src)
    (src / "pytorch_model.bin").unlink()
    with pytest.raises(HFConversionError, match=r"neither model\.safetensors nor pytorch_model\.bin"):
        convert_hf(src)


def test_add_and_row0_ops_refuse_what_does_not_apply() -> None:
    from model.convert import ConversionError, KeyMap, convert

    sd = tiny_bert_state_dict(TINY_BERT)
    sd["embeddings.token_type_embeddings.weight"] = torch.zeros(2, 31)  # row 0 is (31,), the table (12, 32)
    keymap = KeyMap.builtin("hf_bert")
    cfg = EncoderConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=12, max_length=16,
                        positional="learned", activation="gelu", layer_norm_eps=1e-12, embedding_norm=True)
    with pytest.raises(ConversionError, match=r"tok_emb\.weight <- add\(.*add needs shapes that broadcast"):
        convert(sd, cfg, keymap)
    sd["embeddings.token_type_embeddings.weight"] = torch.zeros(0, 32)
    with pytest.raises(ConversionError, match=r"row0 needs a tensor with at least one row"):
        convert(sd, cfg, keymap)
