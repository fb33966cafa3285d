"""One call, as every front door describes it (`Ask`), -> its validated `Plan`, before anything is queued.

Each door decodes its own wire (attention.v1 protobuf, KServe v2, HTTP JSON) into an `Ask` and hands it,
with its own field names (`Names`) and its own response-size function, to the shared call layer
(service/doors/calls.py `Calls.run`), which plans it here, runs the plan's jobs and finishes their outputs
(`Plan.finish`); the door encodes the result. A new request option is added here once, then in each door's
decode and encode.

Every check names the door's field (and index); one bad sequence fails its own call with
INVALID_ARGUMENT and never reaches a batch. Text is tokenized here (the batcher only ever sees token
ids), with the model's tokenizer: the call's characters are counted before tokenizing, its tokens
after. A sequence longer than the model is refused, cut or planned in windows here, as the call asks
(service/chunking.py); the windows of a call are counted arithmetically, before any is planned, so a
call over `max_tokens_per_call` costs nothing to refuse. Sizes of the response (hidden states and
attention weights) are computed here, up front, so that nothing is computed only to be refused at send
time. `plan_call` plans a big call (much text, many tokens) in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from proto.attention.v1.sizes import tensor_field
from service.chunking import (
    CHUNK,
    ERROR,
    MODES,
    REFUSE,
    TRUNCATE,
    Chunked,
    LongInputs,
    choose,
    sequences,
    stitch_all,
    truncated,
)
from service.config import ServiceConfig
from service.errors import FailedPrecondition, InvalidInput, NonFiniteInput, TaskUnavailable, shown
from service.jobs import POOL_CLS, POOL_MEAN, POOL_NONE, Job, ModelSpec, Output
from service.tasks import M3_MODES
from service.vectors import SCALAR, VectorFields, Vectors, plan_vectors

if TYPE_CHECKING:
    from model.text import Encoded

MAX_REQUEST_ID = 128
MAX_EMBEDDING_ABS = 1e6  # far above any trained embedding; far below where float32 LayerNorm overflows
FLOATS = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
POOLINGS = ("none", "mean", "cls", "model")
HEADS = ("all", "mean")
# Calls with more text than this are planned (tokenized) in a worker thread: below it, the hop costs
# more than the tokenizer (about 1 us per character here). Likewise calls with more input tokens.
INLINE_CHARS = 4096
INLINE_TOKENS = 65536
_POOLING = {"none": POOL_NONE, "mean": POOL_MEAN, "cls": POOL_CLS}
_UNSIGNED = {np.dtype(f"{order}i{size}"): np.dtype(f"{order}u{size}") for order in "<>=" for size in (4, 8)}
_WINDOWED = " (the windows of chunked sequences counted)"


@dataclass(frozen=True)
class Ask:
    """One call, decoded from a door's wire. `inputs`: per sequence, token ids (an int array [T]),
    embeddings (a float32 array [T, d_model]) or a text (str)."""

    inputs: Sequence[np.ndarray | str | tuple[str, str]]
    request_id: str = ""
    return_hidden: bool = True
    pooling: str = "none"  # none | mean | cls | model (a text bundle's own; refused without a tokenizer)
    normalize: bool | None = None  # None: the model's default for text bundles (when pooled), else False
    dtype: str = "float32"  # hidden and pooled outputs: float32 | float16 | bfloat16
    attention: tuple[int, ...] | None = None  # None: no weights; (): every layer; negative from the end
    heads: str = "all"  # all | mean
    attention_dtype: str = "float32"
    causal: bool = False
    long_inputs: str | None = None  # error | truncate | chunk; None: what `truncate` says
    truncate: bool = False
    truncation_side: str | None = None  # a cut keeps the start ("right") or the end ("left"); None: the bundle's
    chunk_stride: int = 0
    prompt_name: str = ""
    return_tokens: bool = False
    dimensions: int | None = None  # Matryoshka: the pooled vector's first n values (service/vectors.py); None: all
    quantization: str = "none"  # none | int8 | uint8 | binary | ubinary, of the pooled vector
    quantization_ranges: tuple[Sequence[float], Sequence[float]] | None = None  # (min, max); None: the model's
    # A task head's call (service/tasks.py): "classify" (inputs: texts or (text, text) pairs) or "rerank"
    # (inputs: the texts, each paired with `query`; `top_n` of them answered, 1..len(inputs); None: all).
    task: str = "embed"
    query: str | None = None
    top_n: int | None = None
    sparse: tuple[int, float] | None = None  # embed: a SPLADE vector per sequence, (top_k (0: all), threshold)
    raw_scores: bool = False  # classify and rerank: the logits themselves, not their softmax or sigmoid
    # A late-interaction model's token vectors (Output.vectors), its texts encoded as "query" or "document";
    # None: none. On such a model (no cross-encoder head) rerank scores with them: `scoring` "" (MaxSim) or one
    # of BGE-M3's compute_score modes (service/tasks.py M3_MODES), `weights` (dense, sparse, colbert).
    vectors: str | None = None
    scoring: str = ""
    weights: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Names:
    """A door's names for the fields of its wire, as INVALID_ARGUMENT messages name them. `sequence`
    names sequence i of kind `kind` (a door's name from `kinds`); `element` its element j."""

    sequences: str = "sequences"
    sequence: str = "sequences[{i}].{kind}"
    element: str = "{sequence}[{j}]"
    kinds: tuple[tuple[str, str], ...] = (("ids", "token_ids"), ("embeddings", "embeddings"), ("text", "text"),
                                          ("pair", "pair"))
    request_id: str = "request_id"
    output: str = "output"
    pooling: str = "output.pooling"
    normalize: str = "output.normalize"
    dtype: str = "output.dtype"
    prompt_name: str = "output.prompt_name"
    return_attention: str = "attention.return_attention"
    attention: str = "attention"
    attention_layers: str = "attention.layers"
    heads: str = "attention.heads"
    attention_dtype: str = "attention.dtype"
    long_inputs: str = "long_inputs"
    chunk_stride: str = "chunk_stride"
    texts: str = "sequences"  # all the call's text together (its character limit)
    dimensions: str = "output.dimensions"
    quantization: str = "output.quantization"
    ranges: str = "output.quantization_ranges"
    ranges_min: str = "output.quantization_ranges.min"
    ranges_max: str = "output.quantization_ranges.max"
    task: str = "task"  # the call's task (the RPC or route: a door names it as its callers know it)
    query: str = "query"
    top_n: str = "top_n"
    sparse: str = "output.sparse"
    vectors: str = "output.vectors"
    scoring: str = "scoring"
    weights: str = "weights"

    def vector_fields(self) -> VectorFields:
        return VectorFields(self.dimensions, self.quantization, self.ranges, self.ranges_min, self.ranges_max)

    def of(self, i: int, kind: str) -> str:
        return self.sequence.format(i=i, kind=dict(self.kinds)[kind])

    def at(self, i: int, kind: str, j: int) -> str:
        return self.element.format(sequence=self.of(i, kind), i=i, kind=dict(self.kinds)[kind], j=j)


class Sizes(NamedTuple):
    """A response's bytes: the attention weights, and the whole message as the door sends it."""

    attention: int
    total: int


@dataclass(frozen=True)
class Plan:
    """A validated call: its jobs (one per sequence, in order; a chunked sequence's windows in its
    place) and how to encode the outputs."""

    request_id: str
    jobs: list[Job]
    output_dtype: str  # float32 | float16 | bfloat16
    attention_dtype: str
    texts: tuple[Encoded | None, ...] = ()  # per sequence: how its text was tokenized (None: not text)
    return_tokens: bool = False
    chunks: tuple[Chunked | None, ...] = ()  # per sequence, when the call chunks one: its windows (None: whole)
    truncated: tuple[bool, ...] = ()  # per sequence, when the call cut ids or embeddings: whether it did
    task: str = "embed"  # a head's task: each job's Output.scores hold its logits (service/tasks.py)
    top_n: int = 0  # rerank: how many of the ranked texts to answer
    raw_scores: bool = False  # classify and rerank: the logits as scores (service/tasks.py)
    sparse: tuple[int, float] | None = None  # embed: (top_k, threshold) of each sequence's sparse vector
    vectors: Vectors | None = None  # the pooled vectors' dimensions and quantization; None: as computed
    # rerank on a late-interaction model: (scoring, weights); the query is the last job (service/tasks.py)
    late: tuple[str, tuple[float, float, float]] | None = None

    def finish(self, outputs: Sequence[Output]) -> list[Output]:
        """The output stage: the jobs' outputs (a chunked sequence's windows each) -> one per sequence of
        the call, windows stitched, pooled vectors cut and quantized as asked, token vectors quantized as
        asked (service/vectors.py)."""
        out = stitch_all(self.chunks, outputs) if self.chunks else list(outputs)
        vectors = self.vectors
        if vectors is None:
            return out
        return [dataclasses.replace(o, pooled=None if o.pooled is None else vectors.apply(o.pooled),
                                    vectors=None if o.vectors is None else vectors.quantize(o.vectors))
                for o in out]

    def pooled_size(self, d_model: int) -> tuple[int, int]:
        """The pooled vector's (values, bytes per value) in the response."""
        vectors = self.vectors
        if vectors is None:
            return d_model, ITEMSIZE[self.output_dtype]
        return vectors.width, 1 if vectors.dtype is not None else ITEMSIZE[self.output_dtype]

    @property
    def tokens(self) -> int:
        """Tokens computed: after chunking, the windows' lengths summed."""
        return sum(job.length for job in self.jobs)

    @property
    def sequences(self) -> list[Job]:
        """One job per sequence of the call, as asked (a chunked sequence whole, not its windows)."""
        return sequences(self.jobs, self.chunks) if self.chunks else self.jobs

    def cut(self, i: int) -> bool:
        """Whether sequence i was cut to the model's length (text or not)."""
        text = self.texts[i] if self.texts else None
        return (text is not None and text.truncated) or (bool(self.truncated) and self.truncated[i])


ResponseSize = Callable[[Plan, ModelSpec], Sizes]


def check_count(n: int, config: ServiceConfig, field: str, what: str = "sequences") -> None:
    """The call's number of sequences, 1..max_sequences_per_call (a door checks it before decoding them)."""
    if not 1 <= n <= config.max_sequences_per_call:
        raise InvalidInput(field, f"must hold 1..{config.max_sequences_per_call} {what}; got {n}")


def takes_text(spec: ModelSpec, field: str) -> None:
    """Refuse text for a model without a tokenizer (a door checks it before decoding any text)."""
    if spec.tokenizer is None:
        raise InvalidInput(field, f"model {spec.name} takes no text (it has no tokenizer); send token ids")


async def plan_call(ask: Ask, spec: ModelSpec, config: ServiceConfig, names: Names,
                    response_size: ResponseSize) -> Plan:
    """`plan`, in a worker thread when the call is big (the Rust tokenizer and numpy release the GIL)."""
    if _weight(ask) > INLINE_CHARS:
        return await asyncio.to_thread(plan, ask, spec, config, names, response_size)
    return plan(ask, spec, config, names, response_size)


def _weight(ask: Ask) -> int:
    chars = tokens = 0
    for item in ask.inputs:
        if isinstance(item, str):
            chars += len(item) + len(ask.query or "")
        elif isinstance(item, tuple):
            chars += len(item[0]) + len(item[1])
        else:
            tokens += len(item)
    return max(chars, tokens * INLINE_CHARS // INLINE_TOKENS)


def plan(ask: Ask, spec: ModelSpec, config: ServiceConfig, names: Names, response_size: ResponseSize) -> Plan:
    """`ask` -> its `Plan`, every limit checked (module docstring); InvalidInput names `names`' fields."""
    if len(ask.request_id) > MAX_REQUEST_ID:
        raise InvalidInput(names.request_id, f"at most {MAX_REQUEST_ID} characters; got {len(ask.request_id)}")
    if ask.task != "embed" or "embed" not in spec.tasks:
        return plan_head(ask, spec, config, names, response_size)
    inputs = ask.inputs
    for i, item in enumerate(inputs):
        if isinstance(item, tuple):
            raise InvalidInput(names.of(i, "pair"), "text pairs are for classify and rerank, not embeddings")
    check_count(len(inputs), config, names.sequences)
    output_dtype = _float(ask.dtype, names.dtype)
    attention_dtype = _float(ask.attention_dtype, names.attention_dtype)
    long = _long_inputs(ask, spec, names)
    mode = _multi_vector(ask, spec, long, names)
    texts = _tokenize(ask, spec, config, long, names, mode)
    pooling, normalize = _pooling(ask, spec, names)
    if mode and ask.quantization in SCALAR:
        raise InvalidInput(names.quantization, f"{ask.quantization} needs calibration ranges of the pooled vector; "
                           "token vectors take binary or ubinary")
    vectors = plan_vectors(dimensions=ask.dimensions, quantization=ask.quantization, ranges=ask.quantization_ranges,
                           pooled=pooling != POOL_NONE, normalize=normalize, d_model=spec.d_model,
                           model_ranges=spec.quantization_ranges, fields=names.vector_fields(),
                           token_vectors=bool(mode))
    if vectors is not None and vectors.cut:
        normalize = False  # normalised after the cut, over the values kept (service/vectors.py)
    if ask.heads not in HEADS:
        raise InvalidInput(names.heads, f"must be one of {', '.join(HEADS)}; got {shown(ask.heads)}")
    layers = _attention_layers(ask, spec, config, names)
    head = _sparse(ask, spec, long, names)
    if not ask.return_hidden and pooling == POOL_NONE and not layers and not head and not mode:
        raise InvalidInput(names.output, "nothing to return: hidden states off, no pooling, no attention")

    text_window = _text_window(spec, mode) if texts else 0
    lengths = [len(enc.ids) if enc is not None else len(item) for enc, item in zip(texts or [None] * len(inputs),
                                                                                    inputs, strict=True)]
    limits = [text_window if texts and texts[i] is not None else spec.max_length for i in range(len(inputs))]
    _check_tokens(lengths, limits, long, config, names, lambda i: names.of(i, _kind(inputs[i])))
    jobs: list[Job] = []
    windows: list[tuple[int, int]] = []  # (sequence, window) of each sequence longer than its window
    for i, item in enumerate(inputs):
        encoded = texts[i] if texts else None
        token_ids: np.ndarray | None
        if encoded is not None:
            token_ids, embeddings = encoded.ids, None
        else:
            assert not isinstance(item, tuple)  # refused above: pairs are for head tasks
            token_ids, embeddings = _array(i, item, spec, long.mode, names)
        job = Job(token_ids=token_ids, embeddings=embeddings, causal=ask.causal, attn_layers=layers,
                  heads_mean=ask.heads == "mean", pooling=pooling, return_hidden=ask.return_hidden,
                  normalize=normalize, head=head, vectors=bool(mode),
                  vector_rows=encoded.vector_rows if mode and encoded is not None else None,
                  attend=encoded.attend if mode and encoded is not None else 0)
        if lengths[i] > limits[i]:
            windows.append((i, limits[i]))
        jobs.append(job)
    if windows:
        jobs, chunks, cut = _fit(jobs, windows, long, names, lambda i: names.of(i, _kind(inputs[i])),
                                 _side(ask, spec))
        fitted = Plan(ask.request_id, jobs, output_dtype, attention_dtype, texts, ask.return_tokens, chunks, cut,
                      vectors=vectors, sparse=ask.sparse)
    else:
        fitted = Plan(ask.request_id, jobs, output_dtype, attention_dtype, texts, ask.return_tokens, vectors=vectors,
                      sparse=ask.sparse)
    _check_sizes(fitted, spec, config, names, response_size)
    return fitted


def _kind(item: np.ndarray | str | tuple[str, str]) -> str:
    if isinstance(item, tuple):
        return "pair"
    return "text" if isinstance(item, str) else "ids" if item.ndim == 1 else "embeddings"


HEAD_TASKS = ("classify", "rerank")
MULTI_VECTOR_MODES = ("query", "document")


def _side(ask: Ask, spec: ModelSpec) -> str:
    """The side a cut of the call's ids or embeddings keeps: the call's, else its text bundle's, else the end's."""
    if ask.truncation_side is not None:
        return ask.truncation_side
    return spec.tokenizer.settings.truncation_side if spec.tokenizer is not None else "right"


def check_task(task: str, spec: ModelSpec, field: str) -> None:
    """A task the served model has (manifest tasks), else TaskUnavailable naming it."""
    if task not in spec.tasks:
        raise TaskUnavailable(field, f"model {spec.name} does not serve {shown(task)}; it serves "
                              f"{', '.join(spec.tasks)} (docs/tasks.md)")


def plan_head(ask: Ask, spec: ModelSpec, config: ServiceConfig, names: Names, response_size: ResponseSize) -> Plan:
    """A head task's call (classify, rerank): texts or pairs tokenized (pairs as the HF tokenizer pairs them),
    each one sequence for the batcher, limits counted per sequence (a rerank's query once per pair). A rerank
    on a late-interaction model without a cross-encoder head is `plan_late_rerank`'s."""
    if ask.task == "rerank" and "rerank" not in spec.tasks and spec.vector_dim:
        return plan_late_rerank(ask, spec, config, names, response_size)
    if ask.scoring or ask.weights is not None:
        raise InvalidInput(names.scoring if ask.scoring else names.weights,
                           "applies to a late-interaction model's rerank (ColBERT, BGE-M3)")
    check_task(ask.task, spec, names.task)
    if ask.task not in HEAD_TASKS:
        raise TaskUnavailable(names.task, f"{shown(ask.task)} is not a head task ({', '.join(HEAD_TASKS)})")
    inputs = list(ask.inputs)
    if ask.task == "rerank":
        if not ask.query:
            raise InvalidInput(names.query, "must not be empty")
        check_count(len(inputs), config, names.sequences, "texts")
        if ask.top_n is not None and not 1 <= ask.top_n <= len(inputs):
            raise InvalidInput(names.top_n, f"must be 1..{len(inputs)} (the number of texts), or unset; "
                               f"got {ask.top_n}")
        pairs: list[str | tuple[str, str]] = []
        for i, item in enumerate(inputs):
            if not isinstance(item, str):
                raise InvalidInput(names.of(i, "text"), "must be a text")
            pairs.append((ask.query, item))
    else:
        check_count(len(inputs), config, names.sequences)
        if ask.top_n is not None or ask.query is not None:
            raise InvalidInput(names.top_n if ask.top_n is not None else names.query, "applies to rerank only")
        pairs = []
        for i, item in enumerate(inputs):
            if not isinstance(item, str | tuple):
                raise InvalidInput(names.of(i, _kind(item)), "must be a text or a pair of texts")
            pairs.append(item)
    takes_text(spec, names.of(0, _kind(pairs[0])))
    assert spec.tokenizer is not None
    if ask.long_inputs not in (None, ERROR, TRUNCATE):
        raise InvalidInput(names.long_inputs, f"must be error or truncate for {ask.task}; got {shown(ask.long_inputs)}")
    if ask.chunk_stride:
        raise InvalidInput(names.chunk_stride, f"applies to chunked embeddings, not to {ask.task}")
    truncate = ask.long_inputs == TRUNCATE or (ask.truncate and ask.long_inputs is None)
    encoded = tokenize(pairs, spec, config, fields=[names.of(i, _kind(ask.inputs[i])) for i in range(len(pairs))],
                       truncate=truncate, side=ask.truncation_side, all_field=names.texts,
                       counted=" (a query counted once per text)"
                       if ask.task == "rerank" else "", hint="shorten it, or set truncate to cut it")
    total = 0
    jobs: list[Job] = []
    layers = _attention_layers(ask, spec, config, names)
    if ask.heads not in HEADS:
        raise InvalidInput(names.heads, f"must be one of {', '.join(HEADS)}; got {shown(ask.heads)}")
    attention_dtype = _float(ask.attention_dtype, names.attention_dtype)
    for enc in encoded:
        total += len(enc.ids)
        types = enc.type_ids if spec.pair_types and enc.type_ids is not None and enc.type_ids.any() else None
        jobs.append(Job(token_ids=enc.ids, embeddings=None, attn_layers=layers, heads_mean=ask.heads == "mean",
                        return_hidden=False, head=ask.task, token_types=types))
    if total > config.max_tokens_per_call:
        raise InvalidInput(names.sequences, f"{total} tokens in all; at most {config.max_tokens_per_call} per call")
    top_n = ask.top_n if ask.top_n is not None else len(jobs)
    fitted = Plan(ask.request_id, jobs, "float32", attention_dtype, tuple(encoded), ask.return_tokens,
                  task=ask.task, top_n=top_n, raw_scores=ask.raw_scores)
    _check_sizes(fitted, spec, config, names, response_size)
    return fitted


M3_DEFAULT_WEIGHTS = (0.4, 0.2, 0.4)  # dense, sparse, colbert: FlagEmbedding's example weights_for_different_modes


def plan_late_rerank(ask: Ask, spec: ModelSpec, config: ServiceConfig, names: Names,
                     response_size: ResponseSize) -> Plan:
    """A rerank on a late-interaction model: the query encoded as a query, each text as a document (one sequence
    each, the query last), scored after the forward by `scoring` (service/tasks.py `late_scores`): "" is MaxSim
    over the token vectors; BGE-M3 (a lexical sparse head) also takes its compute_score modes."""
    if not ask.query:
        raise InvalidInput(names.query, "must not be empty")
    texts = list(ask.inputs)
    check_count(len(texts), config, names.sequences, "texts")
    if ask.top_n is not None and not 1 <= ask.top_n <= len(texts):
        raise InvalidInput(names.top_n, f"must be 1..{len(texts)} (the number of texts), or unset; got {ask.top_n}")
    for i, item in enumerate(texts):
        if not isinstance(item, str):
            raise InvalidInput(names.of(i, "text"), "must be a text")
    if ask.attention is not None:
        raise InvalidInput(names.return_attention, "attention weights are not available for a late-interaction "
                           "rerank (the query and each text are encoded apart)")
    if ask.long_inputs not in (None, ERROR, TRUNCATE):
        raise InvalidInput(names.long_inputs, f"must be error or truncate for rerank; got {shown(ask.long_inputs)}")
    lexical = spec.sparse_kind == "lexical"
    scoring = ask.scoring or ("colbert" if lexical else "")
    if scoring and scoring not in M3_MODES or scoring != "colbert" and scoring and not lexical:
        modes = ", ".join(M3_MODES) if lexical else "\"\" (MaxSim)"
        raise InvalidInput(names.scoring, f"must be one of {modes} for model {spec.name}; got {shown(scoring)}")
    weights = tuple(float(w) for w in ask.weights) if ask.weights else M3_DEFAULT_WEIGHTS
    if len(weights) != 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] + weights[1] <= 0:
        raise InvalidInput(names.weights, "must be three finite numbers >= 0 (dense, sparse, colbert), dense + "
                           "sparse above 0")
    # Each side cut to its mode's length, as the authors' encoders always cut them (truncate is moot).
    field = [names.of(i, "text") for i in range(len(texts))]
    documents = tokenize([str(t) for t in texts], spec, config, fields=field, truncate=True, mode="document",
                         all_field=names.texts)
    query = tokenize([ask.query], spec, config, fields=[names.query], truncate=True, mode="query",
                     all_field=names.query)
    dense, sparse = scoring not in ("", "colbert"), "sparse" in scoring
    jobs = [Job(token_ids=enc.ids, embeddings=None, return_hidden=False, vectors=True, vector_rows=enc.vector_rows,
                attend=enc.attend, pooling=POOL_CLS if dense else POOL_NONE, normalize=dense,
                head="sparse" if sparse else "") for enc in (*documents, *query)]
    total = sum(job.length for job in jobs)
    if total > config.max_tokens_per_call:
        raise InvalidInput(names.sequences, f"{total} tokens in all (the query's included); at most "
                           f"{config.max_tokens_per_call} per call")
    w = (weights[0], weights[1], weights[2])
    fitted = Plan(ask.request_id, jobs, "float32", "float32", (*documents, *query), ask.return_tokens, task="rerank",
                  top_n=ask.top_n if ask.top_n is not None else len(texts), late=(scoring, w))
    _check_sizes(fitted, spec, config, names, response_size)
    return fitted


def head_response_bytes(plan: Plan, spec: ModelSpec) -> Sizes:
    """A head task's response, bounded from above: per sequence its scores (a float and a label each), index,
    its text echoed (4 bytes a token's worth of characters, generously) and tokens; the attention weights."""
    labels = sum(len(label.encode()) + 16 for label in spec.labels) or 16
    texts = sum(16 + 8 * job.length for job in plan.jobs) if plan.return_tokens else 0
    attention = attention_bytes(plan, spec)
    per_attention = sum(tensor_field((len(j.attn_layers), 1 if j.heads_mean else spec.n_heads, j.length, j.length),
                                     ITEMSIZE[plan.attention_dtype]) for j in plan.jobs if j.attn_layers)
    total = 256 + len(plan.jobs) * (32 + labels) + texts + per_attention
    return Sizes(attention, total)


def _check_tokens(lengths: list[int], limits: list[int], long: LongInputs, config: ServiceConfig, names: Names,
                  field: Callable[[int], str]) -> None:
    """The call's tokens against max_tokens_per_call, from the lengths alone, before any input is converted
    or any window planned: a sequence over its window is refused (ERROR), cut (TRUNCATE) or counted as
    its windows (CHUNK: `window_starts`' count times the window)."""
    total = 0
    for i, (n, window) in enumerate(zip(lengths, limits, strict=True)):
        if n <= window:
            total += n
        elif long.mode == ERROR:
            raise InvalidInput(field(i), f"length must be 1..{window}; got {n}" + _HINT)
        elif long.mode == TRUNCATE:
            total += window
        else:
            total += (math.ceil((n - window) / long.step(window)) + 1) * window
    if total > config.max_tokens_per_call:
        windowed = long.mode == CHUNK and any(n > w for n, w in zip(lengths, limits, strict=True))
        raise InvalidInput(names.sequences, f"{total} tokens in all{_WINDOWED * windowed}; at most "
                           f"{config.max_tokens_per_call} per call")


def _fit(jobs: list[Job], windows: list[tuple[int, int]], long: LongInputs, names: Names,
         field: Callable[[int], str], side: str) -> tuple[list[Job], tuple[Chunked | None, ...], tuple[bool, ...]]:
    """The call's jobs once some sequences are longer than the model, each cut or planned in windows as
    the call asks (ERROR was refused before), with Plan's `chunks` and `truncated`."""
    if long.mode == CHUNK:
        for i, window in windows:
            if jobs[i].attn_layers:
                raise InvalidInput(names.return_attention, "attention weights are not available for a chunked "
                                   f"sequence: {field(i)} has {jobs[i].length} tokens, over {window}, so it is "
                                   "encoded in windows; ask without attention, or send it within the limit")
    long_at = dict(windows)
    out: list[Job] = []
    chunks: list[Chunked | None] = []
    cut: list[bool] = []
    for i, job in enumerate(jobs):
        chunk = None
        if i not in long_at:
            out.append(job)
        elif long.mode == TRUNCATE:
            out.append(truncated(job, long_at[i], side))
        else:
            chunk = Chunked.plan(job, long_at[i], long.step(long_at[i]))
            out.extend(chunk.jobs())
        chunks.append(chunk)
        cut.append(i in long_at and long.mode == TRUNCATE)
    return (out, tuple(chunks) if any(c is not None for c in chunks) else (),
            tuple(cut) if any(cut) else ())


def _sparse(ask: Ask, spec: ModelSpec, long: LongInputs, names: Names) -> str:
    """"sparse" (the head of each job) when the call asks for SPLADE vectors, checked; else ""."""
    if ask.sparse is None:
        return ""
    check_task("sparse", spec, names.sparse)
    top_k, threshold = ask.sparse
    if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 0:
        raise InvalidInput(f"{names.sparse}.top_k", f"must be >= 0 (0: all); got {shown(top_k)}")
    if not math.isfinite(threshold) or threshold < 0:
        raise InvalidInput(f"{names.sparse}.threshold", f"must be a finite number >= 0; got {shown(threshold)}")
    if long.mode == CHUNK:
        raise InvalidInput(names.sparse, "is not available with chunked long inputs; truncate them instead")
    return "sparse"


def _text_window(spec: ModelSpec, mode: str = "") -> int:
    """The tokens a text may hold: the tokenizer's limit, or a late-interaction mode's length."""
    assert spec.tokenizer is not None
    multi = spec.tokenizer.settings.multi_vector
    return multi.length(mode) if mode and multi is not None else spec.tokenizer.settings.max_tokens


def _multi_vector(ask: Ask, spec: ModelSpec, long: LongInputs, names: Names) -> str:
    """The call's token-vector mode ("query" | "document"), checked; "" when it asks for none."""
    if ask.vectors is None:
        return ""
    if ask.vectors not in MULTI_VECTOR_MODES:
        raise InvalidInput(names.vectors, f"must be one of {', '.join(MULTI_VECTOR_MODES)}; got {shown(ask.vectors)}")
    if not spec.vector_dim or spec.tokenizer is None or spec.tokenizer.settings.multi_vector is None:
        raise TaskUnavailable(names.vectors, f"model {spec.name} has no token vectors (a late-interaction head: "
                              "ColBERT, BGE-M3; docs/tasks.md)")
    if long.mode == CHUNK:
        raise InvalidInput(names.vectors, "are not available with chunked long inputs; truncate them instead")
    for i, item in enumerate(ask.inputs):
        if not isinstance(item, str):
            raise InvalidInput(names.of(i, _kind(item)), "token vectors are encoded from text; send text")
    return ask.vectors


def _float(dtype: str, field: str) -> str:
    if dtype not in ITEMSIZE:
        raise InvalidInput(field, f"must be FLOAT32, FLOAT16 or BFLOAT16; got {shown(dtype)}")
    return dtype


def _pooling(ask: Ask, spec: ModelSpec, names: Names) -> tuple[int, bool]:
    """(pooling, normalize) of the call: "model" and an unset normalize take the model's defaults."""
    settings = spec.tokenizer.settings if spec.tokenizer is not None else None
    if ask.pooling not in POOLINGS:
        raise InvalidInput(names.pooling, f"must be one of {', '.join(POOLINGS)}; got {shown(ask.pooling)}")
    if ask.pooling == "model":
        if settings is None:
            raise InvalidInput(names.pooling, "the model's own pooling needs a model served with a tokenizer "
                               "(ModelInfo.text); use mean or cls")
        pooling = _POOLING[settings.pooling]
    else:
        pooling = _POOLING[ask.pooling]
    if ask.normalize is not None:
        if ask.normalize and pooling == POOL_NONE:
            raise InvalidInput(names.normalize, "normalizes the pooled vector: ask for pooling")
        return pooling, ask.normalize
    return pooling, settings is not None and settings.normalize and pooling != POOL_NONE


def _long_inputs(ask: Ask, spec: ModelSpec, names: Names) -> LongInputs:
    """The call's choice for sequences longer than the model (long_inputs, truncate, chunk_stride)."""
    if ask.long_inputs is None and not ask.truncate and not ask.chunk_stride:
        return REFUSE  # the common call: nothing to look at
    if ask.long_inputs is not None and ask.long_inputs not in MODES:
        raise InvalidInput(names.long_inputs, f"must be one of {', '.join(MODES)}; got {shown(ask.long_inputs)}")
    kinds = {_kind(item) for item in ask.inputs}
    windows = [spec.max_length] if kinds - {"text"} else []
    if "text" in kinds and spec.tokenizer is not None:
        windows.append(spec.tokenizer.settings.max_tokens)
    return choose(ask.long_inputs, ask.truncate, ask.chunk_stride, mode_field=names.long_inputs,
                  stride_field=names.chunk_stride, windows=windows)


def _tokenize(ask: Ask, spec: ModelSpec, config: ServiceConfig, long: LongInputs, names: Names,
              mode: str = "") -> tuple[Encoded | None, ...]:
    """The call's texts tokenized, per sequence (None where a sequence is not text); () without text."""
    where = [i for i, item in enumerate(ask.inputs) if isinstance(item, str)]
    if not where:
        if ask.prompt_name:
            raise InvalidInput(names.prompt_name, "applies to text; the call sends none")
        return ()
    texts = [ask.inputs[i] for i in where]
    # A late-interaction encoding cuts to its mode's length, as its authors' encoders always do.
    encoded = tokenize([t for t in texts if isinstance(t, str)], spec, config,
                       fields=[names.of(i, "text") for i in where], truncate=long.mode == TRUNCATE or bool(mode),
                       side=ask.truncation_side, keep_long=long.mode == CHUNK, prompt_name=ask.prompt_name,
                       all_field=names.texts, prompt_field=names.prompt_name, mode=mode)
    out: list[Encoded | None] = [None] * len(ask.inputs)
    for i, enc in zip(where, encoded, strict=True):
        out[i] = enc
    return tuple(out)


def tokenize(texts: Sequence[str | tuple[str, str]], spec: ModelSpec, config: ServiceConfig, *,
             fields: Sequence[str], truncate: bool, side: str | None = None, prompt_name: str = "",
             all_field: str = "sequences", prompt_field: str = "output.prompt_name", keep_long: bool = False,
             counted: str = "", hint: str = "shorten it, or set truncate to cut it (or chunk it)", mode: str = "",
             specials: bool = True) -> list[Encoded]:
    """`texts` (each a text, or a pair of texts as the model's tokenizer pairs them) -> token ids with the
    model's tokenizer, every limit checked: the characters of the call before tokenizing (`counted` says
    how, in the message), each sequence's tokens (over the limit: refused, cut with `truncate` on `side`
    (None: the bundle's truncation side), or kept whole with `keep_long`, to be chunked) and the ids against
    the vocabulary after. `fields` name each sequence in errors. `specials` False (Tokenize only): a text's
    tokens without the model's special tokens. The one tokenization of every call: encoding, head tasks and
    Tokenize."""
    tokenizer = spec.tokenizer
    takes_text(spec, fields[0])
    assert tokenizer is not None
    chars = sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in texts)
    if chars > config.max_text_chars:
        raise InvalidInput(all_field, f"{chars} characters of text in all{counted}; at most {config.max_text_chars} "
                           "per call")
    try:
        prompt = tokenizer.prompt(prompt_name)
    except KeyError:
        # The name is not echoed: a caller's text never is (shown() would print a plain one).
        known = sorted(tokenizer.settings.prompts)
        raise InvalidInput(prompt_field, f"unknown prompt; the model has {known}") from None
    singles = [i for i, t in enumerate(texts) if isinstance(t, str)]
    if len(singles) == len(texts):  # the common call
        encoded = tokenizer.encode([str(t) for t in texts], truncate=truncate, prompt=prompt, side=side, mode=mode,
                                   specials=specials)
    else:
        doubles = [i for i, t in enumerate(texts) if isinstance(t, tuple)]
        found: dict[int, Encoded] = dict(zip(singles, tokenizer.encode([str(texts[i]) for i in singles],
                                                                      truncate=truncate, prompt=prompt, side=side),
                                             strict=True))
        found.update(zip(doubles, tokenizer.encode_pairs([texts[i] for i in doubles],  # type: ignore[misc]
                                                         truncate=truncate, side=side), strict=True))
        encoded = [found[i] for i in range(len(texts))]
    limit = _text_window(spec, mode)
    for field, enc in zip(fields, encoded, strict=True):
        if len(enc.ids) > limit and not keep_long:
            raise InvalidInput(field, f"{enc.full_length} tokens (special tokens included), over the model's "
                               f"limit of {limit}; {hint}")
        if len(enc.ids) and int(enc.ids.max()) >= spec.vocab_size:
            raise InvalidInput(field, f"the tokenizer gave id {int(enc.ids.max())}, outside the model's "
                               f"vocabulary of {spec.vocab_size}")
    return encoded


