"""Encoders written the way the tutorials this project grew from write them, for the conversion tests.

Each class is the article's code (comments and dropout aside), assembled into a small encoder-only model
whose forward is `forward(src, mask)`: src (B, T) int64, mask bool (B, 1, 1|T, T), True (1) where a query
may attend to a key: the articles' own convention (`masked_fill(mask == 0, ...)`). That is the contract
`python -m model check --reference module.py:factory` calls. Each attention keeps its last probabilities
in `attn_probs` (B, heads, T, T), as the articles do for plotting.
"""

import math

import torch
from torch import nn

# -- "Build your own Transformer from scratch": W_q/W_k/W_v/W_o, split_heads, sinusoidal PositionalEncoding,
#    post-LN EncoderLayer; the improvement article's RelativePositionBias(num_heads, max_len).


class RelativePositionBias(nn.Module):
    def __init__(self, num_heads, max_len):
        super().__init__()
        self.relative_bias = nn.Parameter(torch.zeros(num_heads, max_len, max_len))

    def forward(self, q_len, k_len):
        return self.relative_bias[:, :q_len, :k_len]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, bias=True, relative_bias_max_len=None):
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model, bias=bias)
        self.W_k = nn.Linear(d_model, d_model, bias=bias)
        self.W_v = nn.Linear(d_model, d_model, bias=bias)
        self.W_o = nn.Linear(d_model, d_model, bias=bias)
        self.relative_position_bias = (RelativePositionBias(num_heads, relative_bias_max_len)
                                       if relative_bias_max_len else None)

    def scaled_dot_product_attention(self, Q, K, V, mask=None, position_bias=None):
        attn_scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.d_k)
        if position_bias is not None:
            attn_scores = attn_scores + position_bias
        if mask is not None:
            attn_scores = attn_scores.masked_fill(mask == 0, -1e9)
        attn_probs = torch.softmax(attn_scores, dim=-1)
        self.attn_probs = attn_probs
        output = torch.matmul(attn_probs, V)
        return output

    def split_heads(self, x):
        batch_size, seq_length, d_model = x.size()
        return x.view(batch_size, seq_length, self.num_heads, self.d_k).transpose(1, 2)

    def combine_heads(self, x):
        batch_size, _, seq_length, d_k = x.size()
        return x.transpose(1, 2).contiguous().view(batch_size, seq_length, self.d_model)

    def forward(self, Q, K, V, mask=None, position_bias=None):
        Q = self.split_heads(self.W_q(Q))
        K = self.split_heads(self.W_k(K))
        V = self.split_heads(self.W_v(V))
        if self.relative_position_bias is not None:
            position_bias = self.relative_position_bias(Q.size(2), K.size(2))
        attn_output = self.scaled_dot_product_attention(Q, K, V, mask, position_bias)
        output = self.W_o(self.combine_heads(attn_output))
        return output


class PositionWiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_seq_length):
        super().__init__()
        pe = torch.zeros(max_seq_length, d_model)
        position = torch.arange(0, max_seq_length, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class EncoderLayer(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, dropout, bias=True, relative_bias_max_len=None):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, bias, relative_bias_max_len)
        self.feed_forward = PositionWiseFeedForward(d_model, d_ff)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask, position_bias=None):
        attn_output = self.self_attn(x, x, x, mask, position_bias)
        x = self.norm1(x + self.dropout(attn_output))
        ff_output = self.feed_forward(x)
        x = self.norm2(x + self.dropout(ff_output))
        return x


class TransformerEncoder(nn.Module):
    """The article's Transformer, encoder half. relative_bias: None, "per_layer" (a RelativePositionBias in
    each attention) or "shared" (one, its slice handed to every layer)."""

    def __init__(self, src_vocab_size, d_model, num_heads, num_layers, d_ff, max_seq_length, dropout=0.0,
                 bias=True, relative_bias=None):
        super().__init__()
        self.encoder_embedding = nn.Embedding(src_vocab_size, d_model)
        self.positional_encoding = PositionalEncoding(d_model, max_seq_length)
        per_layer = max_seq_length if relative_bias == "per_layer" else None
        self.encoder_layers = nn.ModuleList(
            [EncoderLayer(d_model, num_heads, d_ff, dropout, bias, per_layer) for _ in range(num_layers)])
        self.relative_position_bias = (RelativePositionBias(num_heads, max_seq_length)
                                       if relative_bias == "shared" else None)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src, mask):
        enc_output = self.dropout(self.positional_encoding(self.encoder_embedding(src)))
        position_bias = None
        if self.relative_position_bias is not None:
            position_bias = self.relative_position_bias(src.size(1), src.size(1))
        for enc_layer in self.encoder_layers:
            enc_output = enc_layer(enc_output, mask, position_bias)
        return enc_output

    def attention_probs(self):
        return [layer.self_attn.attn_probs for layer in self.encoder_layers]


# -- "Transformer from scratch" (einsum): one Linear(head_dim, head_dim, bias=False) per q/k/v shared by the
#    heads, scores scaled by sqrt(embed_size) (a bug, faithfully kept), learned position embeddings.


