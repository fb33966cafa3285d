"""Shared helpers for the model tests: stock PyTorch references, batches, error measures."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import TINY, EncoderConfig
from model.encoder import Encoder, MultiHeadAttention


def tiny(**changes: object) -> EncoderConfig:
    return dataclasses.replace(TINY, **changes)


class StockEncoder(nn.Module):
    """nn.Embedding + nn.TransformerEncoder, the model convert.py reads (keys embedding.*, encoder.*)."""

    def __init__(self, config: EncoderConfig, final_norm: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        layer = nn.TransformerEncoderLayer(
            config.d_model, config.n_heads, config.d_ff, dropout=0.0, activation=config.activation,
            layer_norm_eps=config.layer_norm_eps, batch_first=True, norm_first=config.norm_first,
        )
        norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if final_norm else None
        # enable_nested_tensor=False: the nested fast path zeroes padded rows; we compare real rows anyway.
        self.encoder = nn.TransformerEncoder(layer, config.n_layers, norm=norm, enable_nested_tensor=False)

    def forward(self, ids: Tensor, lengths: Tensor, causal: bool = False) -> Tensor:
        T = ids.shape[1]
        pad = torch.arange(T)[None, :] >= lengths[:, None]  # True = padding, as PyTorch wants
        mask = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None  # True = may not attend
        return self.encoder(self.embedding(ids), mask=mask, src_key_padding_mask=pad, is_causal=causal)


def stock_mha(ours: MultiHeadAttention, d_model: int, n_heads: int) -> nn.MultiheadAttention:
    """nn.MultiheadAttention holding the same weights as our attention."""
    mha = nn.MultiheadAttention(d_model, n_heads, batch_first=True, dropout=0.0)
    with torch.no_grad():
        mha.in_proj_weight.copy_(ours.qkv.weight)
        mha.in_proj_bias.copy_(ours.qkv.bias)
        mha.out_proj.weight.copy_(ours.proj.weight)
        mha.out_proj.bias.copy_(ours.proj.bias)
    return mha.eval()


def key_mask(lengths: Tensor, T: int, causal: bool) -> Tensor:
    """Our mask convention: bool (B, 1, 1|T, T), True where a query may attend to a key."""
    positions = torch.arange(T)
    mask = (positions[None, :] < lengths[:, None])[:, None, None, :]
    if causal:
        mask = mask & (positions[None, :] <= positions[:, None])
    return mask


def batch(config: EncoderConfig, lengths: list[int], seed: int = 0, T: int | None = None) -> tuple[Tensor, Tensor]:
    """Random ids (B, T) padded with 0 beyond each length, and the lengths tensor."""
    g = torch.Generator().manual_seed(seed)
    T = T if T is not None else max(lengths)
    ids = torch.randint(1, config.vocab_size // 2, (len(lengths), T), generator=g)
    lengths_t = torch.tensor(lengths)
    ids = ids.masked_fill(torch.arange(T)[None, :] >= lengths_t[:, None], 0)
    return ids, lengths_t


def rel_err(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want|: the reduced-precision measure in encoder.py's docstring."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def max_errors(config: EncoderConfig, dtype: torch.dtype, lengths: list[int], causal: bool, *, seed: int = 0,
               device: str = "cpu") -> tuple[float, float]:
    """(relative error of hidden states, absolute error of weights) of `dtype` against fp32 on `device`,
    both attention paths (SDPA, and the explicit one that returns weights), real positions only."""
    fp32 = Encoder(config).init_weights(seed).eval().to(device)
    low = Encoder(config).init_weights(seed).eval().to(device, dtype)
    ids, lengths_t = batch(config, lengths, seed=seed)
    ids, lengths_t = ids.to(device), lengths_t.to(device)
    real = torch.arange(ids.shape[1], device=device)[None, :] < lengths_t[:, None]
    hidden_err = weight_err = 0.0
    with torch.inference_mode():
        for layers in ([], list(range(config.n_layers))):
            want, want_w = fp32(ids, None, lengths_t, causal, layers)
            got, got_w = low(ids, None, lengths_t, causal, layers)
            assert got.dtype == dtype and torch.isfinite(got).all()
            hidden_err = max(hidden_err, rel_err(got[real], want[real]))
            if layers:
                assert got_w is not None and want_w is not None and got_w.dtype == torch.float32
                weight_err = max(weight_err, float((got_w - want_w).abs().max()))
    return hidden_err, weight_err


def linear_rows(fn: Callable[[], object]) -> list[int]:
    """The number of rows (tokens) every nn.Linear in fn() ran on, read with the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [math.prod(e.input_shapes[0][:-1]) for e in prof.events() if e.name == "aten::linear"]


def reference_norm(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, c: EncoderConfig) -> torch.Tensor:
    """A LayerNorm or RMSNorm by its definition, with the weights under `name` in `sd`."""
    w = sd[name + ".weight"]
    if c.norm == "rms":
        return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + c.layer_norm_eps) * w
    return F.layer_norm(x, (c.d_model,), w, sd.get(name + ".bias"), c.layer_norm_eps)


def reference_act(x: torch.Tensor, kind: str) -> torch.Tensor:
    """An activation by its definition."""
    if kind == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if kind == "silu":
        return x * torch.sigmoid(x)
    return x.clamp(min=0)


def randomized_encoder(config: EncoderConfig, seed: int) -> Encoder:
    encoder = Encoder(config).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # init_weights sets norms to (1, 0): perturb them so their weights and biases count
        for name, p in encoder.named_parameters():
            if ".ln" in f".{name}" or name.startswith("ln"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.mul_(0.5)
    return encoder.eval()
