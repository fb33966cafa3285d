"""The pooled vector's output stage (service/vectors.py): the same bits as sentence-transformers'
`quantize_embeddings` on its own float vectors (committed references, bench/st_vectors_reference.py),
Matryoshka cuts equal to truncate_dim's, and every bad option refused naming its field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.errors import InvalidInput
from service.plan import Names
from service.vectors import Vectors, plan_vectors
from tests.support.vectors_reference import PRECISIONS, VectorsReference, assert_quantized_like, load_vectors_reference

FIELDS = Names().vector_fields()


@pytest.fixture(scope="module")
def ref() -> VectorsReference:
    return load_vectors_reference()


def vectors(d_model: int, *, dimensions: int | None = None, quantization: str = "none",
            ranges: tuple[list[float], list[float]] | None = None, normalize: bool = True,
            model_ranges: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> Vectors:
    v = plan_vectors(dimensions=dimensions, quantization=quantization, ranges=ranges, pooled=True, normalize=normalize,
                     d_model=d_model, model_ranges=model_ranges, fields=FIELDS)
    assert v is not None
    return v


def test_quantized_equals_sentence_transformers_on_its_own_vectors(ref: VectorsReference) -> None:
    checked = 0
    for d in ref.dims:
        floats = ref.arrays[f"float_{d}"]
        for p in PRECISIONS:
            ranges = ref.ranges(d) if p in ("int8", "uint8") else None
            stage = vectors(d, quantization=p, ranges=ranges)
            got = np.stack([stage.apply(row) for row in floats])
            want = ref.arrays[f"{p}_{d}"]
            assert got.dtype == want.dtype and np.array_equal(got, want), (p, d)
            assert got.shape[1] == (math.ceil(d / 8) if "binary" in p else d) == stage.width
            checked += got.size
        for p in ("int8", "uint8"):  # one (min, max) pair for every dimension; values past it clipped
            stage = vectors(d, quantization=p, ranges=([ref.pair[0]], [ref.pair[1]]))
            got = np.stack([stage.apply(row) for row in floats])
            assert np.array_equal(got, ref.arrays[f"{p}_{d}_pair"]), (p, d)
            assert {0, 255} & set(np.unique(got.astype(np.int32) + (128 if p == "int8" else 0)).tolist())
    assert checked > 4000


def test_synthetic_values_zeros_clipping_and_padded_bits(ref: VectorsReference) -> None:
    floats, r = ref.arrays["synthetic"], ref.arrays["synthetic_ranges"]
    for p in PRECISIONS:
        stage = vectors(37, quantization=p, ranges=(r[0].tolist(), r[1].tolist()) if p.endswith("int8") else None)
        got = np.stack([stage.apply(row) for row in floats])
        assert np.array_equal(got, ref.arrays[f"{p}_synthetic"]) and got.dtype == ref.arrays[f"{p}_synthetic"].dtype


def test_dimensions_cut_then_normalise_equals_truncate_dim(ref: VectorsReference) -> None:
    full = ref.arrays["float_384"]
    for d in ref.dims[1:]:
        stage = vectors(384, dimensions=d)
        assert stage.cut and stage.normalize
        got = np.stack([stage.apply(row) for row in full])
        np.testing.assert_allclose(got, ref.arrays[f"float_{d}"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
        # Then quantized, as sentence-transformers quantizes its cut vectors.
        for p in PRECISIONS:
            ranges = ref.ranges(d) if p.endswith("int8") else None
            q = np.stack([vectors(384, dimensions=d, quantization=p, ranges=ranges).apply(row) for row in full])
            assert_quantized_like(q, ref.arrays[f"{p}_{d}"], ref.arrays[f"float_{d}"], p,
                                  ref.arrays[f"ranges_{d}"] if ranges else None)
    raw = np.arange(1, 9, dtype=np.float32)
    assert np.array_equal(vectors(8, dimensions=3, normalize=False).apply(raw), raw[:3])  # cut only
    assert vectors(8, dimensions=8).cut is False  # the full width: the runner's vector as it is


def test_the_model_ranges_serve_a_call_that_sends_none(ref: VectorsReference) -> None:
    low, high = ref.ranges(384)
    stage = vectors(384, dimensions=100, quantization="uint8", model_ranges=(tuple(low), tuple(high)))
    assert stage.starts is not None and stage.starts.shape == (100,)  # the manifest's first 100
    np.testing.assert_array_equal(stage.starts, np.asarray(low[:100], np.float32))
    assert plan_vectors(dimensions=None, quantization="none", ranges=None, pooled=True, normalize=True, d_model=8,
                        model_ranges=None, fields=FIELDS) is None  # the common call: nothing to do


@pytest.mark.parametrize(("options", "field", "words"), [
    ({"dimensions": 0}, "output.dimensions", "1..8"),
    ({"dimensions": -1}, "output.dimensions", "1..8"),
    ({"dimensions": 9}, "output.dimensions", "1..8"),
    ({"dimensions": 4, "pooled": False}, "output.dimensions", "pooling"),
    ({"quantization": "int4"}, "output.quantization", "one of"),
    ({"quantization": "binary", "pooled": False}, "output.quantization", "pooling"),
    ({"quantization": "int8"}, "output.quantization_ranges", "calibration ranges"),
    ({"quantization": "binary", "ranges": ([0.0], [1.0])}, "output.quantization_ranges", "int8 and uint8"),
    ({"quantization": "int8", "ranges": ([0.0] * 3, [1.0] * 3)}, "output.quantization_ranges.min", "1 or 8"),
    ({"quantization": "int8", "ranges": ([0.0], [1.0, 2.0])}, "output.quantization_ranges.max", "1 or 8"),
    ({"quantization": "int8", "ranges": ([0.0] * 8, [1.0])}, "output.quantization_ranges.max", "as many"),
    ({"quantization": "uint8", "ranges": ([0.5], [0.5])}, "output.quantization_ranges.max[0]", "greater"),
    ({"quantization": "uint8", "ranges": ([0.0, 2.0] + [0.0] * 6, [1.0] * 8)}, "output.quantization_ranges.max[1]",
     "greater"),
    ({"quantization": "int8", "ranges": ([math.nan], [1.0])}, "output.quantization_ranges.min[0]", "finite"),
    ({"quantization": "int8", "ranges": ([0.0], [math.inf])}, "output.quantization_ranges.max[0]", "finite"),
    ({"quantization": "int8", "ranges": ([0.0], [1e39])}, "output.quantization_ranges.max[0]", "float32"),
])
def test_bad_options_are_refused_naming_the_field(options: dict[str, object], field: str, words: str) -> None:
    kwargs: dict[str, object] = {"dimensions": None, "quantization": "none", "ranges": None, "pooled": True,
                                 "normalize": True, "d_model": 8, "model_ranges": None, "fields": FIELDS, **options}
    with pytest.raises(InvalidInput) as info:
        plan_vectors(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field and words in info.value.description, info.value
