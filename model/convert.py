"""Convert another encoder's state_dict to our Encoder, driven by a key map: one mechanism for every source.

A key map (JSON, or TOML through tomllib) says, for each of our parameters, which source key(s) it comes
from and how. Built-in maps are files in model/keymaps/ (`stock` is nn.Embedding + nn.TransformerEncoder;
`article_mha`, `article_einsum`: the hand-written encoders of the tutorials; `hf_bert`: Hugging Face
BertModel, used by model/hf.py); a user passes their own.

  {
    "format": 1,
    "description": "what model this reads",
    "vars": {"p": "encoder."},          # named strings for "{p}" in keys; set or overridden per conversion
    "requires": {"norm_first": false},  # config fields the source layout fixes: any other value is refused
    "checked": ["{p}"],                 # source keys under these prefixes must all be used (default: all)
    "ignore": ["{p}pe"],                # source keys known and deliberately unused
    "params": {                         # ours -> spec; "{i}" runs over the layers
      "tok_emb.weight": "emb.weight",   # a string is {"op": "copy", "src": it}
      "blocks.{i}.attn.qkv.weight": {"op": "concat", "src": ["{p}{i}.q.weight", "{p}{i}.k.weight", "{p}{i}.v.weight"]}
    }
  }

Ops (`src` is a source key or, for the ops that take several, a list of keys or nested specs):
  copy         the tensor as it is                        reshape      the tensor viewed as our shape
  transpose    a 2-D tensor's transpose (stored (in, out)) concat       parts stacked along dim 0 (q|k|v)
  block_diag   a shared per-head (d_head, d_head) matrix -> the block-diagonal (d_model, d_model) one that
               applies it to every head; a shared (d_head,) bias -> tiled n_heads times
  fold         the product src[0] @ src[1] @ ...: linear maps applied one after the other (last first)
  add          the sum of the parts, broadcast (BERT's token type row 0 folded into its word table)
  row0         the first row of a tensor: (N, ...) -> (...)
  zeros, ones  no source: what a module without that parameter computes (bias=False: zeros)
Any spec may say "times": a number, to multiply its result (an embedding the model scales by
sqrt(d_model) in forward becomes the table times that: the same fp32 products). A top-level spec may say
"absent": "zeros" | "ones": if none of its source keys is in the state_dict, the
parameter is that (one map then reads Linear(bias=True) and Linear(bias=False) models; some keys present
and some not is still an error). Entries for parameters this config does not have (ln_f without
final_norm, say) are skipped. "requires" values are a value, a list of allowed values, or for
attention_scale "1/sqrt(d_head)" or "1/sqrt(d_model)".

Public API: ConversionError; KeyMap (.load(path), .builtin(name), .from_dict(data), .with_vars(**v));
builtin_names(); OPS; convert(state_dict, config, keymap, strict=False) -> Encoder; check_sizes(state_dict,
config, keymap) (what convert checks first); resolve(keymap, config) -> {ours: spec};
load_state_dict_file(path); and, for the stock map, convert_state_dict and key_mapping. Another converter
(Hugging Face BERT, say) ships its map in model/keymaps/ and calls convert.
Every problem (missing, unexpected, mis-shaped or mis-typed key, an op that does not apply, a config value
the source cannot express, a parameter the map does not cover) is named in one ConversionError.

The stock map: with E = embedding prefix ("embedding.") and N = encoder prefix ("encoder."),
E weight -> tok_emb.weight; N layers.{i}.self_attn.in_proj_{weight,bias} -> blocks.{i}.attn.qkv (q|k|v rows);
out_proj -> attn.proj; linear1/linear2 -> ff.fc1/fc2; norm1/norm2 -> ln1/ln2; N norm -> ln_f (final_norm);
position_key -> pos_emb (positional="learned"). A state_dict cannot say how the stock model was built:
norm_first, activation, layer_norm_eps and the positional encoding must be set in the config to match.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.config import EncoderConfig
from model.encoder import Encoder

KEYMAP_DIR = Path(__file__).with_name("keymaps")
OPS = ("copy", "reshape", "transpose", "concat", "block_diag", "fold", "add", "row0", "zeros", "ones")
_MULTI = ("concat", "fold", "add")  # ops whose src is a list
_NO_SRC = ("zeros", "ones")
MAX_SPEC_DEPTH = 16  # nested specs (a fold of transposes, say) need a few levels; deeper is not a key map
# max_length * d_model values: the largest (max_length, d_model) table derived from the config alone
# (sinusoidal positions) when no tensor states max_length; 2^28 fp32 values are 1 GiB.
DERIVED_TABLE_LIMIT = 2**28
OVERSIZE = 2  # check_sizes: a config size over this many times the tensors' is refused before anything is built
# Our parameters that exist only for some configs: named in "not covered" errors.
_CONFIG_OF = {"pos_emb": "positional='learned'", "ln_f.": "final_norm=True", "rel_bias": "relative_bias",
              "ln_emb.": "embedding_norm=True"}


class ConversionError(ValueError):
    """The state_dict, key map and config do not fit together; the message lists every problem."""


@dataclass(frozen=True)
class KeyMap:
    """A parsed key map (see the module docstring for the format)."""

    name: str
    params: Mapping[str, Any]
    vars: Mapping[str, str | None] = field(default_factory=dict)
    requires: Mapping[str, Any] = field(default_factory=dict)
    checked: tuple[str, ...] | None = None  # None: every source key is checked
    ignore: tuple[str, ...] = ()
    description: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str = "<key map>") -> KeyMap:
        if not isinstance(data, Mapping):
            raise ConversionError(f"key map {name}: must be an object, got {type(data).__name__}")
        known = {"format", "description", "vars", "requires", "checked", "ignore", "params"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConversionError(f"key map {name}: unknown fields {unknown}; known fields are {sorted(known)}")
        if data.get("format") != 1:
            raise ConversionError(f"key map {name}: format must be 1, got {data.get('format')!r}")
        params = data.get("params")
        if not isinstance(params, Mapping) or not params:
            raise ConversionError(f"key map {name}: params must be a non-empty object")
        variables, requires = data.get("vars", {}), data.get("requires", {})
        if not isinstance(variables, Mapping) or not all(v is None or isinstance(v, str) for v in variables.values()):
            raise ConversionError(f"key map {name}: vars must map names to strings (or null: unset)")
        if not isinstance(requires, Mapping):
            raise ConversionError(f"key map {name}: requires must map EncoderConfig fields to values")
        for key in ("checked", "ignore"):
            value = data.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConversionError(f"key map {name}: {key} must be a list of strings")
        config_fields = set(EncoderConfig.__dataclass_fields__)
        bad_requires = sorted(set(data.get("requires", {})) - config_fields)
        if bad_requires:
            raise ConversionError(f"key map {name}: requires names unknown EncoderConfig fields {bad_requires}")
        problems = [p for ours, spec in params.items() for p in _check_spec(spec, str(ours), top=True)]
        if problems:
            raise ConversionError(f"key map {name}: " + "; ".join(problems))
        checked = data.get("checked")
        return cls(name=name, params=dict(params), vars=dict(data.get("vars", {})),
                   requires=dict(data.get("requires", {})),
                   checked=None if checked is None else tuple(checked), ignore=tuple(data.get("ignore", ())),
                   description=str(data.get("description", "")))

    @classmethod
    def load(cls, path: str | Path) -> KeyMap:
        """Read a key map file: .toml through tomllib, anything else as JSON."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except OSError as e:
            raise ConversionError(f"cannot read the key map {path}: {e}") from e
        except (ValueError, tomllib.TOMLDecodeError) as e:  # JSONDecodeError; an int of over 4300 digits
            raise ConversionError(f"key map {path} is malformed: {e}") from None
        except RecursionError:
            raise ConversionError(f"key map {path} is malformed: nested too deeply") from None
        return cls.from_dict(data, name=path.stem if path.parent == KEYMAP_DIR else str(path))

    @classmethod
    def builtin(cls, name: str) -> KeyMap:
        """One of the maps shipped in model/keymaps/ (builtin_names() lists them)."""
        path = KEYMAP_DIR / f"{name}.json"
        if not path.is_file():
            raise ConversionError(f"no built-in key map {name!r}; built-in maps are {builtin_names()}")
        return cls.load(path)

    def with_vars(self, **values: str | None) -> KeyMap:
        """The same map with some vars set; a var the map does not declare is an error."""
        unknown = sorted(set(values) - set(self.vars))
        if unknown:
            raise ConversionError(f"key map {self.name} has no vars {unknown}; its vars are {sorted(self.vars)}")
        return KeyMap(self.name, self.params, {**self.vars, **values}, self.requires, self.checked, self.ignore,
                      self.description)


