"""Opt-in (make test-mpnet; skipped until `make fetch-mpnet` has unpacked it into .cache): the real
all-mpnet-base-v2 converted with convert-hf, against transformers' MPNetModel on the same folder with
sentence-transformers' pipeline for it (its modules.json: Transformer, mean Pooling, Normalize; max_seq_length
384): token ids equal to its tokenizer's, hidden states within 1e-4, embeddings cosine >= 0.99999, on the
committed texts (tests/data/minilm_reference.json), all in one padded batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.fetch_mpnet import FOLDER, checked
from model.__main__ import main
from model.bundle import load_bundle
from tests.support import family_helpers  # noqa: F401  (HF_HUB_OFFLINE=1 before transformers is imported)

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / FOLDER


@pytest.fixture(scope="module")
def mpnet_dir() -> Path:
    if not checked(MODEL_DIR):
        pytest.skip(f"{MODEL_DIR} is not there (or not the pinned files): `make fetch-mpnet` fetches it")
    return MODEL_DIR


@pytest.mark.timeout(1200)  # a 110M-parameter model converted, exported and run on CPU
def test_all_mpnet_base_v2_matches_transformers(mpnet_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, MPNetModel

    texts = json.loads((ROOT / "tests" / "data" / "minilm_reference.json").read_text(encoding="utf-8"))["texts"]
    assert main(["convert-hf", "--model-dir", str(mpnet_dir), "--out", str(tmp_path / "b")]) == 0
    loaded = load_bundle(tmp_path / "b")
    assert loaded.tokenizer is not None and loaded.manifest.text is not None
    assert (loaded.manifest.text.max_tokens, loaded.manifest.text.pooling, loaded.manifest.text.normalize) == (
        384, "mean", True)
    want_ids = AutoTokenizer.from_pretrained(str(mpnet_dir))(texts, truncation=True, max_length=384)["input_ids"]
    encoded = loaded.tokenizer.encode(texts, truncate=True)
    assert [e.ids.tolist() for e in encoded] == want_ids
    model = MPNetModel.from_pretrained(str(mpnet_dir), attn_implementation="eager").eval()
    lengths = torch.tensor([len(r) for r in want_ids])
    ids = torch.full((len(texts), int(lengths.max())), 1, dtype=torch.int64)
    for b, row in enumerate(want_ids):
        ids[b, :len(row)] = torch.tensor(row)
    with torch.inference_mode():
        ours, _ = loaded.module(ids, None, lengths, False, [])
        worst_hidden, worst_cos = 0.0, 1.0
        for b, row in enumerate(want_ids):
            ref = model(input_ids=torch.tensor([row])).last_hidden_state[0]  # one text per forward, as ST's batch of 1
            got = ours[b, :len(row)]
            worst_hidden = max(worst_hidden, float((got - ref).abs().max()))
            cos = float(F.normalize(got.mean(dim=0), dim=0) @ F.normalize(ref.mean(dim=0), dim=0))
            worst_cos = min(worst_cos, cos)
    print(f"all-mpnet-base-v2: {len(texts)} texts, hidden max |d| {worst_hidden:.3g}, min cosine {worst_cos:.9f}")
    assert worst_hidden <= 1e-4 and worst_cos >= 0.99999, (worst_hidden, worst_cos)