def _attention_layers(ask: Ask, spec: ModelSpec, config: ServiceConfig, names: Names) -> tuple[int, ...]:
    if ask.attention is None:
        return ()
    if not config.allow_attention:
        raise FailedPrecondition("return_attention is disabled on this deployment")
    L = spec.n_layers
    if not ask.attention:
        return tuple(range(L))
    layers: list[int] = []
    for j, layer in enumerate(ask.attention):
        field = f"{names.attention_layers}[{j}]"
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or not -L <= layer < L:
            raise InvalidInput(field, f"layer {shown(layer)} not in [-{L}, {L})")
        layer = int(layer) % L
        if layer in layers:
            raise InvalidInput(field, f"layer {layer} asked for twice")
        layers.append(layer)
    return tuple(layers)


def _array(i: int, item: np.ndarray | str, spec: ModelSpec, long_mode: str,
           names: Names) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A sequence's ids or embeddings, checked against the model (the door checked its wire form)."""
    assert not isinstance(item, str)
    kind = "ids" if item.ndim == 1 else "embeddings"
    field = names.of(i, kind)
    length = item.shape[0]
    if length < 1 or (length > spec.max_length and long_mode == ERROR):
        raise InvalidInput(field, f"length must be 1..{spec.max_length}; got {length}"
                           + _HINT * (length > spec.max_length))
    if kind == "ids":
        if item.dtype.kind not in "iu":
            raise InvalidInput(field, f"token ids must be integers; got {item.dtype} values (float arrays are "
                               "embeddings)")
        if (j := _first_out_of_vocab(item, spec.vocab_size)) is not None:
            raise InvalidInput(names.at(i, kind, j), f"id {int(item[j])} not in [0, {spec.vocab_size})")
        return item.astype(np.int64, copy=False), None  # int64 ids stay a view of the request's bytes
    if item.ndim != 2 or item.shape[1] != spec.d_model:
        raise InvalidInput(field, f"shape must be [T, {spec.d_model}]; got {list(item.shape)}")
    embeddings = item.astype(np.float32, copy=False)
    if not np.isfinite(embeddings).all():
        raise NonFiniteInput(field, "holds NaN or Inf")
    largest = float(np.abs(embeddings).max())
    if largest > MAX_EMBEDDING_ABS:
        # Finite, but LayerNorm's variance would overflow (x^2 past float32 max near 1e19): refuse it
        # as bad input rather than compute a non-finite output.
        raise InvalidInput(field, f"|value| must be <= {MAX_EMBEDDING_ABS:g}; got {largest:.3g}")
    return None, embeddings


