"""Model bundles (TorchScript file + JSON manifest): export, verify, load. The only module that uses torch.jit.

A bundle is a directory:
  model.pt       torch.jit.script of a module with Encoder.forward's signature, fp32 weights
  manifest.json  {format_version, name, version, config, sha256, weights_sha256, dtype,
                  validated_precisions, created_at, source[, text]}
  tokenizer.json a text bundle's Hugging Face tokenizer (model/text.py), sha256 in manifest.text
A text bundle is format_version 2 and an ids-only bundle stays 1, so a server from before text input
refuses a text bundle at load ("format_version 2 is not supported") rather than serving it without
its tokenizer; ids-only bundles written now still load on old servers.
Loading needs torch and json only, never our Python classes (fault bundles need their ops registered:
load_bundle imports model.fault_ops, which imports torch alone, for them). torch 2.13 deprecates
torch.jit; keeping every call here lets torch.export replace it behind the same two functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from model.config import EncoderConfig
from model.encoder import alibi_slopes, packing, relative_buckets, sinusoidal_table
from model.text import TOKENIZER_FILE, TextError, TextSettings, TextTokenizer

FORMAT_VERSION = 1
TEXT_FORMAT_VERSION = 2  # a bundle with a tokenizer (see the module docstring)
MODEL_FILE = "model.pt"
AOTI_FILE = "model.pt2"  # optional: the AOTInductor package of model/aoti.py (manifest.aoti)
MANIFEST_FILE = "manifest.json"
DIAGNOSTICS_METHOD = "diagnostics"  # Encoder.diagnostics, kept through freezing (load_bundle)
UNPACKED_METHOD = "forward_unpacked"  # Encoder.forward_unpacked (query expansion), kept through freezing too
FAULT_MODEL_NAME = "fault-model"  # bundles whose TorchScript calls the ops model.fault_ops registers
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Largest relative error of reduced-precision hidden states vs fp32 that export accepts (max |diff| /
# max |fp32|); measured values are in model/encoder.py's docstring and held by test_model_numerics.
RELATIVE_ERROR_BOUND = {"bfloat16": 0.03, "float16": 0.005}
_FP32_ATOL = 1e-5  # scripted vs eager at export
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class BundleError(Exception):
    """A bundle cannot be written or loaded: missing or malformed file, checksum mismatch, failed check,
    a manifest whose config or weights_sha256 the module itself contradicts."""


@dataclass(frozen=True)
class Manifest:
    """manifest.json. `sha256` is of model.pt; `weights_sha256` is of the weights themselves (name, dtype,
    shape, bytes of each parameter, in order), independent of the file format. model.pt is the same bytes
    for the same weights, code and torch version when built in a fresh process (`script` fixes the one
    order that varied between processes), so replicas that build the default bundle report one sha256.
    A process that scripted other configs of our classes first writes other (mangled) TorchScript class
    names, so the file differs there and weights_sha256 does not. Both are verified on every load, and
    the config is compared with the shapes and constants of the loaded module (module_config_facts)."""

    name: str
    version: str
    config: EncoderConfig
    sha256: str
    weights_sha256: str
    dtype: str
    validated_precisions: tuple[str, ...]
    created_at: str
    source: str
    format_version: int = FORMAT_VERSION
    text: TextSettings | None = None  # text bundles only (format_version 2)
    # Optional: int8/uint8 calibration, {"min": [...], "max": [...]} (d_model values each, or one; finite,
    # min < max): each dimension's range over a representative set of the model's pooled vectors.
    quantization_ranges: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # The tasks served (model/heads.py): {"embed": {}, "classify": {"file", "sha256", "labels", "problem_type"},
    # "rerank": {...}}; None: "embed" only (bundles before heads, and the key left out of the file).
    tasks: Mapping[str, Mapping[str, Any]] | None = None
    # Optional: the compiled artefact (model.pt2, model/aoti.py); None: TorchScript only.
    aoti: AotiArtefact | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        d["validated_precisions"] = list(self.validated_precisions)
        if self.quantization_ranges is None:
            del d["quantization_ranges"]  # optional: absent unless stated
        else:
            d["quantization_ranges"] = {"min": list(self.quantization_ranges[0]),
                                        "max": list(self.quantization_ranges[1])}
        if self.text is None:
            del d["text"]  # the exact key set of format 1, which servers before text input check
        else:
            d["text"] = self.text.to_dict()
        if self.tasks is None:
            del d["tasks"]
        else:
            d["tasks"] = {name: dict(entry) for name, entry in self.tasks.items()}
        if self.aoti is None:
            del d["aoti"]
        return d

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(self.tasks) if self.tasks is not None else ("embed",)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """Parse and check a manifest dict; problems raise ValueError naming the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"manifest must be a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version not in (FORMAT_VERSION, TEXT_FORMAT_VERSION):
            raise ValueError(f"manifest format_version {version!r} is not supported "
                             f"(expected {FORMAT_VERSION}, or {TEXT_FORMAT_VERSION} for a text bundle)")
        if version == TEXT_FORMAT_VERSION and "text" not in data:
            raise ValueError(f"manifest format_version {version} is not supported without its text settings "
                             "(format 2 is a text bundle's)")
        fields = {f.name for f in dataclasses.fields(cls)} - ({"text"} if version == FORMAT_VERSION else set())
        missing = sorted(fields - set(data) - {"quantization_ranges", "tasks", "aoti"})
        unknown = sorted(set(data) - fields)
        if missing or unknown:
            raise ValueError(f"manifest has missing keys {missing} and unknown keys {unknown}")
        for key in ("name", "version", "sha256", "weights_sha256", "dtype", "created_at", "source"):
            if not isinstance(data[key], str) or not data[key]:
                raise ValueError(f"manifest.{key} must be a non-empty string, got {data[key]!r}")
        precisions = data["validated_precisions"]
        if not isinstance(precisions, list) or not all(p in DTYPES for p in precisions):
            raise ValueError(f"manifest.validated_precisions must list names from {list(DTYPES)}, got {precisions!r}")
        text = TextSettings.from_dict(data["text"]) if version == TEXT_FORMAT_VERSION else None
        config = EncoderConfig.from_dict(data["config"])
        ranges = _ranges(data["quantization_ranges"], config.d_model) if "quantization_ranges" in data else None
        tasks = check_tasks(data["tasks"]) if "tasks" in data else None
        aoti = AotiArtefact.from_dict(data["aoti"]) if "aoti" in data else None
        return cls(**{**data, "config": config, "validated_precisions": tuple(precisions), "text": text,
                      "quantization_ranges": ranges, "tasks": tasks, "aoti": aoti})


