"""The compiled-backend test bundle: one small encoder with its model.pt2 (model/aoti.py), compiled once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.aoti import compile_aoti
from model.bundle import save_bundle
from model.config import EncoderConfig
from model.encoder import Encoder

# Small enough that the C++ compile stays well under a minute on a loaded 2-core machine.
AOTI_CONFIG = EncoderConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=100, max_length=32)
AOTI_MAX_BATCH = 8


@pytest.fixture(scope="session")
def aoti_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A d_model 32, 2-layer bundle (max_length 32) with model.pt2 for batches of up to 8, fp32 on cpu."""
    path = tmp_path_factory.mktemp("bundles") / "aoti"
    save_bundle(Encoder(AOTI_CONFIG).init_weights(0), path, name="tiny-aoti", version="1", source="seed:0")
    compile_aoti(path, max_batch_size=AOTI_MAX_BATCH)
    return path