def builtin_names() -> list[str]:
    return sorted(p.stem for p in KEYMAP_DIR.glob("*.json"))


def _check_spec(spec: Any, where: str, top: bool = False, depth: int = 0) -> list[str]:
    """Problems with the form of one spec (not its keys or shapes), for a load-time error."""
    if isinstance(spec, str):
        return []
    if depth >= MAX_SPEC_DEPTH:
        return [f"{where[:60]}...: specs nested deeper than {MAX_SPEC_DEPTH} levels"]
    if not isinstance(spec, Mapping) or spec.get("op") not in OPS:
        op = spec.get("op") if isinstance(spec, Mapping) else spec
        return [f"{where}: op {op!r} is not one of {list(OPS)}"]
    extra = sorted(set(spec) - {"op", "src", "times", *(["absent"] if top else [])})
    if extra:
        return [f"{where}: unknown spec fields {extra}"]
    times = spec.get("times", 1.0)
    if isinstance(times, bool) or not isinstance(times, int | float) or not math.isfinite(times):
        return [f"{where}: times must be a finite number, got {times!r}"]
    if spec.get("absent", "zeros") not in _NO_SRC:
        return [f"{where}: absent must be 'zeros' or 'ones', got {spec['absent']!r}"]
    op, src = spec["op"], spec.get("src")
    if op in _NO_SRC:
        return [] if src is None else [f"{where}: {op} takes no src"]
    if op in _MULTI:
        if not isinstance(src, list) or len(src) < 2:
            return [f"{where}: {op} needs a list of at least two sources in src"]
        return [p for s in src for p in _check_spec(s, f"{where}.{op}", depth=depth + 1)]
    if not isinstance(src, str | Mapping):
        return [f"{where}: {op} needs one source in src"]
    return _check_spec(src, f"{where}.{op}", depth=depth + 1)


