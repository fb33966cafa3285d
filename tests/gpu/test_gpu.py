"""CUDA-only checks (marker `gpu`; every test here skips without CUDA). `make gpu-check` runs them.

- fp16/bf16 against fp32 on CUDA, eager and through a loaded bundle, within the CPU bounds (the reference
  model, BERT-style post-LN and pre-LN, a rotary + SwiGLU + RMSNorm encoder with local layers, and ALiBi)
  (model.bundle.RELATIVE_ERROR_BOUND: bf16 3%, fp16 0.5% relative max error); fp32 on CUDA equals CPU fp32.
- The SDPA path against the explicit path that returns weights, per SDPA backend forced with
  torch.nn.attention.sdpa_kernel: memory-efficient and math must run our masked inputs; flash and cuDNN
  are checked where they accept them (flash takes no attn_mask, so it is also checked maskless).
- Flash through Encoder.forward: a batch with no padded row and lengths on the host passes SDPA no mask,
  so flash alone runs it (causal too), and it equals the masked path (lengths on the device).
- NaN recovery through a real service on CUDA (bf16 and fp16 fault bundles): the NAN_ROW row is re-run
  in fp32 and flagged, the others are not; NAN_ALWAYS answers INTERNAL.
- Out-of-memory split: the OOM_IF_BATCH_GT_1 sentinel on CUDA, and a real CUDA allocation failure in a
  subprocess whose caching allocator is capped (torch.cuda.set_per_process_memory_fraction) between
  the measured peak of two sequences and that of four, so a batch of 8 must be bisected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model import faults
from model.bundle import RELATIVE_ERROR_BOUND, load_bundle, save_bundle
from model.config import REFERENCE, EncoderConfig
from model.encoder import Encoder
from proto.attention.v1.codec import from_tensor
from tests.support import helpers
from tests.support.helpers import ids_request
from tests.support.model_helpers import batch, key_mask, max_errors, rel_err, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
CUDA = "cuda"
REDUCED = [torch.bfloat16, torch.float16]
BOUND = {torch.float32: 1e-4, torch.bfloat16: RELATIVE_ERROR_BOUND["bfloat16"],
         torch.float16: RELATIVE_ERROR_BOUND["float16"]}
# A model whose activations dwarf everything else (fc1 output: 512 x 65536 fp32 = 128 MiB per sequence),
# so peak memory grows in proportion to the batch and a memory cap splits batches deterministically.
OOM_CONFIG = EncoderConfig(d_model=256, n_heads=4, n_layers=1, d_ff=65536, vocab_size=1000, max_length=512)


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize("config, lengths", [
    (tiny(), [48, 20, 5, 1]),
    (tiny(norm_first=True, activation="gelu", final_norm=True), [48, 20, 5, 1]),
    (REFERENCE, [256, 48, 17, 1]),
    # Issue 30: a rotary + SwiGLU + RMSNorm encoder with ModernBERT's local layers, and ALiBi (jina-v2 style).
    (tiny(n_layers=3, positional="rotary", rotary_base=500.0, norm="rms", norm_first=True, final_norm=True,
          ffn_gated=True, activation="silu", linear_bias=False, layer_norm_eps=1e-6, local_radius=8,
          global_every=3), [48, 20, 5, 1]),
    (tiny(positional="alibi", ffn_gated=True, activation="gelu"), [48, 20, 5, 1]),
], ids=["tiny-post-ln", "tiny-pre-ln-gelu", "reference", "rotary-swiglu-rms-local", "alibi-geglu"])
@pytest.mark.parametrize("causal", [False, True])
def test_reduced_precision_within_the_cpu_bounds_on_cuda(dtype, config, lengths, causal):
    hidden_err, weight_err = max_errors(config, dtype, lengths, causal, device=CUDA)
    assert hidden_err <= BOUND[dtype], f"{dtype} hidden relative error {hidden_err:.4g} > {BOUND[dtype]} on CUDA"
    assert weight_err <= BOUND[dtype], f"{dtype} attention weight error {weight_err:.4g} > {BOUND[dtype]} on CUDA"
    assert hidden_err > 0, "the reduced-precision copy must actually differ from fp32"


@pytest.mark.parametrize("dtype", [torch.float32, *REDUCED], ids=str)
def test_bundle_on_cuda_matches_cpu_fp32(tiny_bundle, dtype):
    """The service's path (TorchScript, frozen, cast) on CUDA, three calls (the profiling executor
    optimizes, and may fuse, from the second call on), against the same bundle in fp32 on the CPU.
    fp32 within 1e-4 relative: TF32 matmuls (1e-3) would fail it."""
    want_module = load_bundle(tiny_bundle).module
    module = load_bundle(tiny_bundle, device=CUDA, dtype=dtype).module
    ids, lengths = batch(tiny(), [64, 33, 7, 1], seed=3)
    real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    with torch.inference_mode():
        for layers in ([], [0, 1]):
            want, _ = want_module(ids, None, lengths, False, layers)
            for _ in range(3):
                got, _ = module(ids.to(CUDA), None, lengths.to(CUDA), False, layers)
                assert got.device.type == "cuda" and got.dtype == dtype
                err = rel_err(got.cpu()[real], want[real])
                assert err <= BOUND[dtype], f"{dtype} layers={layers}: {err:.3g} > {BOUND[dtype]}"


def _attention(dtype: torch.dtype, lengths: list[int], causal: bool, T: int = 192):
    """One REFERENCE attention layer on CUDA (d_head 64, flash-sized), its input and our mask."""
    layer = Encoder(dataclasses.replace(REFERENCE, n_layers=1)).init_weights(0).blocks[0].attn
    attn = layer.eval().to(CUDA, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(lengths), T, REFERENCE.d_model, generator=g).to(CUDA, dtype)
    mask = key_mask(torch.tensor(lengths), T, causal).to(CUDA)
    return attn, x, mask


def _run_forced(backend_name: str, fn):
    """fn() with only `backend_name` allowed; (result or None, why it could not run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name, None)
    if backend is None:
        return None, f"this torch has no SDPBackend.{backend_name}"
    with warnings.catch_warnings(record=True) as caught:  # torch says why a kernel is unusable, as warnings
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([backend]):
                return fn(), ""
        except RuntimeError as e:
            reasons = "; ".join(str(w.message) for w in caught)[:500]
            return None, f"{e}".splitlines()[0] + (f" ({reasons})" if reasons else "")


