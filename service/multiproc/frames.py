"""The frames between an edge process and the model process: a fixed header, then a body of fixed
structs and raw array bytes (JSON only for the rare, small parts: the model's description and errors).
Nothing from the socket is unpickled.

    header   <IBQ   body length, kind, call id
    HELLO    model -> edge   JSON (each model's ModelSpec without its tokenizer, aliases, per-call settings and
                             text settings; the default; the model workers), then each tokenizer.json's bytes
    READY    edge -> model   JSON {"pid"}: serving
    SUBMIT   edge -> model   <dHH25s deadline (time.monotonic, system-wide on Linux), jobs, the model's index
                             in HELLO's list, the call's trace context (service/tracing.py `packed`: trace id,
                             span id, flags; zeros when the call is not traced); then each job
    CANCEL   edge -> model   the call's caller is gone: drop its queued jobs
    RESULT   model -> edge   one job's Done: <HddIIB index, queue_s, compute_s, batch size, padded length,
                             fp32 re-run; then hidden, pooled, attention, head scores, token vectors (arrays, each
                             may be absent)
    ERROR    model -> edge   <i index (-1: every job of the call), then the ServiceError as JSON
    DRAIN    model -> edge   <d grace: stop as the service does on SIGTERM
    BYE      edge -> model   JSON: the edge's own call ledger, as it exits
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
from typing import Any

import numpy as np

from model.text import TextSettings, TextTokenizer
from service import errors
from service.batching import Done
from service.errors import ModelFailure, ServiceError
from service.jobs import Job, ModelSpec, Output

HEADER = struct.Struct("<IBQ")
HELLO, READY, SUBMIT, CANCEL, RESULT, ERROR, DRAIN, BYE = range(1, 9)
_SUBMIT = struct.Struct("<dHH25s")  # deadline, jobs, the model (its index in HELLO's list), trace context
_JOB = struct.Struct("<BBHBI")  # flags, pooling, attention layers, head (an index of _HEADS), attend
_HEADS = ("", "classify", "rerank", "sparse")
_RESULT = struct.Struct("<HddIIB")
_ERROR = struct.Struct("<i")
_DRAIN = struct.Struct("<d")
_ARRAY = struct.Struct("<BB")  # dtype code (0: absent), dims
_DTYPES = (np.dtype("<f4"), np.dtype("<i8"), np.dtype("<f2"), np.dtype("<i4"), np.dtype("<f8"))
_IDS, _EMBEDDINGS, _CAUSAL, _HEADS_MEAN, _HIDDEN, _NORMALIZE, _VECTORS = (1 << i for i in range(7))


# What SUBMIT and RESULT carry of a Job, an Output and a Done: a field added there must be added here
# too (tests/service/test_multiproc.py holds these to the dataclasses, so none is dropped silently).
JOB_FIELDS = frozenset({"token_ids", "embeddings", "causal", "attn_layers", "heads_mean", "pooling",
                        "return_hidden", "normalize", "head", "token_types", "vectors", "vector_rows", "attend"})
OUTPUT_FIELDS = frozenset({"hidden", "pooled", "attention", "fp32_rerun", "scores", "vectors"})
DONE_FIELDS = frozenset({"output", "queue_s", "compute_s", "batch_size", "padded_length"})


class FrameError(Exception):
    """A frame that breaks the format or its size bound: the connection is closed."""


def max_frame(max_message_bytes: int) -> int:
    """The largest frame body: a request's or a response's arrays in float32 (up to 2x a float16
    message) and their headers."""
    return 2 * max_message_bytes + (1 << 20)


def frame(kind: int, call: int, *parts: bytes) -> bytes:
    return b"".join((HEADER.pack(sum(len(p) for p in parts), kind, call), *parts))


async def read_frame(reader: asyncio.StreamReader, limit: int) -> tuple[int, int, memoryview]:
    """(kind, call id, body); raises asyncio.IncompleteReadError at EOF, FrameError on a bad frame."""
    length, kind, call = HEADER.unpack(await reader.readexactly(HEADER.size))
    if length > limit or not HELLO <= kind <= BYE:
        raise FrameError(f"frame kind {kind} of {length} bytes (bound {limit})")
    return kind, call, memoryview(await reader.readexactly(length))


# -- arrays --------------------------------------------------------------------------------------

def _array(a: np.ndarray | None) -> list[bytes]:
    if a is None:
        return [_ARRAY.pack(0, 0)]
    a = np.ascontiguousarray(a)
    code = _DTYPES.index(a.dtype.newbyteorder("<") if a.dtype.byteorder == "=" else a.dtype) + 1
    return [_ARRAY.pack(code, a.ndim), struct.pack(f"<{a.ndim}I", *a.shape), a.tobytes()]


def _read_array(body: memoryview, at: int, copy: bool) -> tuple[np.ndarray | None, int]:
    code, ndim = _ARRAY.unpack_from(body, at)
    at += _ARRAY.size
    if code == 0:
        return None, at
    if code > len(_DTYPES):
        raise FrameError(f"array dtype code {code}")
    shape = struct.unpack_from(f"<{ndim}I", body, at)
    at += 4 * ndim
    dtype = _DTYPES[code - 1]
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if at + size > len(body):
        raise FrameError("array past the end of its frame")
    a = np.frombuffer(body[at:at + size], dtype=dtype).reshape(shape)
    return (a.copy() if copy else a), at + size


# -- jobs ------------------------------------------------------------------------------------------

def submit(call: int, deadline: float, jobs: list[Job], model: int = 0, trace: bytes = b"") -> bytes:
    """A call's jobs for the model at index `model`, and its trace context (25 bytes, or b"": none)."""
    parts = [_SUBMIT.pack(deadline, len(jobs), model, trace)]
    for job in jobs:
        flags = ((_IDS if job.token_ids is not None else 0) | (_EMBEDDINGS if job.embeddings is not None else 0)
                 | (_CAUSAL if job.causal else 0) | (_HEADS_MEAN if job.heads_mean else 0)
                 | (_HIDDEN if job.return_hidden else 0) | (_NORMALIZE if job.normalize else 0)
                 | (_VECTORS if job.vectors else 0))
        parts += [_JOB.pack(flags, job.pooling, len(job.attn_layers), _HEADS.index(job.head), job.attend),
                  struct.pack(f"<{len(job.attn_layers)}H", *job.attn_layers)]
        parts += _array(job.token_ids) + _array(job.embeddings) + _array(job.token_types) + _array(job.vector_rows)
    return frame(SUBMIT, call, *parts)