def _expand(text: str, variables: Mapping[str, str | None], i: int | None, where: str) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name == "i":
            if i is None:
                raise ConversionError(f"{where}: {{i}} is only allowed in per-layer entries (ours with {{i}})")
            return str(i)
        if name not in variables:
            raise ConversionError(f"{where}: unknown key map var {{{name}}}; vars are {sorted(variables)}")
        value = variables[name]
        if value is None:
            raise ConversionError(f"{where}: the key map var {name!r} is not set")
        return value

    return re.sub(r"\{(\w+)\}", sub, text)


def _expand_spec(spec: Any, variables: Mapping[str, str | None], i: int | None, where: str) -> dict[str, Any]:
    if isinstance(spec, str):
        return {"op": "copy", "src": _expand(spec, variables, i, where)}
    out = dict(spec)
    src = spec.get("src")
    if isinstance(src, list):
        out["src"] = [_expand(s, variables, i, where) if isinstance(s, str) else _expand_spec(s, variables, i, where)
                      for s in src]
    elif isinstance(src, str):
        out["src"] = _expand(src, variables, i, where)
    elif isinstance(src, Mapping):
        out["src"] = _expand_spec(src, variables, i, where)
    return out


def _expand_prefixes(patterns: tuple[str, ...], variables: Mapping[str, str | None]) -> tuple[str, ...]:
    # A prefix naming an unset var (the stock map's position_key, say) checks nothing.
    out = []
    for p in patterns:
        try:
            out.append(_expand(p, variables, None, "checked/ignore"))
        except ConversionError:
            if not all(variables.get(n, "") is None for n in re.findall(r"\{(\w+)\}", p)):
                raise
    return tuple(out)


