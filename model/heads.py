"""Task heads: small modules run on the encoder's output, each scripted into its own file of the bundle.

The encoder's TorchScript graph stays the same whatever the bundle serves (its op-for-op equality with the
reference is measured); a head is applied by the service to the hidden states of the same batch, in the
same model thread. Heads run in fp32 on the fp32 hidden states.

  ClassifyHead   the first token -> dense -> tanh -> out: BERT's pooler (dense + tanh) and classifier, and
                 RoBERTa / XLM-R's classification head (dense -> tanh -> out_proj on <s>), as Hugging Face's
                 *ForSequenceClassification computes them at inference (dropout is the identity). A
                 reranker (a cross-encoder) is a ClassifyHead with one label.
                 `type_delta` (d_model,): token type 1's embedding minus token type 0's (row 0 is folded into
                 the encoder's word table), for the second text of a pair; empty for a model with one token type.

Both take `forward(hidden (B, T, d_model) fp32, lengths (B,) int64)`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ClassifyHead(nn.Module):
    """(B, T, C) hidden states -> (B, n_labels) logits, from the first token (module docstring)."""

    def __init__(self, d_model: int, n_labels: int, type_delta: Tensor | None = None) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, n_labels)
        delta = torch.zeros(0) if type_delta is None else type_delta.detach().float().reshape(d_model)
        self.register_buffer("type_delta", delta.clone())

    def forward(self, hidden: Tensor, lengths: Tensor) -> Tensor:
        return self.out(torch.tanh(self.dense(hidden[:, 0])))


def probe(head: nn.Module, d_model: int) -> tuple[Tensor, Tensor]:
    """A seeded input for checking a scripted head against its eager module: (hidden (3, 5, C), lengths)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 5, d_model, generator=g), torch.tensor([5, 3, 1])


def pair_embeddings(table: Tensor, type_delta: Tensor, ids: Tensor, types: Tensor) -> Tensor:
    """A batch of pairs as the encoder's `embeddings` input: the word table's rows (token type 0 folded in)
    plus `type_delta` where the token type is 1. ids, types (B, T) int64 -> (B, T, C) in the table's dtype."""
    x = nn.functional.embedding(ids, table)
    return x + types.to(table.dtype)[:, :, None] * type_delta.to(table.dtype)
