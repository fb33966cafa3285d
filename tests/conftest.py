"""Shared fixtures: a tiny seeded model bundle, and real servers on 127.0.0.1:0 (helpers: tests/support/helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from model.bundle import load_bundle, save_bundle
from model.config import TINY
from model.encoder import Encoder
from proto.attention.v1 import attention_pb2_grpc
from service.server import build_server
from tests.support.helpers import Running, test_config


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TINY encoder (d_model 32, 4 heads, 2 layers, vocab 100, max_length 64), seed 0."""
    path = tmp_path_factory.mktemp("bundles") / "tiny"
    save_bundle(Encoder(TINY).init_weights(0), path, name="tiny", version="1", source="seed:0")
    return path


@pytest.fixture(scope="session")
def fault_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """model/faults.py's fault-injecting TINY model (sentinel ids sleep, raise, NaN, ...), seed 0."""
    from model.faults import build_fault_bundle

    path = tmp_path_factory.mktemp("bundles") / "faults"
    build_fault_bundle(path)
    return path


@pytest.fixture(scope="session")
def reference_model(tiny_bundle: Path) -> Callable[..., Any]:
    """Direct in-process call of the tiny bundle (fp32): the truth the service must reproduce."""
    module = load_bundle(tiny_bundle).module

    def encode(ids: np.ndarray, *, causal: bool = False, layers: tuple[int, ...] = ()) -> tuple[Any, Any]:
        with torch.inference_mode():
            hidden, attention = module(torch.from_numpy(ids.astype(np.int64))[None], None,
                                       torch.tensor([len(ids)]), causal, list(layers))
        return hidden[0].numpy(), None if attention is None else attention[0].numpy()

    return encode


@pytest.fixture
async def start_server(tiny_bundle: Path) -> AsyncIterator[Callable[..., Any]]:
    """`await start_server(**config_overrides)` -> a ready `Running`; torn down after the test."""
    running: list[Running] = []

    async def start(wait_ready: bool = True, bundle: Path | None = None, **overrides: Any) -> Running:
        registry = CollectorRegistry()
        server, port = build_server(test_config(bundle or tiny_bundle, **overrides), registry)
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        r = Running(server, port, channel, attention_pb2_grpc.AttentionServiceStub(channel), registry)
        running.append(r)
        if wait_ready:
            await server.ready()
        return r

    yield start
    for r in running:
        await r.channel.close()
        await r.server.stop(0)


@pytest.fixture
async def served(start_server: Callable[..., Any]) -> Running:
    return await start_server()


# Hugging Face models (text in): session fixtures, so the real model is converted once per run.


@pytest.fixture(scope="session")
def bert_classifier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """(bundle, HF folder, HF model): a tiny BertForSequenceClassification, 3 labels (tests/support/head_helpers.py)."""
    from tests.support.head_helpers import head_bundle

    return head_bundle(tmp_path_factory, "bert-classifier")


@pytest.fixture(scope="session")
def bert_reranker(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """The same with one label (a cross-encoder: rerank), pairs with token types."""
    from tests.support.head_helpers import head_bundle

    return head_bundle(tmp_path_factory, "bert-reranker")


@pytest.fixture(scope="session")
def xlmr_reranker(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """A tiny XLMRobertaForSequenceClassification with one label."""
    from tests.support.head_helpers import head_bundle

    return head_bundle(tmp_path_factory, "xlmr-reranker")


from tests.support.aoti_helpers import aoti_bundle  # noqa: E402, F401
from tests.support.hf_helpers import minilm_bundle, minilm_dir, minilm_reference, tiny_text_bundle  # noqa: E402, F401
