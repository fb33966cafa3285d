"""Serving the encoders the tutorials teach (tests/support/article_models.py) exactly: each converts through its key map
into a bundle equal to the eager model, attention weights included; the relative position bias holds the
model's guarantees (scripted == eager, SDPA == explicit, batch invariance, reduced precision, no NaN); the
scale is explicit; and whatever cannot be expressed is refused by name."""

import json
import math
from pathlib import Path

import pytest
import torch

from model.__main__ import main
from model.bundle import MANIFEST_FILE, RELATIVE_ERROR_BOUND, BundleError, load_bundle, read_manifest, save_bundle
from model.config import EncoderConfig
from model.convert import ConversionError, KeyMap, convert
from model.encoder import Encoder
from tests.support import article_models
from tests.support.model_helpers import max_errors, tiny

LAYOUTS = list(article_models.KEY_MAP)
LENGTHS = [24, 10, 3, 1, 17]  # mixed in one batch; 24 is max_length
HERE = Path(__file__).resolve().parents[1] / "support"


def _converted(name: str) -> tuple[torch.nn.Module, Encoder]:
    eager = getattr(article_models, name)(seed=3)
    config = EncoderConfig.from_dict(article_models.config_fields(name))
    return eager, convert(eager.state_dict(), config, KeyMap.builtin(article_models.KEY_MAP[name]))


def _batch(T: int = 24, lengths: list[int] = LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, article_models.VOCAB, (len(lengths), T), generator=g), torch.tensor(lengths)


