"""Reduced precision: error against fp32 within the documented bounds, and never NaN/Inf on hard inputs.

The bounds (model.bundle.RELATIVE_ERROR_BOUND, documented in model/encoder.py) were measured on this CPU
(AVX2, no native bf16): hidden states bf16 <= 0.0125, fp16 <= 0.0014 relative; weights about the same
absolute. The bounds leave a 2-3x margin for other seeds and CPUs.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from model.bundle import RELATIVE_ERROR_BOUND
from model.config import REFERENCE, EncoderConfig
from model.encoder import Encoder, LayerNorm
from tests.support.model_helpers import batch, max_errors, tiny

REDUCED = [torch.bfloat16, torch.float16]
ALL_DTYPES = [torch.float32, *REDUCED]


@functools.cache
def _cpu_runs(dtype: torch.dtype) -> bool:
    """Whether this CPU has the kernels (fp16 matmul and SDPA are missing on some older builds)."""
    try:
        with torch.inference_mode():
            Encoder(tiny(n_layers=1)).to(dtype)(torch.ones(1, 2, dtype=torch.long), None, torch.tensor([2]), False, [0])
    except RuntimeError:
        return False
    return True


@pytest.fixture(autouse=True)
def _skip_unsupported(request: pytest.FixtureRequest) -> None:
    dtype = request.node.callspec.params.get("dtype") if hasattr(request.node, "callspec") else None
    if dtype is not None and not _cpu_runs(dtype):
        pytest.skip(f"this CPU cannot run {dtype}")


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize(
    "config",
    [tiny(), tiny(norm_first=True, activation="gelu", final_norm=True), tiny(positional="learned")],
    ids=["post-ln-relu", "pre-ln-gelu", "learned"],
)
@pytest.mark.parametrize("causal", [False, True])
def test_reduced_precision_error_bound_tiny(dtype: torch.dtype, config: EncoderConfig, causal: bool) -> None:
    bound = RELATIVE_ERROR_BOUND[str(dtype).removeprefix("torch.")]
    hidden_err, weight_err = max_errors(config, dtype, [48, 20, 5, 1], causal)
    assert hidden_err <= bound, f"{dtype} hidden relative error {hidden_err:.4g} > {bound}"
    assert weight_err <= bound, f"{dtype} attention weight error {weight_err:.4g} > {bound}"
    assert hidden_err > 0, "the reduced-precision copy must actually differ from fp32"


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_reduced_precision_error_bound_reference(dtype: torch.dtype) -> None:
    bound = RELATIVE_ERROR_BOUND[str(dtype).removeprefix("torch.")]
    hidden_err, weight_err = max_errors(REFERENCE, dtype, [48, 17, 1], causal=False)
    assert hidden_err <= bound and weight_err <= bound, (hidden_err, weight_err)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), causal=st.booleans(),
       lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_bf16_error_bound_holds_across_seeds(seed: int, causal: bool, lengths: list[int]) -> None:
    hidden_err, weight_err = max_errors(tiny(), torch.bfloat16, lengths, causal, seed=seed)
    assert hidden_err <= RELATIVE_ERROR_BOUND["bfloat16"] and weight_err <= RELATIVE_ERROR_BOUND["bfloat16"]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("config", [tiny(), tiny(norm_first=True)], ids=["post-ln", "pre-ln-no-final-norm"])
@pytest.mark.parametrize("causal", [False, True])
def test_hard_inputs_stay_finite(dtype: torch.dtype, config: EncoderConfig, causal: bool) -> None:
    """max_length rows, a fully padded row (length 0) and embeddings of magnitude 1e4, on both paths."""
    model = Encoder(config).init_weights(0).eval().to(dtype)
    T = config.max_length
    ids, _ = batch(config, [T, 3, 1], seed=5)
    lengths = torch.tensor([T, 3, 0])
    g = torch.Generator().manual_seed(5)
    huge = (torch.randn(3, T, config.d_model, generator=g).sign() * 1e4).to(dtype)
    with torch.inference_mode():
        for attn_layers in ([], [0, 1]):
            for token_ids, embeddings in ((ids, None), (None, huge)):
                hidden, weights = model(token_ids, embeddings, lengths, causal, attn_layers)
                assert torch.isfinite(hidden).all(), (attn_layers, token_ids is None)
                if weights is not None:
                    assert torch.isfinite(weights).all()
                    assert torch.equal(weights[2], torch.zeros_like(weights[2])), "length 0: no attention at all"


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_layer_norm_accumulates_in_fp32(dtype: torch.dtype) -> None:
    """model.encoder.LayerNorm calls the kernel on the reduced dtype directly: that is only right while the
    kernel accumulates in fp32. Rows of magnitude 1e3 around an offset (fp16 x*x overflows above 256; a
    bf16 mean keeps ~3 digits) must come out as the fp32 normalisation rounded once, within one ulp."""
    g = torch.Generator().manual_seed(3)
    C = 384
    x = ((torch.randn(64, C, generator=g) * 1e3 + 300.0)).to(dtype)
    norm = LayerNorm(C, eps=1e-12)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(C, generator=g))
        norm.bias.copy_(0.1 * torch.randn(C, generator=g))
    norm = norm.to(dtype)
    want = F.layer_norm(x.float(), (C,), norm.weight.float(), norm.bias.float(), 1e-12)
    with torch.inference_mode():
        got = norm(x)
    assert got.dtype == dtype and torch.isfinite(got).all()
    ulp = torch.finfo(dtype).eps * want.abs().clamp_min(torch.finfo(dtype).tiny)  # one ulp at each value, about
    assert ((got.float() - want).abs() <= 2 * ulp + 1e-6).all(), float((got.float() - want).abs().max())
