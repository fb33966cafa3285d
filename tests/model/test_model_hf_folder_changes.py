"""A Hugging Face folder that changes while `prepare_model` converts it (model/hf_folder.py): the bundle of
a mix of old and new files is not cached under the old files' key; the folder is converted again under its
new key, and one that keeps changing is refused by name with nothing left in the cache. The real converter
runs; the wrapper around it plays the writer that replaces a file while the conversion reads the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.bundle import read_manifest
from model.hf import HFConversionError
from model.hf_folder import CONVERT_TRIES, convert_hf_folder, folder_key, prepare_model
from tests.support.hf_helpers import write_tiny_bert


def _flip_pooling(folder: Path) -> str:
    """Replace 1_Pooling/config.json with the other pooling (mean <-> cls); the new pooling."""
    path = folder / "1_Pooling" / "config.json"
    pooling = json.loads(path.read_text())
    cls = not pooling["pooling_mode_cls_token"]
    path.write_text(json.dumps({**pooling, "pooling_mode_cls_token": cls, "pooling_mode_mean_tokens": not cls}))
    return "cls" if cls else "mean"


def test_a_folder_changed_during_its_conversion_is_converted_again_under_its_new_key(tmp_path: Path) -> None:
    folder = write_tiny_bert(tmp_path / "hf")
    cache = tmp_path / "cache"
    old_key = folder_key(folder)
    calls: list[str] = []

    def convert_while_a_writer_replaces_a_file(src: Path, out: Path) -> object:
        manifest = convert_hf_folder(src, out)  # read the old files
        if not calls:
            calls.append(_flip_pooling(src))  # ... and the folder changed before the conversion ended
        else:
            calls.append("again")
        return manifest

    prepared = prepare_model(folder, cache, convert=convert_while_a_writer_replaces_a_file)
    assert calls == ["cls", "again"]
    new_key = folder_key(folder)
    assert new_key != old_key and prepared.action == "converted"
    assert prepared.bundle_dir.name.endswith(new_key[:16])
    assert read_manifest(prepared.bundle_dir).text.pooling == "cls"  # type: ignore[union-attr]
    assert [p.name for p in cache.iterdir()] == [prepared.bundle_dir.name], "no bundle under the old key"
    # A later start with the folder as it now is reuses that bundle, converting nothing.
    again = prepare_model(folder, cache, convert=convert_while_a_writer_replaces_a_file)
    assert (again.action, again.bundle_dir, len(calls)) == ("reused", prepared.bundle_dir, 2)


def test_a_folder_that_keeps_changing_is_refused_and_nothing_is_cached(tmp_path: Path) -> None:
    folder = write_tiny_bert(tmp_path / "hf")
    cache = tmp_path / "cache"
    flips: list[str] = []

    def convert_while_a_writer_keeps_writing(src: Path, out: Path) -> object:
        manifest = convert_hf_folder(src, out)
        flips.append(_flip_pooling(src))
        return manifest

    with pytest.raises(HFConversionError, match=f"{folder} changed while it was being converted, "
                                                f"{CONVERT_TRIES} times in a row"):
        prepare_model(folder, cache, convert=convert_while_a_writer_keeps_writing)
    assert len(flips) == CONVERT_TRIES
    assert list(cache.iterdir()) == [], "no bundle and no temporary directory left in the cache"
