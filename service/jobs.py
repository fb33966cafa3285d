"""What flows between the servicer, the batcher and the runner: a validated sequence (`Job`), its
result (`Output`) and what the service knows of the loaded model (`ModelSpec`). numpy only: the
servicer and validation depend on these, not on the runner or torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from model.text import TextTokenizer

POOL_NONE, POOL_MEAN, POOL_CLS = 0, 1, 2


@dataclass(frozen=True)
class Job:
    """One validated sequence and what to compute for it."""

    token_ids: np.ndarray | None  # int64 [T]
    embeddings: np.ndarray | None  # float32 [T, d_model]
    causal: bool = False
    attn_layers: tuple[int, ...] = ()  # non-negative, in the order asked
    heads_mean: bool = False
    pooling: int = POOL_NONE
    return_hidden: bool = True
    normalize: bool = False  # L2-normalise the pooled vector (fp32, on the device)
    # A task head's name ("classify", "rerank": model/heads.py), run on this sequence's hidden states; "": none.
    head: str = ""
    # int64 [T]: a pair's token types (0 first text, 1 second), for a model whose head has a type delta;
    # None: all 0 (single texts, and models with one token type).
    token_types: np.ndarray | None = None
    # Late interaction (the bundle's "colbert" head, model/heads.py ColbertHead): return this sequence's token
    # vectors (Output.vectors), projected and normalised, from the same forward as everything else asked.
    vectors: bool = False
    # int64 [n]: the positions (< length, ascending) whose vectors are returned, as TextTokenizer.encode(mode=...)
    # says (a document's skip list and padding left out, BGE-M3's first token); None: every position.
    vector_rows: np.ndarray | None = None
    # The leading tokens attended as keys; those after them (a query's expansion [MASK]s) are computed as queries
    # but never attended (Encoded.attend). 0: all `length`.
    attend: int = 0

    @property
    def length(self) -> int:
        data = self.token_ids if self.token_ids is not None else self.embeddings
        assert data is not None
        return int(data.shape[0])

    @property
    def key(self) -> tuple[bool, bool, tuple[int, ...], bool]:
        """Jobs with equal keys run the same computation and may share a batch (heads are per row)."""
        return (self.token_ids is not None, self.causal, self.attn_layers, self.token_types is not None)


@dataclass(frozen=True)
class Output:
    hidden: np.ndarray | None  # float32 [T, d_model]
    pooled: np.ndarray | None  # float32 [d_model]
    attention: np.ndarray | None  # float32 [L, H or 1, T, T]
    fp32_rerun: bool  # the reduced-precision output was non-finite, so this is an fp32 re-run's
    scores: np.ndarray | None = None  # float32 [n_labels]: the head's logits (Job.head)
    vectors: np.ndarray | None = None  # float32 [n, dim]: the token vectors of Job.vector_rows (Job.vectors)


@dataclass(frozen=True)
class ModelSpec:
    """What the service needs to know about the loaded model (from the bundle's manifest)."""

    name: str
    version: str
    checksum: str
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int
    max_length: int
    positional: str
    precision: str
    device: str
    tokenizer: TextTokenizer | None = None  # text bundles: strings -> ids, in validation
    attention_scale: float = 0.0  # the scale the scores are multiplied by
    standard_scale: bool = True  # ... 1/sqrt(d_head); False: the manifest asked for another
    relative_bias: str = "none"
    precision_reason: str = ""  # why this precision: configured, a device default, or measured (service/tuning.py)
    precision_forward_ms: dict[str, float] = field(default_factory=dict)  # measured at warm-up, per precision
    # The served precision's outputs against fp32's on the accuracy gate's calibration inputs (precision=auto on
    # CPU, service/tuning.py Fidelity.measures): pooled_cosine, token_cosine, hidden_error, and where the bundle
    # serves them score_error, rank_swaps, sparse_cosine, vector_cosine; finite 1.0. Empty: fp32 or not measured.
    precision_fidelity: dict[str, float] = field(default_factory=dict)
    max_batch_tokens: int = 0  # the batch budget in force (service/engine.py batch_budget); 0: not yet chosen
    batch_reason: str = ""  # configured, a device default, or the measured curve and the choice
    batch_curve: dict[int, float] = field(default_factory=dict)  # warm-up: batch tokens -> tokens/s
    model_workers: int = 0  # the CPU worker split in force (service/engine.py workers_choice); 0: not yet chosen
    workers_reason: str = ""  # configured, a device default, or the measured splits and the choice
    compared_workers: int = 0  # the split measured against it at warm-up (batch_curve is the chosen one's); 0: none
    compared_curve: dict[int, float] = field(default_factory=dict)  # that split's batch tokens -> tokens/s
    # The manifest's int8/uint8 calibration: (min, max), d_model values each or one pair; None: not stated.
    quantization_ranges: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    tasks: tuple[str, ...] = ("embed",)  # what the bundle serves (manifest tasks)
    labels: tuple[str, ...] = ()  # the classification head's labels, in id order
    problem_type: str = ""  # its Hugging Face problem_type: how scores are computed from logits
    pair_types: bool = False  # the head has a token type delta: a pair's second text gets token type 1
    backend: str = "torchscript"  # what runs the serving forward: torchscript | aoti (service/runner.py)
    # Late interaction (manifest tasks.colbert): the token vectors' width, 0 without a colbert head; how MaxSim
    # reduces over query tokens: "sum" (ColBERT, PyLate) or "mean" (BGE-M3); tasks.sparse's kind: "splade" (a
    # masked-LM head) or "lexical" (BGE-M3's), "" without a sparse head.
    vector_dim: int = 0
    colbert_reduce: str = ""
    sparse_kind: str = ""
