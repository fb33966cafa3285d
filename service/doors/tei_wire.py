"""What Text Embeddings Inference's two wires share: TEI's HTTP routes (service/doors/http/tei.py) and its
tei.v1 gRPC services (service/doors/tei_v1.py). TEI's error types, what /info and Info say of the model (its
type: an embedding model, a classifier with its labels, or a reranker), which route `POST /` stands for,
a truncation direction, and a call's timings (TEI's x-*-time headers, its gRPC `Metadata`).

Contracts: TEI 1.9.3's docs/openapi.json and proto/tei.proto (tests/data/tei/ holds both).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model.text import special_ids
from service.config import ServiceConfig
from service.doors.calls import Ran
from service.errors import EmptyInput, InvalidInput, ServiceError, shown, status_of
from service.jobs import ModelSpec

SERVER_VERSION = "0.1.0"  # pyproject.toml's
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # our precision as TEI names a dtype
# TEI's ErrorType (its OpenAPI enum, as its server sends it) for each gRPC code of ours; the rest are Backend.
_ERROR_TYPES = {"INVALID_ARGUMENT": "Validation", "FAILED_PRECONDITION": "Validation", "NOT_FOUND": "Validation",
                "UNAUTHENTICATED": "Validation", "RESOURCE_EXHAUSTED": "Overloaded", "UNAVAILABLE": "Unhealthy"}


def error_type(error: ServiceError) -> str:
    """TEI's `error_type` for `error`: Empty (nothing to compute), Validation, Overloaded, Unhealthy, Backend."""
    if isinstance(error, EmptyInput):
        return "Empty"
    return _ERROR_TYPES.get(status_of(error), "Backend")


def side(value: Any, field: str = "truncation_direction") -> str:
    """TEI's truncation direction ("Right" or "Left", any case) as the side a cut keeps: "right" keeps the
    start, "left" the end."""
    if isinstance(value, str) and value.lower() in ("right", "left"):
        return value.lower()
    raise InvalidInput(field, f"must be \"Right\" or \"Left\"; got {shown(value)}")


def model_type(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """TEI's model type: ("reranker" | "classifier", {id2label, label2id}) for a model with a head, else
    ("embedding", {pooling}): the text bundle's own pooling, "splade" for a SPLADE model."""
    if "rerank" in spec.tasks or "classify" in spec.tasks:
        labels = {"id2label": {str(i): label for i, label in enumerate(spec.labels)},
                  "label2id": {label: i for i, label in enumerate(spec.labels)}}
        return ("reranker" if "rerank" in spec.tasks else "classifier"), labels
    if spec.sparse_kind == "splade":
        return "embedding", {"pooling": "splade"}
    return "embedding", {"pooling": spec.tokenizer.settings.pooling if spec.tokenizer is not None else "mean"}


def root_route(spec: ModelSpec) -> str:
    """The route `POST /` and `POST /invocations` stand for, by the model's type (TEI's choice): rerank for a
    reranker, predict for a classifier, embed_sparse for a SPLADE model, else embed (or similarity: the
    HTTP door tells that one by its body)."""
    kind, details = model_type(spec)
    if kind == "reranker":
        return "rerank"
    if kind == "classifier":
        return "predict"
    return "embed_sparse" if details["pooling"] == "splade" else "embed"


def special_token_ids(spec: ModelSpec) -> frozenset[int]:
    """The ids of the model's special tokens (TEI's `special` flag of a token), read once per tokenizer."""
    return _special_ids(spec.tokenizer.data) if spec.tokenizer is not None else frozenset()


@functools.lru_cache(maxsize=8)
def _special_ids(data: bytes) -> frozenset[int]:
    return frozenset(special_ids(data).values())


INLINE_IDS = 4096  # a decode of more ids runs in a worker thread (the Rust tokenizer releases the GIL)


async def decode_rows(spec: ModelSpec, rows: Sequence[list[int]], skip_special_tokens: bool) -> list[str]:
    """TEI's decode: each row of ids (bounded and checked against the vocabulary by the door) as text, with
    the model's tokenizer; in a worker thread when the call holds more than INLINE_IDS ids."""
    tokenizer = spec.tokenizer
    if tokenizer is None:
        raise InvalidInput("ids", f"model {spec.name} has no tokenizer to decode with")
    if sum(len(row) for row in rows) > INLINE_IDS:
        texts: list[str] = await asyncio.to_thread(tokenizer.decode, rows, skip_special_tokens=skip_special_tokens)
        return texts
    return tokenizer.decode(rows, skip_special_tokens=skip_special_tokens)


def max_input_length(spec: ModelSpec) -> int:
    return spec.tokenizer.settings.max_tokens if spec.tokenizer is not None else spec.max_length


def info(spec: ModelSpec, config: ServiceConfig) -> dict[str, Any]:
    """TEI's /info: every field of its `Info` schema. model_id is the served name too (the bundle's own
    name is not kept once a served name is set); max_batch_tokens is the budget in force (measured at
    warm-up or configured). One field beyond TEI's: `precision_fidelity`, the served precision's measures
    against fp32 on the accuracy gate's calibration inputs (empty when fp32 was asked for)."""
    kind, details = model_type(spec)
    return {
        "model_id": spec.name, "model_sha": spec.checksum, "model_dtype": DTYPES.get(spec.precision, spec.precision),
        "served_model_name": spec.name, "model_type": {kind: details},
        "max_concurrent_requests": config.max_queue_requests, "max_input_length": max_input_length(spec),
        "max_batch_tokens": spec.max_batch_tokens, "max_batch_requests": config.max_batch_size,
        "max_client_batch_size": config.max_sequences_per_call, "auto_truncate": config.auto_truncate,
        "tokenization_workers": 1, "version": SERVER_VERSION, "sha": None, "docker_label": None,
        "precision_fidelity": spec.precision_fidelity}


@dataclass(frozen=True)
class Timing:
    """One call's work and time as TEI reports them: characters and tokens computed, total time, and its
    split into tokenization (our planning), queue and inference (the widest batch that carried it)."""

    device: str
    chars: int
    tokens: int
    total_s: float
    tokenization_s: float
    queue_s: float
    inference_s: float

    @classmethod
    def of(cls, ran: Ran, chars: int, started: float) -> Timing:
        """`ran`'s timing; `started`: `time.perf_counter()` when the call arrived."""
        batch = ran.batch
        return cls(ran.spec.device, chars, ran.plan.tokens, time.perf_counter() - started, ran.plan_s,
                   batch.queue_s, batch.compute_s)

    def headers(self) -> dict[str, str]:
        """TEI's response headers (milliseconds, as integers)."""
        def ms(seconds: float) -> str:
            return str(int(seconds * 1e3))

        return {"x-compute-type": self.device, "x-compute-time": ms(self.total_s),
                "x-compute-characters": str(self.chars), "x-compute-tokens": str(self.tokens),
                "x-total-time": ms(self.total_s), "x-tokenization-time": ms(self.tokenization_s),
                "x-queue-time": ms(self.queue_s), "x-inference-time": ms(self.inference_s)}


def characters(inputs: Any) -> int:
    """The characters of a call's texts (a text, a pair, token ids: none)."""
    total = 0
    for item in inputs:
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, tuple):
            total += len(item[0]) + len(item[1])
    return total