def read_submit(body: memoryview) -> tuple[float, list[Job], int, bytes]:
    """(deadline, jobs, model index, trace context: 25 bytes, zeros for none)."""
    deadline, count, model, trace = _SUBMIT.unpack_from(body, 0)
    at = _SUBMIT.size
    jobs = []
    for _ in range(count):
        flags, pooling, layers, head, attend = _JOB.unpack_from(body, at)
        at += _JOB.size
        if head >= len(_HEADS):
            raise FrameError(f"head code {head}")
        attn_layers = struct.unpack_from(f"<{layers}H", body, at)
        at += 2 * layers
        # Copied: the runner hands them to torch, which wants writable arrays.
        ids, at = _read_array(body, at, copy=True)
        embeddings, at = _read_array(body, at, copy=True)
        types, at = _read_array(body, at, copy=True)
        rows, at = _read_array(body, at, copy=True)
        if (ids is None) == (embeddings is None):
            raise FrameError("a job needs token ids or embeddings")
        jobs.append(Job(ids, embeddings, causal=bool(flags & _CAUSAL), attn_layers=tuple(attn_layers),
                        heads_mean=bool(flags & _HEADS_MEAN), pooling=pooling,
                        return_hidden=bool(flags & _HIDDEN), normalize=bool(flags & _NORMALIZE),
                        head=_HEADS[head], token_types=types, vectors=bool(flags & _VECTORS), vector_rows=rows,
                        attend=attend))
    return deadline, jobs, model, trace


# -- outcomes --------------------------------------------------------------------------------------

def result(call: int, index: int, done: Done) -> bytes:
    out: Output = done.output
    return frame(RESULT, call, _RESULT.pack(index, done.queue_s, done.compute_s, done.batch_size,
                                            done.padded_length, out.fp32_rerun),
                 *_array(out.hidden), *_array(out.pooled), *_array(out.attention), *_array(out.scores),
                 *_array(out.vectors))


def read_result(body: memoryview) -> tuple[int, Done]:
    index, queue_s, compute_s, size, padded, rerun = _RESULT.unpack_from(body, 0)
    at = _RESULT.size
    hidden, at = _read_array(body, at, copy=False)
    pooled, at = _read_array(body, at, copy=False)
    attention, at = _read_array(body, at, copy=False)
    scores, at = _read_array(body, at, copy=False)
    vectors, at = _read_array(body, at, copy=False)
    return index, Done(Output(hidden, pooled, attention, bool(rerun), scores, vectors), queue_s, compute_s, size,
                       padded)