def _mask(lengths: torch.Tensor, T: int, causal: bool) -> torch.Tensor:
    mask = (torch.arange(T)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)
    return mask & torch.ones(T, T, dtype=torch.bool).tril() if causal else mask


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name in LAYOUTS:
        _, encoder = _converted(name)
        out[name] = tmp_path_factory.mktemp("articles") / name
        save_bundle(encoder, out[name], name=name, version="1", source="test")
    return out


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_bundle_equals_the_eager_model_and_its_attention(name: str, causal: bool, bundles: dict[str, Path]) -> None:
    eager = getattr(article_models, name)(seed=3)
    module = load_bundle(bundles[name]).module
    ids, lengths = _batch()
    with torch.inference_mode():
        want = eager(ids, _mask(lengths, 24, causal))
        probs = eager.attention_probs()  # the model's own softmax(scores + bias), (B, nh, T, T) per layer
        fast, _ = module(ids, None, lengths, causal, [])
        slow, weights = module(ids, None, lengths, causal, [0, 1])
    for b, n in enumerate(LENGTHS):
        torch.testing.assert_close(fast[b, :n], want[b, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(slow[b, :n], want[b, :n], atol=1e-5, rtol=0)
        for layer in (0, 1):  # real query rows, every key (padded keys are 0 in both)
            torch.testing.assert_close(weights[b, layer, :, :n], probs[layer][b, :, :n], atol=1e-6, rtol=0)


def test_relative_bias_scripted_equals_eager_and_sdpa_equals_explicit() -> None:
    for relative in ("shared", "per_layer"):
        for norm_first in (False, True):
            eager = Encoder(tiny(relative_bias=relative, norm_first=norm_first)).init_weights(2).eval()
            scripted = torch.jit.script(eager)
            ids, lengths = _batch(T=40, lengths=[40, 33, 7, 1])
            for causal in (False, True):
                with torch.inference_mode():
                    want, want_w = eager(ids, None, lengths, causal, [0, 1])
                    got, got_w = scripted(ids, None, lengths, causal, [0, 1])
                    sdpa, _ = scripted(ids, None, lengths, causal, [])
                    full, _ = eager(ids[:1], None, lengths[:1], causal, [])  # unpadded: the no-mask SDPA branch
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
                torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=0)
                real = torch.arange(40)[None, :] < lengths[:, None]
                torch.testing.assert_close(sdpa[real], want[real], atol=1e-5, rtol=0)
                torch.testing.assert_close(full[0], want[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("relative", ["shared", "per_layer"])
def test_relative_bias_batch_invariance_with_padding(relative: str) -> None:
    model = Encoder(tiny(relative_bias=relative)).init_weights(4).eval()
    ids, lengths = _batch(T=30, lengths=[30, 12, 5, 1])
    for causal in (False, True):
        for layers in ([], [0, 1]):
            with torch.inference_mode():
                batched, bw = model(ids, None, lengths, causal, layers)
                for b, n in enumerate(lengths.tolist()):
                    alone, aw = model(ids[b:b + 1, :n], None, lengths[b:b + 1], causal, layers)
                    torch.testing.assert_close(batched[b, :n], alone[0], atol=1e-5, rtol=0)
                    if layers:
                        torch.testing.assert_close(bw[b, :, :, :n, :n], aw[0], atol=1e-6, rtol=0)


def test_the_bias_really_changes_the_outputs() -> None:
    """Dropping the table (zeroing it) moves outputs and weights far beyond every tolerance above."""
    for relative in ("shared", "per_layer"):
        model = Encoder(tiny(relative_bias=relative)).init_weights(1).eval()
        ids, lengths = _batch(T=20, lengths=[20, 9])
        with torch.inference_mode():
            with_bias = model(ids, None, lengths, False, [1]), model(ids, None, lengths, False, [])[0]
            for name, p in model.named_parameters():
                if name.endswith("rel_bias"):
                    p.zero_()
            without = model(ids, None, lengths, False, [1]), model(ids, None, lengths, False, [])[0]
        assert float((with_bias[0][1] - without[0][1]).abs().max()) > 0.05  # attention weights
        assert float((with_bias[1] - without[1]).abs().max()) > 0.05  # SDPA path hidden states


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("relative", ["shared", "per_layer"])
def test_relative_bias_reduced_precision_within_the_stated_bounds(dtype: torch.dtype, relative: str) -> None:
    bound = RELATIVE_ERROR_BOUND[str(dtype).removeprefix("torch.")]
    for causal in (False, True):
        for seed in (0, 1):
            hidden, weights = max_errors(tiny(relative_bias=relative), dtype, [64, 40, 9, 1], causal, seed=seed)
            assert hidden <= bound and weights <= bound, (hidden, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fully_padded_rows_never_nan_with_a_bias(dtype: torch.dtype) -> None:
    model = Encoder(tiny(relative_bias="per_layer")).init_weights(0).eval().to(dtype)
    ids, lengths = _batch(T=8, lengths=[8, 0, 3])
    for causal in (False, True):
        for layers in ([], [0, 1]):
            with torch.inference_mode():
                hidden, weights = model(ids, None, lengths, causal, layers)
            assert torch.isfinite(hidden).all()
            if layers:
                assert torch.isfinite(weights).all() and float(weights[1].abs().max()) == 0.0


def test_the_scale_is_explicit_and_stated(bundles: dict[str, Path], tmp_path: Path) -> None:
    manifest = read_manifest(bundles["einsum"])
    assert manifest.config.attention_scale == 1 / math.sqrt(article_models.D_MODEL)
    assert read_manifest(bundles["mha"]).config.attention_scale is None  # the default: 1/sqrt(d_head)
    # Leaving it out for the einsum layout is refused by name, not converted into a different model.
    eager = article_models.einsum()
    wrong = EncoderConfig.from_dict({**article_models.config_fields("einsum"), "attention_scale": None})
    with pytest.raises(ConversionError, match=r"config field attention_scale=None \(scale 0\.353553\): the source "
                                              r"layout of key map article_einsum scales by 1/sqrt\(d_model\) = "
                                              r"0\.176777"):
        convert(eager.state_dict(), wrong, KeyMap.builtin("article_einsum"))
    # A manifest that hides the scale is refused at load: the module states its own.
    for name in (MANIFEST_FILE, "model.pt"):
        (tmp_path / name).write_bytes((bundles["einsum"] / name).read_bytes())
    data = json.loads((tmp_path / MANIFEST_FILE).read_text())
    data["config"]["attention_scale"] = None
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"config\.attention_scale is 0\.35355\d* in the manifest, 0\.17677\d* in "
                                          r"the module"):
        load_bundle(tmp_path)


def test_what_the_source_cannot_express_is_named() -> None:
    eager = article_models.mha_relative_shared()
    fields = article_models.config_fields("mha_relative_shared")
    keymap = KeyMap.builtin("article_mha")
    with pytest.raises(ConversionError, match=r"config field norm_first=True: the source layout of key map "
                                              r"article_mha cannot express it \(it has norm_first=False\)"):
        convert(eager.state_dict(), EncoderConfig.from_dict({**fields, "norm_first": True}), keymap)
    with pytest.raises(ConversionError) as info:  # the model has one shared table, the config asks for per-layer
        convert(eager.state_dict(), EncoderConfig.from_dict({**fields, "relative_bias": "per_layer"}), keymap)
    message = str(info.value)
    assert "missing keys (2): ['encoder_layers.0.self_attn.relative_position_bias.relative_bias'" in message
    assert "unexpected keys (1): ['relative_position_bias.relative_bias']" in message
    with pytest.raises(ConversionError, match=r"unexpected keys \(1\): \['relative_position_bias.relative_bias'\]"):
        convert(eager.state_dict(), EncoderConfig.from_dict({**fields, "relative_bias": "none"}), keymap)


def test_manifests_without_the_new_fields_keep_their_meaning(tmp_path: Path) -> None:
    save_bundle(Encoder(tiny()).init_weights(0), tmp_path, name="old", version="1", source="test")
    data = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert data["config"].pop("relative_bias") == "none" and data["config"].pop("attention_scale") is None
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
    loaded = load_bundle(tmp_path)
    assert loaded.manifest.config == tiny() and loaded.manifest.config.scale == 1 / math.sqrt(8)


def test_cli_convert_with_a_key_map_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "mha_relative_per_layer"
    torch.save(getattr(article_models, name)(seed=0).state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.json").write_text(json.dumps(article_models.config_fields(name)))
    argv = ["convert", "--state-dict", str(tmp_path / "model.pt"), "--config", str(tmp_path / "config.json"),
            "--out", str(tmp_path / "bundle"), "--name", "mine", "--version", "1", "--key-map", "article_mha"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "state_dict:model.pt,key_map:article_mha"
    reference = f"{HERE / 'article_models.py'}:{name}"
    assert main(["check", str(tmp_path / "bundle"), "--reference", reference]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["worst_abs_diff"] <= 1e-5 and len(report["cases"]) == 8
    assert {(c["causal"], c["path"]) for c in report["cases"]} == {(a, b) for a in (False, True)
                                                                  for b in ("sdpa", "explicit")}
    # Another model (the same layout without its bias table) is caught: exit 1, the difference printed.
    assert main(["check", str(tmp_path / "bundle"), "--reference", f"{HERE / 'article_models.py'}:mha"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["worst_abs_diff"] > 1e-2
    assert main(["check", str(tmp_path / "bundle"), "--reference", "tests.support.article_models:nothing"]) == 1
    assert "tests.support.article_models has no callable 'nothing'" in capsys.readouterr().err


def test_cli_convert_checks_against_the_reference_before_keeping_the_bundle(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(article_models.mha(seed=0).state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.json").write_text(json.dumps(article_models.config_fields("mha")))
    argv = ["convert", "--state-dict", str(tmp_path / "model.pt"), "--config", str(tmp_path / "config.json"),
            "--out", str(tmp_path / "good"), "--name", "mine", "--version", "1", "--key-map", "article_mha",
            "--reference", f"{HERE / 'article_models.py'}:mha"]
    assert main(argv) == 0 and (tmp_path / "good" / MANIFEST_FILE).is_file()
    capsys.readouterr()
    # The same weights checked against another model (seed 1 of the layout): refused, nothing kept.
    (tmp_path / "other.py").write_text("from tests.support import article_models\n\n\ndef build():\n"
                                       "    return article_models.mha(seed=1)\n")
    argv[6], argv[-1] = str(tmp_path / "bad"), f"{tmp_path / 'other.py'}:build"
    assert main(argv) == 1
    assert "the converted bundle differs from the reference" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # not even the directory it made
