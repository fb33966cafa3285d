"""Late-interaction layouts through `convert-hf` (model/hf_late.py): what each bundle's manifest says (tasks,
text.multi_vector), the tokenizer's query / document encoding against the authors' token ids (committed,
tests/data/late_reference.json), the heads scripted, and each layout's missing pieces refused by name.
The vectors themselves are held to the references at the runner: tests/service/test_late_runner.py."""

from __future__ import annotations

import dataclasses
import json
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.bundle import load_bundle, read_manifest
from model.hf import HFConversionError
from model.hf_folder import convert_hf_folder, folder_key
from model.text import MultiVectorSettings, TextError, TextSettings
from tests.support import late_helpers as L

ROOT = Path(__file__).resolve().parents[2]
META = json.loads((L.DATA / "late_reference.json").read_text(encoding="utf-8"))


def test_pylate_manifest_and_tokens(tmp_path: Path) -> None:
    src = L.write_pylate(tmp_path / "hf")
    manifest = convert_hf_folder(src, tmp_path / "bundle")
    assert manifest.tasks is not None and set(manifest.tasks) == {"embed", "colbert"}
    assert manifest.tasks["colbert"]["dim"] == 16 and manifest.tasks["colbert"]["reduce"] == "sum"
    assert manifest.text is not None and manifest.text.multi_vector is not None
    multi = manifest.text.multi_vector
    vocab = L.LATE_VOCAB + L.PYLATE_PREFIXES
    assert (multi.query_marker, multi.document_marker) == (vocab.index("[Q] "), vocab.index("[D] "))
    assert (multi.query_length, multi.document_length, multi.expansion_id) == (10, 12, vocab.index("[MASK]"))
    assert not multi.attend_expansion and multi.first_vector == 0
    # PyLate's skip list: string.punctuation through convert_tokens_to_ids, the unknown ones as [UNK].
    assert list(multi.skip_ids) == META["pylate"]["skiplist"]
    # Round trip: the manifest on disk reads back the same settings; the tokenizer encodes as PyLate.
    assert read_manifest(tmp_path / "bundle").text == manifest.text
    tok = load_bundle(tmp_path / "bundle").tokenizer
    assert tok is not None
    assert [e.ids.tolist() for e in tok.encode(L.QUERIES, truncate=True, mode="query")] == META["pylate"]["query_ids"]
    docs = tok.encode(L.DOCUMENTS, truncate=True, mode="document")
    assert [e.ids.tolist() for e in docs] == META["pylate"]["document_ids"]
    # Cut to document_length (marker included); whole for the caller to refuse when not truncating.
    whole = tok.encode(L.DOCUMENTS[3:], truncate=False, mode="document")[0]
    assert whole.full_length == len(whole.ids) > 12 and docs[3].truncated and len(docs[3].ids) == 12
    # Plain encoding (embed) is unchanged by the multi-vector settings: no marker.
    assert tok.encode(["the cat"], truncate=True)[0].ids.tolist() == [2, 8, 9, 3]


def test_stanford_manifest_and_tokens(tmp_path: Path) -> None:
    manifest = convert_hf_folder(L.write_stanford(tmp_path / "hf"), tmp_path / "bundle")
    assert manifest.tasks is not None and manifest.tasks["colbert"]["reduce"] == "sum"
    multi = manifest.text.multi_vector if manifest.text is not None else None
    assert multi is not None
    assert (multi.query_marker, multi.document_marker) == (L.LATE_VOCAB.index("[unused0]"),
                                                           L.LATE_VOCAB.index("[unused1]"))
    # ColBERT's skip list: each punctuation symbol's first id, and the pad id its mask drops from documents.
    assert list(multi.skip_ids) == sorted({0, *META["stanford"]["skiplist"]})
    tok = load_bundle(tmp_path / "bundle").tokenizer
    assert tok is not None
    assert [e.ids.tolist() for e in tok.encode(L.QUERIES, truncate=True, mode="query")] == META["stanford"]["query_ids"]


def test_bge_m3_manifest(tmp_path: Path) -> None:
    manifest = convert_hf_folder(L.write_bge_m3(tmp_path / "hf"), tmp_path / "bundle")
    assert manifest.tasks is not None and set(manifest.tasks) == {"embed", "sparse", "colbert"}
    assert manifest.tasks["sparse"]["kind"] == "lexical" and manifest.tasks["colbert"]["reduce"] == "mean"
    text = manifest.text
    assert text is not None and text.pooling == "cls" and text.normalize
    assert text.multi_vector == MultiVectorSettings(query_length=38, document_length=38, first_vector=1)
    loaded = load_bundle(tmp_path / "bundle")
    assert sorted(loaded.heads) == ["colbert", "sparse"]
    assert loaded.heads["sparse"].excluded.tolist() == [0, 1, 2, 3]  # <s> <pad> </s> <unk>
    tok = loaded.tokenizer
    assert tok is not None
    enc = tok.encode(L.M3_QUERIES, truncate=True, mode="query")
    assert [e.ids.tolist() for e in enc] == META["bge_m3"]["query_ids"]
    assert all(e.vector_rows is not None and e.vector_rows.tolist() == list(range(1, len(e.ids))) for e in enc)


