"""Whether a call's results fit the dtype they are sent in, checked before the response is built.

The runner guarantees finite float32 results; FLOAT16 (largest finite 65504) and, at the very top
of the float32 range, BFLOAT16 can still turn a finite value into Inf when it is cast for the wire.
Such a result is refused with INVALID_ARGUMENT naming the dtype field, the largest magnitude and the
dtype's limit (`OutputOverflow`, counted as attention_failures_total{reason="output_overflow"}):
the caller asked for a dtype that cannot hold the answer, and FLOAT32 (or BFLOAT16) can. Never sent
as Inf. Checked only for the fields whose dtype is 16-bit, so FLOAT32 calls pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.errors import OutputOverflow
from service.jobs import Output

# The smallest magnitude that rounds to Inf (round to nearest even): the largest finite value plus
# half a unit in its last place. FLOAT16: 65504 + 16; BFLOAT16: 0x7F7F0000 + 2**119 (0x7F7F8000).
_OVERFLOWS_AT: dict[str, float] = {
    "float16": 65520.0, "bfloat16": float(np.uint32(0x7F7F8000).view(np.float32)),
}
_LIMIT_TEXT: dict[str, str] = {"float16": "65504", "bfloat16": "3.39e+38"}
_ADVICE: dict[str, str] = {"float16": "FLOAT32 or BFLOAT16", "bfloat16": "FLOAT32"}


def check_representable(outputs: Sequence[Output], output_dtype: str, attention_dtype: str,
                         fields: tuple[str, str] = ("output.dtype", "attention.dtype")) -> None:
    """Raise `OutputOverflow` when a value of `outputs` would be Inf in the dtype it is sent in
    (float32 | float16 | bfloat16); `fields` name the two dtype options in the door's terms."""
    if output_dtype in _OVERFLOWS_AT:
        arrays = [a for o in outputs for a in (o.hidden, o.pooled, o.vectors) if a is not None and a.dtype.kind == "f"]
        _check(fields[0], arrays, output_dtype)
    if attention_dtype in _OVERFLOWS_AT:  # softmax weights lie in [0, 1]: kept for models of other kinds
        _check(fields[1], [o.attention for o in outputs if o.attention is not None], attention_dtype)


def check_arrays(field: str, arrays: list[np.ndarray], dtype: str) -> None:
    """The same check for one output named `field` (the KServe v2 front door names its tensors)."""
    if dtype in _OVERFLOWS_AT:
        _check(field, arrays, dtype)


def _check(field: str, arrays: list[np.ndarray], dtype: str) -> None:
    # max and -min rather than abs().max(): no temporary copy of a large output.
    largest = max((max(float(a.max()), -float(a.min())) for a in arrays if a.size), default=0.0)
    if largest >= _OVERFLOWS_AT[dtype]:
        name = dtype.upper()
        raise OutputOverflow(field, f"{name} cannot hold this result: its largest magnitude is {largest:.4g}, "
                                    f"{name}'s limit is {_LIMIT_TEXT[dtype]}; ask for {_ADVICE[dtype]}")
