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
A late-interaction bundle (ColBERT, BGE-M3) also has `MultiVectorSettings`: `encode(..., mode="query" |
"document")` then tokenizes as its authors do (PyLate, stanford-futuredata ColBERT, FlagEmbedding):
- a marker token id ([Q] / [D], or [unused0] / [unused1]) inserted after the first token ([CLS]); the
  text is cut so that the tokens, marker included, fit the mode's length (query_length, document_length);
- query expansion: a query shorter than query_length is padded to it with [MASK] ids, which are not
  attended as keys (`Encoded.attend` counts the tokens that are) unless the model says so; their vectors
  are kept, as the references keep them;
- which tokens have a vector (`Encoded.vector_rows`): a query's all (from `first_vector`); a document's
  but those whose id is in the skip list (punctuation) and those before `first_vector` (BGE-M3 has no
  vector for its <s>).
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
MODES = ("query", "document")  # encode(mode=...) of a late-interaction bundle


class TextError(ValueError):
    """A tokenizer file or text settings cannot be used; the message names the file or field."""


def _id_or_none(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TextError(f"{where} must be a token id (an int >= 0) or null, got {value!r}")
    return value


@dataclass(frozen=True)
class MultiVectorSettings:
    """A late-interaction model's text side (manifest text.multi_vector): how a query and a document become
    token ids, and which of their tokens get a vector (module docstring). Ids are the tokenizer's."""

    query_length: int  # a query's tokens, marker included: cut to it, and with expansion padded to it
    document_length: int  # a document's tokens, marker included: cut to it
    query_marker: int | None = None  # inserted after a query's first token ([Q], [unused0]); None: none
    document_marker: int | None = None  # the same for a document ([D], [unused1])
    expansion_id: int | None = None  # a query padded to query_length with it ([MASK]); None: no expansion
    attend_expansion: bool = False  # the expansion tokens are attended as keys (PyLate attend_to_expansion_tokens)
    skip_ids: tuple[int, ...] = ()  # ids whose vectors a document leaves out (ColBERT's punctuation skip list)
    first_vector: int = 0  # the tokens before it have no vector (BGE-M3: 1, none for its <s>)

    def __post_init__(self) -> None:
        where = "text.multi_vector"
        for key in ("query_length", "document_length"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise TextError(f"{where}.{key} must be an int >= 2, got {value!r}")
        for key in ("query_marker", "document_marker", "expansion_id"):
            _id_or_none(getattr(self, key), f"{where}.{key}")
        if not isinstance(self.attend_expansion, bool):
            raise TextError(f"{where}.attend_expansion must be a bool, got {self.attend_expansion!r}")
        if isinstance(self.skip_ids, str | bytes) or not isinstance(self.skip_ids, Sequence) or not all(
                _id_or_none(i, f"{where}.skip_ids[]") is not None for i in self.skip_ids):
            raise TextError(f"{where}.skip_ids must list token ids, got {self.skip_ids!r}")
        if self.first_vector not in (0, 1):
            raise TextError(f"{where}.first_vector must be 0 or 1, got {self.first_vector!r}")
        object.__setattr__(self, "skip_ids", tuple(sorted(set(self.skip_ids))))

    def length(self, mode: str) -> int:
        return self.query_length if mode == "query" else self.document_length

    def marker(self, mode: str) -> int | None:
        return self.query_marker if mode == "query" else self.document_marker


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
    # A late-interaction model's query and document encoding (MultiVectorSettings); None: none. Left out of the
    # manifest when None, so other text bundles keep the key set servers before it accept.
    multi_vector: MultiVectorSettings | None = None

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
        if isinstance(self.multi_vector, Mapping):  # from JSON (the manifest, an edge process's HELLO)
            known = {f.name for f in dataclasses.fields(MultiVectorSettings)}
            unknown = sorted(set(self.multi_vector) - known)
            if unknown:
                raise TextError(f"unknown text.multi_vector keys {unknown}; known keys are {sorted(known)}")
            try:
                object.__setattr__(self, "multi_vector", MultiVectorSettings(**self.multi_vector))
            except TypeError as e:  # a required key missing
                raise TextError(f"text.multi_vector: {e}") from None
        elif self.multi_vector is not None and not isinstance(self.multi_vector, MultiVectorSettings):
            raise TextError(f"text.multi_vector must be an object or null, got {self.multi_vector!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.multi_vector is None:
            del d["multi_vector"]
        else:
            d["multi_vector"]["skip_ids"] = list(self.multi_vector.skip_ids)
        return d

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
    # encode(mode=...) only: the leading tokens attended as keys (the rest are query expansion); 0: all.
    attend: int = 0
    # encode(mode=...) only: int64 [n], the positions whose token vectors are returned, ascending.
    vector_rows: np.ndarray | None = None

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


@dataclass(frozen=True)
class _Template:
    """Where a tokenizer's post-processor puts its special tokens around one text ($A) or a pair ($A $B),
    read once from a probe encoding: gaps[0] before the first text, gaps[i] after text i-1 (BERT's pair:
    [CLS] | a | [SEP] | b | [SEP]; RoBERTa's: <s> | a | </s></s> | b | </s>). Each text's tokens carry one
    token type (BERT: 0 then 1). Building from the texts' own tokens gives what the post-processor gives."""

    gap_ids: tuple[tuple[int, ...], ...]
    gap_tokens: tuple[tuple[str, ...], ...]
    gap_types: tuple[tuple[int, ...], ...]
    text_types: tuple[int, ...]

    @property
    def specials(self) -> int:
        return sum(len(g) for g in self.gap_ids)

    def build(self, ids: Sequence[list[int]], tokens: Sequence[list[str]], full_length: int) -> Encoded:
        """The texts' tokens (specials excluded, already cut) with the specials around them; `full_length`
        is the length before the cut."""
        out_ids: list[int] = list(self.gap_ids[0])
        out_tokens: list[str] = list(self.gap_tokens[0])
        out_types: list[int] = list(self.gap_types[0])
        for i, (text_ids, text_tokens) in enumerate(zip(ids, tokens, strict=True)):
            out_ids += text_ids
            out_ids += self.gap_ids[i + 1]
            out_tokens += text_tokens
            out_tokens += self.gap_tokens[i + 1]
            out_types += [self.text_types[i]] * len(text_ids)
            out_types += self.gap_types[i + 1]
        return Encoded(np.asarray(out_ids, dtype=np.int64), full_length, out_tokens,
                       np.asarray(out_types, dtype=np.int64) if len(ids) == 2 else None)


# Texts that give at least one token in any vocabulary we meet (a probe of the post-processor's layout).
_PROBES = ("a", "the", "x", "0", ".")


def _read_template(tokenizer: Any, n_texts: int, source: str) -> _Template:
    """The post-processor's layout for `n_texts` (1 or 2) texts, from encoding probe texts with and
    without specials: `sequence_ids` marks each position as text 0, text 1 or special (None)."""
    probe = next((p for p in _PROBES if tokenizer.encode(p, add_special_tokens=False).ids), None)
    if probe is None:
        raise TextError(f"{source}: none of the probe texts {_PROBES} gives a token; cannot read the "
                        f"post-processor's layout")
    alone = tokenizer.encode(probe, add_special_tokens=False).ids
    enc = tokenizer.encode(*([probe] * n_texts))
    gaps: list[list[int]] = [[] for _ in range(n_texts + 1)]
    types: list[set[int]] = [set() for _ in range(n_texts)]
    seen: list[list[int]] = [[] for _ in range(n_texts)]
    last = -1
    for i, seq in enumerate(enc.sequence_ids):
        if seq is None:
            gaps[last + 1].append(i)
            continue
        if seq == last + 1:
            last = seq
        elif seq != last or gaps[last + 1]:  # texts out of order, or a special inside a text
            last = n_texts + 1
            break
        types[seq].add(enc.type_ids[i])
        seen[seq].append(enc.ids[i])
    if last != n_texts - 1 or any(len(t) != 1 for t in types) or any(s != alone for s in seen):
        raise TextError(f"{source}: the post-processor does not lay out {n_texts} text(s) as specials around "
                        f"each text (got sequence ids {enc.sequence_ids}); not supported")
    return _Template(tuple(tuple(enc.ids[i] for i in g) for g in gaps),
                     tuple(tuple(enc.tokens[i] for i in g) for g in gaps),
                     tuple(tuple(enc.type_ids[i] for i in g) for g in gaps),
                     tuple(t.pop() for t in types))


def pair_lengths(first: int, second: int, room: int) -> tuple[int, int]:
    """How many tokens of each text of a pair `longest_first` keeps in `room` tokens (the limit less the
    pair's specials), as Hugging Face tokenizers' `truncate_encodings` decides it: when the shorter text
    fits in half the room it is kept whole and the longer gets the rest; otherwise each gets half, the
    odd token going to the longer text (to the second when both are as long)."""
    if first + second <= room:
        return first, second
    if room <= 0:
        return 0, 0
    short, long_ = min(first, second), max(first, second)
    if 2 * short <= room:
        short, long_ = short, room - short
    else:
        short, long_ = room // 2, room // 2 + room % 2
    return (long_, short) if first > second else (short, long_)


def _cut(items: list[Any], keep: int, side: str) -> list[Any]:
    if len(items) <= keep:
        return items
    return items[:keep] if side == "right" else items[len(items) - keep:]


class TextTokenizer:
    """Strings -> token ids with a bundle's settings. Thread-safe (the Rust tokenizer holds no
    per-call state) and free of the GIL while it encodes, so it may run in a worker thread.

    A text is tokenized once, without specials; a cut keeps `max_tokens` less the specials, from the
    right or the left, and the specials are then put around it as the post-processor does (`_Template`).
    The Rust tokenizer's own truncation is not used: it keeps every cut-off window (stride 0) and, for a
    pair, every combination of both texts' windows, so a pair of 3,000 tokens a side cost hundreds of MB.
    Here a pair costs what tokenizing its two texts costs, whatever their length."""

    def __init__(self, data: bytes, settings: TextSettings, source: str = TOKENIZER_FILE) -> None:
        actual = sha256_bytes(data)
        if actual != settings.tokenizer_sha256:
            raise TextError(f"{source} failed its checksum: manifest sha256 {settings.tokenizer_sha256}, "
                            f"file sha256 {actual}; the file is corrupt or was replaced")
        self.settings = settings
        self.data = data  # the tokenizer.json bytes: an edge process builds its own copy from them
        self._plain = load_tokenizer_json(data, source)
        self._single = _read_template(self._plain, 1, source)
        self._pair = _read_template(self._plain, 2, source)

    def prompt(self, name: str) -> str:
        """The prompt text for `name` ('' = the default prompt, if any); KeyError if unknown."""
        name = name or self.settings.default_prompt_name
        return self.settings.prompts[name] if name else ""

    def _side(self, side: str | None) -> str:
        if side is None:
            return self.settings.truncation_side
        if side not in TRUNCATION_SIDES:
            raise TextError(f"truncation side must be one of {TRUNCATION_SIDES}, got {side!r}")
        return side

    def encode(self, texts: Sequence[str], *, truncate: bool, prompt: str = "", side: str | None = None,
               mode: str = "", specials: bool = True) -> list[Encoded]:
        """Tokenize `texts` (with `prompt` prepended). Texts over max_tokens are cut when `truncate`, on
        `side` ("right" keeps the start, "left" the end; None: the bundle's truncation_side), as Hugging
        Face's `tokenizer(text, truncation=True, max_length=max_tokens)` with that `truncation_side`;
        else returned whole (full_length > max_tokens) for the caller to refuse. `specials` False: the
        texts' own tokens, without the special tokens around them (`add_special_tokens=False`), cut to
        max_tokens likewise.

        mode "query" or "document" (a bundle with multi-vector settings; TextError otherwise): as its authors
        encode one (module docstring); the limit is then the mode's length, marker included, and each Encoded
        says which tokens are attended (`attend`) and which have a vector (`vector_rows`)."""
        side = self._side(side)
        if mode:
            return self._encode_mode(texts, truncate=truncate, prompt=prompt, mode=mode, side=side)
        texts = [prompt + t for t in texts] if prompt else list(texts)
        added = self._single.specials if specials else 0
        room = self.settings.max_tokens - added
        out = []
        for enc in self._plain.encode_batch(texts, add_special_tokens=False):
            ids, tokens = enc.ids, enc.tokens
            full = len(ids) + added
            if truncate and len(ids) > room:
                keep = max(room, 0)
                ids, tokens = _cut(ids, keep, side), _cut(tokens, keep, side)
            out.append(self._single.build([ids], [tokens], full) if specials else
                       Encoded(np.asarray(ids, dtype=np.int64), full, list(tokens)))
        return out

    def _encode_mode(self, texts: Sequence[str], *, truncate: bool, prompt: str, mode: str,
                     side: str) -> list[Encoded]:
        multi = self.settings.multi_vector
        if multi is None:
            raise TextError(f"mode {mode!r}: this tokenizer has no multi-vector (query/document) settings")
        if mode not in MODES:
            raise TextError(f"mode must be one of {MODES}, got {mode!r}")
        texts = [prompt + t for t in texts] if prompt else list(texts)
        limit, marker = multi.length(mode), multi.marker(mode)
        room = limit - (marker is not None) - self._single.specials  # the mode's length less the marker inserted
        out = []
        for enc in self._plain.encode_batch(texts, add_special_tokens=False):
            cut_ids, cut_tokens = enc.ids, enc.tokens
            full = len(cut_ids) + self._single.specials + (marker is not None)
            if truncate and len(cut_ids) > room:
                keep = max(room, 0)
                cut_ids, cut_tokens = _cut(cut_ids, keep, side), _cut(cut_tokens, keep, side)
            built = self._single.build([cut_ids], [cut_tokens], full)
            ids, tokens = built.ids.tolist(), list(built.tokens)
            if marker is not None:  # after the first token ([CLS]), as PyLate's and ColBERT's insert_prefix_token
                ids.insert(1, marker)
                tokens.insert(1, self._plain.id_to_token(marker) or "")
            n, attend = len(ids), 0
            if mode == "query" and multi.expansion_id is not None and n < limit:
                # Query expansion: [MASK] up to query_length; attended only if the model says so.
                ids += [multi.expansion_id] * (limit - n)
                tokens += [self._plain.id_to_token(multi.expansion_id) or ""] * (limit - n)
                attend = 0 if multi.attend_expansion else n
            skip = set(multi.skip_ids) if mode == "document" else set()
            rows = [i for i in range(multi.first_vector, len(ids)) if ids[i] not in skip]
            out.append(Encoded(np.asarray(ids, dtype=np.int64), full, tokens, attend=attend,
                               vector_rows=np.asarray(rows, dtype=np.int64)))
        return out

    def encode_pairs(self, pairs: Sequence[tuple[str, str]], *, truncate: bool,
                     side: str | None = None) -> list[Encoded]:
        """Tokenize text pairs as Hugging Face's `tokenizer(a, b)` does (the post-processor's pair template:
        [CLS] a [SEP] b [SEP] with token types 0/1; RoBERTa's <s> a </s></s> b </s>). A pair over max_tokens is
        cut when `truncate` as `tokenizer(a, b, truncation=True, max_length=max_tokens)` cuts it (longest_first,
        `pair_lengths`), both texts on `side` (None: the bundle's truncation_side)."""
        side = self._side(side)
        room = self.settings.max_tokens - self._pair.specials
        texts = [p[0] for p in pairs] + [p[1] for p in pairs]
        encs = self._plain.encode_batch(texts, add_special_tokens=False)
        out = []
        for first, second in zip(encs[:len(pairs)], encs[len(pairs):], strict=True):
            ids = [first.ids, second.ids]
            tokens = [first.tokens, second.tokens]
            full = len(ids[0]) + len(ids[1]) + self._pair.specials
            if truncate and full > self.settings.max_tokens:
                keep = pair_lengths(len(ids[0]), len(ids[1]), room)
                ids = [_cut(x, k, side) for x, k in zip(ids, keep, strict=True)]
                tokens = [_cut(x, k, side) for x, k in zip(tokens, keep, strict=True)]
            out.append(self._pair.build(ids, tokens, full))
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
