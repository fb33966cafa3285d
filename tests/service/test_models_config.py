"""Configuring several models (service/config.py, docs/configuration.md "Several models"): the flags, the
environment, the TOML models file, and every mistake refused with the bad value named."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import ModelEntry, ServiceConfig


def parse(*argv: str, **env: str) -> ServiceConfig:
    return ServiceConfig.from_args(list(argv), env=env)


def test_a_bare_model_is_the_one_model_form_as_before():
    config = parse("--model", "/models/minilm")
    assert (config.model, config.models) == ("/models/minilm", ())
    assert config.model_entries == (ModelEntry("", "/models/minilm"),)
    assert parse(ATTN_MODEL="/m/x").model == "/m/x"
    assert parse().model_entries == ()  # the built-in default model
    assert parse("--model", "/data/a=b").model == "/data/a=b"  # an "=" after a "/" is the path's


def test_named_models_from_flags_and_the_environment_the_first_the_default():
    config = parse("--model", "embed=/m/minilm", "--model", "rerank=/m/bge")
    assert [(e.name, e.path) for e in config.model_entries] == [("embed", "/m/minilm"), ("rerank", "/m/bge")]
    assert parse("--model", "embed=/m/minilm").model_entries == (ModelEntry("embed", "/m/minilm"),)
    env = parse(ATTN_MODELS="embed=/m/a, rerank=/m/b")
    assert [e.name for e in env.model_entries] == ["embed", "rerank"]
    both = parse("--model", "first=/m/0", "--models", "embed=/m/a,rerank=/m/b")
    assert [e.name for e in both.model_entries] == ["first", "embed", "rerank"]
    assert parse("--model", "x=/m/x", ATTN_MODEL="y=/m/y").model_entries == (ModelEntry("x", "/m/x"),)  # flag wins
    edges = parse("--model", "a=/a", "--model", "b=/b", "--edge-processes", "2")  # edges serve every model
    assert (edges.edge_processes, [e.name for e in edges.model_entries]) == (2, ["a", "b"])


def test_for_model_is_the_service_config_with_the_models_own_settings_over_it():
    config = ServiceConfig(models=(ModelEntry("a", "/m/a"), ModelEntry("b", "/m/b", settings=(
        ("precision", "fp32"), ("max_batch_tokens", 4096), ("max_sequences_per_call", 8)))), max_batch_size=32)
    b = config.for_model(config.models[1])
    assert (b.model, b.models, b.precision, b.max_batch_tokens, b.max_sequences_per_call, b.max_batch_size) == (
        "/m/b", (), "fp32", 4096, 8, 32)
    assert config.for_model(config.models[0]).precision == "auto"


MODELS_FILE = """
[models.embed]
path = "minilm"                      # relative: from this file's directory
aliases = ["text-embedding-3-small", "sentence-transformers/all-MiniLM-L6-v2"]
precision = "fp32"
max_batch_tokens = 4096
max_wait_ms = 2                      # an int where a float is asked: fine