def resolve(keymap: KeyMap, config: EncoderConfig) -> dict[str, Any]:
    """Our state_dict key -> its spec with vars and {i} filled in, for every parameter Encoder(config) has.

    Problems (a config value the source fixes otherwise, a parameter the map does not cover) raise
    ConversionError naming each."""
    problems = []
    for name, allowed in keymap.requires.items():
        allowed_values = allowed if isinstance(allowed, list) else [allowed]
        value = getattr(config, name)
        if name == "attention_scale":  # the scale the config means against the formula the source uses
            formulas = {"1/sqrt(d_head)": config.d_head, "1/sqrt(d_model)": config.d_model}
            wants = [1.0 / math.sqrt(formulas[a]) if a in formulas else a for a in allowed_values]
            if not any(w is not None and math.isclose(config.scale, w, rel_tol=1e-12) for w in wants) and not (
                    None in wants and value is None):
                problems.append(f"config field attention_scale={value!r} (scale {config.scale:.6g}): the source "
                                f"layout of key map {keymap.name} scales by "
                                f"{' or '.join(map(str, allowed_values))} = {' or '.join(f'{w:.6g}' for w in wants)}")
            continue
        if value not in allowed_values:
            problems.append(f"config field {name}={value!r}: the source layout of key map {keymap.name} cannot "
                            f"express it (it has {name}={' or '.join(map(repr, allowed_values))})")
    ours = Encoder(config).state_dict()
    plan: dict[str, Any] = {}
    reported = set()
    for pattern, spec in keymap.params.items():
        layers = range(config.n_layers) if "{i}" in pattern else [None]
        for i in layers:
            key = pattern.replace("{i}", str(i)) if i is not None else pattern
            if key in ours:
                try:
                    plan[key] = _expand_spec(spec, keymap.vars, i, key)
                except ConversionError as e:
                    problems.append(str(e))
                    reported.add(key)
    for key in ours:
        if key not in plan and key not in reported:
            needs = next((c for p, c in _CONFIG_OF.items() if key.startswith(p) or key.endswith(p)), None)
            problems.append(f"our parameter {key}{f' (from {needs})' if needs else ''} is not covered by key map "
                            f"{keymap.name}")
    if problems:
        raise ConversionError(f"key map {keymap.name} does not fit EncoderConfig({config.to_json()}):\n  "
                              + "\n  ".join(problems))
    return plan


def _sources(spec: Mapping[str, Any]) -> list[str]:
    src = spec.get("src")
    parts = src if isinstance(src, list) else [] if src is None else [src]
    return [k for s in parts for k in ([s] if isinstance(s, str) else _sources(s))]


def _describe(spec: Mapping[str, Any]) -> str:
    src = spec.get("src")
    parts = [] if src is None else src if isinstance(src, list) else [src]
    text = spec["op"]
    if parts:
        text += f"({', '.join(s if isinstance(s, str) else _describe(s) for s in parts)})"
    return f"{text} * {spec['times']}" if "times" in spec else text


class _NotApplicable(Exception):
    pass


def _apply(spec: Mapping[str, Any], state: Mapping[str, torch.Tensor], config: EncoderConfig,
           shape: tuple[int, ...]) -> torch.Tensor:
    """Evaluate one spec to a tensor; `shape` is the target's (used by zeros/ones and reshape only)."""
    x = _apply_op(spec, state, config, shape)
    return x * float(spec["times"]) if "times" in spec else x


