"""Names (issue 40): --served-model-name is the name every door shows (OpenAI, TEI /info, KServe v2, attention.v1
ModelInfo, the metrics' model_info), in one process and through edge processes (the name travels in the HELLO);
--model-alias adds names a call may give (the defaults of LangChain, LlamaIndex and Haystack); a name nobody
serves is 404 with the names that are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from proto.attention.v1 import attention_pb2 as pb
from service.config import ServiceConfig
from tests.support.server_process import ServerProcess

ALIASES = ("text-embedding-3-small", "text-embedding-ada-002")


def test_aliases_are_comma_separated_or_repeated_and_checked() -> None:
    config = ServiceConfig.from_args(["--served-model-name", "BAAI/bge-small-en-v1.5", "--model-alias", "a",
                                      "--model-alias", "b, c"], env={})
    assert config.served_model_name == "BAAI/bge-small-en-v1.5" and config.model_aliases == ("a", "b", "c")
    assert ServiceConfig.from_args([], env={"ATTN_MODEL_ALIAS": "x,y"}).model_aliases == ("x", "y")
    assert ServiceConfig().model_aliases == () and ServiceConfig().auto_truncate is True
    for bad in ({"model_alias": "a,a"}, {"served_model_name": "a", "model_alias": "a"},
                {"served_model_name": "has space"}):
        with pytest.raises(ValueError, match="model"):
            ServiceConfig(**bad)


async def test_the_served_name_is_shown_everywhere_and_aliases_are_answered(
        start_server: Any, tiny_text_bundle: Path) -> None:
    s = await start_server(bundle=tiny_text_bundle, http_port=0, served_model_name="my-embedder",
                           model_alias=",".join(ALIASES))
    info = await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.name == "my-embedder"
    assert s.sample("attention_model_info", {"name": "tiny-bert", "model": "my-embedder", "version": info.version,
                                             "device": "cpu", "precision": "fp32",
                                             "precision_source": "configured"}) == 1  # name: the bundle's own
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}", timeout=30) as http:
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["my-embedder", *ALIASES]
        for name in ("my-embedder", *ALIASES):
            r = await http.post("/v1/embeddings", json={"model": name, "input": "the cat"})
            assert r.status_code == 200 and r.json()["model"] == "my-embedder", r.text
        tei = (await http.get("/info")).json()
        assert tei["served_model_name"] == tei["model_id"] == "my-embedder"
        assert (await http.get("/v2/models/my-embedder")).json()["name"] == "my-embedder"
        assert (await http.get(f"/v2/models/{ALIASES[0]}")).json()["name"] == "my-embedder"
        missing = await http.post("/v1/embeddings", json={"model": "gpt-4", "input": "the cat"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "my-embedder" in missing.json()["error"]["message"]


def test_the_served_name_reaches_edge_processes(tiny_text_bundle: Path, tmp_path: Path) -> None:
    process = ServerProcess(tiny_text_bundle, "--edge-processes", "1", "--served-model-name", "edge-name",
                            "--model-alias", ALIASES[0], "--no-warmup",
                            directory=tmp_path)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{process.ports['http_port']}", timeout=30) as http:
            assert http.get("/info").json()["served_model_name"] == "edge-name"
            r = http.post("/v1/embeddings", json={"model": ALIASES[0], "input": "the cat"})
            assert r.status_code == 200 and r.json()["model"] == "edge-name"
    finally:
        process.stop()
