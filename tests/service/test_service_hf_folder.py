"""`python -m service --model <Hugging Face folder>`: the folder is converted with convert-hf's converter into
the bundle cache, served, and reused by the next start (keyed by the folder's files); the log says which.
The real all-MiniLM-L6-v2 folder, as a user has it; answers equal the ahead-of-time converted bundle's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from model.bundle import read_manifest
from model.hf_folder import folder_key, is_hf_folder, prepare_model
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from proto.attention.v1.codec import from_tensor
from tests.support.hf_helpers import Reference, write_tiny_bert
from tests.support.server_process import ServerProcess

ATOL = 1e-6  # the embeddings (pooled, normalised): the text answer
# Hidden states (|x| up to ~10): the reference runs in this process, with its own torch thread count, so the
# fp32 sums are grouped otherwise; measured up to 1.9e-6 apart (the weights are the same: weights_sha256).
HIDDEN_ATOL = 1e-5
# As tests/helpers.py test_config serves the reference in this process.
FLAGS = ("--device", "cpu", "--max-batch-tokens", "2048")


def _request(texts: list[str]) -> pb.EncodeRequest:
    return pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in texts], truncate=True,
                            output=pb.OutputOptions(pooling=pb.POOLING_MODEL, return_tokens=True))


def _answers(response: pb.EncodeResponse) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    return [(from_tensor(o.token_ids).tolist(), np.asarray(from_tensor(o.pooled)), np.asarray(from_tensor(o.hidden)))
            for o in response.outputs]


async def _served_answers(server: ServerProcess, texts: list[str]) -> list[tuple[list[int], Any, Any]]:
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        return _answers(await stub.Encode(_request(texts), timeout=120))


def _assert_equal(got: list[tuple[list[int], Any, Any]], want: list[tuple[list[int], Any, Any]]) -> None:
    assert len(got) == len(want)
    for (ids, pooled, hidden), (want_ids, want_pooled, want_hidden) in zip(got, want, strict=True):
        assert ids == want_ids
        np.testing.assert_allclose(pooled, want_pooled, rtol=0, atol=ATOL)
        np.testing.assert_allclose(hidden, want_hidden, rtol=0, atol=HIDDEN_ATOL)


@pytest.mark.timeout(900)  # two service processes, the first converting (seconds each on a quiet machine)
async def test_a_hugging_face_folder_serves_directly_and_the_second_start_reuses_it(
        start_server: Any, minilm_dir: Path, minilm_bundle: Path, minilm_reference: Reference,
        tmp_path: Path) -> None:
    texts = minilm_reference.texts[:8]
    reference = await start_server(bundle=minilm_bundle)  # convert-hf's bundle, served in this process
    want = _answers(await reference.stub.Encode(_request(texts), timeout=120))
    cache = tmp_path / "cache"
    expected = cache / f"hf-{minilm_dir.resolve().name}-{folder_key(minilm_dir)[:16]}"

    first = ServerProcess(minilm_dir, *FLAGS, "--cache-dir", str(cache), directory=tmp_path / "first", timeout=300)
    try:
        _assert_equal(await _served_answers(first, texts), want)
    finally:
        first.stop()
    assert f"converted Hugging Face folder {minilm_dir} into {expected}" in first.output()
    assert sorted(p.name for p in cache.iterdir()) == [expected.name], "one bundle, no temporary left"
    converted = read_manifest(expected)
    assert converted.weights_sha256 == read_manifest(minilm_bundle).weights_sha256  # the same converter
    assert converted.text == read_manifest(minilm_bundle).text
    made = (expected / "model.pt").stat().st_mtime_ns

    second = ServerProcess(minilm_dir, *FLAGS, "--cache-dir", str(cache), directory=tmp_path / "second",
                           timeout=300)
    try:
        _assert_equal(await _served_answers(second, texts[:3]), want[:3])
    finally:
        second.stop()
    assert f"reusing converted bundle {expected} for Hugging Face folder {minilm_dir}" in second.output()
    assert "converted Hugging Face folder" not in second.output()
    assert (expected / "model.pt").stat().st_mtime_ns == made


def test_the_cache_key_follows_the_files_the_converter_reads(tmp_path: Path) -> None:
    folder = write_tiny_bert(tmp_path / "tiny bert!")
    assert is_hf_folder(folder) and not is_hf_folder(tmp_path / "nowhere")
    first = prepare_model(folder, tmp_path / "cache")
    assert first.action == "converted" and re.fullmatch(r"hf-tiny_bert_-[0-9a-f]{16}", first.bundle_dir.name)
    assert read_manifest(first.bundle_dir).name == "tiny bert!"
    again = prepare_model(folder, tmp_path / "cache")
    assert (again.action, again.bundle_dir) == ("reused", first.bundle_dir)
    assert again.note() == f"reusing converted bundle {first.bundle_dir} for Hugging Face folder {folder}"
    (folder / "README.md").write_text("not read by the converter")
    assert prepare_model(folder, tmp_path / "cache").bundle_dir == first.bundle_dir
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "pooling_mode_mean_tokens": False,
                                   "pooling_mode_cls_token": True}))
    changed = prepare_model(folder, tmp_path / "cache")
    assert changed.action == "converted" and changed.bundle_dir != first.bundle_dir
    assert read_manifest(changed.bundle_dir).text.pooling == "cls"  # type: ignore[union-attr]
    # A bundle is served as it is; so is anything else, for the loader to refuse by name.
    assert prepare_model(first.bundle_dir, tmp_path / "cache").action == "bundle"
    assert prepare_model(tmp_path / "nowhere", tmp_path / "cache").note() is None


@pytest.mark.timeout(300)
def test_a_folder_the_converter_refuses_stops_start_up_with_its_reason(tmp_path: Path) -> None:
    folder = write_tiny_bert(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    with pytest.raises(RuntimeError, match=r"(?s)start-up failed: .*n_layers=1000000, but the state_dict holds 2"):
        ServerProcess(folder, "--cache-dir", str(tmp_path / "cache"), directory=tmp_path / "server")
    assert not any((tmp_path / "cache").iterdir()), "nothing left in the cache"
