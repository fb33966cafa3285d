"""The model runner: loads a bundle, picks device and precision, pads and collates a batch, runs it
under `torch.inference_mode()`, checks every sequence's output for NaN/Inf, and splits the batch
back into per-sequence numpy arrays with the padding stripped.

`execute` is called on the batcher's model thread only (the event loop never runs a forward).
Failure handling, per batch:
- NaN/Inf in a sequence's output under fp16/bf16: re-run those sequences in fp32 (policy `retry`)
  or fail them (`fail`) with `NonFiniteOutput`; counted either way. A non-finite output is never
  returned.
- out of memory: split the batch in halves and retry; one sequence that still does not fit gets
  `OutOfMemory` (RESOURCE_EXHAUSTED).
- any other exception: bisect the same way, so only the sequence that makes the model fail gets
  `ModelFailure` (INTERNAL, with a reference id that is in the log next to the traceback).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from model.bundle import load_bundle
from service.config import ServiceConfig
from service.errors import ModelFailure, NonFiniteOutput, OutOfMemory, ServiceError

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
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

    @property
    def length(self) -> int:
        data = self.token_ids if self.token_ids is not None else self.embeddings
        assert data is not None
        return int(data.shape[0])

    @property
    def key(self) -> tuple[bool, bool, tuple[int, ...]]:
        """Jobs with equal keys run the same computation and may share a batch."""
        return (self.token_ids is not None, self.causal, self.attn_layers)


@dataclass(frozen=True)
class Output:
    hidden: np.ndarray | None  # float32 [T, d_model]
    pooled: np.ndarray | None  # float32 [d_model]
    attention: np.ndarray | None  # float32 [L, H or 1, T, T]
    nonfinite: bool  # the reduced-precision output was non-finite; this is the fp32 re-run


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


class RunnerObserver(Protocol):
    def on_forward(self, precision: str, seconds: float) -> None: ...
    def on_nonfinite(self, precision: str, count: int) -> None: ...
    def on_fp32_retry(self, count: int) -> None: ...
    def on_split(self, reason: str) -> None: ...


def default_threads() -> int:
    """Intra-op threads when the config says 0: one per usable core (torch's own default, stated)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_batch_tokens(device: str) -> int:
    """The token budget when the config says 0 (`device` as configured: auto | cpu | cuda). On CPU,
    forwards are most efficient per token at about 2048 tokens (bench/RESULTS.md); a GPU wants more."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return 16384 if cuda else 2048


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but CUDA is not available")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def is_oom(exc: BaseException) -> bool:
    # TorchScript hides the type: an allocation failure inside it arrives as a plain RuntimeError.
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class Runner:
    """Owns the model. `load()` and `warmup()` run once before serving; then `execute()` per batch."""

    def __init__(self, config: ServiceConfig, bundle_dir: str, observer: RunnerObserver) -> None:
        self._config = config
        self._bundle_dir = bundle_dir
        self._observer = observer
        self.device = resolve_device(config.device)
        self.precision = resolve_precision(config.precision, self.device)
        self._module: Any = None
        self._fp32_module: Any = None
        self.spec: ModelSpec | None = None

    def load(self) -> ModelSpec:
        if self.device.type == "cpu":
            torch.set_num_threads(self._config.torch_threads or default_threads())
        bundle = load_bundle(self._bundle_dir, device=str(self.device), dtype=DTYPES[self.precision])
        self._module = bundle.module
        if self.precision != "fp32" and self._config.nonfinite_policy == "retry":
            self._fp32_module = load_bundle(self._bundle_dir, device=str(self.device)).module
        m, cfg = bundle.manifest, bundle.manifest.config
        self.spec = ModelSpec(
            name=m.name, version=m.version, checksum=m.sha256,
            d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers, vocab_size=cfg.vocab_size,
            max_length=cfg.max_length, positional=cfg.positional,
            precision=self.precision, device=str(self.device),
        )
        return self.spec

    def warmup(self, max_batch_tokens: int, max_batch_size: int) -> None:
        """Forwards at the largest batch shape the limits allow, plus the attention path."""
        spec = self._require_spec()
        n = max(1, min(max_batch_size, max_batch_tokens // spec.max_length))
        ids = np.zeros(spec.max_length, dtype=np.int64)
        for jobs in (
            [Job(ids, None)] * n,
            [Job(ids[:8], None, attn_layers=tuple(range(spec.n_layers)), pooling=POOL_MEAN)] * 2,
            [Job(None, np.zeros((8, spec.d_model), np.float32), causal=True)],
        ):
            outputs, _ = self.execute(jobs)
            failed = [o for o in outputs if isinstance(o, ServiceError)]
            if failed:
                raise RuntimeError(f"warm-up failed: {failed[0]}")
        if self._fp32_module is not None:
            self._forward(self._fp32_module, [Job(ids[:8], None)])

    def execute(self, jobs: list[Job]) -> tuple[list[Output | ServiceError], float]:
        started = time.perf_counter()
        outputs = self._run_split(jobs)
        return outputs, time.perf_counter() - started

    # -- internals -------------------------------------------------------------------------------

    def _require_spec(self) -> ModelSpec:
        assert self.spec is not None, "Runner.load() was not called. This is a bug."
        return self.spec

    def _run_split(self, jobs: list[Job]) -> list[Output | ServiceError]:
        try:
            return self._run(jobs)
        except Exception as exc:  # noqa: BLE001 - classified below; never escapes the model thread
            oom = is_oom(exc)
            if len(jobs) == 1:
                if oom:
                    return [OutOfMemory(f"insufficient device memory for 1 sequence of {jobs[0].length} tokens")]
                error = ModelFailure()
                log.error("model failed on one sequence (ref=%s)", error.ref, exc_info=exc)
                return [error]
            if oom and self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._observer.on_split("oom" if oom else "error")
            mid = len(jobs) // 2
            return self._run_split(jobs[:mid]) + self._run_split(jobs[mid:])

    def _run(self, jobs: list[Job]) -> list[Output | ServiceError]:
        hidden, attention, finite = self._forward(self._module, jobs)
        outputs: list[Output | ServiceError] = [
            _split(job, hidden, attention, row, nonfinite=False) for row, job in enumerate(jobs)
        ]
        bad = [row for row in range(len(jobs)) if not finite[row]]
        if not bad:
            return outputs
        self._observer.on_nonfinite(self.precision, len(bad))
        if self._fp32_module is None:
            for row in bad:
                outputs[row] = error = NonFiniteOutput()
                log.warning("non-finite output at %s; policy fails it (ref=%s)", self.precision, error.ref)
            return outputs
        self._observer.on_fp32_retry(len(bad))
        retry = [jobs[row] for row in bad]
        hidden32, attention32, finite32 = self._forward(self._fp32_module, retry)
        for i, row in enumerate(bad):
            if finite32[i]:
                outputs[row] = _split(retry[i], hidden32, attention32, i, nonfinite=True)
            else:
                outputs[row] = error = NonFiniteOutput()
                log.warning("non-finite output even in fp32 (ref=%s)", error.ref)
        return outputs

    def _forward(self, module: Any, jobs: Sequence[Job]) -> tuple[torch.Tensor, torch.Tensor | None, list[bool]]:
        """Collate, run, and return hidden (fp32, [B,T,D] on CPU), attention and per-row finiteness."""
        spec = self._require_spec()
        first = jobs[0]
        lengths_list = [job.length for job in jobs]
        B, T = len(jobs), max(lengths_list)
        lengths = torch.tensor(lengths_list, dtype=torch.int64, device=self.device)
        ids = emb = None
        if first.token_ids is not None:
            batch = np.zeros((B, T), dtype=np.int64)
            for row, job in enumerate(jobs):
                assert job.token_ids is not None  # one key per batch: all ids or all embeddings
                batch[row, : job.length] = job.token_ids
            ids = torch.from_numpy(batch).to(self.device, non_blocking=True)
        else:
            batch_f = np.zeros((B, T, spec.d_model), dtype=np.float32)
            for row, job in enumerate(jobs):
                batch_f[row, : job.length] = job.embeddings
            dtype = DTYPES[self.precision] if module is self._module else torch.float32
            emb = torch.from_numpy(batch_f).to(self.device, dtype=dtype, non_blocking=True)
        layers = sorted(set(first.attn_layers))
        started = time.perf_counter()
        with torch.inference_mode():
            hidden, attention = module(ids, emb, lengths, first.causal, layers)
            hidden = hidden.float()
            real = torch.arange(T, device=hidden.device)[None, :] < lengths[:, None]  # (B, T)
            finite = (torch.isfinite(hidden).all(dim=-1) | ~real).all(dim=-1)  # (B,)
            if attention is not None:
                if layers != list(first.attn_layers):  # the order asked for
                    attention = attention[:, [layers.index(layer) for layer in first.attn_layers]]
                attention = attention.float()
                finite &= torch.isfinite(attention).flatten(1).all(dim=1)
                if first.heads_mean:
                    attention = attention.mean(dim=2, keepdim=True)  # (B, L, 1, T, T)
                attention = attention.cpu()
            hidden = hidden.cpu()
            finite_list = finite.cpu().tolist()
        self._observer.on_forward(self.precision if module is self._module else "fp32",
                                  time.perf_counter() - started)
        return hidden, attention, finite_list


def _split(job: Job, hidden: torch.Tensor, attention: torch.Tensor | None, row: int, *, nonfinite: bool) -> Output:
    """One row of a batch, padding stripped, as numpy."""
    n = job.length
    h = hidden[row, :n]  # (T, D)
    pooled = None
    if job.pooling == POOL_MEAN:
        pooled = h.mean(dim=0).numpy()
    elif job.pooling == POOL_CLS:
        pooled = h[0].numpy()
    att = attention[row, :, :, :n, :n].contiguous().numpy() if attention is not None else None  # (L, H, T, T)
    return Output(h.numpy() if job.return_hidden else None, pooled, att, nonfinite)
