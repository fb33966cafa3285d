"""The inputs OpenAI's and TEI's embedding routes share (a text, texts, token ids, or lists of token
ids), and the one adapter from a decoded call to the attention.v1 path that computes it.

`encode_request` is the smallest bridge to service/validation.py (an EncodeRequest the gRPC door
would have sent); the door-neutral plan (service/plan.py) replaces it. Errors name the fields as the
HTTP body names them (`input[2]`, not `sequences[2].text`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import to_tensor
from service.errors import InvalidInput

Inputs = list[str] | list[np.ndarray]
_INT64 = (-(2**63), 2**63 - 1)
_SEQUENCE = re.compile(r"^sequences(\[(\d+)\])?(\.\w+)?")


def decode_inputs(value: object, field: str) -> Inputs:
    """A string, an array of strings, an array of token ids, or an array of arrays of token ids."""
    shape = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidInput(field, f"must be {shape} (not empty)")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(_is_int(v) for v in value):
        return [_ids(value, field)]
    if all(isinstance(v, list) for v in value):
        return [_ids(v, f"{field}[{i}]") for i, v in enumerate(value)]
    raise InvalidInput(field, f"must be {shape}; got a mixed array")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values: list[object], field: str) -> np.ndarray:
    if not values:
        raise InvalidInput(field, "holds no token ids")
    for j, v in enumerate(values):
        if not _is_int(v):
            raise InvalidInput(f"{field}[{j}]", "must be an integer token id")
        if not _INT64[0] <= v <= _INT64[1]:  # type: ignore[operator]
            raise InvalidInput(f"{field}[{j}]", "is out of range")
    return np.asarray(values, np.int64)


def encode_request(inputs: Inputs, *, pooling: int, normalize: bool | None, return_hidden: bool = False,
                   truncate: bool = False, prompt_name: str = "", return_tokens: bool = False) -> pb.EncodeRequest:
    """The attention.v1 request for a decoded call."""
    sequences = [pb.Sequence(text=x) if isinstance(x, str) else pb.Sequence(token_ids=to_tensor(x)) for x in inputs]
    output = pb.OutputOptions(return_hidden=return_hidden, pooling=pooling,  # type: ignore[arg-type]
                              return_tokens=return_tokens)
    if normalize is not None:
        output.normalize = normalize
    if prompt_name:
        output.prompt_name = prompt_name
    return pb.EncodeRequest(sequences=sequences, output=output, truncate=truncate)


def rename_sequences(field: str, name: str) -> str:
    """`sequences[2].text` -> `input[2]`; `sequences` -> `input`; `output.prompt_name` -> `prompt_name`."""
    match = _SEQUENCE.match(field)
    if match is not None:
        index = f"[{match.group(2)}]" if match.group(2) is not None else ""
        return name + index + field[match.end():]
    if field.startswith("output."):
        return field[len("output."):]
    return field


def dimensions(vectors: Sequence[np.ndarray], dims: int | None) -> list[np.ndarray]:
    """Matryoshka truncation: the first `dims` values of each vector, renormalised to unit length."""
    if dims is None:
        return list(vectors)
    out = []
    for v in vectors:
        cut = np.asarray(v[:dims], np.float32)
        norm = float(np.linalg.norm(cut))
        out.append(cut / norm if norm > 0 else cut)
    return out
