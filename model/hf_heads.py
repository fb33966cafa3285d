"""The task heads of a Hugging Face folder (model/heads.py), as `convert-hf` reads them: config.json's
`architectures` says which.

  BertForSequenceClassification         bert.pooler.dense (+ tanh) -> classifier
  RobertaForSequenceClassification,     classifier.dense (+ tanh) -> classifier.out_proj, on <s>
  XLMRobertaForSequenceClassification
Labels from config.json's `id2label` in id order (a head whose outputs are not as many as the config's labels
is refused, as transformers refuses to load it), `problem_type` as Hugging Face reads it (unset: regression
for one label, else single-label classification). A head with one label also serves "rerank" (a
cross-encoder). BERT's token type embeddings give the head its `type_delta` (type 1 minus type 0), so the
second text of a pair is embedded as Hugging Face embeds it. Any other *For* architecture is served as its
base model (embeddings only), as before heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from model.heads import ClassifyHead, SparseHead

CLASSIFY_FILE = "heads/classify.pt"
SPARSE_FILE = "heads/sparse.pt"
# model_type -> (architecture, the transform's prefix, its LayerNorm's name, the bias keys in the order tried,
# the word table (the tied decoder), the activation: BERT's config hidden_act, RoBERTa's lm_head always gelu)
_MASKED_LM = {
    "bert": ("BertForMaskedLM", "cls.predictions.transform.", "LayerNorm", ("cls.predictions.bias",
             "cls.predictions.decoder.bias"), "bert.embeddings.word_embeddings.weight", None),
    "roberta": ("RobertaForMaskedLM", "lm_head.", "layer_norm", ("lm_head.bias", "lm_head.decoder.bias"),
                "roberta.embeddings.word_embeddings.weight", "gelu"),
    "xlm-roberta": ("XLMRobertaForMaskedLM", "lm_head.", "layer_norm", ("lm_head.bias", "lm_head.decoder.bias"),
                    "roberta.embeddings.word_embeddings.weight", "gelu"),
}
# model_type -> (architecture, dense weight/bias prefix, output prefix, the token type table or None)
_CLASSIFIERS = {
    "bert": ("BertForSequenceClassification", "bert.pooler.dense.", "classifier.",
             "bert.embeddings.token_type_embeddings.weight"),
    "roberta": ("RobertaForSequenceClassification", "classifier.dense.", "classifier.out_proj.", None),
    "xlm-roberta": ("XLMRobertaForSequenceClassification", "classifier.dense.", "classifier.out_proj.", None),
}


class HeadConversionError(ValueError):
    """A head named by config.json that cannot be converted; the message names the file and key."""


def convert_heads(hf: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], d_model: int,
                  source: str) -> tuple[dict[str, dict[str, Any]] | None, dict[str, nn.Module]]:
    """(manifest tasks, head file -> module) for the folder; (None, {}) for a base model (embeddings only)."""
    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type")
    masked = _MASKED_LM.get(model_type) if isinstance(model_type, str) else None
    if masked is not None and masked[0] in architectures:
        return _sparse(hf, state_dict, d_model, source, masked)
    known = _CLASSIFIERS.get(model_type) if isinstance(model_type, str) else None
    if known is None or known[0] not in architectures:
        return None, {}
    _, dense, out, types = known

    def tensor(key: str) -> torch.Tensor:
        if key not in state_dict:
            raise HeadConversionError(f"{source}: no key {key!r} ({known[0]}'s head)")
        return state_dict[key].detach().float()

    weight = tensor(out + "weight")
    n_labels = int(weight.shape[0])
    declared, how = _declared_labels(hf, source)
    if declared != n_labels:
        # transformers builds the head from the config and then fails to load the weights ("size mismatch
        # for classifier.weight ... ignore_mismatched_sizes"); serving it would cut or invent labels.
        raise HeadConversionError(f"{source}: {out}weight has {n_labels} output(s), but config.json declares "
                                  f"{declared} label(s) ({how}); transformers refuses this folder too (size "
                                  f"mismatch); make id2label name one label per output")
    delta = None
    if types is not None and types in state_dict and state_dict[types].shape[0] > 1:
        table = tensor(types)
        delta = table[1] - table[0]
    head = ClassifyHead(d_model, n_labels, delta)
    shapes = {"dense.weight": (d_model, d_model), "dense.bias": (d_model,), "out.weight": (n_labels, d_model),
              "out.bias": (n_labels,)}
    with torch.no_grad():
        for name, shape in shapes.items():
            key = (dense if name.startswith("dense") else out) + name.split(".")[1]
            value = tensor(key)
            if tuple(value.shape) != shape:
                raise HeadConversionError(f"{source}: {key} has shape {list(value.shape)}; expected {list(shape)}")
            head.get_parameter(name).copy_(value)
    entry = {"file": CLASSIFY_FILE, "labels": _labels(hf, n_labels, source), "problem_type": _problem(hf, n_labels)}
    tasks: dict[str, dict[str, Any]] = {"embed": {}, "classify": entry}
    if n_labels == 1:
        tasks["rerank"] = dict(entry)
    return tasks, {CLASSIFY_FILE: head}


def _sparse(hf: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], d_model: int, source: str,
            masked: tuple[Any, ...]) -> tuple[dict[str, dict[str, Any]], dict[str, nn.Module]]:
    """The masked-LM head as SPLADE's SparseHead (model/heads.py)."""
    architecture, transform, norm, biases, table, activation = masked
    activation = activation or hf.get("hidden_act", "gelu")
    if activation not in ("gelu", "relu"):
        raise HeadConversionError(f"{source}: hidden_act={activation!r}: the masked-LM head's activation must be "
                                  "gelu or relu to be reproduced exactly")

    def tensor(key: str) -> torch.Tensor:
        if key not in state_dict:
            raise HeadConversionError(f"{source}: no key {key!r} ({architecture}'s head)")
        return state_dict[key].detach().float()

    words = tensor(table)
    bias_key = next((k for k in biases if k in state_dict), biases[0])
    head = SparseHead(d_model, int(words.shape[0]), activation, float(hf.get("layer_norm_eps", 1e-12)))
    values = {"dense.weight": tensor(transform + "dense.weight"), "dense.bias": tensor(transform + "dense.bias"),
              "norm.weight": tensor(f"{transform}{norm}.weight"), "norm.bias": tensor(f"{transform}{norm}.bias"),
              "decoder.weight": words, "decoder.bias": tensor(bias_key)}
    with torch.no_grad():
        for name, value in values.items():
            target = head.get_parameter(name)
            if tuple(value.shape) != tuple(target.shape):
                raise HeadConversionError(f"{source}: {name} of the masked-LM head has shape {list(value.shape)}; "
                                          f"expected {list(target.shape)}")
            target.copy_(value)
    return {"embed": {}, "sparse": {"file": SPARSE_FILE}}, {SPARSE_FILE: head}