def _apply_op(spec: Mapping[str, Any], state: Mapping[str, torch.Tensor], config: EncoderConfig,
              shape: tuple[int, ...]) -> torch.Tensor:
    op = spec["op"]
    if op in _NO_SRC:
        return (torch.zeros if op == "zeros" else torch.ones)(shape)
    src = spec["src"]
    parts = [state[s] if isinstance(s, str) else _apply(s, state, config, ()) for s in
             (src if isinstance(src, list) else [src])]
    x = parts[0]
    if op == "copy":
        return x
    if op == "reshape":
        if not shape or x.numel() != torch.Size(shape).numel():
            raise _NotApplicable(f"reshape of {tuple(x.shape)} to {shape}: the element counts differ")
        return x.reshape(shape)
    if op == "transpose":
        if x.dim() != 2:
            raise _NotApplicable(f"transpose needs a 2-D tensor, got shape {tuple(x.shape)}")
        return x.t()
    if op == "concat":
        if len({p.shape[1:] for p in parts}) != 1:
            raise _NotApplicable(f"concat needs parts equal past dim 0, got {[tuple(p.shape) for p in parts]}")
        return torch.cat(parts, dim=0)
    if op == "block_diag":
        d_head, n_heads = config.d_head, config.n_heads
        if x.dim() == 2 and tuple(x.shape) == (d_head, d_head):
            return torch.block_diag(*[x] * n_heads)
        if x.dim() == 1 and x.shape[0] == d_head:
            return x.repeat(n_heads)
        raise _NotApplicable(f"block_diag needs a shared per-head ({d_head}, {d_head}) matrix or ({d_head},) "
                             f"bias (d_head = d_model / n_heads), got shape {tuple(x.shape)}")
    if op == "row0":
        if x.dim() < 1 or x.shape[0] < 1:
            raise _NotApplicable(f"row0 needs a tensor with at least one row, got shape {tuple(x.shape)}")
        return x[0]
    if op == "add":
        try:
            return torch.stack(torch.broadcast_tensors(*parts)).sum(dim=0)
        except RuntimeError:
            raise _NotApplicable(f"add needs shapes that broadcast, got {[tuple(p.shape) for p in parts]}") from None
    if op == "fold":
        y = x
        for p in parts[1:]:
            if y.dim() != 2 or p.dim() != 2 or y.shape[1] != p.shape[0]:
                raise _NotApplicable(f"fold multiplies matrices, got shapes {[tuple(q.shape) for q in parts]}")
            y = y @ p
        return y
    raise AssertionError(f"op {op} passed validation but has no implementation. This is a bug.")


