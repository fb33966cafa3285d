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

  SparseHead     SPLADE's sparse vector from a masked-LM head: transform (dense -> activation -> LayerNorm),
                 the decoder (tied to the word embeddings) plus its bias, then per vocabulary entry the max over
                 the sequence's real tokens of log(1 + relu(logit)). Rows run a few at a time so that the
                 (rows, T, vocab) logits stay under SPARSE_CHUNK_ELEMENTS.

  ColbertHead    late interaction (ColBERT, BGE-M3's colbert_linear): each token's hidden state through a
                 chain of linear layers (PyLate's Dense modules: a bias or not, identity or tanh; ColBERT's
                 `linear`, no bias; BGE-M3's colbert_linear, with bias), then L2-normalised as F.normalize does
                 (x / max(|x|, 1e-12)): (B, T, C) -> (B, T, dim), every position (the caller picks the rows).

  LexicalHead    BGE-M3's sparse weights: relu(sparse_linear(h)) per real token, the max per token id over the
                 sequence scattered into a (B, vocab) vector, its excluded ids (cls, eos, pad, unk) zero; what
                 FlagEmbedding's _sparse_embedding computes for its lexical matching score. It reads the token
                 ids: forward(hidden, lengths, ids) (`takes_ids`).

All take `forward(hidden (B, T, d_model) fp32, lengths (B,) int64)` (LexicalHead also the ids (B, T) int64).
"""


from typing import Final

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


SPARSE_CHUNK_ELEMENTS = 1 << 25  # 128 MiB of fp32 logits at a time


class SparseHead(nn.Module):
    """(B, T, C) hidden states -> (B, vocab) SPLADE weights, padding excluded (module docstring)."""

    chunk: Final[int]
    gelu: Final[bool]

    def __init__(self, d_model: int, vocab_size: int, activation: str, eps: float) -> None:
        super().__init__()
        if activation not in ("gelu", "relu"):
            raise ValueError(f"activation must be gelu or relu, got {activation!r}")
        self.gelu = activation == "gelu"
        self.dense = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.decoder = nn.Linear(d_model, vocab_size)
        self.chunk = SPARSE_CHUNK_ELEMENTS

    def forward(self, hidden: Tensor, lengths: Tensor) -> Tensor:
        B, T = hidden.size(0), hidden.size(1)
        x = self.dense(hidden)
        x = nn.functional.gelu(x) if self.gelu else torch.relu(x)
        x = self.norm(x)
        real = torch.arange(T, device=hidden.device)[None, :, None] < lengths[:, None, None]  # (B, T, 1)
        rows = max(1, self.chunk // max(1, T * self.decoder.out_features))
        parts: list[Tensor] = []
        for start in range(0, B, rows):
            logits = self.decoder(x[start:start + rows])  # (rows, T, V)
            weights = torch.log1p(torch.relu(logits))
            parts.append(torch.where(real[start:start + rows], weights, 0.0).amax(dim=1))
        return torch.cat(parts, dim=0)


class ColbertHead(nn.Module):
    """(B, T, C) hidden states -> (B, T, dim) unit token vectors, every position (module docstring)."""

    dim: Final[int]

    def __init__(self, layers: list[tuple[Tensor, Tensor | None, str]]) -> None:
        """layers: (weight (out, in), bias (out,) or None, activation "identity" | "tanh"), applied in order."""
        super().__init__()
        chain = []
        for weight, bias, activation in layers:
            if activation not in ("identity", "tanh"):
                raise ValueError(f"activation must be identity or tanh, got {activation!r}")
            linear = nn.Linear(int(weight.shape[1]), int(weight.shape[0]), bias=bias is not None)
            with torch.no_grad():
                linear.weight.copy_(weight.detach().float())
                if bias is not None:
                    linear.bias.copy_(bias.detach().float())
            chain.append(nn.Sequential(linear, nn.Tanh()) if activation == "tanh" else nn.Sequential(linear))
        if not chain:
            raise ValueError("a ColbertHead needs at least one linear layer")
        self.layers = nn.ModuleList(chain)
        self.dim = int(layers[-1][0].shape[0])

    def forward(self, hidden: Tensor, lengths: Tensor) -> Tensor:
        x = hidden
        for layer in self.layers:
            x = layer(x)  # (B, T, out)
        return nn.functional.normalize(x, p=2.0, dim=-1)  # (B, T, dim)


class LexicalHead(nn.Module):
    """(B, T, C) hidden states and (B, T) ids -> (B, vocab) BGE-M3 lexical weights (module docstring)."""

    takes_ids: Final[bool]

    def __init__(self, weight: Tensor, bias: Tensor, vocab_size: int, excluded: list[int]) -> None:
        super().__init__()
        self.takes_ids = True
        self.linear = nn.Linear(int(weight.shape[1]), 1)
        with torch.no_grad():
            self.linear.weight.copy_(weight.detach().float().reshape(1, -1))
            self.linear.bias.copy_(bias.detach().float().reshape(1))
        self.vocab_size = vocab_size
        self.register_buffer("excluded", torch.tensor(sorted(set(excluded)), dtype=torch.int64))

    def forward(self, hidden: Tensor, lengths: Tensor, ids: Tensor) -> Tensor:
        B, T = hidden.size(0), hidden.size(1)
        weights = torch.relu(self.linear(hidden)).squeeze(-1)  # (B, T)
        real = torch.arange(T, device=hidden.device)[None, :] < lengths[:, None]  # (B, T)
        weights = torch.where(real, weights, 0.0)  # padding: no weight (its id is whatever the batch padded with)
        out = torch.zeros(B, self.vocab_size, dtype=weights.dtype, device=weights.device)
        out = out.scatter_reduce(1, ids, weights, reduce="amax")  # (B, vocab): the max per id, 0 where absent
        return out.index_fill(1, self.excluded, 0.0)


def probe(head: nn.Module, d_model: int) -> tuple[Tensor, ...]:
    """A seeded input for checking a scripted head against its eager module: (hidden (3, 5, C), lengths), and
    the token ids (3, 5) for a head that `takes_ids`."""
    g = torch.Generator().manual_seed(0)
    hidden, lengths = torch.randn(3, 5, d_model, generator=g), torch.tensor([5, 3, 1])
    if getattr(head, "takes_ids", False):
        vocab = int(head.vocab_size)
        return hidden, lengths, torch.randint(0, vocab, (3, 5), generator=g)
    return hidden, lengths


def pair_embeddings(table: Tensor, type_delta: Tensor, ids: Tensor, types: Tensor) -> Tensor:
    """A batch of pairs as the encoder's `embeddings` input: the word table's rows (token type 0 folded in)
    plus `type_delta` where the token type is 1. ids, types (B, T) int64 -> (B, T, C) in the table's dtype."""
    x = nn.functional.embedding(ids, table)
    return x + types.to(table.dtype)[:, :, None] * type_delta.to(table.dtype)