@pytest.mark.parametrize("backend", ["EFFICIENT_ATTENTION", "MATH", "FLASH_ATTENTION", "CUDNN_ATTENTION"])
@pytest.mark.parametrize("dtype", [torch.float32, *REDUCED], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_path_matches_the_explicit_path_per_backend(backend, dtype, causal):
    """Padded rows, a length-0 row (SDPA must give 0, not NaN: pytorch#110213), causal or not."""
    attn, x, mask = _attention(dtype, [192, 77, 1, 0], causal)
    with torch.inference_mode():
        want, weights = attn(x, mask, True)
        got, reason = _run_forced(backend, lambda: attn(x, mask, False))
    if got is None:
        if backend in ("EFFICIENT_ATTENTION", "MATH"):
            pytest.fail(f"{backend} must run our masked {dtype} input on CUDA: {reason}")
        pytest.skip(f"{backend} does not take this input: {reason}")
    y, none = got
    assert none is None and weights is not None
    assert torch.isfinite(y).all(), f"{backend} gave NaN/Inf"
    err = rel_err(y, want)
    assert err <= BOUND[dtype], f"{backend} {dtype}: SDPA vs explicit relative error {err:.3g} > {BOUND[dtype]}"
    # The length-0 row: no key at all, so attention output 0 and the layer output is the projection's bias.
    torch.testing.assert_close(y[3].float(), attn.proj.bias.float().expand_as(y[3]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_flash_kernel_matches_the_explicit_path_without_a_mask(dtype):
    """Flash takes no attn_mask, so our masked call never reaches it (the test above skips it). On full-
    length, non-causal rows the mask is all True, and flash on our q, k, v must equal the explicit path."""
    attn, x, mask = _attention(dtype, [192, 192], causal=False)
    B, T, C = x.shape
    with torch.inference_mode():
        want, _ = attn(x, mask, True)
        q, k, v = (t.view(B, T, attn.n_heads, attn.d_head).transpose(1, 2) for t in attn.qkv(x).split(C, dim=2))
        y, reason = _run_forced("FLASH_ATTENTION",
                                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=None, scale=attn.scale))
        if y is None:
            pytest.skip(f"flash attention unavailable here: {reason}")
        got = attn.proj(y.transpose(1, 2).reshape(B, T, C))
    assert rel_err(got, want) <= BOUND[dtype]


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_unpadded_batches_with_host_lengths_run_on_flash(dtype, causal):
    config = dataclasses.replace(REFERENCE, n_layers=2)
    enc = Encoder(config).init_weights(0).eval().to(CUDA, dtype)
    ids, lengths = batch(config, [192, 192, 192], seed=2)
    ids = ids.to(CUDA)
    with torch.inference_mode():
        want, _ = enc(ids, None, lengths.to(CUDA), causal, [])  # lengths on the device: the masked path
        got, reason = _run_forced("FLASH_ATTENTION", lambda: enc(ids, None, lengths, causal, []))
        _, masked_reason = _run_forced("FLASH_ATTENTION", lambda: enc(ids, None, lengths.to(CUDA), causal, []))
    assert got is not None, f"flash did not run the unpadded {dtype} batch: {reason}"
    assert masked_reason, "flash ran a masked call: this test no longer tells the two paths apart"
    assert rel_err(got[0], want) <= BOUND[dtype]


def _check_against_reference(hidden: np.ndarray, want: np.ndarray, bound: float, what: str) -> None:
    err = float(np.abs(hidden - want).max() / np.abs(want).max())
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound}"


async def test_service_on_cuda_equals_direct_calls_within_the_bf16_bound(start_server, tiny_bundle, reference_model):
    s = await start_server(device="cuda", precision="bf16")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 100, int(rng.integers(1, 65))) for _ in range(24)]
    responses = await asyncio.gather(*(s.stub.Encode(ids_request(x), timeout=30) for x in seqs))
    for x, r in zip(seqs, responses, strict=True):
        assert r.metadata.device.startswith("cuda") and r.metadata.precision == "bf16"
        assert not r.outputs[0].nonfinite and not r.metadata.fp32_retry
        _check_against_reference(from_tensor(r.outputs[0].hidden), reference_model(x)[0], BOUND[torch.bfloat16],
                                 f"length {len(x)}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
async def test_nan_row_is_rerun_in_fp32_on_cuda_for_that_row_only(start_server, fault_bundle, reference_model,
                                                                  precision):
    s = await start_server(bundle=fault_bundle, device="cuda", precision=precision, max_batch_size=8,
                           max_wait_ms=2000)
    seqs = [np.arange(1, 5 + i) for i in range(8)]
    seqs[5] = np.array([3, faults.NAN_ROW, 4])
    responses = await asyncio.gather(*(s.stub.Encode(ids_request(x), timeout=30) for x in seqs))
    bound = BOUND[torch.bfloat16 if precision == "bf16" else torch.float16]
    for i, r in enumerate(responses):
        out, hidden = r.outputs[0], from_tensor(r.outputs[0].hidden)
        assert r.metadata.device.startswith("cuda") and r.metadata.precision == precision
        assert np.isfinite(hidden).all()
        assert out.nonfinite == (i == 5) and r.metadata.fp32_retry == (i == 5), i
        # The re-run is fp32 on CUDA: the CPU fp32 reference within 1e-4; the others within the dtype's bound.
        _check_against_reference(hidden, reference_model(seqs[i])[0], 1e-4 if i == 5 else bound, f"row {i}")
    assert s.sample("attention_fp32_retries_total") == 1
    assert s.sample("attention_nonfinite_outputs_total", {"precision": precision}) == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:  # NaN in every precision: INTERNAL, never a NaN
        await s.stub.Encode(ids_request([1, 2], [faults.NAN_ALWAYS, 3]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert s.sample("attention_failures_total", {"reason": "nonfinite_output"}) == 1


async def test_oom_sentinel_bisects_the_batch_on_cuda(start_server, fault_bundle, reference_model):
    s = await start_server(bundle=fault_bundle, device="cuda", precision="fp32", max_batch_size=8, max_wait_ms=2000)
    seqs = [np.arange(1, 5 + i) for i in range(8)]
    seqs[3] = np.array([7, faults.OOM_IF_BATCH_GT_1, 9, 10])
    responses = await asyncio.gather(*(s.stub.Encode(ids_request(x), timeout=30) for x in seqs))
    for x, r in zip(seqs, responses, strict=True):
        _check_against_reference(from_tensor(r.outputs[0].hidden), reference_model(x)[0], 1e-4, f"{x}")
    assert s.sample("attention_batch_size_sum") == 8  # one batch held all eight; the runner bisected it
    assert s.sample("attention_batch_splits_total", {"reason": "oom"}) >= 3


async def _real_oom_child(bundle_dir: str) -> dict[str, object]:
    """Runs in a subprocess (the memory cap is process-wide): serve OOM_CONFIG on CUDA in fp32, measure
    the caching allocator's peak for one sequence of 512, cap the process at 3 sequences' worth over
    what it holds, then send 8 such sequences that ride in one batch."""
    from prometheus_client import CollectorRegistry

    from service.jobs import Job
    from service.server import build_server

    T = OOM_CONFIG.max_length
    registry = CollectorRegistry()
    config = helpers.test_config(Path(bundle_dir), device="cuda", precision="fp32", max_batch_size=8,
                                  max_wait_ms=2000, max_batch_tokens=8 * T)
    server, port = build_server(config, registry)
    await server.start()
    channel = None
    try:
        await server.ready()
        runner = server.batcher._runner  # the service's own Runner (no fault hooks armed)
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, OOM_CONFIG.vocab_size, T) for _ in range(8)]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        singles = [runner.execute([Job(x, None)])[0][0] for x in seqs]  # unsplit, one at a time
        per_sequence = torch.cuda.max_memory_reserved() - base
        torch.cuda.empty_cache()
        cap = torch.cuda.memory_reserved() + 3 * per_sequence  # 2 sequences fit, 4 do not
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        from proto.attention.v1 import attention_pb2_grpc

        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        calls = [stub.Encode(ids_request(x), timeout=60) for x in seqs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        codes, errors = [], []
        for single, result in zip(singles, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                codes.append(result.code().name)
                continue
            codes.append("OK")
            got, want = from_tensor(result.outputs[0].hidden), single.hidden
            errors.append(float(np.abs(got - want).max() / np.abs(want).max()))
        sample = registry.get_sample_value
        return {"codes": codes, "max_rel_err": max(errors, default=0.0),
                "per_sequence_mib": per_sequence / 2**20, "cap_mib": cap / 2**20,
                "oom_splits": sample("attention_batch_splits_total", {"reason": "oom", "model": "oom"}) or 0.0,
                "batches": sample("attention_batch_size_count", {"model": "oom"}) or 0.0}
    finally:
        if channel is not None:
            await channel.close()
        await server.stop(0)


@pytest.mark.timeout(240)
def test_a_real_cuda_oom_bisects_the_batch_and_every_call_succeeds(tmp_path):
    save_bundle(Encoder(OOM_CONFIG).init_weights(0), tmp_path / "oom", name="oom", version="1", source="seed:0")
    code = ("import asyncio, json, sys; from tests.gpu.test_gpu import _real_oom_child; "
            "print('RESULT ' + json.dumps(asyncio.run(_real_oom_child(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "oom")], cwd=REPO, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["per_sequence_mib"] >= 100, result  # activations dominate (fc1's output alone is 128 MiB)
    assert result["codes"] == ["OK"] * 8, result
    assert result["oom_splits"] >= 1, f"the cap never bit: {result}"
    assert result["max_rel_err"] <= 1e-4, result  # split batches give the unsplit answers
