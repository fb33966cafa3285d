"""tests/data/st_vectors_reference.*: sentence-transformers' own truncate_dim vectors and quantize_embeddings
outputs for all-MiniLM-L6-v2 (bench/st_vectors_reference.py wrote them), and the check that allows a
quantized value to differ only where the float it came from sits on a bucket's edge."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from tests.support.hf_helpers import DATA, MINILM_SHA256

PRECISIONS = ("int8", "uint8", "binary", "ubinary")


@dataclass(frozen=True)
class VectorsReference:
    queries: list[str]
    dims: list[int]
    pair: tuple[float, float]
    arrays: dict[str, np.ndarray]

    def ranges(self, d: int) -> tuple[list[float], list[float]]:
        r = self.arrays[f"ranges_{d}"]
        return r[0].tolist(), r[1].tolist()


def load_vectors_reference() -> VectorsReference:
    meta = json.loads((DATA / "st_vectors_reference.json").read_text(encoding="utf-8"))
    assert meta["sha256"] == MINILM_SHA256, "the references were made from other files"
    with np.load(DATA / "st_vectors_reference.npz") as npz:
        arrays = {name: npz[name] for name in npz.files}
    return VectorsReference(meta["queries"], meta["dims"], tuple(meta["pair"]), arrays)


def assert_quantized_like(got: np.ndarray, want: np.ndarray, floats: np.ndarray, precision: str,
                          ranges: np.ndarray | None, tol: float = 1e-5) -> None:
    """`got` (our server's, from its own float vectors) equals `want` (sentence-transformers', from
    `floats`) except where a float lies within `tol` (the model's float difference between the two) of
    a bucket edge (int8/uint8) or of 0 (binary), and there by one bucket or one bit only."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if precision in ("binary", "ubinary"):
        differ = np.unpackbits(got.view(np.uint8), axis=-1) != np.unpackbits(want.view(np.uint8), axis=-1)
        near = np.zeros_like(differ)
        near[..., : floats.shape[-1]] = np.abs(floats) < tol
    else:
        assert ranges is not None
        starts = ranges[0].astype(np.float32)
        steps = ((ranges[1] - starts) / 255).astype(np.float32)
        position = (floats - starts) / steps  # buckets from the start: an integer is an edge
        near = np.abs(position - np.round(position)) < tol / steps
        differ = got.astype(np.int32) != want.astype(np.int32)
        assert (np.abs(got.astype(np.int32) - want.astype(np.int32)) <= 1).all()
    assert not (differ & ~near).any(), f"{int((differ & ~near).sum())} values differ away from a bucket edge"
