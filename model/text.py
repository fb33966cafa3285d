"""Text in: a bundle's tokenizer (a Hugging Face `tokenizer.json`) and its text settings.

A text bundle carries `tokenizer.json` beside `model.pt`, checksummed like it, and `TextSettings` in its
manifest. `TextTokenizer` turns strings into the token ids the model was trained on, exactly as
sentence-transformers does with the same files:
- the padding and truncation built into a shipped tokenizer.json are switched off (all-MiniLM-L6-v2's
  truncates at 128 and pads to 128, while sentence-transformers cuts at max_seq_length 256); the bundle's
  own `max_tokens` and `truncation_side` apply instead;
- special-token strings typed in the text ("[SEP]", "[PAD]", ...) become their special ids, as Hugging
  Face's tokenizers do (they are matched before normalisation); we keep that, being exact with HF;
- a named prompt is prepended to the text before tokenizing, and counts towards the limit and the
  pooling, as sentence-transformers' `encode(prompt_name=...)` does with include_prompt=True.
Imports `tokenizers` (Rust; it releases the GIL while encoding), never torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
POOLINGS = ("mean", "cls")
TRUNCATION_SIDES = ("right", "left")


class TextError(ValueError):
    """A tokenizer file or text settings cannot be used; the message names the file or field."""


@dataclass(frozen=True)
class TextSettings:
    """How a text bundle turns strings into token ids, and its default sentence embedding.

    max_tokens counts the special tokens too ([CLS] ... [SEP]), as Hugging Face's max_length does.
    """

    tokenizer_sha256: str
    max_tokens: int
    truncation_side: str = "right"
    pooling: str = "mean"
    normalize: bool = False
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str = ""  # applied when a call names no prompt (sentence-transformers' rule)
    special_ids: Mapping[str, int] = field(default_factory=dict)  # e.g. {"[CLS]": 101, ...}, informational

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer_sha256, str) or len(self.tokenizer_sha256) != 64:
            raise TextError(f"text.tokenizer_sha256 must be a sha256 hex digest, got {self.tokenizer_sha256!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 2:
            raise TextError(f"text.max_tokens must be an int >= 2, got {self.max_tokens!r}")
        if self.truncation_side not in TRUNCATION_SIDES:
            raise TextError(f"text.truncation_side must be one of {TRUNCATION_SIDES}, got {self.truncation_side!r}")
        if self.pooling not in POOLINGS:
            raise TextError(f"text.pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise TextError(f"text.normalize must be a bool, got {self.normalize!r}")
        if not isinstance(self.prompts, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in self.prompts.items()):
            raise TextError(f"text.prompts must map names to strings, got {self.prompts!r}")
        if self.default_prompt_name and self.default_prompt_name not in self.prompts:
            raise TextError(f"text.default_prompt_name {self.default_prompt_name!r} is not among the prompts "
                            f"{sorted(self.prompts)}")
        if not isinstance(self.special_ids, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in
                self.special_ids.items()):
            raise TextError(f"text.special_ids must map token strings to ids, got {self.special_ids!r}")
        object.__setattr__(self, "prompts", dict(self.prompts))
        object.__setattr__(self, "special_ids", dict(self.special_ids))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TextSettings:
        if not isinstance(data, Mapping):
            raise TextError(f"text settings must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TextError(f"unknown text settings keys {unknown}; known keys are {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as e:  # a required key missing
            raise TextError(f"text settings: {e}") from None


@dataclass(frozen=True)
class Encoded:
    """One text, tokenized: ids (int64 [T], specials included), its length before any cut, the tokens."""

    ids: np.ndarray
    full_length: int
    tokens: list[str]
    type_ids: np.ndarray | None = None  # int64 [T], pairs only: 0 for the first text, 1 for the second

    @property
    def truncated(self) -> bool:
        return self.full_length > len(self.ids)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_tokenizer_json(data: bytes, source: str) -> Any:
    """A `tokenizers.Tokenizer` from tokenizer.json bytes, its padding and truncation switched off."""
    from tokenizers import Tokenizer  # here: bundles without text never need the package

    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a plain Exception for malformed JSON or an unknown model
        raise TextError(f"{source} is not a usable Hugging Face tokenizer.json: {e}") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


class TextTokenizer:
    """Strings -> token ids with a bundle's settings. Thread-safe (the Rust tokenizer holds no
    per-call state) and free of the GIL while it encodes, so it may run in a worker thread."""

    def __init__(self, data: bytes, settings: TextSettings, source: str = TOKENIZER_FILE) -> None:
        actual = sha256_bytes(data)
        if actual != settings.tokenizer_sha256:
            raise TextError(f"{source} failed its checksum: manifest sha256 {settings.tokenizer_sha256}, "
                            f"file sha256 {actual}; the file is corrupt or was replaced")
        self.settings = settings
        self.data = data  # the tokenizer.json bytes: an edge process builds its own copy from them
        self._plain = load_tokenizer_json(data, source)
        # A second instance that cuts, the way transformers configures the backend for
        # tokenizer(..., truncation="longest_first", max_length=max_tokens): specials kept, content cut.
        self._cutting = load_tokenizer_json(data, source)
        self._cutting.enable_truncation(settings.max_tokens, strategy="longest_first",
                                        direction=settings.truncation_side)

    def prompt(self, name: str) -> str:
        """The prompt text for `name` ('' = the default prompt, if any); KeyError if unknown."""
        name = name or self.settings.default_prompt_name
        return self.settings.prompts[name] if name else ""

    def encode(self, texts: Sequence[str], *, truncate: bool, prompt: str = "") -> list[Encoded]:
        """Tokenize `texts` (with `prompt` prepended). Texts over max_tokens are cut when `truncate`,
        else returned whole (full_length > max_tokens) for the caller to refuse."""
        texts = [prompt + t for t in texts] if prompt else list(texts)
        limit = self.settings.max_tokens
        out = []
        for text, enc in zip(texts, self._plain.encode_batch(texts), strict=True):
            full = len(enc.ids)
            if full > limit and truncate:
                enc = self._cutting.encode(text)
            out.append(Encoded(np.asarray(enc.ids, dtype=np.int64), full, list(enc.tokens)))
        return out

    def encode_pairs(self, pairs: Sequence[tuple[str, str]], *, truncate: bool) -> list[Encoded]:
        """Tokenize text pairs as Hugging Face's `tokenizer(a, b)` does (the post-processor's pair template:
        [CLS] a [SEP] b [SEP] with token types 0/1; RoBERTa's <s> a </s></s> b </s>). A pair over max_tokens is
        cut when `truncate` (longest_first, HF's default: the longer text loses a token at a time)."""
        limit = self.settings.max_tokens
        out = []
        for pair, enc in zip(pairs, self._plain.encode_batch([tuple(p) for p in pairs]), strict=True):
            full = len(enc.ids)
            if full > limit and truncate:
                enc = self._cutting.encode(pair[0], pair[1])
            out.append(Encoded(np.asarray(enc.ids, dtype=np.int64), full, list(enc.tokens),
                               np.asarray(enc.type_ids, dtype=np.int64)))
        return out

    def decode(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool = True) -> list[str]:
        """Token ids -> texts (ids checked against the vocabulary by the caller)."""
        return list(self._plain.decode_batch([list(r) for r in rows], skip_special_tokens=skip_special_tokens))


def special_ids(data: bytes, source: str = TOKENIZER_FILE) -> dict[str, int]:
    """The special tokens of a tokenizer.json (added tokens marked special) and their ids."""
    try:
        added = json.loads(data).get("added_tokens", [])
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise TextError(f"{source} is not readable JSON: {e}") from None
    return {t["content"]: int(t["id"]) for t in added if isinstance(t, dict) and t.get("special")}
