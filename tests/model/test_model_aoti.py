"""The compiled artefact (model.pt2, model/aoti.py): what the manifest records, outputs equal to model.pt on shapes
other than the export's, and the refusals of a corrupt file, another torch, another dtype or device."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from model.__main__ import main
from model.bundle import (
    AOTI_FILE,
    MANIFEST_FILE,
    BundleError,
    file_sha256,
    load_bundle,
    load_compiled,
    read_manifest,
    save_bundle,
)
from model.encoder import Encoder
from tests.support.aoti_helpers import AOTI_CONFIG, AOTI_MAX_BATCH


def _copy(bundle: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(bundle, out)
    return out


def _edit_aoti(bundle: Path, **changes: object) -> None:
    path = bundle / MANIFEST_FILE
    data = json.loads(path.read_text())
    data["aoti"].update(changes)
    path.write_text(json.dumps(data))


def test_manifest_records_the_artefact(aoti_bundle: Path) -> None:
    aoti = read_manifest(aoti_bundle).aoti
    assert aoti is not None
    assert (aoti.file, aoti.dtype, aoti.device, aoti.torch) == (AOTI_FILE, "float32", "cpu", torch.__version__)
    assert (aoti.max_batch_size, aoti.max_length) == (AOTI_MAX_BATCH, AOTI_CONFIG.max_length)
    assert aoti.sha256 == file_sha256(aoti_bundle / AOTI_FILE)
    manifest = read_manifest(aoti_bundle)
    assert type(manifest).from_dict(manifest.to_dict()) == manifest


@pytest.mark.parametrize(("lengths", "width"), [
    ([1], 1), ([32] * 8, 32), ([7, 3, 1, 5, 2], 7), ([32, 31, 1], 32), ([5, 5, 5], 5), ([20, 9], 24),
])
def test_outputs_equal_torchscript_on_real_positions(aoti_bundle: Path, lengths: list[int], width: int) -> None:
    # Shapes other than the export's example (2 x 16): dynamic batch and length, padded rows and columns.
    scripted = load_bundle(aoti_bundle).module
    compiled = load_compiled(aoti_bundle, read_manifest(aoti_bundle), reference=scripted)
    g = torch.Generator().manual_seed(len(lengths) * 100 + width)
    ids = torch.randint(0, AOTI_CONFIG.vocab_size, (len(lengths), width), generator=g)
    lens = torch.tensor(lengths)
    assert compiled.covers(len(lengths), lens)
    got = compiled(ids, lens)
    with torch.inference_mode():
        want, _ = scripted(ids, None, lens, False, [])
    assert got.shape == want.shape and got.dtype == torch.float32
    real = torch.arange(width)[None, :] < lens[:, None]
    assert float((got - want).abs()[real].max()) <= 1e-5
    assert bool(torch.isfinite(got).all())


def test_covers_only_the_compiled_batch_sizes(aoti_bundle: Path) -> None:
    compiled = load_compiled(aoti_bundle, read_manifest(aoti_bundle))
    assert compiled.covers(AOTI_MAX_BATCH, torch.ones(AOTI_MAX_BATCH, dtype=torch.int64))
    assert not compiled.covers(AOTI_MAX_BATCH + 1, torch.ones(AOTI_MAX_BATCH + 1, dtype=torch.int64))
    assert not compiled.covers(2, torch.zeros(2, dtype=torch.int64))  # no real token: TorchScript's edge case


def test_corrupt_artefact_fails_its_checksum(aoti_bundle: Path, tmp_path: Path) -> None:
    bundle = _copy(aoti_bundle, tmp_path)
    data = bytearray((bundle / AOTI_FILE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bundle / AOTI_FILE).write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"model\.pt2 failed its checksum: manifest aoti\.sha256 [0-9a-f]{64}, file "
                                          r"sha256 [0-9a-f]{64}"):
        load_compiled(bundle, read_manifest(bundle))
    (bundle / AOTI_FILE).unlink()
    with pytest.raises(BundleError, match=r"model\.pt2 not found \(manifest\.aoti names it\)"):
        load_compiled(bundle, read_manifest(bundle))


def test_another_torch_version_is_refused(aoti_bundle: Path, tmp_path: Path) -> None:
    bundle = _copy(aoti_bundle, tmp_path)
    _edit_aoti(bundle, torch="2.0.0+cpu")
    this = re.escape(torch.__version__)
    with pytest.raises(BundleError, match=rf"compiled by torch 2\.0\.0\+cpu, this is torch {this}.*"
                                          r"recompile it with `python -m model compile-aoti"):
        load_compiled(bundle, read_manifest(bundle))


def test_another_dtype_or_device_is_refused(aoti_bundle: Path) -> None:
    manifest = read_manifest(aoti_bundle)
    with pytest.raises(BundleError, match="compiled for float32, the service serves bfloat16"):
        load_compiled(aoti_bundle, manifest, dtype=torch.bfloat16)
    assert manifest.aoti is not None
    cuda = dataclasses.replace(manifest, aoti=dataclasses.replace(manifest.aoti, device="cuda"))
    with pytest.raises(BundleError, match="compiled for cuda, the service runs on cpu"):
        load_compiled(aoti_bundle, cuda)


def test_a_bundle_without_the_artefact_says_how_to_build_it(tiny_bundle: Path) -> None:
    with pytest.raises(BundleError, match=r"has no compiled artefact \(manifest\.aoti\); build one with "
                                          r"`python -m model compile-aoti"):
        load_compiled(tiny_bundle, read_manifest(tiny_bundle))


def test_an_artefact_of_other_weights_fails_the_probe(aoti_bundle: Path, tmp_path: Path) -> None:
    # Another seed's bundle given this model.pt2 with a matching sha256: only the probe against model.pt can tell.
    other = tmp_path / "other"
    save_bundle(Encoder(AOTI_CONFIG).init_weights(1), other, name="tiny-aoti", version="1", source="seed:1")
    shutil.copy(aoti_bundle / AOTI_FILE, other / AOTI_FILE)
    data = json.loads((other / MANIFEST_FILE).read_text())
    data["aoti"] = read_manifest(aoti_bundle).to_dict()["aoti"]
    (other / MANIFEST_FILE).write_text(json.dumps(data))
    manifest = read_manifest(other)
    load_compiled(other, manifest)  # its own checks pass: the file is the one the manifest names
    with pytest.raises(BundleError, match=r"model\.pt2 does not agree with model\.pt"):
        load_compiled(other, manifest, reference=load_bundle(other).module)


@pytest.mark.parametrize(("change", "message"), [
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"file": "../model.pt2"}, "must name a file in the bundle directory"),
    ({"max_batch_size": 0}, "max_batch_size must be a positive integer"),
    ({"extra": 1}, r"unknown keys \['extra'\]"),
])
def test_malformed_aoti_entries_are_refused(aoti_bundle: Path, tmp_path: Path, change: dict[str, object],
                                            message: str) -> None:
    bundle = _copy(aoti_bundle, tmp_path)
    _edit_aoti(bundle, **change)
    with pytest.raises(BundleError, match=message):
        read_manifest(bundle)


def test_cli_refuses_what_it_cannot_compile(tmp_path: Path, fault_bundle: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile-aoti", str(tmp_path)]) == 1
    assert "manifest.json not found: not a model bundle directory" in capsys.readouterr().err
    assert main(["compile-aoti", str(fault_bundle)]) == 1
    assert "a fault bundle runs custom ops; it has no compiled form" in capsys.readouterr().err
