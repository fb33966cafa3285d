"""The transformer encoder in one file, nanoGPT style: attention, feed-forward, block, encoder.

`Encoder.forward` is the scripted interface the service calls (see its docstring). Everything here
is pure PyTorch and `torch.jit.script`-able; export and loading live in model/bundle.py.

Reduced precision (module cast with `.to(torch.bfloat16 | torch.float16)`): the explicit attention
scores and their softmax run in fp32; LayerNorm's kernels and SDPA's fused ones (CPU flash, CUDA flash
and memory-efficient) accumulate in fp32.
Masks are boolean, so no -1e9 literal can overflow fp16 and no two finfo.min terms are ever added.
With a relative position bias the SDPA path passes a float mask instead (the bias, the dtype's finite
minimum filled in where the boolean mask is False): on CPU the attention call then costs 1.2-1.4x the
boolean-mask one at 8 x 128 and 1.65-1.8x at 4 x 512 (REFERENCE heads, one thread; bench.relbias_bench).
A padded batch runs its projections, feed-forwards and LayerNorms on the real tokens only, (N, C)
rather than (B, T, C): they are about nine tenths of the work at d_ff = 4 d_model and T ~ d_model, so
padding costs little beyond its share of attention (as TEI and FasterTransformer's "remove padding"
do): on CPU a padded token costs a fifth to a third of what it did (python -m bench.packing_bench).
Error against the fp32 module, measured on CPU (AVX2) for TINY and REFERENCE, post-/pre-LN, relu/gelu,
seeds 0-2, padded batches, both paths (tests/model/test_model_numerics.py holds the bounds, which
model.bundle.RELATIVE_ERROR_BOUND also applies at export):
  hidden states, max|x - x32| / max|x32|:  bf16 measured <= 0.0125, bound 0.03; fp16 <= 0.0014, bound 0.005
  attention weights, max|w - w32|:         bf16 measured <= 0.0097, bound 0.03; fp16 <= 0.0012, bound 0.005
Rows of length 0, embeddings of magnitude 1e4 and max_length inputs stay finite in every dtype.

Capabilities of other families, each an EncoderConfig field and off by default (then the frozen graph of
REFERENCE is op for op the one without them: tests/model/test_model_capabilities.py): a position table read from
an offset; rotary positions (cos/sin computed per call in fp32, as Hugging Face does); ALiBi (-slope_h * |i - j|
on head h's scores, the (nh, T, T) bias computed per call in fp32 from the paper's slopes: no table, so
nothing but max_length bounds T; tests/model/test_model_alibi.py); MPNet/T5 bucketed relative positions;
RMSNorm, LayerNorm without bias; gated feed-forwards; gelu_tanh, silu; projections without biases; local
(sliding-window) layers between global ones; no norm before the first attention.
"""

import math
from typing import Final, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import EncoderConfig


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose mean, variance and affine step run in fp32 whatever the module dtype, the
    result rounded once to it: a bf16 mean and variance would keep ~3 significant digits, and fp16 x*x
    overflows above 256. The kernels of both devices served (CPU and CUDA) accumulate bf16 and fp16
    inputs in fp32 (their opmath type), so the call is the plain one: an explicit x.float() and cast back
    computed the same numbers (one output ulp apart in about 1 element in 30,000) and cost two casts of
    the whole activation per norm, which took about a sixth of a bf16 MiniLM forward on CPU
    (bench/RESULTS.md). tests/model/test_model_numerics.py holds the kernels to it. State-dict keys are
    nn.LayerNorm's.
    """

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm (x / sqrt(mean(x^2) + eps) * weight, no bias) in fp32 whatever the module dtype, then cast back."""

    eps: Final[float]

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


def make_norm(config: EncoderConfig) -> nn.Module:
    """The model's norm: LayerNorm (with or without bias) or RMSNorm, as config.norm and norm_bias say."""
    if config.norm == "rms":
        return RMSNorm(config.d_model, config.layer_norm_eps)
    return LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.norm_bias)