def convert(state_dict: Mapping[str, object], config: EncoderConfig, keymap: KeyMap, *,
            strict: bool = False) -> Encoder:
    """Build an fp32 Encoder(config) from `state_dict` through `keymap`; ConversionError lists every problem.

    strict: also refuse unused source keys outside the map's `checked` prefixes (default: ignore them).
    The config's sizes are checked against the tensors first (check_sizes), before anything is built from
    it; weights that come out non-finite (a `times` that overflows fp32, say) are refused by name."""
    check_sizes(state_dict, config, keymap)
    plan = resolve(keymap, config)
    encoder = Encoder(config)
    expected = encoder.state_dict()
    variables = keymap.vars
    ignored_known = set(_expand_prefixes(keymap.ignore, variables))
    checked = None if keymap.checked is None else _expand_prefixes(keymap.checked, variables)

    def is_checked(key: str) -> bool:
        return strict or checked is None or key.startswith(checked)

    # "absent": a parameter none of whose sources is there is zeros/ones (a Linear built with bias=False).
    absent = {ours for ours, spec in plan.items()
              if "absent" in spec and _sources(spec) and not any(k in state_dict for k in _sources(spec))}
    wanted = {k for ours, spec in plan.items() if ours not in absent for k in _sources(spec)}
    missing = sorted(k for k in wanted if k not in state_dict)
    unused = [k for k in state_dict if k not in wanted and k not in ignored_known]
    unexpected = sorted(k for k in unused if is_checked(k))
    ignored = sorted(k for k in unused if not is_checked(k))
    bad = []
    for key in sorted(wanted & set(state_dict)):
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            bad.append(f"{key}: expected a floating-point tensor, got {type(value).__name__}"
                       + (f" {value.dtype}" if isinstance(value, torch.Tensor) else ""))
    bad_keys = {b.split(":", 1)[0] for b in bad}
    tensors = {k: state_dict[k].detach().to(torch.float32).cpu() for k in wanted & set(state_dict)
               if k not in bad_keys}
    ours_sd: dict[str, torch.Tensor] = {}
    for ours, spec in plan.items():
        if ours in absent:
            spec = {"op": spec["absent"]}
        if any(k not in tensors for k in _sources(spec)):
            continue  # already reported as missing or mis-typed
        want = tuple(expected[ours].shape)
        try:
            value = _apply(spec, tensors, config, want)
        except _NotApplicable as e:
            bad.append(f"{ours} <- {_describe(spec)}: {e}")
            continue
        if tuple(value.shape) != want:
            source = spec["src"] if spec["op"] == "copy" else f"{ours} <- {_describe(spec)}"
            bad.append(f"{source}: expected shape {want}, got {tuple(value.shape)}")
            continue
        if not bool(torch.isfinite(value).all()):
            bad.append(f"{ours} <- {_describe(spec)}: {int((~torch.isfinite(value)).sum())} of {value.numel()} "
                       "values are not finite (inf or NaN)")
            continue
        ours_sd[ours] = value.contiguous()
    if missing or unexpected or bad:
        lines = [f"state_dict does not match EncoderConfig({config.to_json()}) through key map {keymap.name} "
                 f"(vars {dict(variables)}):"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {unexpected}")
        if bad:
            lines.append(f"  mis-shaped or mis-typed ({len(bad)}): {bad}")
        if ignored and missing:
            lines.append(f"  keys outside the prefixes, ignored (wrong prefix?): {ignored[:20]}")
        raise ConversionError("\n".join(lines))
    encoder.load_state_dict(ours_sd, strict=True)
    return encoder.eval()


def _fact_shape(keymap: KeyMap, ours: str, state_dict: Mapping[str, object], config: EncoderConfig,
                want: tuple[int, ...]) -> tuple[tuple[int, ...] | None, str, int]:
    """(shape, description, element count of the sources) of our parameter `ours` ("{i}" as layer 0)
    evaluated from the source tensors alone; shape () where an op does not apply; (None, "", 0) where the
    map cannot say it without building the encoder (no entry, a key that is missing or not a float
    tensor, zeros/ones): those cases are reported by convert itself. `want` is only what a reshape
    targets (a view: nothing is allocated from it)."""
    spec = keymap.params.get(ours)
    if spec is None:
        return None, "", 0
    try:
        spec = _expand_spec(spec, keymap.vars, 0 if "{i}" in ours else None, ours)
    except ConversionError:
        return None, "", 0
    keys = _sources(spec)

    def generated(s: Any) -> bool:
        src = s.get("src")
        parts = src if isinstance(src, list) else [] if src is None else [src]
        return s["op"] in _NO_SRC or any(isinstance(p, Mapping) and generated(p) for p in parts)

    if not keys or generated(spec) or not all(
            isinstance(state_dict.get(k), torch.Tensor) and state_dict[k].is_floating_point() for k in keys):
        return None, "", 0
    tensors = {k: state_dict[k].detach().to(torch.float32).cpu() for k in keys}  # type: ignore[union-attr]
    described = f"{ours.replace('{i}', '0')} <- {_describe(spec)}"
    numel = sum(t.numel() for t in tensors.values())
    try:
        return tuple(_apply(spec, tensors, config, want).shape), described, numel
    except _NotApplicable as e:
        return (), f"{described} ({e})", numel


def _source_layers(keymap: KeyMap, state_dict: Mapping[str, object]) -> tuple[int, str] | None:
    """(how many layers the state_dict holds through the map, the first key missing past them), counted by
    each layer's feed-forward output weight (every layer of every config has one); None if the map lacks it."""
    spec = keymap.params.get("blocks.{i}.ff.fc2.weight")
    if spec is None:
        return None

    def keys(i: int) -> list[str]:
        return _sources(_expand_spec(spec, keymap.vars, i, "blocks.{i}.ff.fc2.weight"))

    try:
        if not keys(0) or keys(0) == keys(1):
            return None  # no source, or one shared by every layer: the keys cannot count the layers
        for i in range(len(state_dict) + 1):  # each layer has keys of its own: the loop ends at a missing one
            absent = [k for k in keys(i) if k not in state_dict]
            if absent:
                return i, absent[0]
    except ConversionError:
        return None  # an unset var: resolve names it
    raise AssertionError("more layers than keys. This is a bug.")


def check_sizes(state_dict: Mapping[str, object], config: EncoderConfig, keymap: KeyMap) -> None:
    """Refuse, before anything is built from `config`, a config that asks for more than the tensors hold:
    n_layers (counted from the keys), vocab_size and d_model (the token embedding), d_ff (layer 0's
    feed-forward output) or max_length (the learned position table's rows) over OVERSIZE times what the
    tensors state, or, with no position table, a (max_length, d_model) table over DERIVED_TABLE_LIMIT
    values. A config.json that said hidden_size 10^7 once had the encoder allocated at 52 TB, and 10^6
    layers built for minutes, before a tensor was looked at. A smaller difference builds an encoder of
    about the weights' size, and convert then lists it with every other problem, shape by shape. These
    are the facts model/bundle.py's module_config_facts reads off a module."""
    problems, oversize = [], False

    def over(asked: int, stated: int) -> bool:
        return asked > OVERSIZE * stated

    counted = _source_layers(keymap, state_dict)
    if counted is not None:
        layers, absent = counted
        if layers != config.n_layers:
            problems.append(f"n_layers={config.n_layers}, but the state_dict holds {layers} layers through key "
                            f"map {keymap.name}" + (f" (no {absent!r})" if absent else ""))
            # No layer at all: most likely a wrong prefix, which convert explains (if the count is affordable).
            oversize |= over(config.n_layers, layers) if layers else config.n_layers > len(state_dict)
    facts = [("tok_emb.weight", ("vocab_size", "d_model"), "the token embedding"),
             ("blocks.{i}.ff.fc2.weight", ("d_model", "d_ff"), "the feed-forward output")]
    if config.positional == "learned":
        facts.append(("pos_emb", ("max_length", "d_model"), "the position table"))
    table = False
    for ours, fields, what in facts:
        asked = tuple(getattr(config, f) for f in fields)
        shape, described, numel = _fact_shape(keymap, ours, state_dict, config, asked)
        if shape is None:
            continue
        table |= ours == "pos_emb"
        # The position table may hold rows past max_length (an offset's, RoBERTa's); convert checks them.
        fits = len(shape) == 2 and (shape == asked or ours == "pos_emb" and shape[0] >= asked[0]
                                    and shape[1] == asked[1])
        if not fits:
            problems.append(f"{' and '.join(f'{f}={a}' for f, a in zip(fields, asked, strict=True))}, but {what} "
                            f"{described} is {shape} ({', '.join(fields)})")
            if len(shape) == 2:
                oversize |= any(over(a, n) for a, n in zip(asked, shape, strict=True))
            else:  # an op that does not apply (a reshape's element counts): compare the sizes
                oversize |= over(asked[0] * asked[1], OVERSIZE * numel)
    if not table and config.max_length * config.d_model > DERIVED_TABLE_LIMIT:
        oversize = True
        problems.append(f"max_length={config.max_length} with d_model={config.d_model}: no tensor states "
                        f"max_length, and the (max_length, d_model) table it derives would hold "
                        f"{config.max_length * config.d_model} values (the limit is {DERIVED_TABLE_LIMIT})")
    if oversize:
        raise ConversionError("the config does not fit the weights (nothing was built from it): "
                              + "; ".join(problems))


def _stock_map(embedding_prefix: str, encoder_prefix: str, position_key: str | None,
               config: EncoderConfig) -> KeyMap:
    if config.positional == "learned" and not position_key:
        raise ConversionError("positional='learned' needs position_key: the state_dict key of the "
                              "(max_length, d_model) position table (the stock modules have none)")
    return KeyMap.builtin("stock").with_vars(embedding=embedding_prefix, encoder=encoder_prefix,
                                             position_key=position_key)


def key_mapping(config: EncoderConfig, *, embedding_prefix: str = "embedding.", encoder_prefix: str = "encoder.",
                position_key: str | None = None) -> dict[str, str]:
    """Our state_dict key -> the stock key it comes from, for this config (the stock map, resolved)."""
    plan = resolve(_stock_map(embedding_prefix, encoder_prefix, position_key, config), config)
    return {ours: spec["src"] for ours, spec in plan.items()}


def convert_state_dict(state_dict: Mapping[str, object], config: EncoderConfig, *,
                       embedding_prefix: str = "embedding.", encoder_prefix: str = "encoder.",
                       position_key: str | None = None, strict: bool = False) -> Encoder:
    """The stock nn.Embedding + nn.TransformerEncoder state_dict through the built-in `stock` key map."""
    keymap = _stock_map(embedding_prefix, encoder_prefix, position_key, config)
    return convert(state_dict, config, keymap, strict=strict)


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """torch.load a state_dict file safely (weights_only: no arbitrary pickles)."""
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConversionError(f"{path} not found") from None
    except Exception as e:  # torch.load raises UnpicklingError, RuntimeError, ... for a bad file
        raise ConversionError(f"{path} is not a loadable state_dict file: {e}") from e
    if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
        raise ConversionError(f"{path} holds a {type(data).__name__}, not a state_dict (a str -> tensor mapping)")
    return dict(data)
