"""A fault-injecting model for the service's reliability tests: a TINY encoder that misbehaves on sentinel ids.

Same scripted forward as Encoder, saved as an ordinary bundle named "fault-model". A sentinel acts when
it appears at a real position (< length) of any row of token_ids (embeddings input has no sentinels):

  SLEEP=99              sleep `sleep_ms` (default 200 ms) per occurrence in the batch, at most 30 s
  HANG=93               block until HANG_RELEASE is set, or fault_ops.HANG_TIMEOUT_S (30 s); then run normally.
                        HANG_ENTERED is set when the block starts, so tests can wait for it without sleeping
  LEAK=92               append LEAK_BYTES (1 MiB) to the module-global LEAKED list, once per call
  RAISE=98              RuntimeError "fault-model: RAISE sentinel"
  OOM=97                RuntimeError "CUDA out of memory. Tried to allocate ..." (always)
  OOM_IF_BATCH_GT_1=96  the same, only when the batch has more than one row (to test split-and-retry)
  NAN_ROW=95            NaN hidden states (and attention weights) for that row, only when the module
                        is not float32, so an fp32 retry recovers it
  NAN_ALWAYS=94         NaN for that row in every dtype
Faults fire in that order (sleep, hang and leak, then raise), before the encoder runs. Rows without
sentinels get exactly the wrapped encoder's output. Raised errors cross the TorchScript interpreter
as plain RuntimeError whose text starts with "The following operation failed in the TorchScript
interpreter" and ends with the message above, which is how a real OOM inside TorchScript looks.

The effects are custom ops (namespace attention_faults) implemented in Python in model/fault_ops.py,
so a process must import it before torch.jit.load of a fault bundle; model.bundle.load_bundle does that
itself for bundles named "fault-model". The state the ops act on (HANG_RELEASE, HANG_ENTERED, LEAKED,
reset) is re-exported here; HANG_TIMEOUT_S lives in model.fault_ops.
"""


import os
from typing import Final, List, Optional, Tuple

import torch
from torch import Tensor, nn

from model.bundle import FAULT_MODEL_NAME, Manifest, save_bundle
from model.config import TINY, EncoderConfig
from model.encoder import Encoder
from model.fault_ops import HANG_ENTERED, HANG_RELEASE, LEAKED, reset  # noqa: F401  (the state tests use)

SLEEP: Final = 99
RAISE: Final = 98
OOM: Final = 97
OOM_IF_BATCH_GT_1: Final = 96
NAN_ROW: Final = 95
NAN_ALWAYS: Final = 94
HANG: Final = 93
LEAK: Final = 92
SENTINELS: Final = (SLEEP, RAISE, OOM, OOM_IF_BATCH_GT_1, NAN_ROW, NAN_ALWAYS, HANG, LEAK)

SLEEP_MS = 200
MAX_SLEEP_MS = 30_000
LEAK_BYTES = 1 << 20
RAISE_MESSAGE = "fault-model: RAISE sentinel"
OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB (fault-model OOM sentinel)"
FAULT_CONFIG = TINY  # vocab_size 100: the sentinels are its top ids


class FaultModel(nn.Module):
    """Encoder(config) behind the sentinel checks; forward has Encoder.forward's signature."""

    __jit_ignored_attributes__ = ["config"]
    sleep_ms: Final[int]
    # TorchScript cannot read module globals; class-level Finals become constants of the graph.
    SLEEP: Final[int] = SLEEP
    RAISE: Final[int] = RAISE
    OOM: Final[int] = OOM
    OOM_IF_BATCH_GT_1: Final[int] = OOM_IF_BATCH_GT_1
    NAN_ROW: Final[int] = NAN_ROW
    NAN_ALWAYS: Final[int] = NAN_ALWAYS
    HANG: Final[int] = HANG
    LEAK: Final[int] = LEAK
    MAX_SLEEP_MS: Final[int] = MAX_SLEEP_MS
    LEAK_BYTES: Final[int] = LEAK_BYTES
    RAISE_MESSAGE: Final[str] = RAISE_MESSAGE
    OOM_MESSAGE: Final[str] = OOM_MESSAGE

    def __init__(self, config: EncoderConfig = FAULT_CONFIG, seed: int = 0, sleep_ms: int = SLEEP_MS) -> None:
        super().__init__()
        if config.vocab_size <= max(SENTINELS):
            raise ValueError(f"fault model vocab_size must exceed {max(SENTINELS)}, got {config.vocab_size}")
        self.config = config
        self.sleep_ms = sleep_ms
        self.encoder = Encoder(config).init_weights(seed)

    def forward(
        self,
        token_ids: Optional[Tensor],
        embeddings: Optional[Tensor],
        lengths: Tensor,
        causal: bool,
        attn_layers: List[int],
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if token_ids is None:
            return self.encoder(token_ids, embeddings, lengths, causal, attn_layers)
        B, T = token_ids.size(0), token_ids.size(1)
        real = torch.arange(T, device=token_ids.device)[None, :] < lengths[:, None].to(token_ids.device)  # (B, T)
        ids = token_ids.masked_fill(~real, -1)  # (B, T): padding never matches a sentinel
        n_sleep = int((ids == self.SLEEP).sum())
        if n_sleep > 0:
            torch.ops.attention_faults.sleep(ids, min(n_sleep * self.sleep_ms, self.MAX_SLEEP_MS))
        if bool((ids == self.HANG).any()):
            torch.ops.attention_faults.hang(ids)
        if bool((ids == self.LEAK).any()):
            torch.ops.attention_faults.leak(ids, self.LEAK_BYTES)
        if bool((ids == self.RAISE).any()):
            torch.ops.attention_faults.fail(ids, self.RAISE_MESSAGE, False)
        if bool((ids == self.OOM).any()) or (B > 1 and bool((ids == self.OOM_IF_BATCH_GT_1).any())):
            torch.ops.attention_faults.fail(ids, self.OOM_MESSAGE, True)
        hidden, weights = self.encoder(token_ids, embeddings, lengths, causal, attn_layers)
        nan_rows = (ids == self.NAN_ALWAYS).any(dim=1)  # (B,)
        if hidden.dtype != torch.float32:
            nan_rows = nan_rows | (ids == self.NAN_ROW).any(dim=1)
        hidden = hidden.masked_fill(nan_rows[:, None, None], float("nan"))  # (B, T, C)
        if weights is not None:
            weights = weights.masked_fill(nan_rows[:, None, None, None, None], float("nan"))  # (B, L, nh, T, T)
        return hidden, weights


def build_fault_bundle(directory: str | os.PathLike[str], *, seed: int = 0, sleep_ms: int = SLEEP_MS,
                       config: EncoderConfig = FAULT_CONFIG) -> Manifest:
    """Save FaultModel as a bundle named "fault-model" (version "1") into `directory`."""
    module = FaultModel(config, seed=seed, sleep_ms=sleep_ms)
    return save_bundle(module, directory, name=FAULT_MODEL_NAME, version="1",
                       source=f"faults:seed={seed},sleep_ms={sleep_ms}")
