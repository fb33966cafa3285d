"""What OpenAI's and TEI's embedding routes share: their inputs (a text, texts, token ids, or lists of token
ids), the call they make of them (`pooled_ask`, `pooled`), the plan's field names as those bodies name them
(`input[2]`, not `sequences[2].text`), and the size of a JSON response (service/plan.py checks it against
max_message_bytes before any compute).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.doors.calls import Ran
from service.errors import EmptyInput, InvalidInput
from service.jobs import ModelSpec
from service.plan import Ask, Names, Plan, Sizes

Inputs = list[str] | list[np.ndarray]
_INT64 = (-(2**63), 2**63 - 1)


def decode_inputs(value: object, field: str, *, max_inputs: int, max_ids: int,
                  too_many: type[InvalidInput] = InvalidInput) -> Inputs:
    """A string, an array of strings, an array of token ids, or an array of arrays of token ids. The counts
    are checked before anything is converted: at most `max_inputs` sequences (`too_many`, naming `field`,
    else) and `max_ids` ids in all."""
    shape = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and not value:
        raise EmptyInput(field, "cannot be empty")
    if not isinstance(value, list):
        raise InvalidInput(field, f"must be {shape}")
    if len(value) > max(max_inputs, max_ids):  # too many for either form: nothing of it is looked at
        raise too_many(field, f"batch size {len(value)} > maximum allowed batch size {max_inputs}")
    if all(isinstance(v, str) for v in value):
        if len(value) > max_inputs:
            raise too_many(field, f"batch size {len(value)} > maximum allowed batch size {max_inputs}")
        return list(value)
    if all(_is_int(v) for v in value):
        _check_ids(len(value), max_ids, field)
        return [_ids(value, field)]
    if all(isinstance(v, list) for v in value):
        if len(value) > max_inputs:
            raise too_many(field, f"batch size {len(value)} > maximum allowed batch size {max_inputs}")
        _check_ids(sum(len(v) for v in value), max_ids, field)
        return [_ids(v, f"{field}[{i}]") for i, v in enumerate(value)]
    raise InvalidInput(field, f"must be {shape}; got a mixed array")


def _check_ids(count: int, max_ids: int, field: str) -> None:
    if count > max_ids:
        raise InvalidInput(field, f"{count} token ids in all; at most {max_ids} per call")


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


def names(field: str) -> Names:
    """The plan's field names as an HTTP body names them: `input[2]`, `input[2][5]`, `prompt_name`."""
    return Names(sequences=field, sequence=field + "[{i}]", element="{sequence}[{j}]", texts=field,
                 output="body", pooling="pooling", normalize="normalize", dtype="dtype",
                 prompt_name="prompt_name", long_inputs="truncate", chunk_stride="truncate", dimensions="dimensions")


# Bytes one float32 takes as JSON text (the longest repr of a float32 as a double, and a comma).
JSON_FLOAT = 26


def json_size(plan: Plan, spec: ModelSpec) -> Sizes:
    """An upper bound on the JSON response of `plan` (vectors or token embeddings as float text,
    base64 being shorter), for max_message_bytes."""
    pooled = plan.pooled_size(spec.d_model)[0]
    values = sum((job.length * spec.d_model if job.return_hidden else 0) + (pooled if job.pooling else 0)
                 + ((len(job.vector_rows) if job.vector_rows is not None else job.length) * spec.vector_dim
                    if job.vectors else 0)
                 for job in plan.sequences)
    # A sparse vector (/embed_sparse): at most one {"index": ..., "value": ...} per vocabulary entry.
    entries = spec.vocab_size * sum(job.head == "sparse" for job in plan.sequences)
    return Sizes(0, values * JSON_FLOAT + entries * (JSON_FLOAT + 24) + 64 * len(plan.sequences) + 256)



def pooled_ask(spec: ModelSpec, inputs: Sequence[str | np.ndarray], *, normalize: bool | None,
               truncate: bool = False, side: str | None = None, prompt_name: str = "", hidden: bool = False,
               dimensions: int | None = None, sparse: bool = False) -> Ask:
    """An embedding route's call: each sequence's pooled vector (a text bundle's own pooling, else mean; cut
    to `dimensions`), or its hidden states (`hidden`), or its SPLADE vector (`sparse`); a long one cut on
    `side` with `truncate` (None: the model's side)."""
    if sparse:
        return Ask(inputs=inputs, return_hidden=False, truncate=truncate, truncation_side=side,
                   prompt_name=prompt_name, sparse=(0, 0.0))
    return Ask(inputs=inputs, return_hidden=hidden, normalize=None if hidden else normalize,
               pooling="none" if hidden else "model" if spec.tokenizer is not None else "mean",
               truncate=truncate, truncation_side=side, prompt_name=prompt_name, dimensions=dimensions)


def pooled(ran: Ran) -> list[np.ndarray]:
    """Each sequence's pooled vector, or its hidden states when the call asked for those."""
    hidden = ran.plan.jobs[0].return_hidden
    arrays = [out.hidden if hidden else out.pooled for out in ran.outputs]
    assert all(a is not None for a in arrays), "an output asked for is missing. This is a bug."
    return [np.ascontiguousarray(a) for a in arrays if a is not None]  # orjson writes contiguous arrays only