class SelfAttention(nn.Module):
    def __init__(self, embed_size, heads):
        super().__init__()
        self.embed_size = embed_size
        self.heads = heads
        self.head_dim = embed_size // heads
        assert self.head_dim * heads == embed_size, "Embedding size needs to be divisible by heads"
        self.values = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.keys = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.queries = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.fc_out = nn.Linear(heads * self.head_dim, embed_size)

    def forward(self, values, keys, query, mask):
        N = query.shape[0]
        value_len, key_len, query_len = values.shape[1], keys.shape[1], query.shape[1]
        values = values.reshape(N, value_len, self.heads, self.head_dim)
        keys = keys.reshape(N, key_len, self.heads, self.head_dim)
        queries = query.reshape(N, query_len, self.heads, self.head_dim)
        values = self.values(values)
        keys = self.keys(keys)
        queries = self.queries(queries)
        energy = torch.einsum("nqhd,nkhd->nhqk", [queries, keys])
        if mask is not None:
            energy = energy.masked_fill(mask == 0, float("-1e20"))
        attention = torch.softmax(energy / (self.embed_size ** (1 / 2)), dim=3)
        self.attn_probs = attention
        out = torch.einsum("nhql,nlhd->nqhd", [attention, values]).reshape(N, query_len, self.heads * self.head_dim)
        out = self.fc_out(out)
        return out


class TransformerBlock(nn.Module):
    def __init__(self, embed_size, heads, dropout, forward_expansion):
        super().__init__()
        self.attention = SelfAttention(embed_size, heads)
        self.norm1 = nn.LayerNorm(embed_size)
        self.norm2 = nn.LayerNorm(embed_size)
        self.feed_forward = nn.Sequential(
            nn.Linear(embed_size, forward_expansion * embed_size),
            nn.ReLU(),
            nn.Linear(forward_expansion * embed_size, embed_size),
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, value, key, query, mask):
        attention = self.attention(value, key, query, mask)
        x = self.dropout(self.norm1(attention + query))
        forward = self.feed_forward(x)
        out = self.dropout(self.norm2(forward + x))
        return out


class Encoder(nn.Module):
    def __init__(self, src_vocab_size, embed_size, num_layers, heads, device, forward_expansion, dropout,
                 max_length):
        super().__init__()
        self.embed_size = embed_size
        self.device = device
        self.word_embedding = nn.Embedding(src_vocab_size, embed_size)
        self.position_embedding = nn.Embedding(max_length, embed_size)
        self.layers = nn.ModuleList(
            [TransformerBlock(embed_size, heads, dropout=dropout, forward_expansion=forward_expansion)
             for _ in range(num_layers)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask):
        N, seq_length = x.shape
        positions = torch.arange(0, seq_length).expand(N, seq_length).to(self.device)
        out = self.dropout(self.word_embedding(x) + self.position_embedding(positions))
        for layer in self.layers:
            out = layer(out, out, out, mask)
        return out

    def attention_probs(self):
        return [layer.attention.attn_probs for layer in self.layers]


# -- factories with random weights (the tests' "trained" models), and the key maps and configs that serve them


def _randomise(model: nn.Module, seed: int) -> nn.Module:
    """Random weights everywhere, LayerNorms and biases included, so a swapped or dropped key shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("relative_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model.eval()


D_MODEL, HEADS, LAYERS, D_FF, VOCAB, MAX_LEN = 32, 4, 2, 64, 100, 24


def mha(seed: int = 0) -> nn.Module:
    return _randomise(TransformerEncoder(VOCAB, D_MODEL, HEADS, LAYERS, D_FF, MAX_LEN), seed)


def mha_no_bias(seed: int = 0) -> nn.Module:
    return _randomise(TransformerEncoder(VOCAB, D_MODEL, HEADS, LAYERS, D_FF, MAX_LEN, bias=False), seed)


def mha_relative_per_layer(seed: int = 0) -> nn.Module:
    return _randomise(TransformerEncoder(VOCAB, D_MODEL, HEADS, LAYERS, D_FF, MAX_LEN, relative_bias="per_layer"),
                      seed)


def mha_relative_shared(seed: int = 0) -> nn.Module:
    return _randomise(TransformerEncoder(VOCAB, D_MODEL, HEADS, LAYERS, D_FF, MAX_LEN, relative_bias="shared"),
                      seed)


def einsum(seed: int = 0) -> nn.Module:
    return _randomise(Encoder(VOCAB, D_MODEL, LAYERS, HEADS, "cpu", D_FF // D_MODEL, 0.0, MAX_LEN), seed)


def config_fields(name: str) -> dict:
    """The EncoderConfig fields that serve each factory's model (what a user writes in config.json)."""
    base = {"d_model": D_MODEL, "n_heads": HEADS, "n_layers": LAYERS, "d_ff": D_FF, "vocab_size": VOCAB,
            "max_length": MAX_LEN, "positional": "learned", "norm_first": False, "activation": "relu"}
    if name == "einsum":
        return {**base, "attention_scale": 1 / math.sqrt(D_MODEL)}
    relative = {"mha_relative_per_layer": "per_layer", "mha_relative_shared": "shared"}.get(name, "none")
    return {**base, "relative_bias": relative}


KEY_MAP = {"mha": "article_mha", "mha_no_bias": "article_mha", "mha_relative_per_layer": "article_mha",
           "mha_relative_shared": "article_mha", "einsum": "article_einsum"}