_HINT = " (or set long_inputs to truncate or chunk it)"


def _first_out_of_vocab(ids: np.ndarray, vocab_size: int) -> int | None:
    """The index of the first id outside [0, vocab_size), or None."""
    if ids.dtype.kind == "u":
        return None if int(ids.max()) < vocab_size else int(np.flatnonzero(ids >= vocab_size)[0])
    # One reduction checks both bounds: read as unsigned, a negative id is at least 2**31.
    if int(ids.view(_UNSIGNED.get(ids.dtype) or ids.dtype.str.replace("i", "u")).max()) < vocab_size:
        return None
    return int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])


def _check_sizes(plan: Plan, spec: ModelSpec, config: ServiceConfig, names: Names,
                 response_size: ResponseSize) -> None:
    """Refuse, before any compute, a call whose attention or whole response would be over budget."""
    sizes = response_size(plan, spec)
    if sizes.attention > config.max_attention_bytes:
        raise InvalidInput(
            names.attention,
            f"attention weights would be {sizes.attention} bytes, over the budget of {config.max_attention_bytes} "
            "bytes; ask for fewer layers, heads averaged (mean), float16, or shorter sequences",
        )
    if sizes.total > config.max_message_bytes:
        raise InvalidInput(names.sequences, f"the response would be {sizes.total} bytes, over max_message_bytes "
                           f"{config.max_message_bytes}")


def attention_bytes(plan: Plan, spec: ModelSpec, padded_to: int | None = None) -> int:
    """The attention weights of `plan`'s response; `padded_to`: every sequence padded to this length."""
    first = plan.jobs[0]
    if not first.attn_layers:  # one call asks one thing: no attention for one, none for all
        return 0
    heads = 1 if first.heads_mean else spec.n_heads
    total = sum(len(job.attn_layers) * heads * (padded_to or job.length) ** 2 for job in plan.sequences)
    return total * ITEMSIZE[plan.attention_dtype]
