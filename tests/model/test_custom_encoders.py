"""Through a real gRPC server: the tutorials' encoders (tests/support/article_models.py), converted with their key
maps, are served exactly as written: hidden states (atol 1e-5) and attention weights (atol 1e-6) of sequences
of mixed lengths batched in one call, with and without the causal mask, equal the eager model's."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.bundle import save_bundle
from model.config import EncoderConfig
from model.convert import KeyMap, convert
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import from_tensor
from tests.support import article_models
from tests.support.helpers import ids_request

LENGTHS = [24, 10, 3]


@pytest.mark.parametrize("name", list(article_models.KEY_MAP))
async def test_served_article_encoder_equals_the_eager_model(name: str, tmp_path: Path,
                                                             start_server: Callable[..., Any]) -> None:
    eager = getattr(article_models, name)(seed=5)
    config = EncoderConfig.from_dict(article_models.config_fields(name))
    save_bundle(convert(eager.state_dict(), config, KeyMap.builtin(article_models.KEY_MAP[name])), tmp_path / "b",
                name=name, version="1", source="test")
    served = await start_server(bundle=tmp_path / "b")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, article_models.VOCAB, (len(LENGTHS), max(LENGTHS)), generator=g)
    lengths = torch.tensor(LENGTHS)
    for causal in (False, True):
        T = ids.shape[1]
        mask = (torch.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
        if causal:
            mask = mask & torch.ones(T, T, dtype=torch.bool).tril()
        with torch.inference_mode():
            want = eager(ids, mask).numpy()
            probs = [p.numpy() for p in eager.attention_probs()]
        request = ids_request(*[ids[b, :n].numpy() for b, n in enumerate(LENGTHS)], causal=causal,
                              attention=pb.AttentionOptions(return_attention=True))
        reply = await served.stub.Encode(request, timeout=30)
        for b, n in enumerate(LENGTHS):
            out = reply.outputs[b]
            np.testing.assert_allclose(from_tensor(out.hidden), want[b, :n], atol=1e-5, rtol=0)
            attention = from_tensor(out.attention)  # (L, H, n, n)
            assert attention.shape == (config.n_layers, config.n_heads, n, n)
            for layer in range(config.n_layers):
                np.testing.assert_allclose(attention[layer], probs[layer][b, :, :n, :n], atol=1e-6, rtol=0)
        # Without attention the service takes the SDPA path (the float-mask one when there is a bias).
        fast = await served.stub.Encode(ids_request(*[ids[b, :n].numpy() for b, n in enumerate(LENGTHS)],
                                                    causal=causal), timeout=30)
        for b, n in enumerate(LENGTHS):
            np.testing.assert_allclose(from_tensor(fast.outputs[b].hidden), want[b, :n], atol=1e-5, rtol=0)
    # What the model is, said by the service: its scale (and whether it is the standard one) and bias.
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.attention_scale == pytest.approx(config.scale, rel=1e-12)
    assert info.standard_scale == (config.attention_scale is None)
    assert info.relative_bias == config.relative_bias
