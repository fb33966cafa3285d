"""A Hugging Face folder without a tokenizer (config.json and weights only): `convert-hf` gives an ids-only
bundle and says so in one line, with how to add text; served on 127.0.0.1:0 it takes token ids (equal to the
transformers model's own states) and refuses text by field; the service serving the folder directly says the
same in its log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from model.__main__ import main
from model.bundle import read_manifest
from model.hf_folder import prepare_model
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from tests.support.family_helpers import hf_forward, mixed_batch, randomize_, save_hf
from tests.support.helpers import details_of, ids_request, violated_field

VOCAB = 40


def _bert_folder(directory: Path, seed: int = 0) -> tuple[Any, Path]:
    """A tiny random-init transformers BertModel saved with save_pretrained: config.json + model.safetensors."""
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=24, layer_norm_eps=1e-12)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.BertModel(config).eval()
    randomize_(model, seed)
    src = save_hf(model, directory)
    assert not (src / "tokenizer.json").exists() and (src / "config.json").is_file()
    return model, src


def _note_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


async def test_a_folder_without_a_tokenizer_gives_an_ids_only_bundle(start_server: Any, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model, src = _bert_folder(tmp_path / "weights-only")
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["convert-hf", "--model-dir", str(src), "--out", str(tmp_path / "b")]) == 0
    lines = _note_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines  # one clear line: what the bundle takes, and how to give it text
    assert lines[0].startswith(f"note: {src} has no tokenizer.json: the bundle takes token ids and embeddings "
                               "only, no text; to serve text, save the model's fast tokenizer into the folder")
    assert "save_pretrained" in lines[0] and "convert again" in lines[0]
    manifest = read_manifest(tmp_path / "b")
    assert manifest.text is None and manifest.format_version == 1  # an ids-only bundle, as `convert` makes
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["manifest.json", "model.pt"]

    served = await start_server(bundle=tmp_path / "b")
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert not info.text.accepted and info.max_length == 24
    ids, n = mixed_batch([9, 3, 17, 1], VOCAB, pad=0, bos=2, eos=3, seed=1)
    rows = [ids[b, :t].numpy() for b, t in enumerate(n.tolist())]
    response = await served.stub.Encode(ids_request(*rows, attention=pb.AttentionOptions(return_attention=True)),
                                        timeout=60)
    want_h, want_w = hf_forward(model, ids, n)
    for b, (out, t) in enumerate(zip(response.outputs, n.tolist(), strict=True)):
        np.testing.assert_allclose(np.asarray(from_tensor(out.hidden)), want_h[b, :t].numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(from_tensor(out.attention)), want_w[b, :, :, :t, :t].numpy(),
                                   rtol=0, atol=1e-6)

    request = pb.EncodeRequest(sequences=[pb.Sequence(token_ids=ids_request(rows[0]).sequences[0].token_ids),
                                          pb.Sequence(text="hello world")])
    with pytest.raises(grpc.aio.AioRpcError) as info_err:
        await served.stub.Encode(request, timeout=10)
    assert info_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_field(info_err.value) == "sequences[1].text"
    assert "has no tokenizer" in (info_err.value.details() or ""), info_err.value.details()
    assert details_of(info_err.value)  # the rich status names the field as well


def test_serving_the_folder_directly_says_it_takes_ids_only(tmp_path: Path) -> None:
    """What the engine does with `--model <folder>` (model/hf_folder.py prepare_model): the same converter, and
    the note the engine logs says ids only, on the first start and on the one that reuses the bundle."""
    _, src = _bert_folder(tmp_path / "weights-only", seed=2)
    first = prepare_model(src, tmp_path / "cache")
    second = prepare_model(src, tmp_path / "cache")
    assert (first.action, second.action, first.bundle_dir) == ("converted", "reused", second.bundle_dir)
    for prepared in (first, second):
        note = prepared.note()
        assert prepared.ids_only and note is not None and "\n" not in note
        assert f"{src} has no tokenizer.json: the bundle takes token ids and embeddings only" in note
    assert read_manifest(first.bundle_dir).text is None


async def test_the_engine_logs_the_note(start_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, src = _bert_folder(tmp_path / "weights-only", seed=3)
    with caplog.at_level(logging.INFO, logger="service.engine"):
        served = await start_server(bundle=src, cache_dir=str(tmp_path / "cache"))
    logged = [r.getMessage() for r in caplog.records if "has no tokenizer.json" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith(f"converted Hugging Face folder {src} into "), logged
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert not info.text.accepted
