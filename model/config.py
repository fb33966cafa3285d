"""EncoderConfig: the frozen, JSON-round-trippable description of an encoder's shape and flavour.

Checked on construction, so a bad value fails where it is written, with the value in the message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

POSITIONALS = ("sinusoidal", "learned", "rotary", "alibi", "none")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
NORMS = ("layer", "rms")
RELATIVE_BIASES = ("none", "shared", "per_layer", "bucketed")


@dataclass(frozen=True)
class EncoderConfig:
    """A transformer encoder, inference only (dropout is always 0, so it has no field).

    Defaults are those of REFERENCE, the service's default model. `final_norm` (a LayerNorm after the
    last block, as pre-LN models such as GPT-2 and `nn.TransformerEncoder(norm=...)` use) is our
    addition to the issue's field list; it defaults to False so configs without it keep their meaning.
    `embedding_norm` (a LayerNorm after token + position embeddings, as BERT has) likewise.
    """

    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 1024
    vocab_size: int = 8192
    max_length: int = 512
    # sinusoidal | learned | rotary (q and k rotated, no table added) | alibi (no table: head h's scores get
    # -slope_h * |i - j|, the slopes of the ALiBi paper, symmetric as an encoder has them) | none
    positional: str = "sinusoidal"
    norm_first: bool = False  # True: pre-LN (x + f(LN(x))); False: post-LN (LN(x + f(x)))
    # relu | gelu (exact, erf-based, as nn.TransformerEncoderLayer) | gelu_tanh (the tanh approximation,
    # gelu_pytorch_tanh) | silu
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    final_norm: bool = False
    embedding_norm: bool = False
    # A learned (n_heads, max_length, max_length) table added to the scaled scores before mask and softmax,
    # sliced [:, :T, :T], as the tutorials' RelativePositionBias writes it: none | shared (one for all
    # layers) | per_layer.
    # bucketed: MPNet / T5 (bidirectional) relative positions, one learned (relative_buckets, n_heads) table
    # shared by all layers, indexed by the bucket of j - i (exact up to relative_buckets / 4 apart, then
    # logarithmic up to relative_max_distance).
    relative_bias: str = "none"
    # The multiplier of q.k. None: 1/sqrt(d_head), the correct one. Set it only to serve a model trained
    # with another (the sqrt(embed_size) of one tutorial); the manifest then states it.
    attention_scale: float | None = None
    # The row of the position table that position 0 reads (RoBERTa, XLM-R, MPNet: padding_idx + 1, as Hugging
    # Face numbers the positions of a sequence without padding ids inside); the table has max_length + offset
    # rows, so the checkpoint's table is kept whole (and max_length stays the longest sequence).
    position_offset: int = 0
    # Capabilities of other families, each off by default (off = the model above, unchanged):
    # rotary positions (positional="rotary"): q and k of the first rotary_fraction of each head rotated in
    # pairs (i, i + r/2) ("rotate half", GPT-NeoX / Hugging Face), frequencies rotary_base^(-2i/r).
    rotary_base: float = 10000.0
    rotary_fraction: float = 1.0
    norm: str = "layer"  # layer | rms (RMSNorm: x / sqrt(mean(x^2) + eps) * weight): every norm of the model
    norm_bias: bool = True  # False: LayerNorms without a bias (RMSNorm has none either way)
    # Gated feed-forward: fc1 gives 2 * d_ff, fc2(act(first half) * second half) (GeGLU: gelu, SwiGLU: silu).
    ffn_gated: bool = False
    linear_bias: bool = True  # False: every projection (qkv, proj, fc1, fc2) without a bias
    relative_buckets: int = 32  # relative_bias="bucketed" only
    # Local (sliding-window) attention: with local_radius > 0, layer i is local unless i % global_every == 0
    # (ModernBERT: every third layer global); a local layer's query attends keys at most local_radius
    # positions away, either side (ModernBERT: local_attention // 2), with rotary base local_rotary_base
    # (null: rotary_base).
    local_radius: int = 0
    global_every: int = 1
    local_rotary_base: float | None = None
    # False: the first block's attention reads its input un-normed (pre-LN over normed embeddings: ModernBERT).
    first_attn_norm: bool = True
    relative_max_distance: int = 128

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "n_layers", "d_ff", "vocab_size", "max_length"):
            value = getattr(self, name)
            # bool is an int subclass; True as a layer count is a typo, not a size.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EncoderConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"EncoderConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        if self.positional not in POSITIONALS:
            raise ValueError(f"EncoderConfig.positional must be one of {POSITIONALS}, got {self.positional!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"EncoderConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name in ("norm_first", "final_norm", "embedding_norm", "norm_bias", "ffn_gated", "linear_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EncoderConfig.{name} must be a bool, got {getattr(self, name)!r}")
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"EncoderConfig.layer_norm_eps must be a finite float > 0, got {eps!r}")
        # JSON turns 1e-5 into a float either way; normalise ints (eps=1) so round trips compare equal.
        object.__setattr__(self, "layer_norm_eps", float(eps))
        if self.relative_bias not in RELATIVE_BIASES:
            raise ValueError(
                f"EncoderConfig.relative_bias must be one of {RELATIVE_BIASES}, got {self.relative_bias!r}"
            )
        if self.norm not in NORMS:
            raise ValueError(f"EncoderConfig.norm must be one of {NORMS}, got {self.norm!r}")
        for name, low, high in (("rotary_base", 1.0, math.inf), ("rotary_fraction", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and low < value <= high):
                raise ValueError(f"EncoderConfig.{name} must be a finite float in ({low}, {high}], got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.positional == "rotary" and (self.rotary_dims < 2 or self.rotary_dims % 2):
            raise ValueError(f"EncoderConfig.rotary_fraction={self.rotary_fraction} of d_head={self.d_head} gives "
                             f"{self.rotary_dims} rotary dims; rotary needs an even number >= 2")
        offset = self.position_offset
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"EncoderConfig.position_offset must be an int >= 0, got {offset!r}")
        if offset and self.positional not in ("learned", "sinusoidal"):
            raise ValueError(f"EncoderConfig.position_offset={offset} needs a position table "
                             f"(positional={self.positional!r})")
        if self.positional == "alibi" and self.relative_bias != "none":
            raise ValueError(f"EncoderConfig.positional='alibi' with relative_bias={self.relative_bias!r}: two "
                             "relative position terms in one model are not supported")
        for name, low in (("local_radius", 0), ("global_every", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"EncoderConfig.{name} must be an int >= {low}, got {value!r}")
        base = self.local_rotary_base
        if base is not None:
            if isinstance(base, bool) or not isinstance(base, int | float) or not (math.isfinite(base) and base > 1):
                raise ValueError(f"EncoderConfig.local_rotary_base must be null or a finite float > 1, got {base!r}")
            object.__setattr__(self, "local_rotary_base", float(base))
        if not isinstance(self.first_attn_norm, bool):
            raise ValueError(f"EncoderConfig.first_attn_norm must be a bool, got {self.first_attn_norm!r}")
        if not self.first_attn_norm and not self.norm_first:
            raise ValueError("EncoderConfig.first_attn_norm=False needs norm_first=True (a post-LN block's norm "
                             "is on its output)")
        for name in ("relative_buckets", "relative_max_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 4:
                raise ValueError(f"EncoderConfig.{name} must be an int >= 4, got {value!r}")
        if self.relative_max_distance <= self.relative_buckets // 4:
            raise ValueError(f"EncoderConfig.relative_max_distance={self.relative_max_distance} must exceed "
                             f"relative_buckets // 4 = {self.relative_buckets // 4} (the exact buckets)")
        scale = self.attention_scale
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, int | float) or not (math.isfinite(scale)
                                                                                      and scale > 0):
                raise ValueError(f"EncoderConfig.attention_scale must be null or a finite float > 0, got {scale!r}")
            object.__setattr__(self, "attention_scale", float(scale))

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def scale(self) -> float:
        """The attention scale the model uses: attention_scale, or 1/sqrt(d_head) when that is None."""
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.d_head)

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` attends within local_radius only."""
        return self.local_radius > 0 and layer % self.global_every != 0

    @property
    def rotary_dims(self) -> int:
        """Dims of each head that rotary rotates: int(d_head * rotary_fraction) (the rest pass unchanged)."""
        return int(self.d_head * self.rotary_fraction)

    @property
    def position_rows(self) -> int:
        """Rows of the position table: max_length + position_offset."""
        return self.max_length + self.position_offset

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderConfig:
        """Build from a dict; unknown keys are an error (a typo must not silently become a default)."""
        if not isinstance(data, dict):
            raise ValueError(f"EncoderConfig must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown EncoderConfig keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EncoderConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"EncoderConfig JSON is malformed: {e}") from e
        return cls.from_dict(data)


# The service's default model (the seeded bundle a fresh machine serves).
REFERENCE = EncoderConfig(
    d_model=256, n_heads=4, n_layers=4, d_ff=1024, vocab_size=8192, max_length=512,
    positional="sinusoidal", norm_first=False, activation="relu",
)
# Small enough for unit tests on two CPU cores.
TINY = EncoderConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=100, max_length=64)