def test_settings_checks() -> None:
    with pytest.raises(TextError, match=r"text.multi_vector.query_length must be an int >= 2"):
        MultiVectorSettings(query_length=1, document_length=8)
    with pytest.raises(TextError, match=r"unknown text.multi_vector keys \['extra'\]"):
        TextSettings.from_dict({"tokenizer_sha256": "0" * 64, "max_tokens": 8,
                                "multi_vector": {"query_length": 8, "document_length": 8, "extra": 1}})
    plain = TextSettings(tokenizer_sha256="0" * 64, max_tokens=8)
    assert "multi_vector" not in plain.to_dict()  # other text bundles keep the key set older servers accept
    # An edge process gets the settings as JSON of dataclasses.asdict (service/multiproc/frames.py HELLO).
    late = TextSettings(tokenizer_sha256="0" * 64, max_tokens=8,
                        multi_vector=MultiVectorSettings(query_length=8, document_length=8, skip_ids=(5, 1)))
    assert TextSettings(**json.loads(json.dumps(dataclasses.asdict(late)))) == late


def _refused(src: Path, out: Path, *fragments: str) -> None:
    with pytest.raises(HFConversionError) as e:
        convert_hf_folder(src, out)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)
    assert not (out / "manifest.json").exists()


def test_refusals_name_the_missing_piece(tmp_path: Path) -> None:
    src = L.write_pylate(tmp_path / "a")
    (src / "2_Dense" / "model.safetensors").unlink()
    _refused(src, tmp_path / "a-out", "2_Dense: neither model.safetensors nor pytorch_model.bin")

    src = L.write_pylate(tmp_path / "b")
    cfg = json.loads((src / "config_sentence_transformers.json").read_text())
    (src / "config_sentence_transformers.json").write_text(json.dumps({**cfg, "query_prefix": "[QUERY] "}))
    _refused(src, tmp_path / "b-out", "query_prefix='[QUERY] ' is not a token of", "untrained embedding")

    src = L.write_pylate(tmp_path / "c")
    dense = json.loads((src / "1_Dense" / "config.json").read_text())
    (src / "1_Dense" / "config.json").write_text(json.dumps({**dense, "activation_function": "torch.nn.ReLU"}))
    _refused(src, tmp_path / "c-out", "activation_function='torch.nn.ReLU'")

    src = L.write_stanford(tmp_path / "d", metadata={"similarity": "l2"})
    _refused(src, tmp_path / "d-out", "artifact.metadata: similarity='l2'")

    src = L.write_bge_m3(tmp_path / "e")
    (src / "sparse_linear.pt").unlink()
    _refused(src, tmp_path / "e-out", "sparse_linear.pt not found", "colbert_linear.pt is there")


def test_stanford_without_its_projection_refused_by_the_cli(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = L.write_stanford(tmp_path / "hf")
    state = load_file(str(src / "model.safetensors"))
    del state["linear.weight"]
    save_file(state, str(src / "model.safetensors"))
    result = subprocess.run([sys.executable, "-m", "model", "convert-hf", "--model-dir", str(src), "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and "without 'linear.weight'" in result.stderr


def test_folder_key_covers_the_head_files(tmp_path: Path) -> None:
    """Serving a folder directly reconverts when BGE-M3's head files or a Dense module's weights change."""
    m3 = L.write_bge_m3(tmp_path / "m3")
    before = folder_key(m3)
    torch.save({"weight": torch.zeros(1, 32), "bias": torch.zeros(1)}, m3 / "sparse_linear.pt")
    assert folder_key(m3) != before
    pylate = L.write_pylate(tmp_path / "pylate")
    before = folder_key(pylate)
    from safetensors.torch import save_file

    save_file({"linear.weight": torch.zeros(16, 24)}, str(pylate / "2_Dense" / "model.safetensors"))
    assert folder_key(pylate) != before


def test_punctuation_default_is_pylates() -> None:
    from model.hf_late import _PYLATE

    assert _PYLATE["skiplist_words"] == list(string.punctuation)