def _declared_labels(hf: Mapping[str, Any], source: str) -> tuple[int, str]:
    """How many labels transformers' config gives the head, and from what: `num_labels` when config.json
    has it, else the size of `id2label`, else transformers' default of 2."""
    num = hf.get("num_labels")
    if num is not None:
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise HeadConversionError(f"{source}: config.json num_labels must be an int >= 1, got {num!r}")
        return num, f"num_labels={num}"
    id2label = hf.get("id2label")
    if id2label is None:
        return 2, "no id2label: transformers' default of 2 labels"
    if not isinstance(id2label, Mapping):
        raise HeadConversionError(f"{source}: config.json id2label must be an object, got {id2label!r}")
    return len(id2label), f"id2label has {len(id2label)} entries"


def _labels(hf: Mapping[str, Any], n: int, source: str) -> list[str]:
    id2label = hf.get("id2label") or {}
    if not isinstance(id2label, Mapping):
        raise HeadConversionError(f"{source}: config.json id2label must be an object, got {id2label!r}")
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]  # type: ignore[call-overload]


def _problem(hf: Mapping[str, Any], n: int) -> str:
    problem = hf.get("problem_type")
    if isinstance(problem, str) and problem:
        return problem
    return "regression" if n == 1 else "single_label_classification"