class MultiHeadAttention(nn.Module):
    """Self-attention with a fused QKV projection; rows of `qkv.weight` are q|k|v like nn.MultiheadAttention."""

    n_heads: Final[int]
    d_head: Final[int]
    scale: Final[float]
    score_min: Final[float]
    has_rel_bias: Final[bool]
    fp16_min: Final[float]
    bf16_min: Final[float]
    rotary: Final[bool]
    rotary_dims: Final[int]
    rotary_base: Final[float]

    def __init__(self, config: EncoderConfig, rotary_base: Optional[float] = None) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.d_head = config.d_head
        # 1/sqrt(d_head), per head: the logits of each head are a d_head-long dot product.
        # (A seed snippet used 1/sqrt(d_model); that flattens attention by sqrt(n_heads).) A model trained
        # with another scale states it in config.attention_scale.
        self.scale = config.scale
        self.score_min = torch.finfo(torch.float32).min  # the explicit path's scores are fp32
        # The SDPA path's float mask is in the module dtype (TorchScript has no torch.finfo).
        self.fp16_min = torch.finfo(torch.float16).min
        self.bf16_min = torch.finfo(torch.bfloat16).min
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.linear_bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.linear_bias)
        self.rotary = config.positional == "rotary"
        self.rotary_dims = config.rotary_dims if self.rotary else 0
        self.rotary_base = config.rotary_base if rotary_base is None else rotary_base
        self.has_rel_bias = config.relative_bias == "per_layer"
        if self.has_rel_bias:
            self.rel_bias = nn.Parameter(torch.zeros(config.n_heads, config.max_length, config.max_length))
        else:  # an empty placeholder, so TorchScript sees the attribute either way
            self.register_buffer("rel_bias", torch.zeros(0), persistent=False)

    def forward(
        self, x: Tensor, mask: Tensor, need_weights: bool, unpadded: bool = False,
        packed: Optional[Tuple[Tensor, Tensor]] = None, bias: Optional[Tensor] = None,
        diagnose: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """x (B, T, C); mask bool (B, 1, 1|T, T), True where a query may attend to a key.

        bias (nh, T, T): the shared relative position bias (a shared or bucketed table, or ALiBi's), added to
        the scaled scores before the mask (a per-layer table, config.relative_bias="per_layer", is this module's
        own and replaces it).

        packed: x holds only the real tokens, (N, C), and `packed` is `packing(lengths, T)`; the
        projections run on the N tokens alone and only the attention itself sees the padded (B, T) grid
        (padded positions hold a copy of a real token: masked as keys, dropped as queries). y is (N, C).

        unpadded: the caller knows that no key is padding, so `mask` is all True (B, 1, 1, T) or exactly
        the causal triangle (B, 1, T, T). The SDPA path then passes no mask at all (is_causal for the
        triangle), which CUDA's flash kernel requires and CPU SDPA runs faster; the explicit path ignores it.
        Returns (y (B, T, C), weights (B, nh, T, T) fp32 or None). A query row with no allowed key
        gives y = 0 and all-zero weights on both paths (SDPA's own rule for fully masked rows).
        diagnose: take the explicit path and return, in place of the weights, `attention_stats` (B, 2).
        """
        B, T, C = mask.size(0), mask.size(3), self.n_heads * self.d_head
        qkv = self.qkv(x)
        if packed is not None:  # (N, 3C) -> (B, T, 3C)
            qkv = qkv.index_select(0, packed[1]).view(B, T, 3 * C)
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.rotary:
            q, k = self._rotate(q, k, T)
        weights: Optional[Tensor] = None
        if self.has_rel_bias:
            bias = self.rel_bias[:, :T, :T]  # (nh, T, T)
        if not need_weights and not diagnose and unpadded and bias is None:
            # No mask: flash is eligible on CUDA. SDPA's is_causal is the top-left triangle (key j <= query
            # i), the same as our causal mask for T queries over T keys; a (B, 1, 1, 1) mask is either.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=mask.size(2) > 1, scale=self.scale)
        elif not need_weights and not diagnose:
            # Fused kernels (memory-efficient on CUDA, flash on CPU), fp32 accumulation inside.
            attn_mask = mask
            if bias is not None:
                # A float mask: the bias where allowed, the dtype's finite minimum where not (never -inf, and
                # filled rather than added, so nothing overflows). CPU then runs SDPA's math kernel, not flash.
                low = self.score_min
                if q.dtype == torch.float16:
                    low = self.fp16_min
                elif q.dtype == torch.bfloat16:
                    low = self.bf16_min
                attn_mask = bias.to(q.dtype)[None].masked_fill(~mask, low)  # (B, nh, T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)  # (B, nh, T, hs)
            # A query with no key at all (a length-0 row): SDPA's CPU kernels give 0, but CUDA's
            # memory-efficient kernel has given NaN (pytorch#110213). Make it 0 on every backend.
            y = y.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)  # mask.any: (B, 1, 1|T, 1)
        else:
            # Explicit path, all in fp32: fp16 logits overflow past 65504 and a bf16 softmax keeps
            # ~3 digits. finfo(float32).min (not -inf) keeps fully masked rows out of exp(-inf - -inf).
            att = (q.float() @ k.float().transpose(-2, -1)) * self.scale  # (B, nh, T, T)
            if bias is not None:
                att = att + bias.float()  # (B, nh, T, T) + (nh, T, T)
            scores = att
            att = att.masked_fill(~mask, self.score_min)
            # Zero masked keys after the softmax too: exact zeros, and a fully masked row gives 0 not 1/T.
            att = F.softmax(att, dim=-1).masked_fill(~mask, 0.0)
            y = (att @ v.float()).to(x.dtype)  # (B, nh, T, hs)
            weights = attention_stats(scores, att, mask) if diagnose else att
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side again
        if packed is not None:
            y = y.view(B * T, C).index_select(0, packed[0])  # (N, C): the real tokens' rows
        return self.proj(y), weights


    def _rotate(self, q: Tensor, k: Tensor, T: int) -> Tuple[Tensor, Tensor]:
        """Rotary positions on q and k (B, nh, T, hs): their first rotary_dims dims, position t of every row.

        cos and sin are computed here, in fp32, as Hugging Face's rotary embeddings compute them each call (a
        table buffer would be cast with the module: a bf16 cos alone is off by up to 0.4%); the rotation runs in
        fp32 too. Costs T * rotary_dims cos and sin per layer, next to the layer's T * d_model * d_model work."""
        r = self.rotary_dims
        exponents = torch.arange(0, r, 2, dtype=torch.int64, device=q.device).float() / r
        inv_freq = 1.0 / torch.pow(self.rotary_base, exponents)  # (r/2,)
        freqs = torch.arange(T, dtype=torch.int64, device=q.device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, r): the r/2 frequencies twice ("rotate half" layout)
        return self._rotate_one(q, emb.cos(), emb.sin()), self._rotate_one(k, emb.cos(), emb.sin())

    def _rotate_one(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r = self.rotary_dims
        xr = x[..., :r].float()
        half = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), dim=-1)  # rotate_half
        out = (xr * cos + half * sin).to(x.dtype)
        if r == self.d_head:
            return out
        return torch.cat((out, x[..., r:]), dim=-1)