[models.rerank]
path = "/models/bge-reranker"
served_name = "bge-reranker"
default = true
max_sequences_per_call = 16
"""


def test_the_models_file_with_per_model_settings_and_a_default(tmp_path: Path):
    path = tmp_path / "models.toml"
    path.write_text(MODELS_FILE)
    for config in (parse("--models-file", str(path)), parse(ATTN_MODELS_FILE=str(path)),
                   ServiceConfig(models_file=str(path))):
        embed, rerank = config.models
        assert embed == ModelEntry("embed", str(tmp_path / "minilm"),
                                   ("text-embedding-3-small", "sentence-transformers/all-MiniLM-L6-v2"), False,
                                   (("precision", "fp32"), ("max_batch_tokens", 4096), ("max_wait_ms", 2.0)))
        assert (rerank.name, rerank.path, rerank.default) == ("bge-reranker", "/models/bge-reranker", True)
        assert [e.name for e in config.model_entries] == ["bge-reranker", "embed"]  # the default first
        assert config.for_model(rerank).max_sequences_per_call == 16


@pytest.mark.parametrize(("text", "error"), [
    ("[models.a]\nprecision = 'fp32'\n", r"models.a.path: a bundle or Hugging Face folder is required"),
    ("[models.a]\npath = '/m'\ncolour = 'red'\n", r"models.a: unknown setting 'colour'"),
    ("[models.a]\npath = '/m'\nmax_batch_tokens = '4k'\n", r"models.a.max_batch_tokens: must be an int; got '4k'"),
    ("[models.a]\npath = '/m'\nmax_batch_tokens = true\n", r"models.a.max_batch_tokens: must be an int; got True"),
    ("[models.a]\npath = '/m'\nprecision = 'fp8'\n", r"model 'a': precision must be one of auto\|fp32\|fp16\|bf16; "
                                                      r"got 'fp8'"),
    ("[models.a]\npath = '/m'\nmax_batch_size = 0\n", r"model 'a': max_batch_size must be >= 1; got 0"),
    ("[models.a]\npath = '/m'\naliases = 'x'\n", r"models.a.aliases: must be a list of names; got 'x'"),
    ("[models.a]\npath = '/m'\naliases = ['bad name']\n", r"an alias is letters.*got 'bad name'"),
    ("[models.a]\npath = '/m'\ndefault = 'yes'\n", r"models.a.default: must be true or false; got 'yes'"),
    ("[models.a]\npath = '/m'\ndefault = true\n[models.b]\npath = '/n'\ndefault = true\n",
     r"more than one default model: 'a', 'b'"),
    ("[models.a]\npath = '/m'\n[models.b]\npath = '/n'\naliases = ['a']\n", r"model name 'a' is given twice"),
    ("[models.a]\npath = '/m'\nserved_name = 'a/b'\n", r"a model name is letters.*got 'a/b'"),
    ("[models]\n", r"no \[models.NAME\] table"),
    ("port = 1\n[models.a]\npath = '/m'\n", r"unknown key 'port'"),
    ("[models.a\n", r"is not valid TOML"),
])
def test_a_bad_models_file_is_refused_naming_the_value(tmp_path: Path, text: str, error: str):
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        parse("--models-file", str(path))


@pytest.mark.parametrize(("argv", "env", "error"), [
    (["--model", "e=/a", "--model", "e=/b"], {}, r"model name 'e' is given twice"),
    (["--model", "b@d=/x"], {}, r"model: a model name is letters.*got 'b@d'"),
    (["--model", "e="], {}, r"model 'e': path must name a bundle"),
    (["--models", "/a"], {}, r"models: every entry is NAME=PATH; got '/a'"),
    (["--model", "e=/a"], {"ATTN_MODELS_FILE": "/etc/models.toml"}, r"models_file and --model/--models"),
    (["--models-file", "/no/such/file.toml"], {}, r"models_file must name a readable file; got '/no/such"),
    (["--memory-budget-mb", "-1"], {}, r"memory_budget_mb must be >= 0; got -1"),
])
def test_bad_model_flags_are_refused_naming_the_value(argv: list[str], env: dict[str, str], error: str):
    with pytest.raises(ValueError, match=error):
        parse(*argv, **env)


def test_model_control_and_the_memory_budget():
    assert (parse().model_control, parse().memory_budget_mb) == ("none", 0)
    config = parse("--model-control", "explicit", "--memory-budget-mb", "2048")
    assert (config.model_control, config.memory_budget_mb) == ("explicit", 2048)
    assert parse(ATTN_MODEL_CONTROL="explicit").model_control == "explicit"
    with pytest.raises(ValueError, match="model_control must be one of none\\|explicit; got 'auto'"):
        ServiceConfig(model_control="auto")
    with pytest.raises(ValueError, match="model and models both set"):
        ServiceConfig(model="/a", models=(ModelEntry("b", "/b"),))
