"""A Hugging Face model folder served directly: converted once (model/hf.py, what `convert-hf` runs) into the
bundle cache, then reused.

`prepare_model(path, cache_dir)` is what the service calls with its `--model`: a bundle directory (one with
manifest.json) is used as it is; a folder with config.json and no manifest.json is a Hugging Face folder,
converted into cache_dir/hf-{folder name}-{key}, where the key is a sha256 of the files the converter reads
(config.json and the other JSON files, the weights file it picks) and of the converter's own code and the
torch version, so a second start with the same folder reuses the bundle and a changed file or an upgrade
converts again. Built in a temporary sibling and renamed into place (model/bundle.py build_atomically): a
reader never sees half a bundle, and two processes racing end up with one. The key is taken again after
the conversion: a folder that changed meanwhile (a copy still being written, a file replaced) would leave
a bundle of some mix of old and new files under the old files' key, so that bundle is dropped and the
folder converted again under its new key; a folder still changing after CONVERT_TRIES conversions is
refused by name. Nothing here logs: the result
says what was done (and, for a folder without tokenizer.json, that the bundle takes token ids only), and
the service logs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.bundle import MANIFEST_FILE, Manifest, build_atomically, read_manifest, save_bundle
from model.default import ensure_default_bundle
from model.encoder import Encoder
from model.hf import HFConversionError, convert_hf, ids_only_note, load_hf_weights
from model.hf_heads import HeadConversionError, convert_heads
from model.hf_late import M3_FILES, LateConversionError, LateModel, layout_of, read_late
from model.text import TextSettings

CONFIG_FILE = "config.json"
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")  # the order model/hf.py load_hf_weights prefers
_MODEL_CODE = Path(__file__).resolve().parent
CONVERT_TRIES = 3  # conversions of a folder that changes under them before it is refused


class _FolderChanged(Exception):
    """The folder's key after a conversion is not the one before it (a file changed meanwhile)."""


@dataclass(frozen=True)
class PreparedModel:
    """The bundle to load, and how it came to be: "default" (the seeded default bundle), "bundle" (given as
    one), "converted" (from the Hugging Face folder `source`, now), or "reused" (converted by an earlier
    start)."""

    bundle_dir: Path
    source: Path
    action: str
    ids_only: bool = False  # converted from a folder without tokenizer.json: token ids and embeddings only

    def note(self) -> str | None:
        """One line for the log, or None for a bundle given as one (and the default bundle)."""
        if self.action == "converted":
            note = f"converted Hugging Face folder {self.source} into {self.bundle_dir}"
        elif self.action == "reused":
            note = f"reusing converted bundle {self.bundle_dir} for Hugging Face folder {self.source}"
        else:
            return None
        return f"{note}; {ids_only_note(self.source)}" if self.ids_only else note


def is_hf_folder(path: str | os.PathLike[str]) -> bool:
    """A directory with a Hugging Face config.json and no manifest.json (not a bundle)."""
    path = Path(path)
    return path.is_dir() and not (path / MANIFEST_FILE).exists() and (path / CONFIG_FILE).is_file()


def convert_hf_folder(model_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, name: str = "",
                      version: str = "1") -> Manifest:
    """`python -m model convert-hf`: the folder as a text bundle in `out` (name: the folder's, by default)."""
    encoder, tokenizer, settings, source = convert_hf(model_dir)
    late = read_late_heads(model_dir, encoder, tokenizer, settings)
    if late is not None:  # ColBERT (PyLate, stanford) or BGE-M3: their heads and query/document settings
        tasks, heads, settings = late.tasks, late.heads, late.settings
    else:
        tasks, heads = read_heads(model_dir, encoder.config.d_model)
    text = None if tokenizer is None or settings is None else (tokenizer, settings)  # None: no tokenizer.json
    return save_bundle(encoder, out, name=name or Path(model_dir).resolve().name, version=version, source=source,
                       text=text, tasks=tasks, heads=heads)


