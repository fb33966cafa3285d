"""The output stage of a pooled vector: Matryoshka `dimensions`, then quantization, door-neutral (numpy only).

The order is sentence-transformers' (`SentenceTransformer.encode`): the model's vector, cut to its first
n values (`truncate_dim`), L2-normalised when normalisation is on (`normalize_embeddings`; F.normalize:
x / max(|x|, 1e-12)), then quantized (`quantize_embeddings`). The runner pools (and normalises the full
width) on the device; a call that cuts its vectors leaves the normalising to this stage, so a cut vector
is normalised once, over the values it keeps.

Quantization, as `sentence_transformers.util.quantize_embeddings` computes it, in float32:
  int8 / uint8: steps = (max - min) / 255 per dimension (0 -> 1); q = clip(floor((v - min) / steps), 0, 255);
                uint8 is q, int8 is q - 128;
  binary / ubinary: numpy.packbits(v > 0) (ceil(n / 8) bytes, the last padded with zero bits); binary is
                that minus 128 as int8.
tests/service/test_vectors.py holds it to references made by sentence-transformers itself
(bench/st_vectors_reference.py wrote tests/data/st_vectors_reference.*).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.errors import InvalidInput

QUANTIZATIONS = ("none", "int8", "uint8", "binary", "ubinary")
SCALAR = ("int8", "uint8")  # need calibration ranges
Ranges = tuple[tuple[float, ...], tuple[float, ...]]  # (min, max): one pair per dimension, or one for all
AnyRanges = tuple[Sequence[float], Sequence[float]]
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # NaN fails `<=` too


@dataclass(frozen=True)
class Vectors:
    """What the output stage does to each pooled vector: keep the first `dimensions` values (and then
    renormalise, `normalize`), then `quantization` (with `starts`/`steps` for int8/uint8)."""

    dimensions: int
    cut: bool  # dimensions < d_model
    normalize: bool  # renormalise after the cut (the runner normalised nothing)
    quantization: str = "none"
    starts: np.ndarray | None = None  # float32 [dimensions] or [1]
    steps: np.ndarray | None = None

    @property
    def dtype(self) -> str | None:
        """The vector's numpy dtype once quantized ("int8" | "uint8"); None: float, the call's output dtype."""
        if self.quantization == "none":
            return None
        return "int8" if self.quantization in ("int8", "binary") else "uint8"

    @property
    def width(self) -> int:
        """Values in the vector sent: the dimensions, or their bytes of packed bits."""
        return (self.dimensions + 7) // 8 if self.quantization in ("binary", "ubinary") else self.dimensions

    def quantize(self, vectors: np.ndarray) -> np.ndarray:
        """Token vectors (float32 [n, dim]) as the call asked: packed bits each (binary, ubinary), else as they
        are (the cut and the scalar kinds are the pooled vector's; the plan refuses them for token vectors)."""
        q = self.quantization
        if q not in ("binary", "ubinary"):
            return vectors
        bits: np.ndarray = np.packbits(vectors > 0, axis=-1)  # (n, ceil(dim / 8))
        return bits if q == "ubinary" else (bits - 128).astype(np.int8)

    def apply(self, pooled: np.ndarray) -> np.ndarray:
        """One pooled vector (float32 [d_model]) as the call asked for it."""
        v = pooled
        if self.cut:
            v = np.ascontiguousarray(v[: self.dimensions], np.float32)
            if self.normalize:
                v = v / max(float(np.linalg.norm(v)), 1e-12)
        q = self.quantization
        if q == "none":
            return v
        if q in ("binary", "ubinary"):
            bits: np.ndarray = np.packbits(v > 0, axis=-1)
            return bits if q == "ubinary" else (bits - 128).astype(np.int8)
        assert self.starts is not None and self.steps is not None
        buckets: np.ndarray = np.clip(np.floor((v.astype(np.float32, copy=False) - self.starts) / self.steps), 0, 255)
        return buckets.astype(np.uint8) if q == "uint8" else (buckets - 128).astype(np.int8)


def plan_vectors(*, dimensions: int | None, quantization: str, ranges: AnyRanges | None, pooled: bool, normalize: bool,
                 d_model: int, model_ranges: Ranges | None, fields: VectorFields,
                 token_vectors: bool = False) -> Vectors | None:
    """The call's `Vectors`, every option checked (INVALID_ARGUMENT naming `fields`); None when it asks
    for the pooled vector as computed (the common call). `token_vectors`: the call asks for a late-interaction
    model's token vectors too, which binary and ubinary quantize as well."""
    if quantization not in QUANTIZATIONS:
        raise InvalidInput(fields.quantization, f"must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not 1 <= dimensions <= d_model:
            raise InvalidInput(fields.dimensions, f"must be in 1..{d_model} (the model's width); got {dimensions}")
        if not pooled:
            raise InvalidInput(fields.dimensions, "cuts the pooled vector: ask for pooling")
    if quantization != "none" and not pooled and not (token_vectors and quantization not in SCALAR):
        raise InvalidInput(fields.quantization, "quantizes the pooled vector: ask for pooling")
    if ranges is not None and quantization not in SCALAR:
        raise InvalidInput(fields.ranges, f"calibration ranges apply to int8 and uint8 only; the call asks "
                           f"{quantization}")
    if dimensions is None and quantization == "none":
        return None
    n = d_model if dimensions is None else dimensions
    cut = n < d_model
    starts = steps = None
    if quantization in SCALAR:
        if ranges is None:
            if model_ranges is None:
                raise InvalidInput(fields.ranges, f"{quantization} needs calibration ranges (the min and max of each "
                                   "dimension): the model states none, so the call must send them")
            starts, steps = _buckets(model_ranges, n, fields.ranges_min, fields.ranges_max, stated=d_model)
        else:
            starts, steps = _buckets(ranges, n, fields.ranges_min, fields.ranges_max, stated=d_model)
    return Vectors(n, cut, normalize and cut, quantization, starts, steps)


@dataclass(frozen=True)
class VectorFields:
    """A door's names for these options, as INVALID_ARGUMENT names them."""

    dimensions: str
    quantization: str
    ranges: str
    ranges_min: str
    ranges_max: str


def check_ranges(ranges: AnyRanges, widths: Sequence[int], min_field: str,
                 max_field: str) -> Ranges:
    """Ranges as floats, checked: equal lengths among `widths` (1 = one pair for every dimension), finite
    (as float32), min < max. A bundle's manifest and a call's request are checked alike."""
    lows, highs = ranges
    for field, values in ((min_field, lows), (max_field, highs)):
        if len(values) not in widths:
            allowed = " or ".join(str(w) for w in sorted(set(widths)))
            raise InvalidInput(field, f"must hold {allowed} values (one for all dimensions, or one per dimension); "
                               f"got {len(values)}")
        for j, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int | float) or not abs(value) <= _FLOAT32_MAX:
                raise InvalidInput(f"{field}[{j}]", f"must be a finite float32; got {value!r}")
    if len(lows) != len(highs):
        raise InvalidInput(max_field, f"must hold as many values as {min_field} ({len(lows)}); got {len(highs)}")
    low32, high32 = np.asarray(lows, np.float32), np.asarray(highs, np.float32)
    bad = np.flatnonzero(low32 >= high32)
    if len(bad):
        j = int(bad[0])
        raise InvalidInput(f"{max_field}[{j}]", f"must be greater than {min_field}[{j}] (as float32); got min "
                           f"{float(low32[j])!r} and max {float(high32[j])!r}")
    return tuple(float(x) for x in lows), tuple(float(x) for x in highs)


def _buckets(ranges: AnyRanges, n: int, min_field: str, max_field: str, stated: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, steps) for `n` dimensions: ranges of 1, n or `stated` (d_model: the first n kept) values."""
    lows, highs = check_ranges(ranges, (1, n, stated), min_field, max_field)
    width = len(lows) if len(lows) in (1, n) else n
    bounds = np.asarray([lows[:width], highs[:width]], np.float32)  # (2, n or 1): sentence-transformers' ranges
    starts = bounds[0, :]
    steps = (bounds[1, :] - starts) / 255
    steps = np.where(steps == 0, 1, steps).astype(np.float32)
    return starts, steps