@dataclass(frozen=True)
class AotiArtefact:
    """manifest.aoti: the AOTInductor package (model/aoti.py) and what it is tied to. A package is native code
    for one torch version, device type and dtype; load_compiled refuses any other by name."""

    file: str
    sha256: str
    dtype: str  # a DTYPES name: the dtype the weights were cast to before export
    device: str  # "cpu" or "cuda"
    torch: str  # torch.__version__ of the compiling process
    max_batch_size: int  # the largest batch the exported graph takes
    max_length: int  # the longest sequence (the config's max_length)
    compile_seconds: float = 0.0  # informational

    @classmethod
    def from_dict(cls, value: Any) -> AotiArtefact:
        if not isinstance(value, Mapping):
            raise ValueError(f"manifest.aoti must be a JSON object, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = sorted(names - set(value) - {"compile_seconds"}), sorted(set(value) - names)
        if missing or unknown:
            raise ValueError(f"manifest.aoti has missing keys {missing} and unknown keys {unknown}")
        for key in ("file", "sha256", "dtype", "device", "torch"):
            if not isinstance(value[key], str) or not value[key]:
                raise ValueError(f"manifest.aoti.{key} must be a non-empty string, got {value[key]!r}")
        if "/" in value["file"] or value["file"].startswith("."):
            raise ValueError(f"manifest.aoti.file must name a file in the bundle directory, got {value['file']!r}")
        if value["dtype"] not in DTYPES or value["device"] not in ("cpu", "cuda"):
            raise ValueError(f"manifest.aoti: dtype must be one of {list(DTYPES)} and device cpu or cuda, got "
                             f"{value['dtype']!r}, {value['device']!r}")
        for key in ("max_batch_size", "max_length"):
            if not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < 1:
                raise ValueError(f"manifest.aoti.{key} must be a positive integer, got {value[key]!r}")
        seconds = value.get("compile_seconds", 0.0)
        if not isinstance(seconds, int | float) or isinstance(seconds, bool):
            raise ValueError(f"manifest.aoti.compile_seconds must be a number, got {seconds!r}")
        return cls(**{**value, "compile_seconds": float(seconds)})


def _ranges(value: Any, d_model: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """manifest.quantization_ranges, checked as a call's ranges are (service/vectors.py check_ranges)."""
    if not isinstance(value, Mapping) or set(value) != {"min", "max"}:
        raise ValueError("manifest.quantization_ranges must be an object {\"min\": [...], \"max\": [...]}")
    out = []
    for key in ("min", "max"):
        values = value[key]
        if not isinstance(values, list) or len(values) not in (1, d_model) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and abs(v) <= _FLOAT32_MAX
                for v in values):
            raise ValueError(f"manifest.quantization_ranges.{key} must list 1 or d_model ({d_model}) finite numbers")
        out.append(tuple(float(v) for v in values))
    low, high = out
    if len(low) != len(high) or not all(np.float32(a) < np.float32(b) for a, b in zip(low, high, strict=True)):
        raise ValueError("manifest.quantization_ranges: min and max must be as long and min < max in each dimension")
    return low, high


TASKS = ("embed", "classify", "rerank", "sparse", "colbert")
COLBERT_REDUCTIONS = ("sum", "mean")  # MaxSim over query tokens: summed (ColBERT, PyLate) or averaged (BGE-M3)
SPARSE_KINDS = ("splade", "lexical")  # a masked-LM head's SPLADE vector; BGE-M3's lexical weights
HEADS_DIR = "heads"


def check_tasks(tasks: Any) -> dict[str, dict[str, Any]]:
    """manifest.tasks, checked: known task names; classify and rerank name their head file (under heads/), its
    sha256 and the labels in id order (rerank: exactly one); colbert its head file, the vectors' `dim` and
    how MaxSim reduces over query tokens (`reduce`: sum | mean); sparse may say its `kind` (splade |
    lexical; unset: splade); ValueError naming the key."""
    if not isinstance(tasks, Mapping) or not tasks:
        raise ValueError(f"manifest.tasks must be a non-empty JSON object, got {tasks!r}")
    out: dict[str, dict[str, Any]] = {}
    for name, entry in tasks.items():
        where = f"manifest.tasks.{name}"
        if name not in TASKS:
            raise ValueError(f"{where}: unknown task; known tasks are {list(TASKS)}")
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a JSON object, got {entry!r}")
        if name != "embed":
            file, sha, labels = entry.get("file"), entry.get("sha256"), entry.get("labels")
            if not isinstance(file, str) or not file.startswith(HEADS_DIR + "/") or ".." in file:
                raise ValueError(f"{where}.file must name a file under {HEADS_DIR}/, got {file!r}")
            if not isinstance(sha, str) or len(sha) != 64:
                raise ValueError(f"{where}.sha256 must be a sha256 hex digest, got {sha!r}")
        if name in ("classify", "rerank"):
            if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
                raise ValueError(f"{where}.labels must list the label names in id order, got {labels!r}")
            if name == "rerank" and len(labels) != 1:
                raise ValueError(f"{where}.labels: a reranker has one label, got {len(labels)}")
            problem = entry.get("problem_type", "single_label_classification")
            if problem not in PROBLEM_TYPES:
                raise ValueError(f"{where}.problem_type must be one of {list(PROBLEM_TYPES)}, got {problem!r}")
        if name == "colbert":
            dim, reduce = entry.get("dim"), entry.get("reduce")
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ValueError(f"{where}.dim must be an int >= 1, got {dim!r}")
            if reduce not in COLBERT_REDUCTIONS:
                raise ValueError(f"{where}.reduce must be one of {list(COLBERT_REDUCTIONS)}, got {reduce!r}")
        if name == "sparse" and entry.get("kind", "splade") not in SPARSE_KINDS:
            raise ValueError(f"{where}.kind must be one of {list(SPARSE_KINDS)}, got {entry.get('kind')!r}")
        out[str(name)] = dict(entry)
    return out


PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


@dataclass(frozen=True)
class LoadedBundle:
    """A loaded, verified, cast and frozen TorchScript module, its manifest, and a text bundle's tokenizer."""

    module: torch.jit.ScriptModule
    manifest: Manifest
    tokenizer: TextTokenizer | None = None
    heads: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # task -> its scripted head (fp32)
    # The word table (the module's dtype) when a head has a token type delta: a pair's second text is fed
    # as embeddings, word + delta (model/heads.py).
    token_embeddings: torch.Tensor | None = None


@contextlib.contextmanager
def _quiet_jit() -> Iterator[None]:
    # torch 2.13 warns on every torch.jit call; the service would repeat it on each load.
    # (catch_warnings is process-wide state; loads are rare and happen before serving.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        yield


class _InsertionOrderedSet(dict):  # type: ignore[type-arg]
    """The `set` torch.jit._recursive builds while it scripts: add, `in` and iteration in insertion order."""

    def __init__(self, items: Iterable[Any] = ()) -> None:
        super().__init__((item, None) for item in items)

    def add(self, item: Any) -> None:
        self[item] = None


_SCRIPTING = threading.Lock()


@contextlib.contextmanager
def _constants_in_declaration_order() -> Iterator[None]:
    # torch.jit._recursive collects a module's constants (Final attributes, __constants__) in a set()
    # of names and emits them in its iteration order, which for strings depends on the process's hash
    # seed (PYTHONHASHSEED): the same module scripted in two processes gave two model.pt files (the
    # code files listed the constants in another order, and serialization_id hashes their CRCs). A
    # module-global `set` there shadows the builtin, so while we script, the names come out in the
    # order they are declared. tests/model/test_model_bundle.py builds the default bundle under two hash seeds.
    import torch.jit._recursive as recursive

    with _SCRIPTING:
        setattr(recursive, "set", _InsertionOrderedSet)  # noqa: B010 (mypy: a module attribute it does not know)
        try:
            yield
        finally:
            delattr(recursive, "set")


def script(module: nn.Module) -> torch.jit.ScriptModule:
    """torch.jit.script (not trace: the graph must take any batch size and length), with the constants in
    declaration order so the saved file does not depend on the process's hash seed."""
    with _quiet_jit(), _constants_in_declaration_order():
        return torch.jit.script(module)


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:  # streamed: bundles of real checkpoints run to hundreds of MB
        return hashlib.file_digest(f, "sha256").hexdigest()


def weights_sha256(module: nn.Module) -> str:
    """Digest of the parameters (name, dtype, shape, bytes per tensor, in order), independent of the file format.

    Parameters, not the state_dict: a loaded TorchScript module lists non-persistent buffers (our
    sinusoidal table) in its state_dict, so the digest must skip buffers to be recomputable at load.
    For our Encoder (no persistent buffers) this is the state_dict digest earlier bundles recorded."""
    digest = hashlib.sha256()
    for name, tensor in module.named_parameters():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _submodule(module: Any, path: str) -> Any:
    for part in path.split(".") if path else []:
        module = getattr(module, part)
    return module


def _encoder_of(module: Any) -> tuple[str, Any]:
    """(prefix, submodule) of the one encoder in `module`: the submodule holding `tok_emb.weight`."""
    keys = [k for k, _ in module.named_parameters() if k.endswith("tok_emb.weight")]
    if len(keys) != 1:
        raise BundleError(f"cannot find one encoder (a tok_emb.weight parameter) in the module; found {keys}")
    prefix = keys[0][: -len("tok_emb.weight")]
    return prefix, _submodule(module, prefix.rstrip("."))


def _class_name(module: Any) -> str:
    """The Python class a module was built from (TorchScript keeps it as original_name)."""
    return str(getattr(module, "original_name", type(module).__name__))


def module_config_facts(module: Any) -> dict[str, Any]:
    """The EncoderConfig fields the module itself states, read from its parameters and TorchScript constants.

    Works on an eager Encoder and on a loaded (unfrozen) TorchScript one, alone or wrapped (the encoder
    is the submodule holding `tok_emb.weight`). Raises BundleError if the module is not shaped like one."""
    prefix, enc = _encoder_of(module)
    try:
        params = dict(enc.named_parameters())
        blocks = [getattr(enc.blocks, str(i)) for i in range(len(list(enc.blocks.children())))]
        vocab_size, d_model = params["tok_emb.weight"].shape
        first = blocks[0]
        facts: dict[str, Any] = {
            "vocab_size": int(vocab_size),
            "d_model": int(d_model),
            "n_layers": len(blocks),
            "n_heads": int(first.attn.n_heads),
            "d_ff": int(params["blocks.0.ff.fc1.weight"].shape[0]) // (2 if getattr(first.ff, "gated", False) else 1),
            "max_length": int(enc.max_length),
            "positional": "rotary" if getattr(first.attn, "rotary", False) else "alibi" if getattr(enc, "alibi", False)
            else "none" if not enc.has_positions
            else "learned" if "pos_emb" in params else "sinusoidal",
            "norm_first": bool(first.norm_first),
            "activation": "gelu" if first.ff.use_gelu else "gelu_tanh" if getattr(first.ff, "use_gelu_tanh", False)
            else "silu" if getattr(first.ff, "use_silu", False) else "relu",
            "layer_norm_eps": float(first.ln2.eps),
            "final_norm": "ln_f.weight" in params,
            "embedding_norm": "ln_emb.weight" in params,
            # Bundles from before these fields have neither constant: no bias, 1/sqrt(d_head).
            "relative_bias": "per_layer" if getattr(first.attn, "has_rel_bias", False)
            else "shared" if getattr(enc, "has_rel_bias", False)
            else "bucketed" if getattr(enc, "bucketed", False) else "none",
            "attention_scale": float(first.attn.scale),
            "position_offset": int(getattr(enc, "position_offset", 0)),  # bundles from before it: 0
            "norm": "rms" if _class_name(first.ln2) == "RMSNorm" else "layer",
            "first_attn_norm": _class_name(first.ln1) != "Identity",
            "local_radius": int(getattr(enc, "local_radius", 0)),
            "ffn_gated": bool(getattr(first.ff, "gated", False)),
            "linear_bias": "blocks.0.attn.qkv.bias" in params,
        }
        if facts["local_radius"] > 0:  # which layers are local, and their rotary base
            facts["global_every"] = int(enc.global_every)
            local = [bool(b.local) for b in blocks]
            want = [i % facts["global_every"] != 0 for i in range(len(blocks))]
            if local != want:
                raise BundleError(f"the module's local layers {local} are not every layer but each "
                                  f"{facts['global_every']}th")
            if facts["positional"] == "rotary" and any(local):
                facts["local_rotary_base"] = float(blocks[local.index(True)].attn.rotary_base)
        if facts["relative_bias"] == "bucketed":
            facts["relative_buckets"] = int(enc.rel_buckets.shape[0])
            if tuple(enc.rel_buckets.shape) != (facts["relative_buckets"], facts["n_heads"]):
                raise BundleError(f"the module's bucket table is {tuple(enc.rel_buckets.shape)}, not "
                                  f"(relative_buckets, n_heads)")
        if facts["norm"] == "layer":  # RMSNorm has no bias whatever norm_bias says
            facts["norm_bias"] = "blocks.0.ln2.bias" in params
        if facts["positional"] == "rotary":
            facts["rotary_base"] = float(first.attn.rotary_base)
            facts["rotary_dims"] = int(first.attn.rotary_dims)  # what rotary_fraction of d_head comes to
        tables = ([b.attn.rel_bias for b in blocks] if facts["relative_bias"] == "per_layer"
                  else [enc.rel_bias] if facts["relative_bias"] == "shared" else [])
        want_table = (facts["n_heads"], facts["max_length"], facts["max_length"])
        if any(tuple(t.shape) != want_table for t in tables):
            raise BundleError(f"the module's relative bias tables are {[tuple(t.shape) for t in tables]}, not "
                              f"(n_heads, max_length, max_length) = {want_table}")
        # Constants each layer holds for itself must agree with the first (and the encoder's own count).
        layer_facts = {(int(b.attn.n_heads), int(b.attn.d_head), bool(b.norm_first), bool(b.ff.use_gelu),
                        float(b.ln1.eps if i or facts["first_attn_norm"] else b.ln2.eps), float(b.ln2.eps),
                        float(b.attn.scale)) for i, b in enumerate(blocks)}
        if int(enc.n_layers) != len(blocks) or len(layer_facts) != 1:
            raise BundleError(f"the module's layers disagree: n_layers constant {int(enc.n_layers)}, "
                              f"{len(blocks)} blocks, per-layer constants {sorted(layer_facts)}")
        if int(first.attn.n_heads) * int(first.attn.d_head) != d_model:
            raise BundleError(f"the module's attention has {int(first.attn.n_heads)} heads of "
                              f"{int(first.attn.d_head)} for d_model {int(d_model)}")
        rows = facts["max_length"] + facts["position_offset"]
        if facts["positional"] in ("learned", "sinusoidal") and tuple(enc.pos_emb.shape) != (rows, d_model):
            raise BundleError(f"the module's position table is {tuple(enc.pos_emb.shape)}, not (max_length + "
                              f"position_offset, d_model) = ({rows}, {int(d_model)})")
    except (AttributeError, KeyError, IndexError) as e:
        raise BundleError(f"the module is not shaped like our Encoder (under {prefix!r}): {e}") from e
    return facts


def _check_module(module: Any, manifest: Manifest, where: Path) -> None:
    """Refuse a module that contradicts its manifest: config fields by name, weights by digest."""
    facts = module_config_facts(module)
    # The scale the manifest's config means (null: 1/sqrt(d_head)) against the one the module multiplies by.
    c = manifest.config
    config = {**c.to_dict(), "attention_scale": c.scale, "rotary_dims": c.rotary_dims,
              "local_rotary_base": c.rotary_base if c.local_rotary_base is None else c.local_rotary_base}
    wrong = [f"config.{k} is {config[k]!r} in the manifest, {v!r} in the module" for k, v in facts.items()
             if config[k] != v]
    if wrong:
        raise BundleError(f"{where} does not match its manifest: " + "; ".join(wrong))
    if facts["positional"] == "sinusoidal":
        # Not a parameter (it is derived from the config), so outside weights_sha256: compare exactly.
        table = _encoder_of(module)[1].pos_emb
        if not torch.equal(table.cpu(), sinusoidal_table(facts["max_length"] + facts["position_offset"],
                                                            facts["d_model"])):
            raise BundleError(f"{where}: the module's sinusoidal position table is not the one its config derives")
    if facts["positional"] == "alibi":  # derived, outside weights_sha256
        slopes = list(_encoder_of(module)[1].alibi_slopes)
        if slopes != alibi_slopes(facts["n_heads"]):
            raise BundleError(f"{where}: the module's ALiBi slopes {slopes} are not the ones its config derives")
    if facts["relative_bias"] == "bucketed":  # derived, outside weights_sha256
        c = manifest.config
        index = relative_buckets(c.max_length, c.relative_buckets, c.relative_max_distance)
        if not torch.equal(_encoder_of(module)[1].bucket_index.cpu(), index):
            raise BundleError(f"{where}: the module's relative position buckets are not the ones its config derives")
    actual = weights_sha256(module)
    if actual != manifest.weights_sha256:
        raise BundleError(f"{where} failed its weights check: manifest weights_sha256 {manifest.weights_sha256}, "
                          f"module weights_sha256 {actual}; the weights were changed")


def _probe(config: EncoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    # A fixed padded batch. Ids from the lower half of the vocabulary: fault models keep their
    # sentinel ids at the top, and a probe must not trip them.
    g = torch.Generator().manual_seed(1234)
    t = min(16, config.max_length)
    ids = torch.randint(0, max(1, config.vocab_size // 2), (3, t), generator=g)
    return ids, torch.tensor([t, max(1, t // 2), 1])


def _forward(module: Any, ids: torch.Tensor, lengths: torch.Tensor, layers: list[int]) -> tuple[Any, Any]:
    with torch.inference_mode():
        return module(ids, None, lengths, False, layers)


def _validated_precisions(eager: nn.Module, saved: Path, config: EncoderConfig) -> tuple[str, ...]:
    """Reload the saved file and check it: fp32 must equal the eager module (else BundleError); each
    reduced precision is listed if, on this CPU, it runs and stays within RELATIVE_ERROR_BOUND."""
    ids, lengths = _probe(config)
    all_layers = list(range(config.n_layers))
    want, _ = _forward(eager, ids, lengths, [])
    want_w, want_weights = _forward(eager, ids, lengths, all_layers)
    ok = ["float32"]
    for name, dtype in DTYPES.items():
        try:
            with _quiet_jit():
                module = torch.jit.freeze(torch.jit.load(str(saved), map_location="cpu").to(dtype).eval())
            got, _ = _forward(module, ids, lengths, [])
            got_w, got_weights = _forward(module, ids, lengths, all_layers)
        except RuntimeError as e:  # e.g. a CPU without the kernels for this dtype
            if dtype == torch.float32:
                raise BundleError(f"the exported model fails to run in float32: {e}") from e
            continue
        err = max(
            float((got.float() - want).abs().max() / want.abs().max()),
            float((got_w.float() - want_w).abs().max() / want_w.abs().max()),
            float((got_weights - want_weights).abs().max()),
        )
        if dtype == torch.float32:
            abs_err = max(float((got - want).abs().max()), float((got_w - want_w).abs().max()))
            if abs_err > _FP32_ATOL:
                raise BundleError(f"the scripted model differs from the eager one by {abs_err:.3g} (> {_FP32_ATOL})")
        elif err <= RELATIVE_ERROR_BOUND[name] and all(bool(torch.isfinite(x).all()) for x in (got, got_w)):
            ok.append(name)
    return tuple(ok)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_bundle(module: nn.Module, directory: str | os.PathLike[str], *, name: str, version: str,
                source: str, text: tuple[bytes, TextSettings] | None = None,
                tasks: Mapping[str, Mapping[str, Any]] | None = None,
                heads: Mapping[str, nn.Module] | None = None) -> Manifest:
    """Script `module` (an Encoder, or a module with its forward and a `config` attribute), save it
    with its manifest into `directory` (created; must not already hold a bundle), and return the manifest.
    `text`: the tokenizer.json bytes and settings of a text bundle (checked to load, and to match).
    `tasks`: the manifest's tasks (model/heads.py), each head task's "file" one of `heads` (file -> module),
    scripted into that file and checked against the eager module; its sha256 is filled in here.

    The saved file is reloaded and checked against the eager module before the manifest is written,
    so a directory with a manifest.json is a complete, checked bundle.
    """
    config = getattr(module, "config", None)
    if not isinstance(config, EncoderConfig):
        raise BundleError(f"{type(module).__name__} has no EncoderConfig `config` attribute to export")
    dtypes = {p.dtype for p in module.parameters()}
    if dtypes != {torch.float32}:
        raise BundleError(f"bundles store float32 weights; the module has {sorted(map(str, dtypes))}")
    non_finite = [name for name, p in module.named_parameters() if not bool(torch.isfinite(p).all())]
    if non_finite:  # such a bundle would load and then fail its warm-up (or answer NaN)
        raise BundleError(f"the module's parameters {non_finite[:5]}{' ...' if len(non_finite) > 5 else ''} hold "
                          "non-finite values (inf or NaN); no bundle written")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for existing in (MODEL_FILE, MANIFEST_FILE, TOKENIZER_FILE):
        if (directory / existing).exists():
            raise BundleError(f"{directory} already holds a bundle ({existing}); choose an empty directory")
    if text is not None:
        try:
            TextTokenizer(text[0], text[1], source=f"the tokenizer for {directory}")
        except TextError as e:
            raise BundleError(str(e)) from None
        if text[1].max_tokens > config.max_length:
            raise BundleError(f"text max_tokens {text[1].max_tokens} exceeds the model's max_length "
                              f"{config.max_length}")
    module = module.eval()
    scripted = script(module)
    model_path = directory / MODEL_FILE
    with _quiet_jit():
        torch.jit.save(scripted, str(model_path))
    try:
        validated = _validated_precisions(module, model_path, config)
    except BaseException:
        model_path.unlink(missing_ok=True)  # no half bundle left to block a retry
        raise
    manifest = Manifest(
        name=name,
        version=version,
        config=config,
        sha256=file_sha256(model_path),
        weights_sha256=weights_sha256(module),
        dtype="float32",
        validated_precisions=validated,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        source=source,
        format_version=FORMAT_VERSION if text is None else TEXT_FORMAT_VERSION,
        text=None if text is None else text[1],
    )
    try:
        with _quiet_jit():
            _check_module(torch.jit.load(str(model_path), map_location="cpu"), manifest, model_path)
    except BaseException:
        model_path.unlink(missing_ok=True)
        raise
    if text is not None:
        _write_atomic(directory / TOKENIZER_FILE, text[0])
    if tasks is not None:
        manifest = dataclasses.replace(manifest, tasks=_save_heads(directory, tasks, heads or {}, config.d_model))
    _write_atomic(directory / MANIFEST_FILE, (json.dumps(manifest.to_dict(), indent=2) + "\n").encode())
    return manifest


def _save_heads(directory: Path, tasks: Mapping[str, Mapping[str, Any]], heads: Mapping[str, nn.Module],
                d_model: int) -> dict[str, dict[str, Any]]:
    """Script each head into its file, check it reloads equal to the eager module; the tasks with sha256s."""
    from model.heads import probe

    sums: dict[str, str] = {}
    for file, head in heads.items():
        path = directory / file
        path.parent.mkdir(parents=True, exist_ok=True)
        head = head.eval()
        with _quiet_jit():
            torch.jit.save(torch.jit.script(head), str(path))
            loaded = torch.jit.load(str(path), map_location="cpu")
        inputs = probe(head, d_model)
        with torch.inference_mode():
            if not torch.allclose(loaded(*inputs), head(*inputs), atol=_FP32_ATOL, rtol=0):
                raise BundleError(f"{path}: the scripted head differs from the eager module")
        sums[file] = file_sha256(path)
    out = {name: dict(entry) for name, entry in tasks.items()}
    for name, entry in out.items():
        if name != "embed":
            if entry.get("file") not in sums:
                raise BundleError(f"task {name}: head file {entry.get('file')!r} is not among the heads given")
            entry["sha256"] = sums[entry["file"]]
    try:
        return check_tasks(out)
    except ValueError as e:
        raise BundleError(str(e)) from None


def _load_heads(directory: Path, manifest: Manifest, device: str | torch.device) -> dict[str, Any]:
    """task -> its scripted head, each file checked against its sha256 (one module per file)."""
    loaded: dict[str, Any] = {}
    heads: dict[str, Any] = {}
    for name, entry in (manifest.tasks or {}).items():
        if name == "embed":
            continue
        file = entry["file"]
        if file not in loaded:
            path = directory / file
            if not path.is_file():
                raise BundleError(f"{path} not found (manifest.tasks.{name} names it)")
            if file_sha256(path) != entry["sha256"]:
                raise BundleError(f"{path} failed its checksum (manifest.tasks.{name}.sha256); the file is corrupt "
                                  "or was replaced")
            try:
                with _quiet_jit():
                    loaded[file] = torch.jit.load(str(path), map_location=device).eval()
            except RuntimeError as e:
                raise BundleError(f"{path} could not be loaded as TorchScript: {e}") from e
        heads[name] = loaded[file]
    return heads


def build_atomically(final: Path, build: Callable[[Path], object]) -> bool:
    """`build(tmp)` a bundle in a temporary sibling of `final`, then rename it into place: a reader never sees
    half a bundle, and of two processes racing, one bundle stays (the other's is as good). True if ours did."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)  # atomic; replaces an empty directory, fails on a non-empty one
        except OSError:
            if not (final / MANIFEST_FILE).is_file():
                raise BundleError(f"{final} exists but holds no bundle; remove it and retry") from None
            return False  # another process finished first
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and check DIR/manifest.json; any problem is a BundleError naming the file."""
    path = Path(directory) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{path} not found: not a model bundle directory") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError, JSONDecodeError, an int of over 4300 digits
        raise BundleError(f"{path} is not readable JSON: {e}") from e
    except RecursionError:
        raise BundleError(f"{path} is not readable JSON: nested too deeply") from None
    try:
        return Manifest.from_dict(data)
    except (ValueError, TypeError) as e:
        raise BundleError(f"{path} is not a valid manifest: {e}") from e


def load_bundle(directory: str | os.PathLike[str], *, device: str | torch.device = "cpu",
                dtype: torch.dtype | str = torch.float32) -> LoadedBundle:
    """Verify model.pt against the manifest's sha256, load it onto `device`, check the module against the
    manifest (config facts by name, weights_sha256), cast to `dtype`, eval, freeze.

    Freezing (torch.jit.freeze) inlines the weights as constants of the graph, so it happens here,
    after the cast: a frozen module cannot be cast again. For fp32 and bf16 copies of one bundle
    (fp32 retry of non-finite rows), call load_bundle twice. Frozen outputs equal unfrozen ones
    bit for bit (tests/model/test_model_bundle.py). `dtype` may not be among validated_precisions; the
    caller decides whether that matters.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    dtype = DTYPES[dtype] if isinstance(dtype, str) and dtype in DTYPES else dtype
    if dtype not in DTYPES.values():
        raise BundleError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    model_path = directory / MODEL_FILE
    if not model_path.is_file():
        raise BundleError(f"{model_path} not found (the manifest is there, the model is not)")
    actual = file_sha256(model_path)
    if actual != manifest.sha256:
        raise BundleError(
            f"{model_path} failed its checksum: manifest sha256 {manifest.sha256}, file sha256 {actual}; "
            "the file is corrupt or was replaced"
        )
    tokenizer = None
    if manifest.text is not None:
        tokenizer_path = directory / TOKENIZER_FILE
        try:
            tokenizer = TextTokenizer(tokenizer_path.read_bytes(), manifest.text, source=str(tokenizer_path))
        except FileNotFoundError:
            raise BundleError(f"{tokenizer_path} not found (the manifest is of a text bundle)") from None
        except TextError as e:
            raise BundleError(str(e)) from None
    if manifest.name == FAULT_MODEL_NAME:
        # Imported here, not at the top: registering the ops is a side effect other bundles do not need.
        import model.fault_ops  # noqa: F401  (registers the attention_faults ops its TorchScript calls)
    try:
        with _quiet_jit():
            module = torch.jit.load(str(model_path), map_location=device)
    except RuntimeError as e:
        raise BundleError(f"{model_path} could not be loaded as TorchScript: {e}") from e
    _check_module(module, manifest, model_path)  # fp32, before the cast and freeze
    heads = _load_heads(directory, manifest, device)
    # Freezing keeps only `forward` unless told: keep the diagnostics and unpacked entry points where the bundle
    # has them (bundles exported before them, and wrappers that export only forward, do not).
    preserved = [name for name in (DIAGNOSTICS_METHOD, UNPACKED_METHOD) if module._c._has_method(name)]
    module = module.to(dtype).eval()
    table = None
    if any(int(head.type_delta.numel()) for head in heads.values() if hasattr(head, "type_delta")):
        table = _encoder_of(module)[1].tok_emb.weight.detach()  # before freezing inlines it
    with _quiet_jit():
        module = torch.jit.freeze(module, preserved_attrs=preserved)
    return LoadedBundle(module=module, manifest=manifest, tokenizer=tokenizer, heads=heads, token_embeddings=table)


def has_diagnostics(module: Any) -> bool:
    """Whether a loaded bundle's module has Encoder.diagnostics (attention health sampling)."""
    return bool(module._c._has_method(DIAGNOSTICS_METHOD))


def has_unpacked(module: Any) -> bool:
    """Whether a loaded bundle's module has Encoder.forward_unpacked (query expansion tokens not attended);
    bundles exported before it do not."""
    return bool(module._c._has_method(UNPACKED_METHOD))


class CompiledForward:
    """A loaded AOTInductor package (model/aoti.py's PackedForward): `(ids, lengths) -> hidden` for the calls it
    covers (`covers`); the packing is computed here on the host, from host lengths."""

    def __init__(self, runner: Any, artefact: AotiArtefact, device: torch.device) -> None:
        self._runner = runner
        self.dtype = artefact.dtype
        self.max_batch_size = artefact.max_batch_size
        self.max_length = artefact.max_length
        self.device = device

    @staticmethod
    def inputs(ids: torch.Tensor, lengths: torch.Tensor,
               device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, lengths, tokens, grid) on `device`, from ids (B, T) and host lengths (B,)."""
        B, T = ids.shape
        tokens, grid = packing(lengths, T)
        return (ids.to(device, non_blocking=True), lengths.to(device, non_blocking=True),
                tokens.to(device, non_blocking=True), grid.view(B, T).to(device, non_blocking=True))

    def covers(self, batch: int, lengths: torch.Tensor) -> bool:
        """Whether a batch of token ids of these host lengths is within the compiled graph's shapes."""
        return 1 <= batch <= self.max_batch_size and bool((lengths > 0).any())

    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self._runner(*self.inputs(ids, lengths.cpu(), self.device))
        hidden: torch.Tensor = out[0] if isinstance(out, list | tuple) else out
        return hidden


def load_compiled(directory: str | os.PathLike[str], manifest: Manifest, *, device: str | torch.device = "cpu",
                  dtype: torch.dtype | str = "float32", reference: Any = None, runners: int = 1) -> CompiledForward:
    """Load manifest.aoti's package after checking it: the file's sha256, the torch version, the device type and the
    dtype it was compiled for. With `reference` (the bundle's loaded TorchScript module, in `dtype`), a probe batch
    must agree with it on real positions (fp32: 1e-5; reduced precision: RELATIVE_ERROR_BOUND). BundleError naming
    what does not match. `runners`: model instances, so that many threads can run it at once (one: they take
    turns)."""
    directory = Path(directory)
    artefact = manifest.aoti
    if artefact is None:
        raise BundleError(f"{directory} has no compiled artefact (manifest.aoti); build one with "
                          f"`python -m model compile-aoti {directory}`")
    name = dtype if isinstance(dtype, str) else next((k for k, v in DTYPES.items() if v == dtype), str(dtype))
    device = torch.device(device)
    path = directory / artefact.file
    if artefact.torch != torch.__version__:
        raise BundleError(f"{path} was compiled by torch {artefact.torch}, this is torch {torch.__version__}: an "
                          "AOTInductor package runs only on the torch that built it; recompile it with "
                          f"`python -m model compile-aoti {directory}`")
    if artefact.device != device.type:
        raise BundleError(f"{path} was compiled for {artefact.device}, the service runs on {device.type}")
    if artefact.dtype != name:
        raise BundleError(f"{path} was compiled for {artefact.dtype}, the service serves {name}")
    if not path.is_file():
        raise BundleError(f"{path} not found (manifest.aoti names it)")
    actual = file_sha256(path)
    if actual != artefact.sha256:
        raise BundleError(f"{path} failed its checksum: manifest aoti.sha256 {artefact.sha256}, file sha256 {actual}; "
                          "the file is corrupt or was replaced")
    try:
        from torch._inductor.package import load_package

        runner = load_package(str(path), num_runners=max(1, runners),
                              device_index=device.index if device.index is not None else -1)
    except Exception as e:  # noqa: BLE001 - a package torch cannot open, whatever it raises
        raise BundleError(f"{path} could not be loaded as an AOTInductor package: {type(e).__name__}: {e}") from e
    compiled = CompiledForward(runner, artefact, device)
    if reference is not None:
        _check_compiled(compiled, reference, manifest, path)
    return compiled


def _check_compiled(compiled: CompiledForward, reference: Any, manifest: Manifest, path: Path) -> None:
    ids, lengths = _probe(manifest.config)
    try:
        got = compiled(ids.to(compiled.device), lengths).float()
    except Exception as e:  # noqa: BLE001 - whatever the native code raises
        raise BundleError(f"{path} fails to run: {type(e).__name__}: {e}") from e
    want, _ = _forward(reference, ids.to(compiled.device), lengths, [])
    want = want.float()
    real = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).to(got.device)
    diff = float((got - want).abs().masked_fill(~real[..., None], 0.0).max())
    if compiled.dtype == "float32":
        bad, bound = diff > _FP32_ATOL, _FP32_ATOL
    else:
        bound = 2 * RELATIVE_ERROR_BOUND[compiled.dtype]
        diff /= float(want.abs().max())
        bad = diff > bound
    if bad or not bool(torch.isfinite(got).all()):
        raise BundleError(f"{path} does not agree with model.pt: {diff:.3g} on the probe (bound {bound}); recompile "
                          "it or remove manifest.aoti")


def scripted_parameters(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """model.pt's parameters (fp32, CPU) after the checks load_bundle makes (sha256, config facts, weights)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    model_path = directory / MODEL_FILE
    if not model_path.is_file() or file_sha256(model_path) != manifest.sha256:
        raise BundleError(f"{model_path} is missing or failed its checksum (manifest sha256)")
    try:
        with _quiet_jit():
            module = torch.jit.load(str(model_path), map_location="cpu")
    except RuntimeError as e:
        raise BundleError(f"{model_path} could not be loaded as TorchScript: {e}") from e
    _check_module(module, manifest, model_path)
    return {name: p.detach().clone() for name, p in module.named_parameters()}
