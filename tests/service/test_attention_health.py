"""Attention health: the sampled per-layer diagnostics (max |pre-softmax score|, normalised entropy) equal an
offline computation, move where a broken model puts them, and cost nothing when switched off."""

from __future__ import annotations

import bisect
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from model.bundle import FAULT_MODEL_NAME, has_diagnostics, load_bundle, save_bundle
from model.config import TINY
from model.encoder import Encoder
from proto.attention.v1.codec import from_tensor
from service.config import ServiceConfig
from service.metrics import ENTROPY_BUCKETS
from tests.support.helpers import Running, ids_request, wait_for

SEQUENCES = [np.arange(1, 40) % 100, np.arange(7, 19), np.array([5, 9]), np.array([3])]


def offline(encoder: Encoder, ids: np.ndarray) -> tuple[list[float], list[float]]:
    """Per layer, for one unpadded sequence, by hand from the eager module's weights: max |q.k| x scale and
    the mean over heads and queries of entropy / log(T) (NaN for T = 1)."""
    C, nh = encoder.d_model, encoder.config.n_heads
    x = encoder.tok_emb(torch.from_numpy(ids.astype(np.int64)))[None] + encoder.pos_emb[: len(ids)]
    mask = torch.ones(1, 1, 1, len(ids), dtype=torch.bool)
    scores, entropies = [], []
    with torch.no_grad():
        for block in encoder.blocks:
            h = block.ln1(x) if block.norm_first else x
            q, k, _ = block.attn.qkv(h).split(C, dim=2)
            q = q.view(1, -1, nh, C // nh).transpose(1, 2)
            k = k.view(1, -1, nh, C // nh).transpose(1, 2)
            s = (q @ k.transpose(-2, -1)) / math.sqrt(C // nh)  # (1, nh, T, T)
            p = torch.softmax(s, dim=-1)
            h_rows = -(p * torch.log(p)).sum(-1) / math.log(len(ids)) if len(ids) > 1 else torch.tensor(math.nan)
            scores.append(float(s.abs().max()))
            entropies.append(float(h_rows.mean()))
            x, _ = block(x, mask, False)
    return scores, entropies


def bundle_of(encoder: Encoder, path: Path) -> Path:
    save_bundle(encoder, path, name="health", version="1", source="test")
    return path


def scale_qk(encoder: Encoder, factor: float, layers: range) -> Encoder:
    C = encoder.d_model
    with torch.no_grad():
        for layer in layers:
            attn = encoder.blocks[layer].attn
            attn.qkv.weight[: 2 * C] *= factor  # rows q|k|v: the q and k projections
            attn.qkv.bias[: 2 * C] *= factor
    return encoder


def histogram(s: Running, name: str, layer: int) -> tuple[float, float]:
    return s.sample(f"{name}_count", {"layer": str(layer)}), s.sample(f"{name}_sum", {"layer": str(layer)})


def test_diagnostics_entry_point_equals_offline_computation_in_a_padded_batch():
    encoder = Encoder(TINY).init_weights(3)
    module = torch.jit.script(encoder)
    B, T = len(SEQUENCES), max(len(s) for s in SEQUENCES)
    ids = torch.zeros(B, T, dtype=torch.int64)
    for row, seq in enumerate(SEQUENCES):
        ids[row, : len(seq)] = torch.from_numpy(seq)
    with torch.inference_mode():
        stats = module.diagnostics(ids, None, torch.tensor([len(s) for s in SEQUENCES]), False).numpy()
    assert stats.shape == (B, TINY.n_layers, 2)
    for row, seq in enumerate(SEQUENCES):
        scores, entropies = offline(encoder, seq)
        np.testing.assert_allclose(stats[row, :, 0], scores, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stats[row, :, 1], entropies, rtol=1e-5, atol=1e-5)  # NaN == NaN for T = 1


async def test_sampled_metrics_equal_the_offline_computation(start_server, tmp_path):
    encoder = Encoder(TINY).init_weights(3)
    s = await start_server(bundle=bundle_of(encoder, tmp_path / "b"), diagnostics_sample=1.0)
    response = await s.stub.Encode(ids_request(*SEQUENCES), timeout=10)
    assert len(response.outputs) == len(SEQUENCES)
    # Sampled after the answer was delivered: wait for the model thread to have recorded it.
    await wait_for(lambda: histogram(s, "attention_score_max_abs", TINY.n_layers - 1)[0] == len(SEQUENCES),
                   what="the batch sampled")
    want = [offline(encoder, seq) for seq in SEQUENCES]
    for layer in range(TINY.n_layers):
        scores = [w[0][layer] for w in want]
        entropies = [w[1][layer] for w in want if not math.isnan(w[1][layer])]  # T = 1 has no entropy
        count, total = histogram(s, "attention_score_max_abs", layer)
        assert count == len(SEQUENCES) and total == pytest.approx(sum(scores), rel=1e-5)
        count, total = histogram(s, "attention_entropy_normalized", layer)
        assert count == len(entropies) and total == pytest.approx(sum(entropies), rel=1e-5)
        for le in ENTROPY_BUCKETS:
            bucket = s.sample("attention_entropy_normalized_bucket", {"layer": str(layer), "le": str(float(le))})
            assert bucket == sum(e <= le for e in entropies)
        assert s.sample("attention_score_overflow_risk_total", {"layer": str(layer)}) == 0
    assert s.sample("attention_diagnostics_enabled") == 1


async def test_uniform_attention_moves_the_entropy_histogram_to_1(start_server, tmp_path):
    encoder = scale_qk(Encoder(TINY).init_weights(0), 0.0, range(TINY.n_layers))  # zero Q/K: all scores 0
    s = await start_server(bundle=bundle_of(encoder, tmp_path / "b"), diagnostics_sample=1.0,
                           entropy_baseline="0.7")
    await s.stub.Encode(ids_request(*SEQUENCES[:3]), timeout=10)
    await wait_for(lambda: histogram(s, "attention_entropy_normalized", TINY.n_layers - 1)[0] == 3,
                   what="the batch sampled")
    for layer in map(str, range(TINY.n_layers)):
        assert s.sample("attention_entropy_normalized_bucket", {"layer": layer, "le": "0.99"}) == 0
        assert s.sample("attention_entropy_normalized_bucket", {"layer": layer, "le": "1.0"}) == 3
        assert s.sample("attention_entropy_baseline", {"layer": layer}) == 0.7
        assert s.sample("attention_score_max_abs_sum", {"layer": layer}) == 0


async def test_huge_qk_weights_under_fp16_raise_the_overflow_counter_before_any_nan(start_server, tmp_path):
    seq = SEQUENCES[0]
    # The largest factor on layer 0 whose scores (fp32, offline) stay below fp16's largest finite value but
    # pass half of it: the fast path still returns finite values, the early warning must already count.
    # The scores grow with the factor, so a bisection finds the same first factor in 8 forwards, not up to 200
    # (which ran past the 120 s test timeout on a busy machine).
    grid = list(np.geomspace(1, 400, 200))
    factor = grid[bisect.bisect_left(grid, True, key=lambda f: bool(
        offline(scale_qk(Encoder(TINY).init_weights(0), f, range(1)), seq)[0][0] > 0.6 * 65504))]
    encoder = scale_qk(Encoder(TINY).init_weights(0), factor, range(1))
    assert 0.6 * 65504 < offline(encoder, seq)[0][0] < 65504
    s = await start_server(bundle=bundle_of(encoder, tmp_path / "b"), diagnostics_sample=1.0, precision="fp16",
                           nonfinite_policy="fail")
    response = await s.stub.Encode(ids_request(seq), timeout=10)
    assert np.isfinite(from_tensor(response.outputs[0].hidden)).all()  # no NaN reached the caller
    await wait_for(lambda: s.sample("attention_score_overflow_risk_total", {"layer": "0"}) == 1,
                   what="the overflow warning counted")
    assert s.sample("attention_score_overflow_risk_total", {"layer": "1"}) == 0
    assert s.sample("attention_nonfinite_outputs_total", {"precision": "fp16"}) == 0


async def test_sampling_off_records_nothing_and_alerted_counters_exist_at_zero(start_server):
    s = await start_server(diagnostics_sample=0.0)
    assert s.server.batcher._after_batch is None  # nothing runs after a batch at all
    for _ in range(3):
        await s.stub.Encode(ids_request(*SEQUENCES), timeout=10)
    assert s.sample("attention_diagnostics_enabled") == 0
    for layer in map(str, range(TINY.n_layers)):
        labels = {"layer": layer, "model": "tiny"}
        assert s.registry.get_sample_value("attention_score_overflow_risk_total", labels) == 0
        assert s.registry.get_sample_value("attention_entropy_normalized_count", labels) is None


async def test_sampling_follows_the_configured_fraction(start_server):
    s = await start_server(diagnostics_sample=0.25, max_batch_size=1)
    for _ in range(8):  # one sequence a call, one call at a time: 8 batches, every 4th sampled
        await s.stub.Encode(ids_request(SEQUENCES[1]), timeout=10)
    await wait_for(lambda: histogram(s, "attention_score_max_abs", 1)[0] == 2, what="two batches sampled")


async def test_a_bundle_without_the_entry_point_serves_without_diagnostics(start_server, fault_bundle, caplog):
    assert not has_diagnostics(load_bundle(fault_bundle).module)  # a wrapper exporting only forward
    with caplog.at_level(logging.WARNING, logger="service.runner"):
        s = await start_server(bundle=fault_bundle, diagnostics_sample=1.0)
    assert any("attention health unavailable" in r.getMessage() for r in caplog.records)
    response = await s.stub.Encode(ids_request(SEQUENCES[1]), timeout=10)
    assert len(response.outputs) == 1
    assert s.sample("attention_diagnostics_enabled") == 0
    labels = {"layer": "0", "model": FAULT_MODEL_NAME}
    assert s.registry.get_sample_value("attention_score_overflow_risk_total", labels) == 0


def test_entropy_baseline_is_validated():
    assert ServiceConfig(entropy_baseline="0.5, 0.75").entropy_baselines == (0.5, 0.75)
    with pytest.raises(ValueError, match="1.5"):
        ServiceConfig(entropy_baseline="0.5,1.5")
    with pytest.raises(ValueError, match="entropy_baseline"):
        ServiceConfig(entropy_baseline="high")
    with pytest.raises(ValueError, match="diagnostics_sample"):
        ServiceConfig(diagnostics_sample=1.5)


async def test_entropy_baseline_must_match_the_layers(start_server):
    s = await start_server(wait_ready=False, entropy_baseline="0.1,0.2,0.3")
    with pytest.raises(ValueError, match="3 values; the model has 2 layers"):
        await s.server.ready()