def attention_stats(scores: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    """(B, 2) fp32 per sequence: the largest |score| and the mean normalised entropy of one layer.

    scores (B, nh, T, T): scaled (and biased) logits before the mask; weights (B, nh, T, T) their softmax,
    masked keys exactly 0; mask as MultiHeadAttention's. Only real queries and their allowed keys count.
    A row's entropy is divided by log(its allowed keys): 1 = uniform over them, 0 = one-hot. Rows with
    fewer than 2 allowed keys (a length-1 sequence, a causal first query) have no spread to measure and
    are left out; a sequence with no row left gets NaN entropy.
    """
    keys = mask.any(dim=2)[:, 0, :]  # (B, T): the key mask (keys some query may attend: causal, local or not)
    allowed = mask & keys[:, None, :, None]  # (B, 1, T, T): real queries over their allowed keys
    top = scores.abs().masked_fill(~allowed, 0.0).amax(dim=(1, 2, 3))  # (B,)
    n = allowed.sum(dim=-1).float()  # (B, 1, T): allowed keys per query
    rows = n >= 2  # (B, 1, T)
    ent = -torch.xlogy(weights, weights).sum(dim=-1) / torch.log(n.clamp(min=2.0))  # (B, nh, T)
    ent = ent.masked_fill(~rows, 0.0).sum(dim=(1, 2)) / (rows.sum(dim=(1, 2)).float() * weights.size(1))  # (B,)
    ent = ent.clamp(0.0, 1.0)  # rounding puts a uniform row a hair above 1; NaN stays NaN
    return torch.stack((top, ent), dim=1)  # (B, 2)


class FeedForward(nn.Module):
    """Position-wise MLP: fc2(act(fc1(x))), the linear1/linear2 of nn.TransformerEncoderLayer; gated
    (config.ffn_gated): fc1 gives 2 * d_ff and fc2(act(first half) * second half) (GeGLU, SwiGLU)."""

    use_gelu: Final[bool]
    use_gelu_tanh: Final[bool]
    use_silu: Final[bool]
    gated: Final[bool]
    d_ff: Final[int]

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.use_gelu = config.activation == "gelu"
        self.use_gelu_tanh = config.activation == "gelu_tanh"
        self.use_silu = config.activation == "silu"
        self.gated = config.ffn_gated
        self.d_ff = config.d_ff
        self.fc1 = nn.Linear(config.d_model, config.d_ff * (2 if config.ffn_gated else 1), bias=config.linear_bias)
        self.fc2 = nn.Linear(config.d_ff, config.d_model, bias=config.linear_bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if self.gated:
            return self.fc2(self._act(h[..., : self.d_ff]) * h[..., self.d_ff:])
        return self.fc2(self._act(h))

    def _act(self, h: Tensor) -> Tensor:
        # Exact (erf) GELU, as nn.TransformerEncoderLayer(activation="gelu"); gelu_tanh the tanh approximation.
        if self.use_gelu:
            return F.gelu(h)
        if self.use_gelu_tanh:
            return F.gelu(h, approximate="tanh")
        if self.use_silu:
            return F.silu(h)
        return F.relu(h)


class EncoderBlock(nn.Module):
    """Attention then feed-forward, each in a residual; LayerNorm before (pre-LN) or after (post-LN).
    A local block (config.is_local(index)) attends through the local mask it is given."""

    norm_first: Final[bool]
    local: Final[bool]

    def __init__(self, config: EncoderConfig, index: int = 0) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.local = config.is_local(index)
        self.ln1 = nn.Identity() if index == 0 and not config.first_attn_norm else make_norm(config)
        local_base = config.local_rotary_base if self.local else None
        self.attn = MultiHeadAttention(config, local_base)
        self.ln2 = make_norm(config)
        self.ff = FeedForward(config)

    def forward(
        self, x: Tensor, mask: Tensor, need_weights: bool, unpadded: bool = False,
        packed: Optional[Tuple[Tensor, Tensor]] = None, bias: Optional[Tensor] = None,
        diagnose: bool = False, local_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if self.local:  # keys beyond the radius are masked: never the unmasked fast path
            assert local_mask is not None
            mask, unpadded = local_mask, False
        if self.norm_first:
            a, w = self.attn(self.ln1(x), mask, need_weights, unpadded, packed, bias, diagnose)
            x = x + a
            x = x + self.ff(self.ln2(x))
        else:
            a, w = self.attn(x, mask, need_weights, unpadded, packed, bias, diagnose)
            x = self.ln1(x + a)
            x = self.ln2(x + self.ff(x))
        return x, w


# A batch runs packed when its padding is at least this share of its real tokens: packing costs two
# gathers a layer. In process (REFERENCE, batches of 7, CPU, 1 and 2 threads), packing every padded
# batch gave 0.98-0.99x at 1.8% padding; `python -m bench.packing_bench`: 1.04-1.07x at 9%, 1.28x at 39%.
PACK_MIN_PADDING = 1.0 / 16


def packing(lengths: Tensor, T: int) -> Tuple[Tensor, Tensor]:
    """How a padded (B, T) batch maps to its N real tokens and back, from host lengths (B,) (>= T: full).

    tokens (N,): the flat index in (B*T) of each real token, row by row. grid (B*T,): the packed row each
    position of the grid reads: its own token, or for a padding position the last real token of its row
    (for an empty row the next row's first, or the very last token), so padding holds finite values. Both are gathers
    (index_select): scattering into zeros with index_copy_ was 5x slower on CPU.
    """
    n = lengths.clamp(0, T)
    t = torch.arange(T)
    tokens = (t[None, :] < n[:, None]).flatten().nonzero().squeeze(1)
    start = torch.cumsum(n, 0) - n
    grid = (start[:, None] + torch.minimum(t[None, :], (n - 1).clamp(min=0)[:, None])).flatten()
    return tokens, grid.clamp(max=max(tokens.numel() - 1, 0))


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """(n_positions, d_model) fp32: sin on even, cos on odd columns ("Attention Is All You Need").

    Computed in fp64 and rounded once, so the table is the same bits on every CPU.
    """
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (n, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])  # odd d_model: one cos column fewer
    return table.float()


def relative_buckets(n_positions: int, n_buckets: int, max_distance: int) -> Tensor:
    """(n_positions, n_positions) int64: the bucket of key j - query i, bidirectional, as MPNet's (and T5's)
    relative_position_bucket computes it: half the buckets per direction, the first half of those exact
    distances, the rest logarithmic up to max_distance (fp32 log, as Hugging Face computes it)."""
    pos = torch.arange(n_positions, dtype=torch.long)
    n = -(pos[None, :] - pos[:, None])  # i - j
    half = n_buckets // 2
    ret = (n < 0).to(torch.long) * half
    n = torch.abs(n)
    max_exact = half // 2
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (half - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, half - 1))
    return ret + torch.where(n < max_exact, n, large)


def alibi_slopes(n_heads: int) -> List[float]:
    """The ALiBi slope of each head (Press et al., "Train Short, Test Long", and their code): for n a power of
    two the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise those of the closest power of two
    below, p, followed by every other one of 2p's (its 1st, 3rd, ...) up to n. Python floats (fp64)."""

    def power_of_2(n: int) -> List[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_2(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n_heads - closest]


def _uniform_(t: Tensor, std: float, generator: torch.Generator) -> None:
    # Uniform with the given std, drawn as integers and scaled in fp64: torch's float samplers have
    # vectorised kernels whose last bit may differ between CPUs; integer draws and exact scaling do not.
    ints = torch.randint(0, 2**24, t.shape, generator=generator, dtype=torch.int64)
    with torch.no_grad():
        t.copy_((ints.double() * 2.0**-23 - 1.0) * (std * math.sqrt(3.0)))


class Encoder(nn.Module):
    """Token embedding (or precomputed embeddings), positions, n_layers blocks, optional final LayerNorm;
    a shared relative position bias table (and ALiBi's slopes) lives here, a per-layer one in each block's
    attention."""

    # The Python config is for Python callers (bundle export); TorchScript sees the Final ints below.
    __jit_ignored_attributes__ = ["config"]
    d_model: Final[int]
    n_layers: Final[int]
    max_length: Final[int]
    has_positions: Final[bool]
    pack_min_padding: Final[float]
    has_rel_bias: Final[bool]
    position_offset: Final[int]
    bucketed: Final[bool]
    local_radius: Final[int]
    global_every: Final[int]
    alibi: Final[bool]
    # A TorchScript attribute, not a buffer: a module cast to bf16 / fp16 keeps the slopes as they are.
    alibi_slopes: List[float]

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.position_offset = config.position_offset
        self.d_model = config.d_model
        self.n_layers = config.n_layers
        self.max_length = config.max_length
        self.has_positions = config.positional in ("learned", "sinusoidal")  # a table added to the input
        self.pack_min_padding = PACK_MIN_PADDING
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.positional == "learned":
            self.pos_emb = nn.Parameter(torch.zeros(config.position_rows, config.d_model))
        else:
            # Derived from the config, so not in the state_dict (nor in the weights checksum);
            # TorchScript still saves it with the module. "none" and "rotary" keep an empty table for the type.
            table = sinusoidal_table(config.position_rows, config.d_model)
            self.register_buffer("pos_emb", table if self.has_positions else table[:0], persistent=False)
        # BERT's LayerNorm over word + position (+ token type) embeddings; also over given embeddings.
        self.ln_emb = make_norm(config) if config.embedding_norm else nn.Identity()
        self.blocks = nn.ModuleList([EncoderBlock(config, i) for i in range(config.n_layers)])
        self.local_radius = config.local_radius
        self.global_every = config.global_every
        self.ln_f = make_norm(config) if config.final_norm else nn.Identity()
        self.has_rel_bias = config.relative_bias == "shared"  # per_layer tables live in each attention
        if self.has_rel_bias:
            self.rel_bias = nn.Parameter(torch.zeros(config.n_heads, config.max_length, config.max_length))
        else:
            self.register_buffer("rel_bias", torch.zeros(0), persistent=False)
        self.bucketed = config.relative_bias == "bucketed"
        if self.bucketed:  # the learned (buckets, nh) table; the bucket of each (i, j) derived (not saved)
            self.rel_buckets = nn.Parameter(torch.zeros(config.relative_buckets, config.n_heads))
            index = relative_buckets(config.max_length, config.relative_buckets, config.relative_max_distance)
        else:
            self.register_buffer("rel_buckets", torch.zeros(0), persistent=False)
            index = torch.zeros(0, 0, dtype=torch.long)
        self.register_buffer("bucket_index", index, persistent=False)
        self.alibi = config.positional == "alibi"
        self.alibi_slopes = alibi_slopes(config.n_heads) if self.alibi else []

    def init_weights(self, seed: int) -> "Encoder":
        """Re-initialise deterministically: same seed -> same bits on any machine and torch version.

        Linear weights uniform with std 1/sqrt(fan_in), embeddings and relative bias tables std 1, biases 0,
        LayerNorms (1, 0).
        """
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():  # fixed registration order
            if name.endswith("rel_bias"):
                _uniform_(p, 1.0, g)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight", "ln_emb.weight")):
                nn.init.ones_(p)
            elif name in ("tok_emb.weight", "pos_emb"):
                _uniform_(p, 1.0, g)
            else:
                _uniform_(p, 1.0 / math.sqrt(p.shape[1]), g)
        return self

    def forward(
        self,
        token_ids: Optional[Tensor],
        embeddings: Optional[Tensor],
        lengths: Tensor,
        causal: bool,
        attn_layers: List[int],
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Encode a padded batch. The service depends on exactly this signature.

        token_ids (B, T) int64, or embeddings (B, T, d_model) replacing the token lookup (positions
        are still added); exactly one. lengths (B,) int64: keys at positions >= length are padding;
        padded rows of the output are finite and meant to be ignored. On the host (a CPU tensor, pinned
        for an asynchronous copy), lengths also tell without a device sync whether any row is padded: if
        none is, the SDPA layers pass no mask (flash-eligible on CUDA); if some are, the position-wise
        layers run on the real tokens alone ("packed") and the padded rows of the output are zeros.
        Lengths on the device always take the masked, padded path (reading them would wait for the
        device). causal: lookahead mask.
        attn_layers: sorted, distinct layer indices in [0, n_layers) whose weights are wanted; those
        layers take the explicit path. Returns hidden (B, T, d_model) in the module's dtype and, if
        attn_layers is not empty, weights (B, len(attn_layers), nh, T, T) fp32, padded keys exactly 0.
        """
        x, weights = self._encode(token_ids, embeddings, lengths, causal, attn_layers, False)
        if len(weights) == 0:
            return x, None
        return x, torch.stack(weights, dim=1)  # (B, len(attn_layers), nh, T, T)

    @torch.jit.export
    def forward_unpacked(
        self,
        token_ids: Optional[Tensor],
        embeddings: Optional[Tensor],
        lengths: Tensor,
        causal: bool,
        attn_layers: List[int],
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """`forward`, never packed: every position past a row's length is computed too, as a query over that row's
        keys (< length), which is what Hugging Face computes for a position whose attention_mask is 0. ColBERT's
        query expansion ([MASK] tokens not attended as keys) reads its vectors from those rows; `forward` packs a
        padded batch and leaves them zeros."""
        x, weights = self._encode(token_ids, embeddings, lengths, causal, attn_layers, False, False)
        if len(weights) == 0:
            return x, None
        return x, torch.stack(weights, dim=1)  # (B, len(attn_layers), nh, T, T)

    @torch.jit.export
    def diagnostics(
        self, token_ids: Optional[Tensor], embeddings: Optional[Tensor], lengths: Tensor, causal: bool,
    ) -> Tensor:
        """Attention health of a padded batch (inputs as `forward`): (B, n_layers, 2) fp32, per sequence and
        layer the largest |pre-softmax score| (scaled, bias added) and the mean normalised entropy over
        heads and real queries (`attention_stats`). Every layer takes the explicit path; the service samples
        batches through this, separately from `forward`, whose signature stays the one it depends on."""
        _, stats = self._encode(token_ids, embeddings, lengths, causal, list(range(self.n_layers)), True)
        return torch.stack(stats, dim=1)  # (B, n_layers, 2)

    def _encode(
        self, token_ids: Optional[Tensor], embeddings: Optional[Tensor], lengths: Tensor, causal: bool,
        attn_layers: List[int], diagnose: bool, pack: bool = True,
    ) -> Tuple[Tensor, List[Tensor]]:
        """`forward`'s work: hidden (B, T, C) and, per layer of attn_layers, its weights (or, diagnosing, its
        `attention_stats`). pack: a padded batch with host lengths may run packed (`forward_unpacked`: never)."""
        if token_ids is not None and embeddings is None:
            x = self.tok_emb(token_ids)  # (B, T, C)
        elif embeddings is not None and token_ids is None:
            if embeddings.dim() != 3 or embeddings.size(2) != self.d_model:
                raise ValueError(
                    "embeddings must be (B, T, {}), got {}".format(self.d_model, list(embeddings.shape))
                )
            x = embeddings.to(self.tok_emb.weight.dtype)
        else:
            raise ValueError("exactly one of token_ids and embeddings must be given")
        B, T = x.size(0), x.size(1)
        if T > self.max_length:
            raise ValueError("sequence length {} exceeds max_length {}".format(T, self.max_length))
        if lengths.dim() != 1 or lengths.size(0) != B:
            raise ValueError("lengths must be ({},), got {}".format(B, list(lengths.shape)))
        previous = -1
        for layer in attn_layers:
            if layer <= previous or layer >= self.n_layers:
                raise ValueError(
                    "attn_layers must be sorted, distinct, in [0, {}); got {}".format(self.n_layers, attn_layers)
                )
            previous = layer
        if self.has_positions:
            # Position t reads row position_offset + t (a constant: the same one slice when it is 0).
            x = x + self.pos_emb[self.position_offset:self.position_offset + T]  # (B, T, C) + (T, C)
        x = self.ln_emb(x)
        # Host lengths only: a device tensor would be read by waiting for the device (no pipelining).
        # -1 for device lengths: neither unpadded nor packed.
        real_tokens = int(lengths.clamp(0, T).sum()) if lengths.device.type == "cpu" else -1
        unpadded = real_tokens == B * T
        positions = torch.arange(T, device=x.device)
        mask = (positions[None, :] < lengths.to(x.device, non_blocking=True)[:, None])[:, None, None, :]  # (B,1,1,T)
        if causal:
            mask = mask & (positions[None, :] <= positions[:, None])  # (B, 1, T, T): key j <= query i
        packed: Optional[Tuple[Tensor, Tensor]] = None
        if pack and real_tokens > 0 and B * T - real_tokens >= real_tokens * self.pack_min_padding:
            # Padded, with host lengths: the position-wise layers (projections, feed-forward, LayerNorms)
            # run on the real tokens alone, (N, C); only attention sees the padded grid.
            tokens, grid = packing(lengths, T)
            packed = (tokens.to(x.device, non_blocking=True), grid.to(x.device, non_blocking=True))
            x = x.reshape(B * T, self.d_model).index_select(0, packed[0])
        bias: Optional[Tensor] = None
        if self.has_rel_bias:
            bias = self.rel_bias[:, :T, :T]  # (nh, T, T)
        if self.bucketed:
            bias = F.embedding(self.bucket_index[:T, :T], self.rel_buckets).permute(2, 0, 1)  # (nh, T, T)
        if self.alibi:  # -slope_h * |i - j| in fp32, whatever the module dtype (as the explicit scores)
            slopes = torch.tensor(self.alibi_slopes, dtype=torch.float32, device=x.device)  # (nh,)
            distance = (positions[None, :] - positions[:, None]).abs().float()  # (T, T)
            bias = -slopes[:, None, None] * distance  # (nh, T, T)
        local_mask: Optional[Tensor] = None
        if self.local_radius > 0:  # (B, 1, T, T): the mask within local_radius either side
            local_mask = mask & ((positions[None, :] - positions[:, None]).abs() <= self.local_radius)
        weights: List[Tensor] = []
        for i, block in enumerate(self.blocks):
            x, w = block(x, mask, i in attn_layers, unpadded, packed, bias, diagnose, local_mask)
            if w is not None:
                weights.append(w)
        x = self.ln_f(x)
        if packed is not None:  # back to (B, T, C), padded rows zeros (mask[:, 0, -1] is the key mask)
            x = x.index_select(0, packed[1]).view(B, T, self.d_model).masked_fill(~mask[:, 0, -1, :, None], 0.0)
        return x, weights
