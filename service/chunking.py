"""Inputs longer than the model: a call's choice (error | truncate | chunk), the windows of a chunked
sequence (planned in validation), and its outputs stitched back from theirs (in the response).

The window W is the model's length: `max_length` tokens for token ids and embeddings, the tokenizer's
`max_tokens` for text (special tokens included). A sequence of T <= W tokens is never windowed: it is
one job, computed exactly as without the choice.

Windows of a sequence of T > W tokens, with stride S (1 <= S <= W; 0 asks for the default, W // 2):
they start at 0, S, 2S, ... for as long as a window ends before the sequence does, and one last window
ends with it (starts at T - W). Every window is W long, so no window is padded and the last one may
overlap its neighbour by more than W - S. S = W cuts the sequence into consecutive pieces (the last
shifted back to stay W long); a smaller S gives each token more context on both sides.

Most central: window k (start a_k) has its centre at a_k + (W - 1) / 2; token t takes its hidden state
from the window whose centre is nearest to t, the earlier window on a tie. Equivalently, the window in
which t has the most context on its shorter side, min(t - a_k, a_k + W - 1 - t). So window k supplies
a contiguous run of tokens: from the midpoint after its predecessor's centre to the midpoint before its
successor's (`Chunked.bounds`).

Each window is encoded as the model saw sequences in training: from position 0, alone, with no
attention to the tokens outside it. Text windows are cut from the whole tokenized text ([CLS] at its
start and [SEP] at its end stay where they are; windows are not wrapped in special tokens again), so
the tokens keep the ids a caller sees with return_tokens. Pooled outputs are computed over the
stitched hidden states in float32 on the host: MEAN is the mean over all T tokens, CLS the first
token's (window 0's), then L2-normalised as the runner does (x / max(|x|, 1e-12)) when asked.
Windows ride the batcher as ordinary jobs (token budget, age bound, cancellation, the queue bound);
the call counts their lengths summed towards max_tokens_per_call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from service.errors import InvalidInput
from service.jobs import POOL_MEAN, POOL_NONE, Job, Output

ERROR, TRUNCATE, CHUNK = "error", "truncate", "chunk"
MODES = (ERROR, TRUNCATE, CHUNK)


@dataclass(frozen=True)
class LongInputs:
    """A call's choice for sequences longer than the model; `stride` only with CHUNK (0: W // 2)."""

    mode: str = ERROR
    stride: int = 0

    def step(self, window: int) -> int:
        return self.stride or max(1, window // 2)


REFUSE = LongInputs()  # the default: a long sequence is INVALID_ARGUMENT


def choose(mode: str | None, truncate: bool, stride: int, *, mode_field: str, stride_field: str,
           windows: Sequence[int]) -> LongInputs:
    """The call's `LongInputs` from its fields: `mode` (None = unset: what the older `truncate` flag
    says), `truncate`, and `stride`, which must lie in 1..W for every window W the call uses."""
    if mode is None:
        mode = TRUNCATE if truncate else ERROR
    elif truncate and mode != TRUNCATE:
        raise InvalidInput(mode_field, f"{mode} contradicts truncate = true; set one of them")
    if stride and mode != CHUNK:
        raise InvalidInput(stride_field, f"given, but long inputs are set to {mode}, not chunk")
    if stride < 0 or (windows and stride > min(windows)):
        raise InvalidInput(stride_field, f"must be 1..{min(windows) if windows else 'the window'} tokens "
                                         f"(0: half the window); got {stride}")
    return LongInputs(mode, stride)


def window_starts(length: int, window: int, stride: int) -> tuple[int, ...]:
    """Where the windows of a sequence of `length` > `window` tokens start (module docstring)."""
    assert length > window >= stride > 0, (length, window, stride)
    return (*range(0, length - window, stride), length - window)


def truncated(job: Job, window: int, side: str = "right") -> Job:
    """`job` cut to its first `window` tokens (or embedding rows); side "left": to its last."""
    keep = slice(None, window) if side == "right" else slice(job.length - window, None)
    ids = job.token_ids[keep] if job.token_ids is not None else None
    emb = job.embeddings[keep] if job.embeddings is not None else None
    return dataclasses.replace(job, token_ids=ids, embeddings=emb)


@dataclass(frozen=True)
class Chunked:
    """A sequence encoded in windows: the whole sequence as asked (`job`), and where its windows start."""

    job: Job
    window: int
    starts: tuple[int, ...]

    @classmethod
    def plan(cls, job: Job, window: int, stride: int) -> Chunked:
        return cls(job, window, window_starts(job.length, window, stride))

    def jobs(self) -> list[Job]:
        """The windows as jobs: hidden states only, whatever the call asked; pooling comes after stitching."""
        w, job = self.window, self.job
        return [dataclasses.replace(
            job, token_ids=None if job.token_ids is None else job.token_ids[a: a + w],
            embeddings=None if job.embeddings is None else job.embeddings[a: a + w],
            attn_layers=(), heads_mean=False, pooling=POOL_NONE, return_hidden=True, normalize=False,
        ) for a in self.starts]

    @cached_property
    def bounds(self) -> tuple[int, ...]:
        """Window k supplies tokens bounds[k]:bounds[k + 1]: those nearer its centre than any other's."""
        a, w = self.starts, self.window
        # Token t belongs to window k - 1 while 2t <= centre(k - 1) + centre(k) = a[k-1] + a[k] + w - 1.
        return (0, *((a[k - 1] + a[k] + w - 1) // 2 + 1 for k in range(1, len(a))), self.job.length)

    def stitch(self, outputs: Sequence[Output]) -> Output:
        """The sequence's output from its windows' (in window order)."""
        assert len(outputs) == len(self.starts), "one output per window. This is a bug."
        first = outputs[0].hidden
        assert first is not None, "a window without hidden states. This is a bug."
        hidden = np.empty((self.job.length, first.shape[1]), np.float32)  # (T, D)
        bounds = self.bounds
        for k, (a, out) in enumerate(zip(self.starts, outputs, strict=True)):
            assert out.hidden is not None
            hidden[bounds[k]: bounds[k + 1]] = out.hidden[bounds[k] - a: bounds[k + 1] - a]
        pooled = None
        if self.job.pooling != POOL_NONE:
            pooled = hidden.mean(axis=0, dtype=np.float32) if self.job.pooling == POOL_MEAN else hidden[0].copy()  # CLS
            if self.job.normalize:
                pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
        return Output(hidden if self.job.return_hidden else None, pooled, None,
                      any(out.fp32_rerun for out in outputs))


def sequences(jobs: Sequence[Job], chunks: Sequence[Chunked | None]) -> list[Job]:
    """One job per sequence of the call, as asked: a chunked sequence whole, in place of its windows."""
    out, at = [], 0
    for chunk in chunks:
        if chunk is None:
            out.append(jobs[at])
            at += 1
        else:
            out.append(chunk.job)
            at += len(chunk.starts)
    return out


def stitch_all(chunks: Sequence[Chunked | None], outputs: Sequence[Output]) -> list[Output]:
    """Per sequence of the call, its output: its own, or stitched from its windows'."""
    out, at = [], 0
    for chunk in chunks:
        if chunk is None:
            out.append(outputs[at])
            at += 1
        else:
            out.append(chunk.stitch(outputs[at: at + len(chunk.starts)]))
            at += len(chunk.starts)
    assert at == len(outputs), "outputs left over after stitching. This is a bug."
    return out