_EXTRAS = ("field", "description", "retry_after_s", "ref")
_ERRORS = {cls.__name__: cls for cls in vars(errors).values()
           if isinstance(cls, type) and issubclass(cls, ServiceError)}


def error(call: int, index: int, exc: ServiceError) -> bytes:
    data = {"type": type(exc).__name__, "message": exc.message,
            **{name: getattr(exc, name) for name in _EXTRAS if hasattr(exc, name)}}
    return frame(ERROR, call, _ERROR.pack(index), json.dumps(data).encode())


def read_error(body: memoryview) -> tuple[int, ServiceError]:
    """The same ServiceError subclass, message and details the model process raised."""
    (index,) = _ERROR.unpack_from(body, 0)
    data = json.loads(bytes(body[_ERROR.size:]))
    cls = _ERRORS.get(data.get("type"))
    if cls is None:
        return index, ModelFailure("internal error")
    exc = cls.__new__(cls)
    Exception.__init__(exc, data["message"])
    exc.message = str(data["message"])
    for name in _EXTRAS:
        if name in data:
            setattr(exc, name, data[name])
    return index, exc


def drain(grace: float) -> bytes:
    return frame(DRAIN, 0, _DRAIN.pack(grace))


def read_drain(body: memoryview) -> float:
    grace: float = _DRAIN.unpack_from(body, 0)[0]
    return grace


# -- the model's description ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Served:
    """One model as a HELLO describes it to an edge: its spec (its tokenizer rebuilt from the bytes sent), the
    other names it answers to and its own per-call settings (service/config.py MODEL_SETTINGS)."""

    spec: ModelSpec
    aliases: tuple[str, ...] = ()
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


def hello(models: list[Served], default: str, workers: int, auth_tokens: str = "") -> bytes:
    """Every model the model process serves (the index of each in this list is what SUBMIT names), the default
    one's name, the model workers and the bearer tokens. `auth_tokens` (ServiceConfig.auth_tokens) travel here,
    over the private socket, and are never written to a file."""
    described, tokenizers = [], []
    for model in models:
        spec = model.spec
        data: dict[str, Any] = {"spec": {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                                         if f.name != "tokenizer"}, "text": None, "tokenizer_bytes": 0,
                                "aliases": list(model.aliases), "settings": model.settings}
        if spec.tokenizer is not None:
            data["text"] = dataclasses.asdict(spec.tokenizer.settings)
            data["tokenizer_bytes"] = len(spec.tokenizer.data)
            tokenizers.append(spec.tokenizer.data)
        described.append(data)
    encoded = json.dumps({"models": described, "default": default, "workers": workers,
                          "auth_tokens": auth_tokens}).encode()
    return frame(HELLO, 0, struct.pack("<I", len(encoded)), encoded, *tokenizers)


def read_hello(body: memoryview) -> tuple[list[Served], str, int, str]:
    """The models (in the order SUBMIT indexes them), the default one's name, the model workers and the bearer
    tokens (comma-separated) of a HELLO."""
    (length,) = struct.unpack_from("<I", body, 0)
    data = json.loads(bytes(body[4:4 + length]))
    at, models = 4 + length, []
    for described in data["models"]:
        tokenizer = None
        if described["text"] is not None:
            size = int(described["tokenizer_bytes"])
            tokenizer = TextTokenizer(bytes(body[at:at + size]), TextSettings(**described["text"]),
                                      source="the model process's tokenizer")
            at += size
        spec = described["spec"]
        for key in ("batch_curve", "compared_curve"):  # JSON keys are strings
            spec[key] = {int(tokens): rate for tokens, rate in spec.get(key, {}).items()}
        if spec.get("quantization_ranges") is not None:  # JSON made the tuples lists
            spec["quantization_ranges"] = tuple(tuple(values) for values in spec["quantization_ranges"])
        for key in ("tasks", "labels"):  # JSON lists
            if key in spec:
                spec[key] = tuple(spec[key])
        models.append(Served(ModelSpec(**spec, tokenizer=tokenizer), tuple(described["aliases"]),
                             dict(described["settings"])))
    return models, str(data["default"]), int(data["workers"]), str(data["auth_tokens"])


def message(kind: int, data: dict[str, Any]) -> bytes:
    """READY and BYE: a small JSON object."""
    return frame(kind, 0, json.dumps(data).encode())


def read_message(body: memoryview) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(bytes(body))
    return data