def read_heads(model_dir: str | os.PathLike[str], d_model: int) -> tuple[dict[str, dict[str, Any]] | None,
                                                                          dict[str, nn.Module]]:
    """The folder's task heads (model/hf_heads.py), from config.json's architectures and the weights."""
    config = json.loads((Path(model_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    heads = ("ForSequenceClassification", "ForMaskedLM")
    if not any(str(a).endswith(heads) for a in config.get("architectures") or []):
        return None, {}
    state_dict, path = load_hf_weights(model_dir)
    try:
        return convert_heads(config, state_dict, d_model, str(path))
    except HeadConversionError as e:
        raise HFConversionError(str(e)) from None


def read_late_heads(model_dir: str | os.PathLike[str], encoder: Encoder, tokenizer: bytes | None,
                    settings: TextSettings | None) -> LateModel | None:
    """A late-interaction folder's heads and text settings (model/hf_late.py); None for any other folder."""
    config = json.loads((Path(model_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    if layout_of(model_dir, config) is None:
        return None
    state_dict, _ = load_hf_weights(model_dir)
    try:
        return read_late(model_dir, encoder.config, state_dict, tokenizer, settings)
    except LateConversionError as e:
        raise HFConversionError(str(e)) from None


def folder_key(model_dir: str | os.PathLike[str]) -> str:
    """sha256 (hex) over the folder's JSON files and the weights file the converter reads (names and bytes),
    the converter's code (model/**/*.py, the key maps) and the torch version that scripts the bundle."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(f"torch {torch.__version__}\n".encode())
    for path in sorted(p for p in _MODEL_CODE.rglob("*") if p.suffix in (".py", ".json") and p.is_file()):
        digest.update(f"code {path.relative_to(_MODEL_CODE).as_posix()}\n".encode())
        digest.update(path.read_bytes())
    weights = next((model_dir / n for n in WEIGHTS_FILES if (model_dir / n).is_file()), None)
    # The JSON files (modules' configs too), a stanford ColBERT's artifact.metadata, BGE-M3's two head files and a
    # PyLate Dense module's weights: what the converters read.
    inputs = [p for p in model_dir.rglob("*") if p.is_file() and (
        p.suffix in (".json", ".metadata") or p.name in M3_FILES or (p.parent != model_dir and p.name in WEIGHTS_FILES))
        and not any(part.startswith(".") for part in p.relative_to(model_dir).parts)]
    for path in sorted(inputs + ([weights] if weights is not None else [])):
        digest.update(f"file {path.relative_to(model_dir).as_posix()}\n".encode())
        with path.open("rb") as f:  # streamed: weights run to gigabytes
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def prepare_model(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str], *,
                  convert: Callable[[Path, Path], object] = convert_hf_folder) -> PreparedModel:
    """The bundle directory to serve for `--model path` (see the module docstring); no path ("") is the
    seeded default bundle, built into cache_dir once (model/default.py). A folder that is neither a bundle
    nor a Hugging Face folder is returned as given, for load_bundle to refuse by name. `convert(folder, out)`
    is convert_hf_folder (a test wraps it to change the folder while it runs)."""
    if not path:
        return PreparedModel(ensure_default_bundle(cache_dir), Path(), "default")
    path = Path(path)
    if not is_hf_folder(path):
        return PreparedModel(path, path, "bundle")
    safe_name = re.sub(r"[^A-Za-z0-9._-]+", "_", path.resolve().name)[:64] or "model"
    for _ in range(CONVERT_TRIES):
        key = folder_key(path)
        final = Path(cache_dir) / f"hf-{safe_name}-{key[:16]}"
        if (final / MANIFEST_FILE).is_file():
            return PreparedModel(final, path, "reused", read_manifest(final).text is None)

        def build(tmp: Path, key: str = key) -> None:
            convert(path, tmp)
            if folder_key(path) != key:  # raised before the rename: the mixed bundle is removed with tmp
                raise _FolderChanged

        try:
            built = build_atomically(final, build)
        except _FolderChanged:
            continue
        return PreparedModel(final, path, "converted" if built else "reused", read_manifest(final).text is None)
    raise HFConversionError(f"{path} changed while it was being converted, {CONVERT_TRIES} times in a row (its "
                            f"files' sha256 differed before and after each conversion); serve it once it is "
                            f"complete (copy it elsewhere, then move it into place)")
