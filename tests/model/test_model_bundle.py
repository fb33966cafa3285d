"""Bundles: save -> load round trip, checksum and manifest checks, freezing, fp32 + bf16 copies, the seeded
default bundle, and the `python -m model` command line."""

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
import torch

import model.default as default_mod
from model.__main__ import main
from model.bundle import (
    MANIFEST_FILE,
    MODEL_FILE,
    RELATIVE_ERROR_BOUND,
    BundleError,
    Manifest,
    file_sha256,
    load_bundle,
    read_manifest,
    save_bundle,
    weights_sha256,
)
from model.config import REFERENCE, TINY
from model.default import build_default_bundle, code_id, ensure_default_bundle
from model.encoder import Encoder
from tests.support.model_helpers import batch, rel_err, tiny

# weights_sha256 of Encoder(TINY).init_weights(0): pins "same seed -> same weights" across machines
# and torch versions. If it changes, the default model changed: bump DEFAULT_VERSION.
TINY_SEED0_WEIGHTS_SHA256 = "db545f53c43f1e970c76b4150d464862f7578e2913f398f47ccb21dffefb4558"


@pytest.fixture(scope="module")
def eager() -> Encoder:
    return Encoder(tiny(norm_first=True, activation="gelu", final_norm=True)).init_weights(5).eval()


@pytest.fixture(scope="module")
def bundle_dir(eager: Encoder, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bundle") / "tiny"
    save_bundle(eager, directory, name="tiny", version="3", source="test")
    return directory


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("default") / "a"
    build_default_bundle(directory, seed=0)
    return directory


def _outputs(module: torch.nn.Module, config=TINY, causal: bool = True, layers=(0, 1)):  # noqa: ANN001, ANN202
    ids, lengths = batch(config, [12, 7, 1], seed=9)
    with torch.inference_mode():
        return module(ids, None, lengths, causal, list(layers)), module(ids, None, lengths, False, [])


def test_round_trip_is_identical(eager: Encoder, bundle_dir: Path) -> None:
    loaded = load_bundle(bundle_dir)
    assert loaded.manifest.name == "tiny" and loaded.manifest.version == "3"
    for (got, got_w), (want, want_w) in zip(_outputs(loaded.module), _outputs(eager), strict=True):
        assert torch.equal(got, want)
        assert (got_w is None and want_w is None) or torch.equal(got_w, want_w)


def test_manifest_contents(eager: Encoder, bundle_dir: Path) -> None:
    raw = json.loads((bundle_dir / MANIFEST_FILE).read_text())
    assert set(raw) == {"format_version", "name", "version", "config", "sha256", "weights_sha256", "dtype",
                        "validated_precisions", "created_at", "source"}
    manifest = read_manifest(bundle_dir)
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert manifest.config == eager.config
    assert manifest.sha256 == file_sha256(bundle_dir / MODEL_FILE)
    assert manifest.weights_sha256 == weights_sha256(eager)
    assert manifest.dtype == "float32" and manifest.source == "test" and manifest.format_version == 1
    assert manifest.validated_precisions[0] == "float32" and "bfloat16" in manifest.validated_precisions
    created = datetime.datetime.fromisoformat(manifest.created_at)
    assert created.utcoffset() == datetime.timedelta(0)


def test_loaded_module_is_frozen_and_equals_unfrozen(bundle_dir: Path) -> None:
    loaded = load_bundle(bundle_dir, dtype="bfloat16").module
    assert list(loaded.parameters()) == []  # the weights became graph constants
    unfrozen = torch.jit.load(str(bundle_dir / MODEL_FILE)).to(torch.bfloat16).eval()
    for (got, got_w), (want, want_w) in zip(_outputs(loaded), _outputs(unfrozen), strict=True):
        assert torch.equal(got, want)
        assert (got_w is None and want_w is None) or torch.equal(got_w, want_w)


def test_fp32_and_bf16_copies_of_one_bundle(bundle_dir: Path) -> None:
    fp32 = load_bundle(bundle_dir, dtype=torch.float32).module
    bf16 = load_bundle(bundle_dir, dtype=torch.bfloat16).module
    (h32, w32), _ = _outputs(fp32)
    (h16, w16), _ = _outputs(bf16)
    assert h32.dtype == torch.float32 and h16.dtype == torch.bfloat16 and w16.dtype == torch.float32
    assert 0 < rel_err(h16, h32) <= RELATIVE_ERROR_BOUND["bfloat16"]
    (again, _), _ = _outputs(fp32)  # loading the bf16 copy did not disturb the fp32 one
    assert torch.equal(again, h32)


def test_corrupted_model_is_refused_with_both_hashes(bundle_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "corrupt"
    copy.mkdir()
    (copy / MANIFEST_FILE).write_bytes((bundle_dir / MANIFEST_FILE).read_bytes())
    data = bytearray((bundle_dir / MODEL_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / MODEL_FILE).write_bytes(bytes(data))
    expected, actual = read_manifest(bundle_dir).sha256, file_sha256(copy / MODEL_FILE)
    with pytest.raises(BundleError, match=rf"model\.pt failed its checksum: manifest sha256 {expected}, "
                                          rf"file sha256 {actual}"):
        load_bundle(copy)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: (d / MANIFEST_FILE).unlink(), r"manifest\.json not found: not a model bundle directory"),
        (lambda d: (d / MANIFEST_FILE).write_text("{oops"), r"manifest\.json is not readable JSON"),
        (lambda d: (d / MODEL_FILE).unlink(), r"model\.pt not found"),
        (lambda d: _edit_manifest(d, sha256=None), r"missing keys \['sha256'\]"),
        (lambda d: _edit_manifest(d, format_version=2), r"format_version 2 is not supported"),
        (lambda d: _edit_manifest(d, validated_precisions=["int8"]), r"validated_precisions must list"),
        (lambda d: _edit_manifest(d, config={"d_model": 33}), r"d_model=33 must be divisible by n_heads=4"),
        (lambda d: _edit_manifest(d, extra=1), r"unknown keys \['extra'\]"),
        (lambda d: _edit_manifest(d, quantization_ranges=[0, 1]), r"quantization_ranges must be an object"),
        (lambda d: _edit_manifest(d, quantization_ranges={"min": [0.0] * 3, "max": [1.0] * 3}),
         r"quantization_ranges\.min must list 1 or d_model \(32\)"),
        (lambda d: _edit_manifest(d, quantization_ranges={"min": [0.0], "max": [float("nan")]}),
         r"quantization_ranges\.max must list"),
        (lambda d: _edit_manifest(d, quantization_ranges={"min": [1.0], "max": [1.0]}), r"min < max"),
    ],
)
def test_bad_bundles_are_refused(bundle_dir: Path, tmp_path: Path, mutate, match: str) -> None:  # noqa: ANN001
    for name in (MANIFEST_FILE, MODEL_FILE):
        (tmp_path / name).write_bytes((bundle_dir / name).read_bytes())
    mutate(tmp_path)
    with pytest.raises(BundleError, match=match):
        load_bundle(tmp_path)


