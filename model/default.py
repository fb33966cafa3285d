"""The default model: the REFERENCE encoder with weights from a seed, so a fresh machine can serve at once."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import model.config
import model.encoder
from model.bundle import MANIFEST_FILE, Manifest, build_atomically, save_bundle
from model.config import REFERENCE
from model.encoder import Encoder

DEFAULT_NAME = "attention-reference"
DEFAULT_VERSION = "1"


def build_default_bundle(directory: str | os.PathLike[str], seed: int = 0) -> Manifest:
    """Build the REFERENCE bundle into `directory`. Same seed -> bit-identical weights, same weights_sha256."""
    module = Encoder(REFERENCE).init_weights(seed)
    return save_bundle(module, directory, name=DEFAULT_NAME, version=DEFAULT_VERSION, source=f"seed:{seed}")


def code_id() -> str:
    """A fingerprint of the code a default bundle scripts (model/encoder.py, model/config.py): after an
    upgrade that changes the model's code, a bundle cached by the old code is not reused."""
    digest = hashlib.sha256()
    for source in (model.encoder.__file__, model.config.__file__):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


def default_bundle_dir(cache_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Where `ensure_default_bundle` keeps it: cache_dir/attention-reference-v1-seed{seed}-{code_id()}."""
    return Path(cache_dir) / f"{DEFAULT_NAME}-v{DEFAULT_VERSION}-seed{seed}-{code_id()}"


def ensure_default_bundle(cache_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Return `default_bundle_dir(cache_dir, seed)`, building the bundle there first if it is not there.

    Built in a temporary sibling and renamed into place, so a reader never sees half a bundle and two
    processes racing both end up with one complete bundle.
    """
    final = default_bundle_dir(cache_dir, seed)
    if not (final / MANIFEST_FILE).is_file():
        build_atomically(final, lambda tmp: build_default_bundle(tmp, seed))
    return final