def test_calibration_ranges_are_optional_and_round_trip(bundle_dir: Path, tmp_path: Path) -> None:
    assert "quantization_ranges" not in read_manifest(bundle_dir).to_dict()  # absent unless stated
    for name in (MANIFEST_FILE, MODEL_FILE):
        (tmp_path / name).write_bytes((bundle_dir / name).read_bytes())
    low, high = [-0.5 + i / 100 for i in range(32)], [0.5] * 32
    _edit_manifest(tmp_path, quantization_ranges={"min": low, "max": high})
    manifest = load_bundle(tmp_path).manifest
    assert manifest.quantization_ranges == (tuple(low), tuple(high))
    assert Manifest.from_dict(manifest.to_dict()) == manifest


def _edit_manifest(directory: Path, **changes: object) -> None:
    data = json.loads((directory / MANIFEST_FILE).read_text())
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    (directory / MANIFEST_FILE).write_text(json.dumps(data))


def test_save_refusals(eager: Encoder, bundle_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="already holds a bundle"):
        save_bundle(eager, bundle_dir, name="x", version="1", source="test")
    with pytest.raises(BundleError, match=r"float32 weights; the module has \['torch.bfloat16'\]"):
        save_bundle(Encoder(TINY).to(torch.bfloat16), tmp_path / "a", name="x", version="1", source="test")
    with pytest.raises(BundleError, match="no EncoderConfig `config` attribute"):
        save_bundle(torch.nn.Linear(2, 2), tmp_path / "b", name="x", version="1", source="test")
    with pytest.raises(BundleError, match="dtype must be one of"):
        load_bundle(bundle_dir, dtype=torch.int8)


class _Drifting(torch.nn.Module):
    """Scripted, it computes something slightly different from eager: export must notice."""

    __jit_ignored_attributes__ = ["config"]

    def __init__(self) -> None:
        super().__init__()
        self.config = TINY
        self.inner = Encoder(TINY)

    def forward(self, token_ids: Optional[torch.Tensor], embeddings: Optional[torch.Tensor], lengths: torch.Tensor,
                causal: bool, attn_layers: List[int]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        hidden, weights = self.inner(token_ids, embeddings, lengths, causal, attn_layers)
        if torch.jit.is_scripting():
            hidden = hidden + 1e-3
        return hidden, weights


def test_export_check_catches_script_drift(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"scripted model differs from the eager one by 0\.001"):
        save_bundle(_Drifting(), tmp_path, name="x", version="1", source="test")
    assert os.listdir(tmp_path) == [], "a failed export leaves nothing behind"


def test_seeded_weights_are_pinned() -> None:
    assert weights_sha256(Encoder(TINY).init_weights(0)) == TINY_SEED0_WEIGHTS_SHA256


def test_default_bundle_is_deterministic_from_the_seed(default_dir: Path, tmp_path: Path) -> None:
    first = read_manifest(default_dir)
    again = build_default_bundle(tmp_path / "b", seed=0)
    other = build_default_bundle(tmp_path / "c", seed=1)
    assert first.name == "attention-reference" and first.version == "1" and first.source == "seed:0"
    assert first.config == REFERENCE and first.validated_precisions[:2] == ("float32", "bfloat16")
    assert again.weights_sha256 == first.weights_sha256 != other.weights_sha256
    assert again.sha256 == first.sha256 != other.sha256  # the file too, not only the weights
    a, b = load_bundle(default_dir).module, load_bundle(tmp_path / "b").module
    for (x, xw), (y, yw) in zip(_outputs(a, REFERENCE), _outputs(b, REFERENCE), strict=True):
        assert torch.equal(x, y)
        assert (xw is None and yw is None) or torch.equal(xw, yw)


def test_default_bundle_is_one_file_in_every_process(tmp_path: Path) -> None:
    """Identical replicas report one checksum: `python -m model default` in two processes whose string
    hashes differ (PYTHONHASHSEED; it once ordered TorchScript's constants) writes the same model.pt.
    (Not compared with a bundle built in this process: scripting other configs first mangles class names.)"""
    built = []
    for hash_seed in ("1", "2"):
        result = subprocess.run([sys.executable, "-m", "model", "default", "--out", str(tmp_path / hash_seed)],
                                capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
                                env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert result.returncode == 0, result.stderr
        built.append(json.loads(result.stdout)["sha256"])
        assert file_sha256(tmp_path / hash_seed / MODEL_FILE) == built[-1]
    assert built[0] == built[1]


def test_save_refuses_non_finite_weights(tmp_path: Path) -> None:
    module = Encoder(TINY).init_weights(0)
    with torch.no_grad():
        module.blocks[1].ff.fc2.weight[3, 4] = float("inf")
    with pytest.raises(BundleError, match=r"\['blocks\.1\.ff\.fc2\.weight'\] hold non-finite values"):
        save_bundle(module, tmp_path / "b", name="x", version="1", source="test")
    assert not (tmp_path / "b").exists()


def test_ensure_default_bundle_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_build = default_mod.build_default_bundle

    def counting_build(directory: Path, seed: int = 0) -> Manifest:
        calls.append(seed)
        return real_build(directory, seed)

    monkeypatch.setattr(default_mod, "build_default_bundle", counting_build)
    path = ensure_default_bundle(tmp_path / "cache")
    assert path == tmp_path / "cache" / f"attention-reference-v1-seed0-{code_id()}" and calls == [0]
    assert ensure_default_bundle(tmp_path / "cache") == path and calls == [0]
    assert sorted(os.listdir(tmp_path / "cache")) == [path.name], "no temporary directory left behind"
    assert load_bundle(path).manifest.source == "seed:0"


def test_ensure_default_bundle_loses_a_race_gracefully(default_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    final = cache / f"attention-reference-v1-seed0-{code_id()}"

    def racing_build(directory: Path, seed: int = 0) -> Manifest:
        # Another process finishes first, while we are still building.
        final.mkdir(parents=True)
        for name in (MANIFEST_FILE, MODEL_FILE):
            (final / name).write_bytes((default_dir / name).read_bytes())
            (Path(directory) / name).write_bytes(b"ours")
        return read_manifest(default_dir)

    monkeypatch.setattr(default_mod, "build_default_bundle", racing_build)
    assert ensure_default_bundle(cache) == final
    assert sorted(os.listdir(cache)) == [final.name]
    assert load_bundle(final).manifest == read_manifest(default_dir)


def test_cli_default_and_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["default", "--out", str(tmp_path / "d"), "--seed", "3"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["source"] == "seed:3" and built["config"] == REFERENCE.to_dict()
    assert main(["info", str(tmp_path / "d")]) == 0
    assert json.loads(capsys.readouterr().out) == built
    assert main(["info", str(tmp_path / "nowhere")]) == 1
    assert "manifest.json not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "convert" in capsys.readouterr().out


def test_bundle_loads_with_torch_alone(bundle_dir: Path, tmp_path: Path) -> None:
    """A fresh interpreter outside the repository (no `model` package) loads and runs the bundle."""
    script = (
        "import json, sys, torch\n"
        "d = sys.argv[1]\n"
        "m = json.load(open(d + '/manifest.json'))\n"
        "mod = torch.jit.load(d + '/model.pt').eval()\n"
        "h, w = mod(torch.ones(2, 5, dtype=torch.long), None, torch.tensor([5, 2]), False, [0])\n"
        "print(m['name'], tuple(h.shape), tuple(w.shape))\n"
        "import importlib.util; print(importlib.util.find_spec('model') is None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script, str(bundle_dir)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
    assert out[:2] == ["tiny (2, 5, 32) (2, 1, 4, 5, 5)", "True"]


def _copy_bundle(bundle_dir: Path, to: Path) -> Path:
    to.mkdir()
    for name in (MANIFEST_FILE, MODEL_FILE):
        (to / name).write_bytes((bundle_dir / name).read_bytes())
    return to


@pytest.mark.parametrize(
    ("field", "value", "module_value"),
    [
        ("n_layers", 1, 2), ("n_heads", 1, 4), ("vocab_size", 200, 100), ("vocab_size", 50, 100),
        ("max_length", 128, 64), ("d_model", 64, 32), ("d_ff", 128, 64), ("positional", "learned", "sinusoidal"),
        ("positional", "none", "sinusoidal"), ("norm_first", False, True), ("activation", "relu", "gelu"),
        ("final_norm", False, True), ("layer_norm_eps", 1e-6, 1e-5),
    ],
)
def test_a_manifest_that_misstates_the_config_is_refused_by_name(
        bundle_dir: Path, tmp_path: Path, field: str, value: object, module_value: object) -> None:
    """Issue 16 item 3: the shape facts come from the module itself, whatever the manifest says."""
    copy = _copy_bundle(bundle_dir, tmp_path / "b")
    config = json.loads((copy / MANIFEST_FILE).read_text())["config"]
    _edit_manifest(copy, config={**config, field: value})
    with pytest.raises(BundleError, match=rf"does not match its manifest: config\.{field} is {value!r} in the "
                                          rf"manifest, {module_value!r} in the module"):
        load_bundle(copy)


def test_a_changed_weight_with_a_recomputed_file_checksum_is_refused(bundle_dir: Path, tmp_path: Path) -> None:
    """Issue 16 item 7: weights_sha256 is verified at load, not only recorded."""
    copy = _copy_bundle(bundle_dir, tmp_path / "b")
    module = torch.jit.load(str(copy / MODEL_FILE))
    with torch.no_grad():
        getattr(module.blocks, "1").ff.fc2.weight[3, 5] += 0.25
    torch.jit.save(module, str(copy / MODEL_FILE))
    _edit_manifest(copy, sha256=None)
    _edit_manifest(copy, sha256=file_sha256(copy / MODEL_FILE))  # the file checksum now passes
    recorded = read_manifest(copy).weights_sha256
    with pytest.raises(BundleError, match=rf"failed its weights check: manifest weights_sha256 {recorded}, "
                                          r"module weights_sha256 [0-9a-f]{64}; the weights were changed"):
        load_bundle(copy)
    for dtype in ("float32", "bfloat16"):  # the service's second load (the fp32 retry copy) is checked too
        assert load_bundle(bundle_dir, dtype=dtype).manifest.weights_sha256 == recorded


def test_a_changed_sinusoidal_table_is_refused(bundle_dir: Path, tmp_path: Path) -> None:
    """The sinusoidal table is a buffer (outside weights_sha256): it must be exactly the one the config derives."""
    copy = _copy_bundle(bundle_dir, tmp_path / "b")
    module = torch.jit.load(str(copy / MODEL_FILE))
    module.pos_emb[10, 0] += 1e-3
    torch.jit.save(module, str(copy / MODEL_FILE))
    _edit_manifest(copy, sha256=file_sha256(copy / MODEL_FILE))
    with pytest.raises(BundleError, match="sinusoidal position table is not the one its config derives"):
        load_bundle(copy)


class _Misdeclared(torch.nn.Module):
    """Says TINY (4 heads) but holds a 2-head encoder: scripted equals eager, so only the facts check sees it."""

    __jit_ignored_attributes__ = ["config"]

    def __init__(self) -> None:
        super().__init__()
        self.config = TINY
        self.inner = Encoder(tiny(n_heads=2)).init_weights(0)

    def forward(self, token_ids: Optional[torch.Tensor], embeddings: Optional[torch.Tensor], lengths: torch.Tensor,
                causal: bool, attn_layers: List[int]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.inner(token_ids, embeddings, lengths, causal, attn_layers)


def test_export_refuses_a_module_whose_config_attribute_lies(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"config\.n_heads is 4 in the manifest, 2 in the module"):
        save_bundle(_Misdeclared(), tmp_path, name="x", version="1", source="test")
    assert os.listdir(tmp_path) == [], "a failed export leaves nothing behind"
